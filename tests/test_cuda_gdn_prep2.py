"""The GDN prep kernel v2 of the chunked forward (KDA_CUDA_GDN_PREP=2, the default since session 10:
kernels_src/cuda/gdn_chunk_prep2.cuh, three blocks per SM) against v1 (KDA_CUDA_GDN_PREP=1, gdn_chunk_prep.cuh, set
explicitly) and the float64 reference (tests/ref_delta.py).

v2 writes the same workspace with the same products in the same order (S0-S4 are v1's code with another shared
memory layout; S5 the same tf32 operands, conversions and accumulation order, in pairs of jobs): the workspace
slices of every real chunk (read back through gdn_chunk_fwd_stage's stage 0) agree with v1's to rounding (expected
bit-equal; the tests leave room for an ulp), and so do o and the final state; both pass DESIGN.md section 6 against the float64 reference. Cases:
random and correlated keys, gates logsigmoid(randn)/{0.1, 10}, extreme gates (-20, -1e4), T not a multiple of the
chunk (1, 63, 65, 200), varlen with empty sequences, GVA (HV = 4 H), initial state, K=V=64, odd K/V, V = 80 / 200 /
256 (several 128-column passes of u0), odd V (element stores of u0), bf16 / fp16, bf16 and fp32 workspace, the
benchmark shape B1 T8192 H16 HV32 K=V=128 (4096 blocks, three per SM), and replay under a CUDA graph.
Needs a CUDA GPU (skipped with the reason otherwise).
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the GDN prep v2 tests need an NVIDIA GPU",
                allow_module_level=True)

from ref_delta import assert_close, ref_delta_rule  # noqa: E402
from test_cuda_chunk_fwd import DEV, OPS, TOL, case_inputs, fwd_per_knob, make  # noqa: E402  (loads the build)

KNOB = "KDA_CUDA_GDN_PREP"
CASES_V2 = ["T1", "T63", "T65", "T200", "T2048", "correlated_keys", "gate_div_0.1", "gate_div_10", "extreme_gates",
            "extreme_gates_div_0.1", "gva_4x", "kv64", "odd_kv", "wide_v", "cp_width_v256", "v200", "odd_v",
            "varlen", "varlen_extreme"]
FP16_CASES = ("T65", "extreme_gates", "varlen", "odd_kv", "odd_v", "cp_width_v256")


@pytest.mark.parametrize("ws", ["ws_bf16", "ws_fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES_V2)
def test_gdn_prep2_vs_default_and_reference(case, dtype, ws, monkeypatch):
    """o and the final state with KDA_CUDA_GDN_PREP=1 (v1, the default before session 10) and =2 (v2) on the same
    inputs and initial state: finite, equal to 1e-5 (state) / 1e-3 (o, bf16: room for a flipped rounding; the same
    workspace, expected bit-equal), and both within DESIGN.md section 6 of the float64 reference."""
    if dtype == torch.float16 and case not in FP16_CASES:
        pytest.skip("fp16 differs from bf16 only in the load conversion; a subset suffices")
    (o1, s1), (o2, s2) = fwd_per_knob("gdn", case, dtype, ws, KNOB, ("1", "2"), monkeypatch)
    assert torch.isfinite(o2.float()).all() and torch.isfinite(s2).all()
    assert_close("final_state (prep v2 vs v1)", s1.cpu(), s2.cpu(), 1e-5)
    assert_close("o (prep v2 vs v1)", o1.float().cpu(), o2.float().cpu(), 1e-3)
    (q, k, v, g, beta), h0, cu = case_inputs("gdn", case, dtype)
    ro, rs = ref_delta_rule(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), scale=q.shape[3] ** -0.5,
                            initial_state=h0.cpu(), cu_seqlens=None if cu is None else cu.cpu())
    assert_close("o (prep v2)", ro, o2.cpu(), TOL[dtype])
    assert_close("final_state (prep v2)", rs, s2.cpu(), TOL[dtype])


def ws_sections(K, V, half):
    """The workspace slice's sections (WsLayout in delta_chunk_fwd.cuh), offsets in floats: name -> (start, end,
    bf16)."""
    KP = 64 if K <= 64 else 128
    d = 2 if half else 1
    w, qg = 0, 64 * KP
    kg = qg + 64 * KP // d
    aqk = kg + 64 * KP // d
    decay = aqk + 64 * 64 // d
    u = decay + KP
    return {"w": (w, qg, False), "qg": (qg, kg, half), "kg": (kg, aqk, half), "aqk": (aqk, decay, half),
            "decay": (decay, u, False), "u0": (u, u + 64 * V, False)}, u + 64 * V


def real_chunks(q, cu):
    if cu is None:
        return q.shape[0] * ((q.shape[1] + 63) // 64)
    lens = (cu[1:] - cu[:-1]).tolist()
    return sum((n + 63) // 64 for n in lens)


def stage0_ws(q, k, v, g, beta, cu, value, monkeypatch):
    monkeypatch.setenv(KNOB, value)
    work = OPS.gdn_chunk_fwd_stage([], 0, q, k, v, g, beta, q.shape[3] ** -0.5, None, cu)
    torch.cuda.synchronize()
    return work[0]


def compare_workspaces(q, k, v, g, beta, cu, half, monkeypatch):
    K, V, HV = q.shape[3], v.shape[3], v.shape[2]
    secs, stride = ws_sections(K, V, half)
    n = real_chunks(q, cu) * HV  # slices past the last real chunk (varlen) are never written
    w1 = stage0_ws(q, k, v, g, beta, cu, "1", monkeypatch)
    w2 = stage0_ws(q, k, v, g, beta, cu, "2", monkeypatch)
    assert w1.numel() == w2.numel() and w1.numel() >= n * stride
    a = w1[: n * stride].view(n, stride)
    b = w2[: n * stride].view(n, stride)
    for name, (s0, s1, bf) in secs.items():
        x, y = a[:, s0:s1].contiguous(), b[:, s0:s1].contiguous()
        if bf:
            x, y = x.view(torch.bfloat16).float(), y.view(torch.bfloat16).float()
        assert torch.isfinite(y).all(), f"{name}: non-finite values in v2's workspace"
        # expected bit-equal (same values, same order); the bounds leave room for an ulp of rounding somewhere (one
        # flipped tf32 / bf16 rounding), while a wrong index or a stale tile moves values by O(1)
        tol = 4e-3 if bf else 1e-4
        assert_close(f"workspace section {name} (prep v2 vs v1)", x.double().cpu(), y.double().cpu(), tol)
        worst = (x - y).abs().max().item()
        assert worst <= 16 * tol * max(x.abs().max().item(), 1e-30), f"section {name}: max |v2 - v1| {worst:.3g}"
    return a, b


@pytest.mark.parametrize("ws", ["ws_bf16", "ws_fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["T1", "T65", "T200", "correlated_keys", "extreme_gates", "extreme_gates_div_0.1",
                                  "gva_4x", "kv64", "odd_kv", "wide_v", "odd_v", "varlen", "varlen_extreme"])
def test_gdn_prep2_workspace_matches_default(case, dtype, ws, monkeypatch):
    """The workspace itself (gdn_chunk_fwd_stage, stage 0: the prep alone), section by section (w, q~, k~^T, A~,
    decay, u0; bf16 sections compared as bf16) over every real chunk and value head: v2 writes v1's values."""
    if dtype == torch.float16 and case not in FP16_CASES:
        pytest.skip("fp16 differs from bf16 only in the load conversion; a subset suffices")
    monkeypatch.setenv("KDA_CUDA_CHUNK_WS_BF16", "1" if ws == "ws_bf16" else "0")
    (q, k, v, g, beta), _, cu = case_inputs("gdn", case, dtype, h0_on=False)
    compare_workspaces(q, k, v, g, beta, cu, ws == "ws_bf16", monkeypatch)


