"""`nki.isa` subset (NKI >= 0.3 signatures: the destination tile is the first argument, `dst=`)."""
import numpy as np

from . import _core, limits
from ._core import SimError, Tensor, bfloat16, float16, float32, tfloat32
from . import language as nl


class _Engine:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"nisa.{self.name}"


tensor_engine = _Engine("tensor_engine")
vector_engine = _Engine("vector_engine")
scalar_engine = _Engine("scalar_engine")
gpsimd_engine = _Engine("gpsimd_engine")
unknown_engine = _Engine("unknown")


class engine:
    tensor = tensor_engine
    vector = vector_engine
    scalar = scalar_engine
    gpsimd = gpsimd_engine
    unknown = unknown_engine


class reduce_cmd:
    idle = "idle"
    reset = "reset"
    reduce = "reduce"
    reset_reduce = "reset_reduce"


class matmul_perf_mode:
    none = "none"
    double_row = "double_row"


# ---------------------------------------------------------------- checks
def _check_tile(t, who, what="operand"):
    if not isinstance(t, Tensor):
        raise SimError(f"{who}: {what} must be a tile, got {type(t).__name__}")
    if not t.onchip:
        raise SimError(f"{who}: {what} must be on chip (SBUF/PSUM), got an HBM tensor")


def _check_compute(t, who, what="operand"):
    """Partition rules for compute-engine access: <= 128 partitions, quadrant-aligned start."""
    _check_tile(t, who, what)
    n, s = t.partitions, t.pstart
    if n > limits.PMAX or s + n > limits.PMAX:
        raise SimError(f"{who}: {what} spans partitions {s}..{s + n - 1}, beyond {limits.PMAX}")
    active = _core.ceil_div(n, 32) * 32
    ok = (s == 0) if active >= 96 else (s in (0, 64)) if active == 64 else (s % limits.PARTITION_START_ALIGN == 0)
    if not ok:
        raise SimError(f"{who}: {what} starts at partition {s} with {n} partitions; compute instructions start "
                       f"at partition 0 (or 64 for <= 64 partitions, or a multiple of 32 for <= 32)")


def _same_lanes(who, *tiles):
    ref = tiles[0]
    for t in tiles[1:]:
        if t.partitions != ref.partitions:
            raise SimError(f"{who}: partition counts differ ({ref.partitions} vs {t.partitions})")
        if t.pstart != ref.pstart:
            raise SimError(f"{who}: operands start at partitions {ref.pstart} and {t.pstart}; compute engines do "
                           f"not move data across partitions (use a matmul/transpose or a DMA)")


def _same_elems(who, *tiles):
    ref = tiles[0]
    for t in tiles[1:]:
        if t.free_size != ref.free_size:
            raise SimError(f"{who}: elements per partition differ ({ref.free_size} vs {t.free_size})")


def _no_gpsimd_psum(who, eng, *tiles):
    if eng is gpsimd_engine and any(t.buffer == "psum" for t in tiles):
        raise SimError(f"{who}: the GpSimd engine cannot access PSUM")


def _vec_operand(op, data, who):
    """A scalar, or a [P, 1] tile on the same partitions as data."""
    if isinstance(op, Tensor):
        _check_compute(op, who, "vector operand")
        if op.partitions != data.partitions or op.free_size != 1:
            raise SimError(f"{who}: a tile operand must be [partitions, 1] = [{data.partitions}, 1], got {op.shape}")
        _same_lanes(who, data, op)
        return op.read().reshape(op.partitions, 1)
    if isinstance(op, (int, float, np.floating, np.integer)):
        return float(op)
    raise SimError(f"{who}: operand must be a scalar or a [P, 1] tile, got {type(op).__name__}")


def _flat(t):
    return t.read().reshape(t.partitions, -1)


def _apply(op, a, b, who):
    if not isinstance(op, nl._Op) or op.arity != 2:
        raise SimError(f"{who}: {op!r} is not a binary ALU operator")
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return op.fn(a, b)


