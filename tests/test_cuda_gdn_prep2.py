"""The GDN prep kernel v2 of the chunked forward (kernels_src/cuda/gdn_chunk_prep2.cuh, three blocks per SM; the
default since session 10 and, since session 11, the only GDN prep for bf16/fp16 inputs: KDA_CUDA_GDN_PREP=2, set
explicitly) against the float64 reference (tests/ref_delta.py) at DESIGN.md section 6 tolerances.

Until session 11 these tests also compared v2 with v1 (KDA_CUDA_GDN_PREP=1, gdn_chunk_prep_kernel: the same
workspace, expected bit-equal; they passed on the H200 in sessions 10 and 11) workspace section by section; v1 was
retired in session 11 (0.297 ms against v2's 0.227; refused: test_cuda_chunk_fwd.py's
test_retired_fwd_knob_values_are_refused). Cases: random and correlated keys, gates logsigmoid(randn)/{0.1, 10},
extreme gates (-20, -1e4), T not a multiple of the chunk (1, 63, 65, 200), varlen with empty sequences, GVA
(HV = 4 H), initial state, K=V=64, odd K/V, V = 80 / 200 / 256 (several 128-column passes of u0), odd V (element
stores of u0), bf16 / fp16, bf16 and fp32 workspace, the benchmark shape B1 T8192 H16 HV32 K=V=128 (4096 blocks,
three per SM: against the fp32-input path, the generic 3xTF32 prep), and replay under a CUDA graph.
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
def test_gdn_prep2_reference(case, dtype, ws, monkeypatch):
    """o and the final state with KDA_CUDA_GDN_PREP=2 (v2): finite and within DESIGN.md section 6 of the float64
    reference."""
    if dtype == torch.float16 and case not in FP16_CASES:
        pytest.skip("fp16 differs from bf16 only in the load conversion; a subset suffices")
    ((o2, s2),) = fwd_per_knob("gdn", case, dtype, ws, KNOB, ("2",), monkeypatch)
    assert torch.isfinite(o2.float()).all() and torch.isfinite(s2).all()
    (q, k, v, g, beta), h0, cu = case_inputs("gdn", case, dtype)
    ro, rs = ref_delta_rule(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), scale=q.shape[3] ** -0.5,
                            initial_state=h0.cpu(), cu_seqlens=None if cu is None else cu.cpu())
    assert_close("o (prep v2)", ro, o2.cpu(), TOL[dtype])
    assert_close("final_state (prep v2)", rs, s2.cpu(), TOL[dtype])


def test_gdn_prep2_benchmark_shape(monkeypatch):
    """B1 T8192 H16 HV32 K=V=128 bf16 (the benchmark shape: 4096 blocks, three resident per SM), bf16 workspace:
    o and the final state within DESIGN.md section 6 of the same inputs' fp32 forward (fp32 inputs run the generic
    3xTF32 prep and an fp32 workspace: about fp32 accuracy, standing in for the float64 reference at this size),
    and a second v2 call gives the same bits."""
    q, k, v, g, beta = make("gdn", B=1, T=8192, H=16, HV=32, seed=11)
    monkeypatch.setenv("KDA_CUDA_CHUNK_WS_BF16", "1")
    monkeypatch.setenv(KNOB, "2")
    h0 = (torch.randn(1, 32, 128, 128, generator=torch.Generator().manual_seed(4)) * 0.5).to(DEV)
    o2, s2 = OPS.gdn_chunk_fwd(q, k, v, g, beta, 128 ** -0.5, h0, None)
    o2b, s2b = OPS.gdn_chunk_fwd(q, k, v, g, beta, 128 ** -0.5, h0, None)
    of, sf = OPS.gdn_chunk_fwd(q.float(), k.float(), v.float(), g, beta, 128 ** -0.5, h0, None)
    assert torch.isfinite(o2.float()).all() and torch.isfinite(s2).all()
    assert_close("o (prep v2 vs the fp32 path)", of.double().cpu(), o2.double().cpu(), TOL[torch.bfloat16])
    assert_close("final_state (prep v2 vs the fp32 path)", sf.double().cpu(), s2.double().cpu(), TOL[torch.bfloat16])
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
