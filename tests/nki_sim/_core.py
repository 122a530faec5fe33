"""Tensors, memory accounting and kernel launch for the NKI simulator."""
import collections
import itertools
import math
import weakref

import numpy as np

from . import limits


def limit_blas_threads(n=1):
    """Small fp32 matmuls are ~10x faster on one OpenBLAS thread than on an oversubscribed pool."""
    import ctypes
    import glob
    import os
    for lib in glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs", "*openblas*")):
        try:
            so = ctypes.CDLL(lib)
        except OSError:
            continue
        for fn in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            if hasattr(so, fn):
                getattr(so, fn)(n)
                return True
    return False


class SimError(RuntimeError):
    """A kernel broke an NKI rule or a NeuronCore limit."""


# ---------------------------------------------------------------- dtypes
class DType:
    def __init__(self, name, itemsize, kind):
        self.name, self.itemsize, self.kind = name, itemsize, kind  # kind: "f" float, "i" int

    def __repr__(self):
        return f"nl.{self.name}"


float32 = DType("float32", 4, "f")
tfloat32 = DType("tfloat32", 4, "f")
bfloat16 = DType("bfloat16", 2, "f")
float16 = DType("float16", 2, "f")
int32 = DType("int32", 4, "i")
uint32 = DType("uint32", 4, "i")
int16 = DType("int16", 2, "i")
uint16 = DType("uint16", 2, "i")
int8 = DType("int8", 1, "i")
uint8 = DType("uint8", 1, "i")
ALL_DTYPES = (float32, tfloat32, bfloat16, float16, int32, uint32, int16, uint16, int8, uint8)


_TINY = np.float32(np.finfo(np.float32).tiny)


def round_to(values, dtype):
    """Values (any float array) as the given dtype would hold them, stored in the simulator's storage type."""
    if dtype.kind == "i":
        return np.asarray(np.trunc(values), dtype=np.int64).astype(np.int32)
    v = np.asarray(values, dtype=np.float32)
    # Flush subnormals to zero, as the NeuronCore engines do (and as CPU BLAS would otherwise crawl over them).
    v = np.where(np.abs(v) < _TINY, np.float32(0), v)
    if dtype is bfloat16:
        u = v.view(np.uint32).astype(np.uint64)
        # round to nearest even on the upper 16 bits (NaN stays NaN)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        out = (u & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
        return np.where(np.isnan(v), v, out)
    if dtype is float16:
        with np.errstate(over="ignore"):
            return v.astype(np.float16).astype(np.float32)
    return v


def storage_dtype(dtype):
    return np.int32 if dtype.kind == "i" else np.float32


# ---------------------------------------------------------------- launch context and accounting
class _Ctx:
    def __init__(self, grid):
        self.grid = grid
        self.pid = (0,) * len(grid)
        self.sbuf_live = 0
        self.psum_banks_live = 0
        self.sbuf_peak = 0
        self.psum_peak = 0
        self.shared = []           # shared_hbm outputs, in allocation order (same objects for every program)
        self.shared_i = 0
        self.counts = collections.Counter()


_ctx = None
stats = collections.Counter()   # instruction counts and peaks over every launch (for tests and curiosity)


def ctx():
    if _ctx is None:
        raise SimError("NKI API used outside a @nki.jit kernel")
    return _ctx


def count(name):
    c = ctx()
    c.counts[name] += 1
    stats[name] += 1


class _Alloc:
    """One on-chip allocation; freed (for accounting) when the last view of it is garbage."""

    def __init__(self, buffer, nbytes_pp, c):
        self.buffer = buffer
        self.nbytes_pp = nbytes_pp
        self.matmul_ready = None  # PSUM only: elements whose last write was a matmul (may accumulate)
        if buffer == "sbuf":
            if nbytes_pp > limits.SBUF_BYTES_PER_PARTITION:
                raise SimError(f"SBUF tile needs {nbytes_pp} bytes per partition, more than the "
                               f"{limits.SBUF_BYTES_PER_PARTITION} bytes of one partition")
            c.sbuf_live += nbytes_pp
            if c.sbuf_live > limits.SBUF_BYTES_PER_PARTITION:
                live = c.sbuf_live
                c.sbuf_live -= nbytes_pp
                raise SimError(f"SBUF overflow: {live} bytes per partition live, capacity "
                               f"{limits.SBUF_BYTES_PER_PARTITION} (192 KiB, trn2)")
            c.sbuf_peak = max(c.sbuf_peak, c.sbuf_live)
            weakref.finalize(self, _free_sbuf, c, nbytes_pp)
        else:
            if nbytes_pp > limits.PSUM_BANK_BYTES:
                raise SimError(f"PSUM tile needs {nbytes_pp} bytes per partition; one PSUM tile must fit one "
                               f"bank of {limits.PSUM_BANK_BYTES} bytes (512 fp32)")
            banks = 1
            c.psum_banks_live += banks
            if c.psum_banks_live > limits.PSUM_BANKS:
                c.psum_banks_live -= banks
                raise SimError(f"PSUM overflow: more than {limits.PSUM_BANKS} banks (2 KiB each per partition) "
                               f"live at once")
            c.psum_peak = max(c.psum_peak, c.psum_banks_live)
            weakref.finalize(self, _free_psum, c, banks)


