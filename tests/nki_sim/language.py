"""`nki.language` subset: dtypes, buffers, tile constructors, load/store, SPMD ids, loops, math ops."""
import numpy as np

from . import _core, limits
from ._core import (SimError, Tensor, bfloat16, float16, float32, int8, int16, int32, tfloat32, uint8, uint16,
                    uint32)

__all__ = ["float32", "bfloat16", "float16", "tfloat32", "int32", "uint32", "int16", "uint16", "int8", "uint8"]

# buffers
sbuf = "sbuf"
psum = "psum"
shared_hbm = "shared_hbm"
private_hbm = "private_hbm"
hbm = "hbm"


class tile_size:
    pmax = limits.PMAX
    psum_fmax = limits.PSUM_FMAX
    psum_fmax_bytes = limits.PSUM_BANK_BYTES
    psum_num_banks = limits.PSUM_BANKS
    gemm_stationary_fmax = limits.GEMM_STATIONARY_FMAX
    gemm_moving_fmax = limits.GEMM_MOVING_FMAX
    sbuf_fmax_bytes = limits.SBUF_BYTES_PER_PARTITION
    sbuf_fmax = limits.SBUF_BYTES_PER_PARTITION // 4
    sbuf_size_bytes = limits.SBUF_BYTES_PER_PARTITION * limits.PMAX


# ---------------------------------------------------------------- math operators (usable as isa `op`s)
class _Op:
    def __init__(self, name, fn, arity, kind="arith"):
        self.name, self.fn, self.arity, self.kind = name, fn, arity, kind

    def __repr__(self):
        return f"nl.{self.name}"

    def __call__(self, *args, dtype=None, **_kw):
        """Eager nl.<op>(tile, ...) form: returns a new SBUF tile (computed on the Vector/Scalar engine)."""
        tiles = [a for a in args if isinstance(a, Tensor)]
        if not tiles:
            return self.fn(*args)
        ref = tiles[0]
        vals = []
        for a in args:
            if isinstance(a, Tensor):
                from .isa import _check_compute
                _check_compute(a, "nl." + self.name)
                if a.partitions != ref.partitions or a.free_size != ref.free_size:
                    raise SimError(f"nl.{self.name}: operand shapes {a.shape} and {ref.shape} differ")
                vals.append(a.read().reshape(a.partitions, -1))
            else:
                vals.append(a)
        out = _core.new_tensor(ref.shape, dtype or ref.dtype, "sbuf")
        _core.count("nl." + self.name)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            out.write(self.fn(*vals))
        return out


def _f(name, fn, arity, kind="arith"):
    return _Op(name, fn, arity, kind)


add = _f("add", np.add, 2)
subtract = _f("subtract", np.subtract, 2)
multiply = _f("multiply", np.multiply, 2)
divide = _f("divide", np.divide, 2)
maximum = _f("maximum", np.maximum, 2)
minimum = _f("minimum", np.minimum, 2)
power = _f("power", np.power, 2)
equal = _f("equal", lambda a, b: np.equal(a, b).astype(np.float64), 2, "cmp")
not_equal = _f("not_equal", lambda a, b: np.not_equal(a, b).astype(np.float64), 2, "cmp")
greater = _f("greater", lambda a, b: np.greater(a, b).astype(np.float64), 2, "cmp")
greater_equal = _f("greater_equal", lambda a, b: np.greater_equal(a, b).astype(np.float64), 2, "cmp")
less = _f("less", lambda a, b: np.less(a, b).astype(np.float64), 2, "cmp")
less_equal = _f("less_equal", lambda a, b: np.less_equal(a, b).astype(np.float64), 2, "cmp")
exp = _f("exp", np.exp, 1, "act")
log = _f("log", np.log, 1, "act")
copy = _f("copy", lambda a: a, 1, "act")
identity = copy
negative = _f("negative", np.negative, 1, "act")
abs = _f("abs", np.abs, 1, "act")  # noqa: A001
sigmoid = _f("sigmoid", lambda a: 1.0 / (1.0 + np.exp(-a)), 1, "act")
square = _f("square", np.square, 1, "act")
rsqrt = _f("rsqrt", lambda a: 1.0 / np.sqrt(a), 1, "act")
sqrt = _f("sqrt", np.sqrt, 1, "act")
reciprocal = _f("reciprocal", lambda a: 1.0 / a, 1, "act")
softplus = _f("softplus", lambda a: np.logaddexp(0.0, a), 1, "act")


