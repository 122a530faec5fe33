"""state_bwd3f (KDA_CUDA_CHUNK_BWD_STATE_BWD=11 and 12; kernels_src/cuda/delta_chunk_bwd_state_bwd3.cuh; session 13,
12 the default since its verification call): the former default state_bwd3 tf32 (=4) with its operands rounded to tf32 once where they are written and 3
barriers per chunk step instead of 4; 11 also permutes the warp's dS rows inside the m16 tiles (8-byte A reads), 12
reads every fragment from =4's addresses. Both issue the same mma on the same tf32 operands into the same
accumulator chains, so their outputs must EQUAL =4's bit for bit (torch.equal; for 11 this also assumes that an
mma's result for an output row does not depend on the row's slot in the tile -- 12 does not need that):
  - the state_bwd stage's own outputs (staged op, V <= 128): dh0, and from the work list dU [tokens, HV, V] and dhs
    [chunks, HV, K, V] (the rows of real chunks);
  - all six gradients of the one-call backward (V > 128 runs column blocks through it; the kernels after state_bwd
    are deterministic: checked by running =4 twice);
and against the float64 reference at DESIGN.md section 6 (tests/test_cuda_chunk_bwd.py's _run). Every knob value is
set explicitly. Cases: KDA and GDN, bf16 and fp16, varlen with empty sequences, GVA (HV = 4 H), with and without
initial state / grad of the final state, gates at -20 and -1e4, T = 1, 65, 1000, 8192 (128 chunks), V = 30, 40
(partial column blocks: dO's scalar path), 64, 96, 128, 200, 256, and grad_o at an address that is not 16-byte
aligned (dO's scalar path). Needs a CUDA GPU: without one the module is skipped.
"""
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the state_bwd3f tests need an NVIDIA GPU",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from test_cuda_backend import OPS, make_inputs  # noqa: E402  (loads / builds the CUDA variant)
from test_cuda_chunk_bwd import CASES, GVA_CASES, WY2_CASES, _run, bwd_inputs  # noqa: E402

torch.set_num_threads(1)
KNOB = "KDA_CUDA_CHUNK_BWD_STATE_BWD"
VALUES = ("11", "12")
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
MY_CASES = {
    **{c: CASES[c] for c in ("random_T65", "T1", "T63", "T1000", "extreme_gates", "gate_div_10", "gva_4x",
                             "varlen_empty", "odd_dims", "v256_blocks", "v200_blocks_varlen")},
    **{c: WY2_CASES[c] for c in ("v64_T130", "k96_v96_varlen")},
    "gva_g8_varlen": GVA_CASES["gva_g8_varlen"],
    "extreme_gates_1e4": dict(CASES["extreme_gates"], g_fill=-1e4),
    "gva_varlen_extreme": dict(H=1, HV=4, cu=[0, 0, 130, 130, 131, 400], extreme=True),
    "v40": dict(B=1, T=100, H=1, HV=2, K=64, V=40),
    "long_T8192": dict(B=1, T=8192, H=1, HV=1, gate_div=10.0),  # 128 chunks
}
FP16 = ("random_T65", "extreme_gates", "extreme_gates_1e4", "varlen_empty", "gva_4x", "odd_dims", "v40")


def _inputs(family, case, dtype, with_state=True, misalign=False):
    spec = dict(MY_CASES[case])
    g_fill = spec.pop("g_fill", None)
    args, N = bwd_inputs(family, spec, dtype, with_state, g_fill)
    if misalign:  # grad_o one element past a 16-byte boundary (contiguous, same values)
        do = args[8]
        buf = torch.empty(do.numel() + 1, dtype=do.dtype, device=do.device)
        buf[1:].copy_(do.reshape(-1))
        args = args[:8] + (buf[1:].view(do.shape),) + args[9:]
        assert args[8].data_ptr() % 16 != 0
    return args, N


def _one_call(family, args, value, monkeypatch):
    monkeypatch.setenv(KNOB, value)
    out = getattr(OPS, f"{family}_chunk_bwd")(*args)
    torch.cuda.synchronize()
    return [o.detach().clone() for o in out]


def _assert_equal(tag, a, b):
    for n, x, y in zip(NAMES, a, b):
        assert x.shape == y.shape and x.dtype == y.dtype, (tag, n)
        if not torch.equal(x, y):
            d = (x.double() - y.double()).abs()
            raise AssertionError(f"{tag} {n}: not bit-identical, {int((d > 0).sum())} of {d.numel()} differ, "
                                 f"max |diff| {float(d[torch.isfinite(d)].max()) if torch.isfinite(d).any() else d}")


