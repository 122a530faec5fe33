"""kda-kernels: delta-rule linear attention (KDA and Gated DeltaNet), forward and backward, chunked and
recurrent, with native CPU / CUDA / Metal / Neuron backends and a pure-PyTorch fallback.

Public names follow flash-linear-attention, so `from fla.ops.kda import chunk_kda` can become
`chunk_kda = get_kernel("<org>/kda-kernels", version=N).chunk_kda`.
"""
from . import _ops, layers
from .api import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda
from .context_parallel import balanced_bounds, chunk_gated_delta_rule_cp, chunk_kda_cp, split_varlen
from .gate import fused_gdn_gate, fused_kda_gate
from .ops import NATIVE, ops

__version__ = _ops.VERSION
BACKEND = _ops.BACKEND
VARIANT = _ops.VARIANT

__all__ = [
    "chunk_kda",
    "chunk_gated_delta_rule",
    "fused_recurrent_kda",
    "fused_recurrent_gated_delta_rule",
    "fused_kda_gate",
    "fused_gdn_gate",
    "layers",
    "chunk_kda_cp",
    "chunk_gated_delta_rule_cp",
    "split_varlen",
    "balanced_bounds",
]
