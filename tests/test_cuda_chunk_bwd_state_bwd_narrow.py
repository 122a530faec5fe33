"""state_bwd3 narrow (KDA_CUDA_CHUNK_BWD_STATE_BWD=7 tf32, =8 3xTF32; state_bwd3n_kernel in
kernels_src/cuda/delta_chunk_bwd_state_bwd3.cuh: 16 value columns per block, two blocks per SM; off by default,
session 11) against the 32-column state_bwd3 it mirrors (=4 tf32, the default, and =3 3xTF32; both set explicitly so
that a changed default cannot turn this into a self-comparison) and against autograd through the float64 reference
(tests/ref_delta.py) at DESIGN.md section 6 tolerances.

Per state / dU element the narrow kernel runs the default's arithmetic (the same fragments, the same mma chains in
the same k order, the same final adds; only the warp tiling and the buffering differ; on sm_90a both compile to the
same per-element FFMA / FMUL / FADD counts), so the gradients must be bit-identical: torch.equal, every output.
Cases: varlen with empty sequences, GVA, odd K / V (V = 30: a partial second 16-column block), T not a multiple of
64, T = 1000 (16 chunks: the rotating buffers cycle), gates at -20 (make_inputs' extreme gates) / -50 (whole rows) /
-1e4, initial state and grad of the final state (and neither), V > 128 (column blocks), the staged op, bf16 and fp16
(fp32 inputs run state_bwd2 for every value). Needs a CUDA GPU: without one the module is skipped with the reason.
"""
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the state_bwd3 narrow tests need an NVIDIA GPU",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from test_cuda_backend import OPS, make_inputs  # noqa: E402  (loads / builds the CUDA variant)
from test_cuda_chunk_bwd import _run, bwd_default_and_knob  # noqa: E402

torch.set_num_threads(1)
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
KNOB = "KDA_CUDA_CHUNK_BWD_STATE_BWD"
PAIRS = [("4", "7"), ("3", "8")]  # (the 32-column state_bwd3, its narrow instance): tf32, 3xTF32

# cases of test_cuda_chunk_bwd.py (CASES, WY2_CASES, GVA_CASES; T200_*: B=1 T=200 H=1 HV=2, see bwd_default_and_knob)
KNOB_CASES = ["random_T65", "T1", "T63", "varlen_empty", "gva_4x", "odd_dims", "T1000", "extreme_gates",
              "T200_bf16", "T200_gates_50_rows", "T200_gates_1e4", "gva_g3_k30", "gva_g8_varlen", "k40_v32_gva",
              "k96_v96_varlen", "v256_blocks", "v200_blocks_varlen"]


def assert_equal(what, a, b):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    if not torch.equal(a, b):
        d = (a.double() - b.double()).abs()
        raise AssertionError(f"{what}: not bit-identical ({int((d > 0).sum())} of {d.numel()} differ, max abs diff "
                             f"{d.max().item():.3e}, max |ref| {a.double().abs().max().item():.3e})")


