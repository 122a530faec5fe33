"""The GDN prep kernel v3 of the chunked forward (KDA_CUDA_GDN_PREP=3, kernels_src/cuda/gdn_chunk_prep3.cuh; session
13; unset, it runs where HV / H is even): one block per pair of value heads of a GVA group (HV / H even; else one head per block), the
q / k loads and S1's raw products Q K^T, K K^T shared by the pair, the per-head scalar-gate factors applied after
the product exactly as v2 applies them. Claimed: v2's workspace bit for bit, hence v2's o and final state
(torch.equal), and DESIGN.md section 6 against the float64 reference (tests/ref_delta.py).

Cases: GVA HV = 2H (pairs), HV = H (groups of one), HV = 3H (odd ratio: one head per block), HV = 4H (two pairs per
group), T = 1000 / 65 / 200 (not multiples of 64), varlen with empty sequences, initial state, gates near 0
(logsigmoid / 1e4) and very negative (-20, -1e4, mixed within a pair of heads), K = V = 64, odd K / V, V = 200 (two
128-column u0 passes), bf16 / fp16, bf16 and fp32 workspace; the workspace itself through gdn_chunk_fwd_stage's
stage 0 (bits, every real chunk and head) with scan7 (bf16 w) and the single scan (fp32 w); the benchmark shape
B1 T8192 H16 HV32; a CUDA graph; fp32 inputs (the generic prep, knob not used); unknown values refused.
Needs a CUDA GPU (skipped with the reason otherwise).
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the GDN prep v3 tests need an NVIDIA GPU",
                allow_module_level=True)

from ref_delta import assert_close, ref_delta_rule  # noqa: E402
from test_cuda_chunk_fwd import DEV, OPS, TOL, make  # noqa: E402  (loads the build)

KNOB = "KDA_CUDA_GDN_PREP"
CASES3 = {
    "gva2_T1000": dict(B=1, T=1000, H=2, HV=4),
    "hv_eq_h_T1000": dict(B=1, T=1000, H=2, HV=2),
    "gva2_T65_B2": dict(B=2, T=65, H=2, HV=4),
    "gva3_T200": dict(B=1, T=200, H=1, HV=3),
    "gva4_T130": dict(B=2, T=130, H=1, HV=4),
    "gates_near_0": dict(B=1, T=300, H=2, HV=4, gate_div=1e4),
    "extreme_gates": dict(B=2, T=150, H=2, HV=4, extreme=True),
    "extreme_gates_hv_eq_h": dict(B=1, T=150, H=2, HV=2, extreme=True),
    "extreme_gates_div_0.1": dict(B=1, T=200, H=1, HV=2, extreme=True, gate_div=0.1),
    "varlen_empty": dict(cu=[0, 0, 70, 70, 135, 136, 1000], H=2, HV=4),
    "varlen_extreme_hv_eq_h": dict(cu=[0, 64, 64, 65, 193], H=2, HV=2, extreme=True),
    "kv64": dict(B=1, T=130, H=2, HV=4, K=64, V=64),
    "odd_kv": dict(B=1, T=77, H=2, HV=4, K=40, V=30),
    "v200": dict(B=1, T=130, H=1, HV=2, K=128, V=200),
    "odd_v": dict(B=1, T=70, H=1, HV=2, K=64, V=37),
}
FP16_CASES = ("gva2_T1000", "hv_eq_h_T1000", "extreme_gates", "varlen_empty", "odd_kv", "v200")


def inputs3(case, dtype, h0_on=True):
    spec = dict(CASES3[case])
    cu_list = spec.pop("cu", None)
    cu = None if cu_list is None else torch.tensor(cu_list, dtype=torch.long, device=DEV)
    q, k, v, g, beta = make("gdn", dtype=dtype, cu=cu_list, seed=3, **spec)
    N = q.shape[0] if cu is None else cu.numel() - 1
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    h0 = (torch.randn(N, HV, K, V, generator=torch.Generator().manual_seed(5)) * 0.5).to(DEV) if h0_on else None
    return (q, k, v, g, beta), h0, cu


def fwd(x, h0, cu, value, monkeypatch):
    monkeypatch.setenv(KNOB, value)
    q = x[0]
    return OPS.gdn_chunk_fwd(*x, q.shape[3] ** -0.5, h0, cu)


@pytest.mark.parametrize("ws", ["ws_bf16", "ws_fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES3))
def test_gdn_prep3_matches_prep2_and_reference(case, dtype, ws, monkeypatch):
    """o and the final state with KDA_CUDA_GDN_PREP=3: v2's bits (=2 set explicitly), and within DESIGN.md section 6
    of the float64 reference."""
    if dtype == torch.float16 and case not in FP16_CASES:
        pytest.skip("fp16 differs from bf16 only in the load conversion; a subset suffices")
    monkeypatch.setenv("KDA_CUDA_CHUNK_WS_BF16", "1" if ws == "ws_bf16" else "0")
    x, h0, cu = inputs3(case, dtype)
    o2, s2 = fwd(x, h0, cu, "2", monkeypatch)
    o3, s3 = fwd(x, h0, cu, "3", monkeypatch)
    assert torch.isfinite(o3.float()).all() and torch.isfinite(s3).all()
    q, k, v, g, beta = (t.cpu() for t in x)
    ro, rs = ref_delta_rule(q, k, v, g, beta, scale=q.shape[3] ** -0.5, initial_state=h0.cpu(),
                            cu_seqlens=None if cu is None else cu.cpu())
    assert_close("o (prep v3)", ro, o3.cpu(), TOL[dtype])
    assert_close("final_state (prep v3)", rs, s3.cpu(), TOL[dtype])
    d_o = (o3.float() - o2.float()).abs().max().item()
    d_s = (s3 - s2).abs().max().item()
    assert torch.equal(o3, o2) and torch.equal(s3, s2), f"v3 != v2: max |do| {d_o:.3g}, max |ds| {d_s:.3g}"


def ws_sections(K, V, half):
    """The workspace slice's sections (WsLayout in delta_chunk_fwd.cuh), offsets in floats: name -> (start, end)."""
    KP = 64 if K <= 64 else 128
    d = 2 if half else 1
    w, qg = 0, 64 * KP
    kg = qg + 64 * KP // d
    aqk = kg + 64 * KP // d
    decay = aqk + 64 * 64 // d
    u = decay + KP
    return {"w": (w, qg), "qg": (qg, kg), "kg": (kg, aqk), "aqk": (aqk, decay), "decay": (decay, u),
            "u0": (u, u + 64 * V)}, u + 64 * V