def _free_sbuf(c, n):
    c.sbuf_live -= n


def _free_psum(c, n):
    c.psum_banks_live -= n


# ---------------------------------------------------------------- tensors
class Tensor:
    """An HBM tensor or an on-chip tile (SBUF/PSUM); views share memory with their parent."""

    def __init__(self, arr, dtype, buffer, alloc=None, pstart=0, ready=None):
        self._arr = arr
        self.dtype = dtype
        self.buffer = buffer
        self._alloc = alloc
        self.pstart = pstart
        self._ready = ready  # view of alloc.matmul_ready (PSUM)

    @property
    def shape(self):
        return tuple(self._arr.shape)

    @property
    def ndim(self):
        return self._arr.ndim

    @property
    def onchip(self):
        return self.buffer in ("sbuf", "psum")

    def __repr__(self):
        return f"<{self.buffer} {self.dtype.name}{list(self.shape)}>"

    def __getitem__(self, idx):
        if not isinstance(idx, tuple):
            idx = (idx,)
        if any(i is None or i is Ellipsis for i in idx):
            raise SimError("None/Ellipsis indexing is not supported on NKI tensors in this simulator")
        pstart = self.pstart
        if self.onchip:
            p = idx[0]
            if isinstance(p, (int, np.integer)):
                p = slice(int(p), int(p) + 1)
            if not isinstance(p, slice):
                raise SimError("the partition axis of an on-chip tile takes an int or a slice")
            start, stop, step = p.indices(self._arr.shape[0])
            if step != 1:
                raise SimError("the partition axis of an on-chip tile cannot be strided")
            idx = (slice(start, stop),) + idx[1:]
            pstart = self.pstart + start
        for i in idx:
            if not isinstance(i, (int, np.integer, slice)):
                raise SimError(f"only ints and slices index NKI tensors here, got {type(i).__name__}")
        arr = self._arr[idx]
        if arr.ndim == 0:
            arr = self._arr[idx + (slice(None),) * 0].reshape(1)
        ready = self._ready[idx] if self._ready is not None else None
        return Tensor(arr, self.dtype, self.buffer, self._alloc, pstart, ready)

    def reshape(self, shape):
        if self.onchip:
            raise SimError("reshape is only supported on HBM tensors in this simulator")
        if not self._arr.flags.c_contiguous:
            raise SimError("reshape of a non-contiguous HBM view")
        return Tensor(self._arr.reshape(shape), self.dtype, self.buffer)

    # helpers for the instruction implementations
    def read(self):
        return self._arr.astype(np.float64) if self.dtype.kind == "f" else self._arr.astype(np.int64)

    def write(self, values, from_matmul=False):
        vals = np.asarray(values)
        if vals.size != self._arr.size:
            raise SimError(f"write of {vals.size} elements into {self!r}")
        self._arr[...] = round_to(vals.reshape(self._arr.shape), self.dtype)
        if self._ready is not None:
            self._ready[...] = from_matmul

    @property
    def partitions(self):
        return self._arr.shape[0]

    @property
    def free_size(self):
        n = 1
        for d in self._arr.shape[1:]:
            n *= d
        return n