def test_gdn_prep2_benchmark_shape(monkeypatch):
    """B1 T8192 H16 HV32 K=V=128 bf16 (the benchmark shape: 4096 blocks, three resident per SM): the workspace
    matches v1's, o and the final state too, and a second v2 call gives the same bits."""
    q, k, v, g, beta = make("gdn", B=1, T=8192, H=16, HV=32, seed=11)
    monkeypatch.setenv("KDA_CUDA_CHUNK_WS_BF16", "1")
    compare_workspaces(q, k, v, g, beta, None, True, monkeypatch)
    h0 = (torch.randn(1, 32, 128, 128, generator=torch.Generator().manual_seed(4)) * 0.5).to(DEV)
    out = {}
    for value in ("1", "2"):
        monkeypatch.setenv(KNOB, value)
        out[value] = OPS.gdn_chunk_fwd(q, k, v, g, beta, 128 ** -0.5, h0, None)
    o2b, s2b = OPS.gdn_chunk_fwd(q, k, v, g, beta, 128 ** -0.5, h0, None)
    (o1, s1), (o2, s2) = out["1"], out["2"]
    assert torch.isfinite(o2.float()).all() and torch.isfinite(s2).all()
    assert_close("final_state (prep v2 vs v1)", s1.cpu(), s2.cpu(), 1e-5)
    assert_close("o (prep v2 vs v1)", o1.float().cpu(), o2.float().cpu(), 1e-3)
    assert torch.equal(o2, o2b) and torch.equal(s2, s2b)


def test_gdn_prep2_cuda_graph(monkeypatch):
    """v2 under CUDA graph capture (varlen with an empty sequence): the replay gives the eager call's bits."""
    monkeypatch.setenv(KNOB, "2")
    q, k, v, g, beta = make("gdn", B=1, T=300, H=2, HV=4)
    cu = torch.tensor([0, 100, 100, 300], dtype=torch.long, device=DEV)
    fn = OPS.gdn_chunk_fwd
    o_ref, s_ref = fn(q, k, v, g, beta, 0.088, None, cu)
    fn(q, k, v, g, beta, 0.088, None, cu)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, s = fn(q, k, v, g, beta, 0.088, None, cu)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


def test_gdn_prep2_fp32_inputs_unchanged(monkeypatch):
    """fp32 inputs keep the generic 3xTF32 prep whatever the knob says: =2 gives =1's bits."""
    (o1, s1), (o2, s2) = fwd_per_knob("gdn", "T200", torch.float32, "ws_fp32", KNOB, ("1", "2"), monkeypatch)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
