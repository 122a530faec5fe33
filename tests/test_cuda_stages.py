"""The staged chunked ops (kda/gdn_chunk_fwd_stage, kda/gdn_chunk_bwd_stage; delta_chunk_fwd_host.cuh,
delta_chunk_bwd_host.cuh) that context parallelism's relay schedule runs: stage by stage they must give what the
one-call ops give (same kernels on the same inputs; relative RMS <= 1e-6, every output), with the backward's two
state stages in either order (the relay's last rank runs state_bwd first), and refuse bad stage use with a clear
error. The one-call ops themselves are checked against the float64 reference in test_cuda_chunk_fwd/bwd.py.

Needs a CUDA GPU: without one the module is skipped with the reason.
"""
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the staged CUDA ops need an NVIDIA GPU",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from test_cuda_backend import DEV, OPS, kk, make_inputs  # noqa: E402  (loads / builds the CUDA variant)

CASES = {
    "T200_h0": dict(B=2, T=200, H=2, HV=2, init=True),
    "T1_no_state": dict(B=1, T=1, H=1, HV=2, init=False),
    "gva_correlated": dict(B=1, T=300, H=1, HV=4, keys="correlated", init=True),
    "extreme_gates": dict(B=1, T=130, H=1, HV=2, extreme=True, gate_div=0.1, init=True),
    "varlen_empty": dict(H=2, HV=2, cu=[0, 0, 17, 17, 90, 91, 200], init=True),
    "k128_v128": dict(B=1, T=160, H=1, HV=2, K=128, V=128, init=True),
    "odd_dims": dict(B=1, T=77, H=1, HV=2, K=40, V=30, init=False),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _rel(a, b):
    a, b = a.double(), b.double()
    den = b.pow(2).sum().sqrt()
    return float((a - b).pow(2).sum().sqrt() / den) if den > 0 else float((a - b).abs().max())


def _inputs(family, case, dtype):
    spec = dict(CASES[case])
    init = spec.pop("init")
    cu_list = spec.get("cu")
    cu = None if cu_list is None else torch.tensor(cu_list, dtype=torch.long, device=DEV)
    q, k, v, g, beta = make_inputs(family, dtype=dtype, seed=5, **spec)
    N = q.shape[0] if cu is None else cu.numel() - 1
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    gen = torch.Generator().manual_seed(11)
    h0 = (torch.randn(N, HV, K, V, generator=gen) * 0.5).to(DEV) if init else None
    dht = torch.randn(N, HV, K, V, generator=gen).to(DEV) if init else None
    do = torch.randn(*v.shape, generator=gen).to(DEV).to(dtype)
    return (q, k, v, g, beta, K ** -0.5), h0, cu, do, dht


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_fwd_stages_match_one_call(family, case, dtype):
    x, h0, cu, _, _ = _inputs(family, case, DTYPES[dtype])
    o1, f1 = getattr(OPS, f"{family}_chunk_fwd")(*x, h0, cu)
    stage = getattr(OPS, f"{family}_chunk_fwd_stage")
    work = stage([], 0, *x, None, cu)
    o2, f2 = stage(work, 1, *x, h0, cu)
    torch.cuda.synchronize()
    assert o2.shape == o1.shape and o2.dtype == o1.dtype and f2.shape == f1.shape
    assert _rel(o2, o1) <= 1e-6 and _rel(f2, f1) <= 1e-6, (_rel(o2, o1), _rel(f2, f1))


@pytest.mark.parametrize("order", ["fwd_first", "bwd_first"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_bwd_stages_match_one_call(family, case, dtype, order):
    x, h0, cu, do, dht = _inputs(family, case, DTYPES[dtype])
    ref = getattr(OPS, f"{family}_chunk_bwd")(*x, h0, cu, do, dht)
    stage = getattr(OPS, f"{family}_chunk_bwd_stage")
    work = stage([], 0, *x, None, cu, do, None)
    if order == "fwd_first":
        assert stage(work, 1, *x, h0, cu, do, None) == []
        (dh0,) = stage(work, 2, *x, h0, cu, do, dht)
    else:
        (dh0,) = stage(work, 2, *x, h0, cu, do, dht)
        assert stage(work, 1, *x, h0, cu, do, None) == []
    dq, dk, dv, dg, dbeta = stage(work, 3, *x, h0, cu, do, None)
    torch.cuda.synchronize()
    for name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), (dq, dk, dv, dg, dbeta, dh0), ref):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert _rel(got, want) <= 1e-6, (name, _rel(got, want))


def test_cuda_build_has_stages():
    import importlib

    ops_module = importlib.import_module(kk.__name__ + ".ops")
    assert ops_module.has_stages("kda", DEV) and ops_module.has_stages("gdn", DEV)


def test_stage_misuse_is_refused():
    x, h0, cu, do, dht = _inputs("kda", "T200_h0", torch.bfloat16)
    fs, bs = OPS.kda_chunk_fwd_stage, OPS.kda_chunk_bwd_stage
    with pytest.raises(RuntimeError, match="stage must be"):
        fs([], 2, *x, None, cu)
    with pytest.raises(RuntimeError, match="stage 0 takes an empty work list"):
        fs([], 1, *x, h0, cu)
    work = fs([], 0, *x, None, cu)
    with pytest.raises(RuntimeError, match="work must be the list stage 0 returned"):
        fs(work[:2], 1, *x, h0, cu)
    with pytest.raises(RuntimeError, match="stage must be"):
        bs([], 4, *x, h0, cu, do, dht)
    bwork = bs([], 0, *x, None, cu, do, None)
    with pytest.raises(RuntimeError, match="work"):
        fs(bwork, 1, *x, h0, cu)  # the backward's work list handed to the forward
    q, k, v, g, beta, scale = x
    wide = torch.zeros(*v.shape[:3], 256, dtype=v.dtype, device=DEV)
    with pytest.raises(RuntimeError, match="V <= 128"):
        fs([], 0, q, k, wide, g, beta, scale, None, cu)


# Indices into the backward's work list (enum BwdWork of delta_chunk_bwd_host.cuh) of what the prep stage writes, and
# the rows of each that belong to real chunks: ("chunk", n) = n floats per (chunk, value head), ("token", n) = n
# per (token, value head). The rest of the list is written by later stages or not at all.
_PREP_OUT = {"aqk": (1, "chunk", 64 * 64), "akk": (2, "chunk", 64 * 64), "wc": (3, "chunk", 64 * 128),
             "kendc": (4, "chunk", 64 * 128), "qgc": (5, "chunk", 64 * 128), "glc": (6, "chunk", 128),
             "u": (7, "token", None)}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES) + ["gates_1e4", "gates_50_rows"])