def new_tensor(shape, dtype, buffer):
    shape = tuple(int(s) for s in shape)
    if dtype not in ALL_DTYPES:
        raise SimError(f"unsupported dtype {dtype!r}")
    if buffer in ("shared_hbm", "hbm", "private_hbm"):
        c = ctx()
        if buffer == "shared_hbm":
            # Every SPMD program allocating its k-th shared_hbm tensor gets the same tensor.
            if c.shared_i < len(c.shared):
                t = c.shared[c.shared_i]
                if t.shape != shape or t.dtype is not dtype:
                    raise SimError("SPMD programs allocated different shared_hbm outputs")
                c.shared_i += 1
                return t
            t = Tensor(np.zeros(shape, storage_dtype(dtype)), dtype, "hbm")
            c.shared.append(t)
            c.shared_i += 1
            return t
        return Tensor(np.zeros(shape, storage_dtype(dtype)), dtype, "hbm")
    if buffer not in ("sbuf", "psum"):
        raise SimError(f"unknown buffer {buffer!r}")
    if len(shape) < 1:
        raise SimError("an on-chip tile needs a partition axis")
    if shape[0] > limits.PMAX:
        raise SimError(f"tile partition dimension {shape[0]} exceeds {limits.PMAX} (tile_size.pmax)")
    if buffer == "psum" and dtype not in (float32, int32):
        raise SimError(f"PSUM tiles are float32 here (matmul results are float32 on trn2), got {dtype!r}")
    free = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    c = ctx()
    alloc = _Alloc(buffer, free * dtype.itemsize, c)
    # Fill with a poison value: reading memory nobody wrote is a kernel bug the tests should see.
    fill = np.nan if dtype.kind == "f" else -(2 ** 31)
    arr = np.full(shape, fill, storage_dtype(dtype))
    ready = np.zeros(shape, bool) if buffer == "psum" else None
    alloc.matmul_ready = ready
    return Tensor(arr, dtype, buffer, alloc, 0, ready)


# ---------------------------------------------------------------- torch/numpy interop
def _from_host(x):
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None
    if torch is not None and isinstance(x, torch.Tensor):
        dt = {torch.float32: float32, torch.bfloat16: bfloat16, torch.float16: float16,
              torch.int32: int32, torch.int64: int32, torch.int16: int16, torch.int8: int8,
              torch.uint8: uint8}.get(x.dtype)
        if dt is None:
            raise SimError(f"unsupported torch dtype {x.dtype}")
        arr = x.detach().cpu()
        arr = arr.float().numpy() if dt.kind == "f" else arr.to(torch.int32).numpy()
        return Tensor(np.array(arr, copy=True), dt, "hbm"), "torch"
    if isinstance(x, np.ndarray):
        dt = {np.dtype(np.float32): float32, np.dtype(np.float16): float16,
              np.dtype(np.int32): int32}.get(x.dtype)
        if dt is None:
            raise SimError(f"unsupported numpy dtype {x.dtype}")
        return Tensor(np.array(x, dtype=storage_dtype(dt), copy=True), dt, "hbm"), "numpy"
    return x, None


def _to_host(t, kind):
    if not isinstance(t, Tensor):
        return t
    if kind == "torch":
        import torch
        dt = {float32: torch.float32, bfloat16: torch.bfloat16, float16: torch.float16,
              int32: torch.int32}.get(t.dtype, torch.float32)
        return torch.from_numpy(np.array(t._arr, copy=True)).to(dt)
    return np.array(t._arr, copy=True)


# ---------------------------------------------------------------- jit and launch
class Kernel:
    def __init__(self, fn, grid=()):
        self.fn = fn
        self.grid = tuple(grid)
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)
        self.last_counts = None
        self.last_sbuf_peak = 0
        self.last_psum_peak = 0

    def __getitem__(self, grid):
        if not isinstance(grid, tuple):
            grid = (grid,)
        k = Kernel(self.fn, grid)
        k._parent = self
        return k

    def __call__(self, *args, **kwargs):
        global _ctx
        if _ctx is not None:
            raise SimError("nested kernel launch")
        conv = [_from_host(a) for a in args]
        kinds = {kind for _, kind in conv if kind}
        hargs = [a for a, _ in conv]
        hkw = {}
        for key, val in kwargs.items():
            hkw[key], kind = _from_host(val)
            if kind:
                kinds.add(kind)
        kind = "torch" if "torch" in kinds else "numpy"
        grid = self.grid
        for gdim in grid:
            if int(gdim) < 1:
                raise SimError(f"bad SPMD grid {grid}")
        c = _Ctx(grid)
        _ctx = c
        out = None
        try:
            for pid in itertools.product(*[range(int(n)) for n in grid]) if grid else [()]:
                c.pid = pid
                c.shared_i = 0
                out = self.fn(*hargs, **hkw)
        finally:
            _ctx = None
        target = getattr(self, "_parent", self)
        target.last_counts = dict(c.counts)
        target.last_sbuf_peak = c.sbuf_peak
        target.last_psum_peak = c.psum_peak
        stats["sbuf_peak_max"] = max(stats["sbuf_peak_max"], c.sbuf_peak)
        stats["psum_banks_peak_max"] = max(stats["psum_banks_peak_max"], c.psum_peak)
        if isinstance(out, tuple):
            return tuple(_to_host(o, kind) for o in out)
        return _to_host(out, kind)


def jit(fn=None, **_options):
    if fn is None:
        return lambda f: Kernel(f)
    return Kernel(fn)


def ceil_div(a, b):
    return -(-a // b)


_ = math  # keep import used
