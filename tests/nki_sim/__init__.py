"""A NumPy stand-in for the subset of AWS NKI (`nki`, `nki.language`, `nki.isa`) that kda-kernels uses.

It runs `@nki.jit` kernels eagerly on the CPU, instruction by instruction, and ENFORCES the NeuronCore
limits a kernel must respect on Trainium2 (see `limits.py` for the numbers and docs/neuron.md for the list).
It is not the Neuron compiler: it does not schedule, does not model engine timing, and accepts some programs
the real compiler may reject (and, hopefully rarely, the reverse). A kernel that passes here has a fair
chance on hardware; it has not run on hardware until it has.

Use `install()` to put it in `sys.modules` as `nki` (only when the real package is missing, unless forced).
"""
import sys

from . import isa, language, limits
from ._core import Kernel, SimError, jit, stats

__all__ = ["jit", "language", "isa", "limits", "SimError", "install", "stats", "Kernel"]


def simulate(kernel):
    """Mirror of `nki.simulate(kernel)`: kernels here always run simulated."""
    return kernel


def install(force=False):
    """Register this package as `nki`, `nki.language` and `nki.isa`. Returns the module now named `nki`."""
    if not force:
        try:
            import nki as real  # noqa: F401
            if getattr(real, "__name__", "") == "nki" and not getattr(real, "IS_SIMULATOR", False):
                return real
        except ImportError:
            pass
    from ._core import limit_blas_threads
    limit_blas_threads(1)
    me = sys.modules[__name__]
    sys.modules["nki"] = me
    sys.modules["nki.language"] = language
    sys.modules["nki.isa"] = isa
    return me


IS_SIMULATOR = True