def real_chunks(q, cu):
    if cu is None:
        return q.shape[0] * ((q.shape[1] + 63) // 64)
    lens = (cu[1:] - cu[:-1]).tolist()
    return sum((n + 63) // 64 for n in lens)


@pytest.mark.parametrize("scan", ["11", "1"])
@pytest.mark.parametrize("ws", ["ws_bf16", "ws_fp32"])
@pytest.mark.parametrize("case", ["gva2_T1000", "hv_eq_h_T1000", "gva3_T200", "gva4_T130", "extreme_gates",
                                  "gates_near_0", "varlen_empty", "odd_kv", "odd_v"])
def test_gdn_prep3_workspace_bits(case, ws, scan, monkeypatch):
    # (not v200: the staged forward needs V <= 128 and says so; test_gdn_prep3_matches_prep2_and_reference
    # compares o / state there)
    """The workspace itself (gdn_chunk_fwd_stage stage 0: the prep alone), every section of every real chunk and
    value head, as raw bits: v3 writes v2's. With scan7 (11) w may be bf16 in the first half of its section (the
    second half unwritten), so only that half of w is compared there; the single scan (1) reads all of w in fp32."""
    monkeypatch.setenv("KDA_CUDA_CHUNK_WS_BF16", "1" if ws == "ws_bf16" else "0")
    monkeypatch.setenv("KDA_CUDA_CHUNK_SCAN", scan)
    (q, k, v, g, beta), _, cu = inputs3(case, torch.bfloat16, h0_on=False)
    K, V, HV = q.shape[3], v.shape[3], v.shape[2]
    secs, stride = ws_sections(K, V, ws == "ws_bf16")
    n = real_chunks(q, cu) * HV  # slices past the last real chunk (varlen) are never written
    out = {}
    for value in ("2", "3"):
        monkeypatch.setenv(KNOB, value)
        work = OPS.gdn_chunk_fwd_stage([], 0, q, k, v, g, beta, K ** -0.5, None, cu)
        torch.cuda.synchronize()
        assert work[0].numel() >= n * stride
        out[value] = work[0][: n * stride].view(n, stride).view(torch.int32)
    for name, (s0, s1) in secs.items():
        if name == "w" and scan == "11":
            s1 = s0 + (s1 - s0) // 2
        a, b = out["2"][:, s0:s1], out["3"][:, s0:s1]
        bad = (a != b).sum().item()
        assert bad == 0, f"section {name}: {bad} of {a.numel()} words differ between v3 and v2"


def test_gdn_prep3_benchmark_shape(monkeypatch):
    """B1 T8192 H16 HV32 K=V=128 bf16 (the benchmark shape: 2048 blocks of two heads): v2's bits, and a second v3
    call gives the same bits."""
    q, k, v, g, beta = make("gdn", B=1, T=8192, H=16, HV=32, seed=11)
    monkeypatch.setenv("KDA_CUDA_CHUNK_WS_BF16", "1")
    h0 = (torch.randn(1, 32, 128, 128, generator=torch.Generator().manual_seed(4)) * 0.5).to(DEV)
    monkeypatch.setenv(KNOB, "2")
    o2, s2 = OPS.gdn_chunk_fwd(q, k, v, g, beta, 128 ** -0.5, h0, None)
    monkeypatch.setenv(KNOB, "3")
    o3, s3 = OPS.gdn_chunk_fwd(q, k, v, g, beta, 128 ** -0.5, h0, None)
    o3b, s3b = OPS.gdn_chunk_fwd(q, k, v, g, beta, 128 ** -0.5, h0, None)
    assert torch.isfinite(o3.float()).all() and torch.isfinite(s3).all()
    assert torch.equal(o3, o3b) and torch.equal(s3, s3b)
    assert torch.equal(o3, o2) and torch.equal(s3, s2)


# (v3 under CUDA graph capture: test_cuda_chunk_fwd.py's test_chunk_fwd_cuda_graph, whose GDN case, HV = 2H, runs
# it by default since session 13)


def test_gdn_prep3_fp32_inputs_unchanged(monkeypatch):
    """fp32 inputs keep the generic 3xTF32 prep: =3 gives =2's bits."""
    x, h0, cu = inputs3("gva2_T65_B2", torch.float32)
    o2, s2 = fwd(x, h0, cu, "2", monkeypatch)
    o3, s3 = fwd(x, h0, cu, "3", monkeypatch)
    assert torch.equal(o3, o2) and torch.equal(s3, s2)


@pytest.mark.parametrize("value", ["4", "v3", "-3"])
def test_gdn_prep_unknown_values_list_2_and_3(value, monkeypatch):
    monkeypatch.setenv(KNOB, value)
    x, h0, cu = inputs3("gva2_T65_B2", torch.bfloat16)
    with pytest.raises(RuntimeError, match=f"{KNOB}={value} is not an accepted value: {KNOB} takes 2, 3"):
        OPS.gdn_chunk_fwd(*x, 0.1, h0, cu)


@pytest.mark.parametrize("case, kernel", [("gva2_T65_B2", "gdn_chunk_prep3_kernel"),
                                          ("gva4_T130", "gdn_chunk_prep3_kernel"),
                                          ("hv_eq_h_T1000", "gdn_chunk_prep2_kernel"),
                                          ("gva3_T200", "gdn_chunk_prep2_kernel")])
def test_gdn_prep_default_routes_by_group(case, kernel, monkeypatch):
    """KDA_CUDA_GDN_PREP unset (the default since session 13): v3 where HV / H is even (pairs of heads to share),
    v2 where it is odd or 1 -- seen as the kernel the profiler records, since the two give the same bits."""
    monkeypatch.delenv(KNOB, raising=False)
    x, h0, cu = inputs3(case, torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        OPS.gdn_chunk_fwd(*x, 0.1, h0, cu)
        torch.cuda.synchronize()
    preps = [e.name for e in prof.events() if "gdn_chunk_prep" in e.name]
    assert preps and all(kernel in n for n in preps), preps
