"""Small tile helpers shared by the kda-kernels NKI kernels (called from inside @nki.jit kernels)."""
import nki.isa as nisa
import nki.language as nl

F32 = nl.float32
PMAX = 128          # partitions: K (the state's rows) and the chunk length live on them
MAX_V = 128         # value columns per kernel launch; the torch wrappers tile larger V


def sb(shape, dtype=F32):
    """A new SBUF tile."""
    return nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)


def ps(shape):
    """A new fp32 PSUM tile (must fit one 2 KiB bank per partition)."""
    return nl.ndarray(shape, dtype=F32, buffer=nl.psum)


def load_f32(src):
    """HBM -> SBUF, converted to fp32 (inputs may be bf16/fp16; all math is fp32)."""
    t = sb(src.shape, src.dtype)
    nisa.dma_copy(dst=t, src=src)
    if src.dtype == F32:
        return t
    f = sb(src.shape)
    nisa.tensor_copy(dst=f, src=t)
    return f


def mm(stationary, moving, shape):
    """stationary^T @ moving on the Tensor Engine, returned in a new SBUF tile (the PSUM bank is released)."""
    p = ps(shape)
    nisa.nc_matmul(dst=p, stationary=stationary, moving=moving, accumulate=False)
    out = sb(shape)
    nisa.tensor_copy(dst=out, src=p)
    return out


def transpose(x, rows, cols):
    """[rows, cols] SBUF tile -> new [cols, rows] SBUF tile via the Tensor Engine."""
    p = ps((cols, rows))
    nisa.nc_transpose(dst=p, data=x)
    out = sb((cols, rows))
    nisa.tensor_copy(dst=out, src=p)
    return out


def exp(x, shape):
    out = sb(shape)
    nisa.activation(dst=out, op=nl.exp, data=x)
    return out


def mul(a, b, shape):
    out = sb(shape)
    nisa.tensor_tensor(dst=out, data1=a, data2=b, op=nl.multiply)
    return out


SUB = 16  # tokens per sub-chunk: the reference points of the exact per-channel factorisation


def chunk_layout(L):
    """Column offsets of the constant masks in the [L, W] `consts` input of the chunked kernels.

    I: identity.  INCL[m, i] = m <= i.  SU[m, j] = m > j.  LOC[m, i] = same 16-block and m <= i.
    NB: for sub-chunk I >= 1 a segment of width 16 I at NB + 8 I (I - 1), column j: j < m <= 16 I - 1.
    OFF + L * lvl: the transposed merge mask of level s = 2 ** lvl of the triangular inverse,
    OffT_s[a, b] = (a // 2s == b // 2s) and (a // s odd) and (b // s even).
    """
    nb = L // SUB
    w_nb = 8 * nb * (nb - 1)
    levels = L.bit_length() - 1
    lay = {"I": 0, "INCL": L, "SU": 2 * L, "LOC": 3 * L, "NB": 4 * L, "OFF": 4 * L + w_nb}
    lay["W"] = lay["OFF"] + levels * L
    lay["levels"] = levels
    return lay


def nb_offset(i):
    """Start column (relative to NB) of sub-chunk i's segment."""
    return 8 * i * (i - 1)
