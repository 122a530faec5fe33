"""The chunked-forward scan delta_chunk_scan6_kernel (KDA_CUDA_CHUNK_SCAN=8, the default since session 11;
kernels_src/cuda/delta_chunk_scan6.cuh), set explicitly, against the float64 reference (tests/ref_delta.py,
DESIGN.md section 6), against the single scan kernel delta_chunk_scan_kernel (KDA_CUDA_CHUNK_SCAN=1: the same
prep, workspace and tf32 products in another fp32 summation order, so o agrees to 1e-3 and the final state to
1e-4, as scan3 did), and against a repeat scan6 call (the same bits: no race between its warp groups); the knob
unset runs scan7 since session 12 (tests/test_cuda_scan7.py).

Until session 12 these tests compared scan6 bit for bit with scan5 (KDA_CUDA_CHUNK_SCAN=7: scan6 runs scan5's
products in scan5's order; they were bit-equal in every case of session 11's candidate call). scan5 was
retired in session 12 (refused: tests/test_cuda_chunk_fwd.py). The index math of the warp tiles is emulated on the
CPU by tests/test_cuda_scan6_emu.py, the h_c / U_c handoff by tests/test_cuda_scan6_handoff_emu.py. Cases: random
and correlated keys, gates logsigmoid(randn)/{0.1, 10}, extreme gates (30 % at -20, some at -1e4), T not a
multiple of the chunk (1, 63, 65, 200), T2048 (32 chunks: every h_c / U_c buffer reused ~10 times), varlen with
empty sequences, GVA (HV = 4 H), initial state, K=V=64, odd K/V, V = 80 / 200 / 256 / 37 (partial and several
column blocks), bf16 / fp16; longer runs at 64 to 128 chunks (many blocks in flight, the output warps lagging)
with a repeat call, a CUDA graph replay, and fp32 inputs (fall back to the single kernel). Needs a CUDA GPU
(skipped with the reason otherwise).
"""
import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the scan6 tests need an NVIDIA GPU",
                allow_module_level=True)

from ref_delta import assert_close, ref_delta_rule  # noqa: E402
from test_cuda_chunk_fwd import DEV, OPS, TOL, case_inputs, fwd_per_knob, make  # noqa: E402  (loads the build)

KNOB = "KDA_CUDA_CHUNK_SCAN"
CASES6 = ["T1", "T63", "T65", "T200", "T2048", "correlated_keys", "gate_div_0.1", "gate_div_10", "extreme_gates",
          "extreme_gates_div_0.1", "gva_4x", "kv64", "odd_kv", "wide_v", "cp_width_v256", "v200", "odd_v",
          "varlen", "varlen_extreme"]
FP16_CASES = ("T65", "extreme_gates", "varlen", "odd_kv", "odd_v", "cp_width_v256")


@functools.lru_cache(maxsize=None)  # shared by the bf16 / fp16 parametrizations
def _reference(family, case, dtype):
    (q, k, v, g, beta), h0, cu = case_inputs(family, case, dtype)
    return ref_delta_rule(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), scale=q.shape[3] ** -0.5,
                          initial_state=None if h0 is None else h0.cpu(), cu_seqlens=None if cu is None else cu.cpu())


MODES = ["8"]  # (9, scan6 with warp pairs, was retired in session 11: refused, tests/test_cuda_chunk_fwd.py)
SINGLE = "1"  # the single scan kernel, the cross-check


def _close_to_single(tag, o1, s1, o8, s8):
    assert_close(f"final_state ({tag} vs single scan)", s1.cpu(), s8.cpu(), 1e-4)
    assert_close(f"o ({tag} vs single scan)", o1.float().cpu(), o8.float().cpu(), 1e-3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES6)
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_scan6_reference_and_single(family, case, dtype, mode, monkeypatch):
    if dtype == torch.float16 and case not in FP16_CASES:
        pytest.skip("fp16 differs from bf16 only in the load/store conversion; a subset suffices")
    (o1, s1), (o8, s8), (o8b, s8b) = fwd_per_knob(family, case, dtype, "ws_bf16", KNOB, (SINGLE, mode, mode),
                                                  monkeypatch)
    assert o8.dtype == dtype and s8.dtype == torch.float32 and o8.shape == o1.shape and s8.shape == s1.shape
    assert torch.isfinite(o8.float()).all() and torch.isfinite(s8).all()
    ro, rs = _reference(family, case, dtype)
    assert_close("o (scan6)", ro, o8.cpu(), TOL[dtype])
    assert_close("final_state (scan6)", rs, s8.cpu(), TOL[dtype])
    _close_to_single("scan6", o1, s1, o8, s8)
    assert torch.equal(o8, o8b) and torch.equal(s8, s8b), "a repeat scan6 call gave other bits"


