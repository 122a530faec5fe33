"""NKI (AWS Trainium) kernels of kda-kernels: exact chunked forward, checkpointed exact backward and the
token-by-token decode kernel, for KDA (per-channel gate) and GDN (per-head gate, broadcast over K).

Kernels import the real `nki` package; the tests run them on a NumPy stand-in (tests/nki_sim). See docs/neuron.md.
"""
from .torch_wrappers import (kda_chunk_bwd, kda_chunk_fwd, kda_recurrent_bwd, kda_recurrent_fwd,  # noqa: F401
                             kda_recurrent_serve, register_neuron_impls)

__all__ = ["kda_chunk_fwd", "kda_chunk_bwd", "kda_recurrent_fwd", "kda_recurrent_bwd", "kda_recurrent_serve",
           "register_neuron_impls"]