# ---------------------------------------------------------------- Tensor Engine
def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=None, name=None, **_kw):
    who = "nc_matmul"
    for t, what in ((stationary, "stationary"), (moving, "moving")):
        _check_compute(t, who, what)
        if t.buffer != "sbuf":
            raise SimError(f"{who}: {what} must be in SBUF")
        if t.dtype not in (float32, tfloat32, bfloat16, float16):
            raise SimError(f"{who}: {what} dtype {t.dtype!r} not supported")
    _check_compute(dst, who, "dst")
    if dst.buffer != "psum" or dst.dtype is not float32:
        raise SimError(f"{who}: dst must be a float32 PSUM tile (trn2)")
    fp32 = (float32, tfloat32)
    if (stationary.dtype in fp32) != (moving.dtype in fp32):
        raise SimError(f"{who}: a float32 operand needs a float32 partner (got {stationary.dtype!r} and "
                       f"{moving.dtype!r})")
    K = stationary.partitions
    if moving.partitions != K:
        raise SimError(f"{who}: contraction (partition) sizes differ: stationary {K}, moving {moving.partitions}")
    if stationary.pstart != moving.pstart:
        raise SimError(f"{who}: stationary and moving start on different partitions")
    M, N = stationary.free_size, moving.free_size
    if M > limits.GEMM_STATIONARY_FMAX:
        raise SimError(f"{who}: stationary free size {M} exceeds {limits.GEMM_STATIONARY_FMAX} "
                       f"(tile_size.gemm_stationary_fmax)")
    if N > limits.GEMM_MOVING_FMAX:
        raise SimError(f"{who}: moving free size {N} exceeds {limits.GEMM_MOVING_FMAX} (tile_size.gemm_moving_fmax)")
    if dst.partitions != M or dst.free_size != N:
        raise SimError(f"{who}: dst {dst.shape} must be [{M}, {N}] (stationary free x moving free)")
    _core.count("nc_matmul")
    s = stationary._arr.reshape(K, M).astype(np.float32)
    m = moving._arr.reshape(K, N).astype(np.float32)
    res = (s.T @ m).astype(np.float64)  # fp32 products, fp32 accumulation
    ready = dst._ready.reshape(M, N)
    if accumulate is None:
        accumulate = bool(ready.all())
    if accumulate:
        if not ready.all():
            raise SimError(f"{who}: accumulate=True into PSUM that no matmul initialised (undefined on hardware)")
        res = res + dst.read().reshape(M, N)
    dst.write(res, from_matmul=True)


def nc_transpose(dst, data, engine=unknown_engine, name=None, **_kw):
    who = "nc_transpose"
    _check_compute(data, who, "data")
    _check_compute(dst, who, "dst")
    P, F = data.partitions, data.free_size
    if engine is vector_engine:
        if P > limits.DVE_TRANSPOSE_MAX or F > limits.DVE_TRANSPOSE_MAX:
            raise SimError(f"{who}: the Vector Engine transposes at most 32 x 32, got {P} x {F}")
    else:
        if P > limits.PE_TRANSPOSE_MAX or F > limits.PE_TRANSPOSE_MAX:
            raise SimError(f"{who}: the Tensor Engine transposes at most 128 x 128, got {P} x {F}")
        if data.buffer != "sbuf" or dst.buffer != "psum":
            raise SimError(f"{who}: a Tensor Engine transpose reads SBUF and writes PSUM")
    if dst.partitions != F or dst.free_size != P:
        raise SimError(f"{who}: dst {dst.shape} must be [{F}, {P}]")
    _core.count("nc_transpose")
    dst.write(_flat(data).T, from_matmul=True)


# ---------------------------------------------------------------- Scalar / Vector / GpSimd engines
def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle,
               name=None, **_kw):
    who = "activation"
    _check_compute(data, who, "data")
    _check_compute(dst, who, "dst")
    _same_lanes(who, dst, data)
    _same_elems(who, dst, data)
    if not isinstance(op, nl._Op) or op.arity != 1:
        raise SimError(f"{who}: {op!r} is not an activation function")
    x = _flat(data)
    sc = _vec_operand(scale, data, who)
    x = x * sc
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise SimError(f"{who}: bias must be a [P, 1] tile")
        if bias.dtype is not float32:
            raise SimError(f"{who}: bias must be float32")
        x = x + _vec_operand(bias, data, who)
    _core.count("activation")
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        y = op.fn(x)
    dst.write(y)
    if reduce_res is not None:
        _check_compute(reduce_res, who, "reduce_res")
        if reduce_op is not nl.add:
            raise SimError(f"{who}: reduce_op must be nl.add")
        reduce_res.write(y.sum(axis=1, keepdims=True))