@pytest.mark.parametrize("with_state", [True, False], ids=["state", "no_state"])
@pytest.mark.parametrize("case", list(MY_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_bwd11_gradients_equal_4(family, dtype, case, with_state, monkeypatch):
    if dtype == torch.float16 and case not in FP16:
        pytest.skip("fp16 differs from bf16 in dO's load conversion; a subset suffices")
    if not with_state and case not in ("random_T65", "varlen_empty", "T1", "gva_4x", "v200_blocks_varlen"):
        pytest.skip("without state: a subset")
    if case == "long_T8192" and (family == "gdn" or not with_state):
        pytest.skip("128 chunks once (KDA, with state)")
    args, _ = _inputs(family, case, dtype, with_state)
    a = _one_call(family, args, "4", monkeypatch)
    a2 = _one_call(family, args, "4", monkeypatch)
    _assert_equal(f"{family} {case} =4 run twice (the backward is not deterministic?)", a, a2)
    for value in VALUES:
        b = _one_call(family, args, value, monkeypatch)
        for n, x in zip(NAMES, b):
            assert torch.isfinite(x).all(), (value, n)
        _assert_equal(f"{family} {case} {KNOB}={value} vs =4", b, a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_bwd11_misaligned_grad_o(family, dtype, monkeypatch):
    # grad_o not 16-byte aligned: the kernel's dO loads take the scalar path, with the same values
    args, _ = _inputs(family, "gva_varlen_extreme", dtype, True, misalign=True)
    a = _one_call(family, args, "4", monkeypatch)
    for value in VALUES:
        b = _one_call(family, args, value, monkeypatch)
        _assert_equal(f"{family} misaligned grad_o ={value} vs =4", b, a)


def _stage_outputs(family, args, value, monkeypatch):
    """Stages 0 and 2 of the staged op under KNOB=value: (dh0, dU, dhs) with dU / dhs the rows of real tokens /
    chunks of the work list (enum BwdWork in delta_chunk_bwd_host.cuh: kBwDU = 9, kBwDhs = 11)."""
    q, k, v, g, beta, scale, h0, cu, do, dht = args
    monkeypatch.setenv(KNOB, value)
    stage = getattr(OPS, f"{family}_chunk_bwd_stage")
    x = (q, k, v, g, beta, scale)
    work = stage([], 0, *x, None, cu, do, None)
    (dh0,) = stage(work, 2, *x, h0, cu, do, dht)
    torch.cuda.synchronize()
    B, T, HV, V = v.shape
    K = q.shape[3]
    lens = [T] * B if cu is None else (cu[1:] - cu[:-1]).tolist()
    chunks = sum((n + 63) // 64 for n in lens)
    du, dhs = work[9], work[11]
    assert du.numel() >= B * T * HV * V and dhs.numel() >= chunks * HV * K * V, "enum BwdWork changed?"
    return dh0.clone(), du[:B * T * HV * V].clone(), dhs[:chunks * HV * K * V].clone()


@pytest.mark.parametrize("case", ["random_T65", "T1", "T1000", "extreme_gates", "extreme_gates_1e4", "gva_4x",
                                  "varlen_empty", "gva_varlen_extreme", "odd_dims", "v40", "v64_T130",
                                  "k96_v96_varlen"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_bwd11_stage_outputs_equal_4(family, dtype, case, monkeypatch):
    # the state_bwd stage's own outputs, bit for bit (the staged op runs V <= 128)
    args, _ = _inputs(family, case, dtype, True)
    a = _stage_outputs(family, args, "4", monkeypatch)
    for value in VALUES:
        b = _stage_outputs(family, args, value, monkeypatch)
        for n, x, y in zip(("dh0", "dU", "dhs"), b, a):
            assert torch.isfinite(x).all(), (value, n)
            assert torch.equal(x, y), f"{family} {case} state_bwd stage {n}: ={value} differs from =4 " \
                                      f"(max |diff| {float((x.double() - y.double()).abs().max()):.3e})"


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("case", ["random_T65", "T1", "extreme_gates", "gva_4x", "varlen_empty", "odd_dims",
                                  "v256_blocks", "v200_blocks_varlen"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_bwd11_reference(family, dtype, case, value, monkeypatch):
    # against autograd through the float64 reference at DESIGN.md section 6 (test_cuda_chunk_bwd.py's _run)
    if dtype == "fp16" and case not in ("random_T65", "extreme_gates", "varlen_empty", "gva_4x"):
        pytest.skip("fp16: a subset")
    if value == "12" and case not in ("random_T65", "extreme_gates", "varlen_empty", "v200_blocks_varlen"):
        pytest.skip("12: a subset")
    monkeypatch.setenv(KNOB, value)
    _run(family, case, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_bwd11_reference_without_state_and_1e4(family, monkeypatch):
    for value in VALUES:
        monkeypatch.setenv(KNOB, value)
        _run(family, "varlen_empty", torch.bfloat16, with_state=False)
        _run(family, "extreme_gates", torch.bfloat16, g_fill=-1e4)


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_bwd11_runs_under_its_knob(family, value, monkeypatch):
    # the knob selects the kernel: state_bwd3f_kernel<PC, true> for 11, <PC, false> for 12 (bf16 / fp16 inputs);
    # fp32 inputs run state_bwd2
    monkeypatch.setenv(KNOB, value)

    def names(dtype):
        q, k, v, g, beta = make_inputs(family, B=1, T=100, H=1, HV=2, dtype=dtype, seed=41)
        do = torch.randn_like(v)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            getattr(OPS, f"{family}_chunk_bwd")(q, k, v, g, beta, 0.1, None, None, do, None)
            torch.cuda.synchronize()
        return [e.name.replace(" ", "") for e in prof.events() if "state_bwd" in e.name]

    pc = "true" if family == "kda" else "false"
    rowp = "true" if value == "11" else "false"
    for dtype in (torch.bfloat16, torch.float16):
        ev = names(dtype)
        assert ev and all(f"state_bwd3f_kernel<{pc},{rowp}>" in n for n in ev), ev
    ev = names(torch.float32)
    assert ev and all("state_bwd2_kernel" in n for n in ev), ev


@pytest.mark.parametrize("value", ["5", "6", "9"])
def test_state_bwd_retired_values_stay_refused(value, monkeypatch):
    monkeypatch.setenv(KNOB, value)
    q, k, v, g, beta = make_inputs("kda", B=1, T=70, H=1, HV=2, dtype=torch.bfloat16, seed=43)
    do = torch.randn_like(v)
    with pytest.raises(RuntimeError, match=f"{KNOB}={value} .*retired"):
        OPS.kda_chunk_bwd(q, k, v, g, beta, 0.1, None, None, do, None)