def test_kda_bwd_prep4_matches_prep2(case, dtype, monkeypatch):
    """The KDA backward prep v4 (delta_chunk_bwd_prep4.cuh; KDA_CUDA_CHUNK_BWD_PREP=4, with the 8x8 split; =5,
    without, was retired in session 11) against the fp32 SIMT prep (=2; the session-8 partner prep v3 was retired in session 9), output by
    output: stage 0 of kda_chunk_bwd_stage runs only the prep, and its work list holds A_qk, A_kk, w, K Eend,
    Q Gam, Gam_last (row-major fp32, zero / one padded) and u. Both form every gate factor exactly (SIMT: running
    products in fp32; v4: running products of e^g within a 16-token sub-chunk, exponentials of float sums across),
    with fp32 / 3xTF32 products: relative RMS <= 3e-5 for the
    direct products, 3e-4 for w and u (through the inverse of I + A_kk Diag(beta)), over the valid rows of every
    buffer (padding rows / columns included: they must be the same zeros / ones). gates_1e4 / gates_50_rows: the
    extreme_gates case with its -20 gates at -1e4 (e^g = 0 exactly) / -50 plus every 7th token's gates at -50."""
    base = "extreme_gates" if case.startswith("gates_") else case
    x, h0, cu, do, dht = _inputs("kda", base, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    q, k, v, g, beta, scale = x
    if case == "gates_1e4":
        g = torch.where(g == -20.0, torch.full_like(g, -1e4), g)
    elif case == "gates_50_rows":
        g = torch.where(g == -20.0, torch.full_like(g, -50.0), g)
        g[:, ::7] = -50.0
    x = (q, k, v, g.contiguous(), beta, scale)
    B, T, HV = v.shape[0], v.shape[1], v.shape[2]
    lens = [T] * B if cu is None else (cu[1:] - cu[:-1]).tolist()
    chunks = sum((n + 63) // 64 for n in lens)
    stage = OPS.kda_chunk_bwd_stage
    outs = {}
    version = "4"
    for ver in ("2", version):
        monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_PREP", ver)
        work = stage([], 0, *x, None, cu, do, None)
        torch.cuda.synchronize()
        outs[ver] = {}
        for name, (i, kind, n) in _PREP_OUT.items():
            rows = chunks * HV * n if kind == "chunk" else B * T * HV * v.shape[3]
            assert work[i].numel() >= rows, f"work[{i}] ({name}) is smaller than expected: enum BwdWork changed?"
            outs[ver][name] = work[i][:rows].clone()
    differ = False
    for name, a in outs["2"].items():
        b = outs[version][name]
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), name
        err = _rel(b, a)
        assert err <= (3e-4 if name in ("wc", "u") else 3e-5), (name, err)
        differ = differ or not torch.equal(a, b)
    # the knob selects another kernel: its different (equally exact) rounding shows somewhere
    if case != "T1_no_state":
        assert differ, f"KDA_CUDA_CHUNK_BWD_PREP={version} gave bit-identical prep outputs: the knob had no effect?"


@pytest.mark.parametrize("mode", ["1", "11"], ids=["single", "scan7"])
@pytest.mark.parametrize("case", ["T200_h0", "varlen_empty", "gva_correlated", "odd_dims"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_fwd_stages_match_one_call_scan_knob(family, case, mode, monkeypatch):
    """Stage 1 with the scan KDA_CUDA_CHUNK_SCAN chose at stage 0 (1: the single kernel, 11: scan7, the default)
    gives the one-call op's result with the same knob, even when the knob changes between the stages (stage 0 records
    the choice in the work list; under 11 its prep also wrote w as bf16 for scan7). (Until session 12 this ran the
    split forward, 5 / 6, scan5, 7, and scan6, 8: retired.)"""
    monkeypatch.setenv("KDA_CUDA_CHUNK_SCAN", mode)
    x, h0, cu, _, _ = _inputs(family, case, torch.bfloat16)
    o1, f1 = getattr(OPS, f"{family}_chunk_fwd")(*x, h0, cu)
    stage = getattr(OPS, f"{family}_chunk_fwd_stage")
    work = stage([], 0, *x, None, cu)
    monkeypatch.setenv("KDA_CUDA_CHUNK_SCAN", "11" if mode == "1" else "1")
    o2, f2 = stage(work, 1, *x, h0, cu)
    torch.cuda.synchronize()
    assert _rel(o2, o1) <= 1e-6 and _rel(f2, f1) <= 1e-6, (_rel(o2, o1), _rel(f2, f1))