@pytest.mark.parametrize("modes", PAIRS, ids=["tf32", "3xtf32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", KNOB_CASES)
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_bwd_narrow_bit_identical(family, case, dtype, modes, monkeypatch):
    # STATE_BWD=7 / 8 against 4 / 3, same inputs (extreme gates, initial state, grad of the final state) and cotangents
    monkeypatch.setenv(KNOB, modes[0])
    a, b = bwd_default_and_knob(family, case, dtype, 23, f"STATE_BWD={modes[1]}", monkeypatch)
    for name, x, y in zip(NAMES, a, b):
        assert torch.isfinite(y).all(), name
        assert_equal(f"{family} {case} {name}", x, y)


@pytest.mark.parametrize("case", ["random_T65", "extreme_gates", "extreme_gates_mild", "varlen_empty", "gva_4x",
                                  "odd_dims", "T1000", "v200_blocks_varlen"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("knob", ["7", "8"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_bwd_narrow_matches_reference(family, knob, case, dtype, monkeypatch):
    # against autograd through the float64 reference, initial state and grad of the final state included (_run)
    if (dtype == torch.float16 or knob == "8") and case not in ("extreme_gates", "varlen_empty", "gva_4x"):
        pytest.skip("fp16 differs from bf16 only in the load/store conversion, and 8 from 7 only in the products "
                    "(bit-identical to 3 by test_state_bwd_narrow_bit_identical): a subset suffices")
    monkeypatch.setenv(KNOB, knob)
    _run(family, case, dtype)


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_bwd_narrow_without_state(family, monkeypatch):
    monkeypatch.setenv(KNOB, "7")
    _run(family, "random_T65", torch.bfloat16, with_state=False)
    _run(family, "varlen_empty", torch.bfloat16, with_state=False)


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_bwd_narrow_staged(family, monkeypatch):
    # the staged op (prep, state_fwd, state_bwd, grad in four calls; the knob is read at stage 0) with STATE_BWD=7
    # against the one-call backward with STATE_BWD=4, varlen with empty sequences, GVA and extreme gates
    cu_list = [0, 0, 17, 17, 90, 91, 200]
    cu = torch.tensor(cu_list, dtype=torch.long, device="cuda")
    q, k, v, g, beta = make_inputs(family, H=2, HV=4, dtype=torch.bfloat16, seed=29, extreme=True, cu=cu_list)
    N, HV, K, V = cu.numel() - 1, v.shape[2], q.shape[3], v.shape[3]
    gen = torch.Generator().manual_seed(29)
    h0 = (torch.randn(N, HV, K, V, generator=gen) * 0.5).cuda()
    dht = torch.randn(N, HV, K, V, generator=gen).cuda()
    do = torch.randn(*v.shape, generator=gen).cuda().to(v.dtype)
    x = (q, k, v, g, beta, K ** -0.5)
    monkeypatch.setenv(KNOB, "4")
    a = getattr(OPS, f"{family}_chunk_bwd")(*x, h0, cu, do, dht)
    monkeypatch.setenv(KNOB, "7")
    stage = getattr(OPS, f"{family}_chunk_bwd_stage")
    work = stage([], 0, *x, None, cu, do, None)
    assert stage(work, 1, *x, h0, cu, do, None) == []
    (dh0,) = stage(work, 2, *x, h0, cu, do, dht)
    b = list(stage(work, 3, *x, h0, cu, do, None)) + [dh0]
    torch.cuda.synchronize()
    for name, x, y in zip(NAMES, a, b):
        assert_equal(f"{family} staged {name}", x, y)


@pytest.mark.parametrize("knob", ["4", "3", "7", "8"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_bwd_narrow_runs_under_its_knob(family, knob, monkeypatch):
    # the knob really selects the kernel (bit-identical results cannot show it): state_bwd3n_kernel<PC, PRECISE>
    # with STATE_BWD=7 (PRECISE false) / 8 (true), state_bwd3_kernel with 4 / 3; bf16 inputs. fp32 inputs run
    # state_bwd2_kernel under every value.
    monkeypatch.setenv(KNOB, knob)

    def names(dtype):
        q, k, v, g, beta = make_inputs(family, B=1, T=100, H=1, HV=2, dtype=dtype, seed=41)
        do = torch.randn_like(v)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            getattr(OPS, f"{family}_chunk_bwd")(q, k, v, g, beta, 0.1, None, None, do, None)
            torch.cuda.synchronize()
        return [e.name.replace(" ", "") for e in prof.events() if "state_bwd" in e.name]

    ev = names(torch.bfloat16)
    kern = "state_bwd3n_kernel<" if knob in ("7", "8") else "state_bwd3_kernel<"
    precise = "true>" if knob in ("3", "8") else "false>"
    assert ev and all(kern in n and n.split("(")[0].endswith(precise) for n in ev), ev
    ev = names(torch.float32)
    assert ev and all("state_bwd2_kernel" in n for n in ev), ev


@pytest.mark.parametrize("val", ["0", "1", "9", "-1"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_bwd_bad_knob_values_are_refused(family, val, monkeypatch):
    monkeypatch.setenv(KNOB, val)
    q, k, v, g, beta = make_inputs(family, B=1, T=70, H=1, HV=2, dtype=torch.bfloat16, seed=43)
    do = torch.randn_like(v)
    with pytest.raises(RuntimeError, match=f"{KNOB}={val} is not a state_bwd kernel"):
        getattr(OPS, f"{family}_chunk_bwd")(q, k, v, g, beta, 0.1, None, None, do, None)