def tensor_tensor(dst, data1, data2, op, engine=unknown_engine, name=None, **_kw):
    who = "tensor_tensor"
    for t, w in ((data1, "data1"), (data2, "data2"), (dst, "dst")):
        _check_compute(t, who, w)
    if data1.buffer == "psum" and data2.buffer == "psum":
        raise SimError(f"{who}: data1 and data2 cannot both be in PSUM")
    _no_gpsimd_psum(who, engine, data1, data2, dst)
    _same_lanes(who, dst, data1, data2)
    _same_elems(who, dst, data1, data2)
    _core.count("tensor_tensor")
    dst.write(_apply(op, _flat(data1), _flat(data2), who))


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=unknown_engine, name=None, **_kw):
    who = "tensor_scalar"
    _check_compute(data, who, "data")
    _check_compute(dst, who, "dst")
    _no_gpsimd_psum(who, engine, data, dst)
    _same_lanes(who, dst, data)
    _same_elems(who, dst, data)
    x = _flat(data)
    a = _vec_operand(operand0, data, who)
    x = _apply(op0, a, x, who) if reverse0 else _apply(op0, x, a, who)
    if op1 is not None:
        b = _vec_operand(operand1, data, who)
        x = _apply(op1, b, x, who) if reverse1 else _apply(op1, x, b, who)
    elif operand1 is not None:
        raise SimError(f"{who}: operand1 given without op1")
    _core.count("tensor_scalar")
    dst.write(x)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None, **_kw):
    who = "scalar_tensor_tensor"
    for t, w in ((data, "data"), (operand1, "operand1"), (dst, "dst")):
        _check_compute(t, who, w)
    if data.buffer == "psum" and operand1.buffer == "psum":
        raise SimError(f"{who}: data and operand1 cannot both be in PSUM")
    _same_lanes(who, dst, data, operand1)
    _same_elems(who, dst, data, operand1)
    x = _flat(data)
    a = _vec_operand(operand0, data, who)
    x = _apply(op0, a, x, who) if reverse0 else _apply(op0, x, a, who)
    y = _flat(operand1)
    x = _apply(op1, y, x, who) if reverse1 else _apply(op1, x, y, who)
    _core.count("scalar_tensor_tensor")
    dst.write(x)


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None, **_kw):
    who = "tensor_reduce"
    _check_compute(data, who, "data")
    _check_compute(dst, who, "dst")
    _same_lanes(who, dst, data)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    nd = data.ndim
    if 0 in axes:
        raise SimError(f"{who}: cannot reduce the partition axis (use a matmul or tensor_partition_reduce)")
    if sorted(axes) != list(range(nd - len(axes), nd)):
        raise SimError(f"{who}: axis {axes} must be the trailing free axes of a rank-{nd} tile")
    fn = {"add": np.sum, "maximum": np.max, "minimum": np.min, "multiply": np.prod}.get(getattr(op, "name", ""))
    if fn is None:
        raise SimError(f"{who}: unsupported reduce op {op!r}")
    r = fn(data.read(), axis=axes, keepdims=True)
    if negate:
        r = -r
    if dst._arr.size != r.size:
        raise SimError(f"{who}: dst {dst.shape} does not hold the reduction {r.shape}")
    _core.count("tensor_reduce")
    dst.write(r)


def tensor_copy(dst, src, engine=unknown_engine, name=None, **_kw):
    who = "tensor_copy"
    _check_compute(src, who, "src")
    _check_compute(dst, who, "dst")
    _no_gpsimd_psum(who, engine, src, dst)
    _same_lanes(who, dst, src)
    _same_elems(who, dst, src)
    _core.count("tensor_copy")
    dst.write(_flat(src))