# ---------------------------------------------------------------- constructors
def ndarray(shape, dtype, buffer=sbuf, name=None, **_kw):
    return _core.new_tensor(shape, dtype, buffer)


def zeros(shape, dtype, buffer=sbuf, name=None, **_kw):
    t = _core.new_tensor(shape, dtype, buffer)
    _core.count("nl.zeros")
    t.write(np.zeros(t.shape))
    return t


def full(shape, fill_value, dtype, buffer=sbuf, name=None, **_kw):
    t = _core.new_tensor(shape, dtype, buffer)
    _core.count("nl.full")
    t.write(np.full(t.shape, fill_value, dtype=np.float64))
    return t


def load(src, dtype=None, **_kw):
    """HBM -> new SBUF tile (DMA). The first axis of src becomes the partition axis."""
    if not isinstance(src, Tensor) or src.buffer != "hbm":
        raise SimError("nl.load reads an HBM tensor")
    if len(src.shape) < 1:
        raise SimError("nl.load needs at least one axis (the partition axis)")
    out = _core.new_tensor(src.shape if len(src.shape) > 1 else (src.shape[0], 1), dtype or src.dtype, "sbuf")
    _core.count("dma")
    out.write(src.read())
    return out


def store(dst, value, **_kw):
    """SBUF tile -> HBM (DMA)."""
    if not isinstance(dst, Tensor) or dst.buffer != "hbm":
        raise SimError("nl.store writes an HBM tensor")
    if not isinstance(value, Tensor) or value.buffer != "sbuf":
        raise SimError("nl.store stores an SBUF tile (copy PSUM to SBUF first)")
    if value._arr.size != dst._arr.size or value.partitions != (dst.shape[0] if dst.shape else 1):
        raise SimError(f"nl.store: shape {value.shape} does not match destination {dst.shape}")
    _core.count("dma")
    dst.write(value.read())


# ---------------------------------------------------------------- SPMD
def program_id(axis):
    c = _core.ctx()
    if axis >= len(c.grid):
        raise SimError(f"program_id({axis}) in a launch with grid {c.grid}")
    return c.pid[axis]


def num_programs(axes=None):
    c = _core.ctx()
    if axes is None:
        return int(np.prod(c.grid)) if c.grid else 1
    if isinstance(axes, (tuple, list)):
        return int(np.prod([c.grid[a] for a in axes]))
    if axes >= len(c.grid):
        raise SimError(f"num_programs({axes}) in a launch with grid {c.grid}")
    return c.grid[axes]


def program_ndim():
    return len(_core.ctx().grid)


# ---------------------------------------------------------------- loops (executed eagerly in order)
def affine_range(start, stop=None, step=1):
    return range(start, stop, step) if stop is not None else range(start)


def sequential_range(start, stop=None, step=1):
    return range(start, stop, step) if stop is not None else range(start)


def static_range(start, stop=None, step=1):
    return range(start, stop, step) if stop is not None else range(start)


def arange(*args):
    return np.arange(*args)


# ---------------------------------------------------------------- high-level helpers built on the ISA
def matmul(x, y, transpose_x=False):
    """x @ y (or x.T @ y with transpose_x=True) into a new PSUM tile."""
    from . import isa
    if not transpose_x:
        if x.partitions > limits.PE_TRANSPOSE_MAX or x.free_size > limits.PE_TRANSPOSE_MAX:
            raise SimError("nl.matmul: x must be at most 128 x 128")
        tp = _core.new_tensor((x.free_size, x.partitions), float32 if x.dtype is float32 else x.dtype, "psum") \
            if x.dtype is float32 else None
        if tp is None:
            raise SimError("nl.matmul without transpose_x is only simulated for float32 x")
        isa.nc_transpose(dst=tp, data=x)
        xt = _core.new_tensor(tp.shape, x.dtype, "sbuf")
        isa.tensor_copy(dst=xt, src=tp)
        x = xt
    out = _core.new_tensor((x.free_size, y.free_size), float32, "psum")
    isa.nc_matmul(dst=out, stationary=x, moving=y, accumulate=False)
    return out


def transpose(x, dtype=None):
    from . import isa
    tp = _core.new_tensor((x.free_size, x.partitions), float32, "psum")
    isa.nc_transpose(dst=tp, data=x)
    out = _core.new_tensor(tp.shape, dtype or x.dtype, "sbuf")
    isa.tensor_copy(dst=out, src=tp)
    return out


_ = (bfloat16, float16, int8, int16, int32, tfloat32, uint8, uint16, uint32)
