"""state_fwd3 narrow (KDA_CUDA_CHUNK_BWD_STATE_FWD=7; kernels_src/cuda/delta_chunk_bwd_state_fwd3.cuh with BV = 16
value columns per block, single-buffered operands, two blocks per SM; the default since session 10) against the
32-column state_fwd3 with 3xTF32 products (=3: BV = 32, double-buffered; set explicitly), against the one-call
backward from the staged op, and against autograd through the float64 reference (tests/ref_delta.py) at DESIGN.md
section 6 tolerances. (Its session-10 partner, the 32-column instance with the same tf32 products, =4, the default
before, was retired in session 11: test_retired_bwd_knob_values_are_refused.)

Against =3 the narrow kernel's tf32 products (10-bit mantissas) move the fp32 outputs dg, dbeta by up to ~7e-5
relative RMS (H200, session 6, tf32 against state_fwd2), so 1e-3 there (as STATE_FWD=2 in
test_cuda_chunk_bwd.py's test_chunk_bwd_grad_v1_matches_v2), and dq, dk, dv (bf16 / fp16 outputs) to 0.008. Cases: varlen with empty sequences, GVA, odd K / V (V = 30: a partial second 16-column block), T not a
multiple of 64, 16 chunks (the single buffers cycle), gates at -50 (whole rows) / -1e4 mixed with ordinary ones,
initial state and grad of the final state (and neither), V > 128 (column blocks), the staged op, bf16 and fp16
(fp32 inputs run state_fwd2 for every value). Needs a CUDA GPU: without one the module is skipped with the reason.
"""
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the state_fwd3 narrow tests need an NVIDIA GPU",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from ref_delta import assert_close  # noqa: E402
from test_cuda_backend import OPS, make_inputs  # noqa: E402  (loads / builds the CUDA variant)
from test_cuda_chunk_bwd import _run, bwd_default_and_knob  # noqa: E402

torch.set_num_threads(1)
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
KNOB = "KDA_CUDA_CHUNK_BWD_STATE_FWD"

# cases of test_cuda_chunk_bwd.py (CASES, WY2_CASES, GVA_CASES; T200_*: B=1 T=200 H=1 HV=2, see bwd_default_and_knob)
KNOB_CASES = ["random_T65", "T1", "T63", "varlen_empty", "gva_4x", "odd_dims", "T1000", "T200_bf16",
              "T200_gates_50_rows", "T200_gates_1e4", "gva_g3_k30", "gva_g8_varlen", "k40_v32_gva",
              "k96_v96_varlen", "v256_blocks", "v200_blocks_varlen"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", KNOB_CASES)
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_fwd_narrow_matches_3xtf32(family, case, dtype, monkeypatch):
    # STATE_FWD=7 against the 32-column state_fwd3 with 3xTF32 products (STATE_FWD=3, set explicitly), same inputs
    # and cotangents
    monkeypatch.setenv(KNOB, "3")
    a, b = bwd_default_and_knob(family, case, dtype, 23, "STATE_FWD=7", monkeypatch)
    for name, x, y in zip(NAMES, a, b):
        assert torch.isfinite(x).all(), name
        assert torch.isfinite(y).all(), name
        tol = 0.008 if name in ("dq", "dk", "dv") else 1e-3
        assert_close(f"{family} {case} {name}", x.double().cpu(), y.double().cpu(), tol)


@pytest.mark.parametrize("case", ["random_T65", "extreme_gates", "extreme_gates_mild", "varlen_empty", "gva_4x",
                                  "odd_dims", "T1000", "v200_blocks_varlen"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_fwd_narrow_matches_reference(family, case, dtype, monkeypatch):
    # against autograd through the float64 reference, initial state and grad of the final state included (_run)
    if dtype == torch.float16 and case not in ("extreme_gates", "varlen_empty", "gva_4x"):
        pytest.skip("fp16 differs from bf16 only in the load/store conversion; a subset suffices")
    monkeypatch.setenv(KNOB, "7")
    _run(family, case, dtype)


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_fwd_narrow_without_state(family, monkeypatch):
    monkeypatch.setenv(KNOB, "7")
    _run(family, "random_T65", torch.bfloat16, with_state=False)
    _run(family, "varlen_empty", torch.bfloat16, with_state=False)


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_fwd_narrow_staged(family, monkeypatch):
    # the staged op (prep, state_fwd, state_bwd, grad in four calls; the knob is read at stage 0) with STATE_FWD=7
    # against the one-call backward with STATE_FWD=7 (the same kernels: equal to fp32 rounding), varlen with empty
    # sequences and GVA
    cu_list = [0, 0, 17, 17, 90, 91, 200]
    cu = torch.tensor(cu_list, dtype=torch.long, device="cuda")
    q, k, v, g, beta = make_inputs(family, H=2, HV=4, dtype=torch.bfloat16, seed=29, extreme=True, cu=cu_list)
    N, HV, K, V = cu.numel() - 1, v.shape[2], q.shape[3], v.shape[3]
    gen = torch.Generator().manual_seed(29)
    h0 = (torch.randn(N, HV, K, V, generator=gen) * 0.5).cuda()
    dht = torch.randn(N, HV, K, V, generator=gen).cuda()
    do = torch.randn(*v.shape, generator=gen).cuda().to(v.dtype)
    x = (q, k, v, g, beta, K ** -0.5)
    monkeypatch.setenv(KNOB, "7")
    a = getattr(OPS, f"{family}_chunk_bwd")(*x, h0, cu, do, dht)
    stage = getattr(OPS, f"{family}_chunk_bwd_stage")
    work = stage([], 0, *x, None, cu, do, None)
    assert stage(work, 1, *x, h0, cu, do, None) == []
    (dh0,) = stage(work, 2, *x, h0, cu, do, dht)
    b = list(stage(work, 3, *x, h0, cu, do, None)) + [dh0]
    torch.cuda.synchronize()
    for name, x, y in zip(NAMES, a, b):
        tol = 0.004 if name in ("dq", "dk", "dv") else 1e-6
        assert_close(f"{family} staged {name}", x.double().cpu(), y.double().cpu(), tol)


@pytest.mark.parametrize("knob", ["3", "7"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_fwd_narrow_runs_under_its_knob(family, knob, monkeypatch):
    # the knob really selects the kernel (matching results cannot show it): the state_fwd3 instance with 16 columns
    # and single buffers (template arguments <PC, false, 16, false>) with STATE_FWD=7, the 3xTF32 instance (<PC,
    # true, 32, true>) with 3; bf16 inputs. fp32 inputs run state_fwd2_kernel under either value.
    monkeypatch.setenv(KNOB, knob)

    def names(dtype):
        q, k, v, g, beta = make_inputs(family, B=1, T=100, H=1, HV=2, dtype=dtype, seed=41)
        do = torch.randn_like(v)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            getattr(OPS, f"{family}_chunk_bwd")(q, k, v, g, beta, 0.1, None, None, do, None)
            torch.cuda.synchronize()
        return [e.name.replace(" ", "") for e in prof.events() if "state_fwd" in e.name]

    ev = names(torch.bfloat16)
    assert ev and all("state_fwd3_kernel" in n for n in ev), ev
    assert all(("16,false>" if knob == "7" else "32,true>") in n for n in ev), ev
    ev = names(torch.float32)
    assert ev and all("state_fwd2_kernel" in n for n in ev), ev