def memset(dst, value, engine=unknown_engine, name=None, **_kw):
    who = "memset"
    _check_compute(dst, who, "dst")
    _no_gpsimd_psum(who, engine, dst)
    _core.count("memset")
    dst.write(np.full(dst.shape, float(value)))


def _pattern_values(dst, pattern, offset, channel_multiplier, who):
    pat = [list(p) for p in pattern]
    if len(pat) > 4 or any(len(p) != 2 for p in pat):
        raise SimError(f"{who}: pattern is a list of up to 4 [step, num] pairs")
    while len(pat) < 4:
        pat.insert(0, [0, 1])
    nums = [p[1] for p in pat]
    if int(np.prod(nums)) != dst.free_size:
        raise SimError(f"{who}: pattern covers {int(np.prod(nums))} elements per partition, dst has {dst.free_size}")
    grids = np.meshgrid(*[np.arange(n) * s for s, n in pat], indexing="ij")
    free = sum(grids).reshape(-1)
    ch = np.arange(dst.partitions).reshape(-1, 1) * channel_multiplier
    return offset + ch + free.reshape(1, -1)


def iota(dst, pattern, offset, channel_multiplier=0, name=None, **_kw):
    who = "iota"
    _check_compute(dst, who, "dst")
    if dst.buffer != "sbuf":
        raise SimError(f"{who}: dst must be in SBUF (GpSimd engine)")
    _core.count("iota")
    dst.write(_pattern_values(dst, pattern, offset, channel_multiplier, who))


def affine_select(dst, pattern, offset, channel_multiplier, on_true_tile, on_false_value, cmp_op=nl.equal, name=None,
                  **_kw):
    who = "affine_select"
    _check_compute(dst, who, "dst")
    _check_compute(on_true_tile, who, "on_true_tile")
    if dst.buffer != "sbuf" or on_true_tile.buffer != "sbuf":
        raise SimError(f"{who}: the GpSimd engine reads and writes SBUF only")
    _same_lanes(who, dst, on_true_tile)
    _same_elems(who, dst, on_true_tile)
    vals = _pattern_values(dst, pattern, offset, channel_multiplier, who)
    if not isinstance(cmp_op, nl._Op) or cmp_op.kind != "cmp":
        raise SimError(f"{who}: cmp_op must be a comparison (nl.equal, nl.greater_equal, ...)")
    pred = cmp_op.fn(vals, 0) != 0
    _core.count("affine_select")
    dst.write(np.where(pred, _flat(on_true_tile), float(on_false_value)))


def dma_copy(dst, src, dst_rmw_op=None, name=None, **_kw):
    who = "dma_copy"
    for t, w in ((dst, "dst"), (src, "src")):
        if not isinstance(t, Tensor):
            raise SimError(f"{who}: {w} must be a tensor")
        if t.buffer == "psum":
            raise SimError(f"{who}: DMA cannot access PSUM")
        if t.onchip and t.partitions > limits.PMAX:
            raise SimError(f"{who}: {w} has more than {limits.PMAX} partitions")
    if dst._arr.size != src._arr.size:
        raise SimError(f"{who}: {src.shape} -> {dst.shape} element counts differ")
    if dst.onchip and src.onchip and dst.partitions != src.partitions:
        raise SimError(f"{who}: SBUF -> SBUF copies keep the partition count")
    if dst.onchip and not src.onchip and (src.shape[0] if src.shape else 1) != dst.partitions:
        raise SimError(f"{who}: the first axis of src {src.shape} must match dst partitions {dst.partitions}")
    if src.onchip and not dst.onchip and (dst.shape[0] if dst.shape else 1) != src.partitions:
        raise SimError(f"{who}: the first axis of dst {dst.shape} must match src partitions {src.partitions}")
    v = src.read()
    if dst_rmw_op is not None:
        if dst_rmw_op is not nl.add:
            raise SimError(f"{who}: dst_rmw_op must be nl.add")
        v = dst.read().reshape(v.shape) + v
    _core.count("dma")
    dst.write(v)


_ = (float16,)