@pytest.mark.parametrize("shape", [(2, 4096, 8, 16, 128, 128), (1, 8192, 2, 4, 64, 64), (3, 1000, 4, 8, 128, 96),
                                   (1, 8192, 16, 32, 128, 128)],
                         ids=["B2_T4096_HV16", "T8192_kv64", "B3_T1000_v96", "B1_T8192_HV32"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_scan6_long(family, shape, mode, monkeypatch):
    B, T, H, HV, K, V = shape
    q, k, v, g, beta = make(family, B=B, T=T, H=H, HV=HV, K=K, V=V, seed=3)
    h0 = (torch.randn(B, HV, K, V, generator=torch.Generator().manual_seed(5)) * 0.5).to(DEV)
    fn = getattr(OPS, f"{family}_chunk_fwd")
    out = {}
    for m in (SINGLE, mode):
        monkeypatch.setenv(KNOB, m)
        out[m] = fn(q, k, v, g, beta, K ** -0.5, h0, None)
    o8b, s8b = fn(q, k, v, g, beta, K ** -0.5, h0, None)
    (o1, s1), (o8, s8) = out[SINGLE], out[mode]
    assert torch.isfinite(o8.float()).all() and torch.isfinite(s8).all()
    _close_to_single("scan6", o1, s1, o8, s8)
    assert torch.equal(o8, o8b) and torch.equal(s8, s8b), "a repeat scan6 call gave other bits"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_scan6_varlen_mix(family, mode, monkeypatch):
    """A varlen batch of 16 sequences of mixed lengths, empty ones among them, with an initial state (long and short
    blocks side by side)."""
    lens = [0, 1, 64, 65, 1000, 0, 127, 2048, 3, 500, 0, 4096, 63, 129, 700, 1]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.long, device=DEV)
    q, k, v, g, beta = make(family, cu=cu.tolist(), H=4, HV=8, seed=7, extreme=True)
    h0 = (torch.randn(len(lens), 8, 128, 128, generator=torch.Generator().manual_seed(11)) * 0.5).to(DEV)
    fn = getattr(OPS, f"{family}_chunk_fwd")
    out = {}
    for m in (SINGLE, mode):
        monkeypatch.setenv(KNOB, m)
        out[m] = fn(q, k, v, g, beta, 128 ** -0.5, h0, cu)
    o8b, s8b = fn(q, k, v, g, beta, 128 ** -0.5, h0, cu)
    (o1, s1), (o8, s8) = out[SINGLE], out[mode]
    assert torch.isfinite(o8.float()).all() and torch.isfinite(s8).all()
    _close_to_single("scan6", o1, s1, o8, s8)
    assert torch.equal(o8, o8b) and torch.equal(s8, s8b), "a repeat scan6 call gave other bits"
    for i in (0, 5, 10):  # empty sequences: the final state is the initial state
        assert torch.equal(s8[i], h0[i])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_scan6_cuda_graph(family, mode, monkeypatch):
    monkeypatch.setenv(KNOB, mode)
    (q, k, v, g, beta), h0, cu = case_inputs(family, "varlen", torch.bfloat16)
    fn = getattr(OPS, f"{family}_chunk_fwd")
    o_ref, s_ref = fn(q, k, v, g, beta, 128 ** -0.5, h0, cu)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(q, k, v, g, beta, 128 ** -0.5, h0, cu)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, s_g = fn(q, k, v, g, beta, 128 ** -0.5, h0, cu)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_g, o_ref) and torch.equal(s_g, s_ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_scan6_fp32_inputs_fall_back(family, mode, monkeypatch):
    """fp32 inputs (fp32 workspace) take the single kernel under 8, as under 1."""
    (o1, s1), (o8, s8) = fwd_per_knob(family, "T200", torch.float32, "ws_bf16", KNOB, (SINGLE, mode), monkeypatch)
    assert torch.equal(o1, o8) and torch.equal(s1, s8)
