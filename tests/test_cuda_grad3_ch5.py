"""KDA's per-channel grad stage, grad3_ch2's F5 instance (KDA_CUDA_CHUNK_BWD_CH=5; kernels_src/cuda/
delta_chunk_bwd_grad3_ch2.cuh, grad3_ch2_kernel<true, true>; session 13, the default since its verification call): the default grad3_ch2 (=2) with
the same floating-point operations on the same operands in the same order and fewer integer / shuffle instructions
(compile-time dA copy offsets, hoisted 64-bit row addresses, the 16 rows' dRg . k warp sums as one transposed
butterfly that adds the same pairs). Claimed bit-identical, so: every gradient of kda_chunk_bwd (dq, dk, dv, dg,
dbeta, dh0) torch.equal between =5 and =2 (both set explicitly; grad3_ch2 has no atomics: its dbeta partials are
summed over the cluster in a fixed order, so the default is run-to-run deterministic, checked here too); =5 against
autograd through the float64 reference at DESIGN.md section 6 tolerances; each value runs its own instance (the
profiler's kernel names); unknown values refused, 1 / 3 / 4 still refused as retired (test_cuda_chunk_bwd.py's
RETIRED_BWD).

Cases (bwd_inputs of tests/test_cuda_chunk_bwd.py): bf16, fp16 and fp32; T in {1, 63, 65, 1000, 2048}, varlen with
empty sequences, GVA (HV = 2 H, 4 H, 8 H varlen), initial state and grad of the final state (and neither), 30 % of
the gates at -20 and at -1e4 (e^g = 0 exactly), odd K / V (K = 40: lanes past K; V = 30), V = 64, V > 128 (column
blocks). Needs a CUDA GPU: without one the module is skipped.
"""
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the grad3_ch2 F5 tests need an NVIDIA GPU",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from test_cuda_backend import OPS, make_inputs  # noqa: E402  (loads / builds the CUDA variant)
from test_cuda_chunk_bwd import CASES, DTYPES, GVA_CASES, WY2_CASES, _run, bwd_inputs  # noqa: E402

KNOB = "KDA_CUDA_CHUNK_BWD_CH"
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
SPECS = {**CASES, **WY2_CASES, **GVA_CASES, "T2048_gva2": dict(B=1, T=2048, H=2, HV=4)}
# (case, spec name, with_state, g_fill)
EQ_CASES = {
    "random_T65": ("random_T65", True, None),
    "random_T65_no_state": ("random_T65", False, None),
    "T1": ("T1", True, None),
    "T63": ("T63", True, None),
    "T1000": ("T1000", True, None),
    "T200_correlated_gva2": ("T200_correlated", True, None),
    "extreme_gates": ("extreme_gates", True, None),
    "extreme_gates_1e4": ("extreme_gates", True, -1e4),
    "extreme_gates_mild_1e4": ("extreme_gates_mild", True, -1e4),
    "gva_4x": ("gva_4x", True, None),
    "gva_g8_varlen": ("gva_g8_varlen", True, None),
    "varlen_empty": ("varlen_empty", True, None),
    "varlen_empty_no_state": ("varlen_empty", False, None),
    "odd_dims": ("odd_dims", True, None),
    "v64_T130": ("v64_T130", True, None),
    "v256_blocks": ("v256_blocks", True, None),
    "v200_blocks_varlen": ("v200_blocks_varlen", True, None),
    "T2048_gva2": ("T2048_gva2", True, None),
}


def _bwd(args, ver, monkeypatch):
    monkeypatch.setenv(KNOB, ver)
    out = OPS.kda_chunk_bwd(*args)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case", list(EQ_CASES))
def test_grad3_ch5_is_ch2(case, dtype, monkeypatch):
    if dtype == "fp32" and case not in ("random_T65", "T1000", "extreme_gates_1e4", "varlen_empty", "odd_dims"):
        pytest.skip("fp32 differs only in the q / k loads; a subset suffices")
    name, with_state, g_fill = EQ_CASES[case]
    args, _ = bwd_inputs("kda", dict(SPECS[name]), DTYPES[dtype], with_state, g_fill)
    a = _bwd(args, "2", monkeypatch)
    a2 = _bwd(args, "2", monkeypatch)
    assert all(torch.equal(x, y) for x, y in zip(a, a2)), "the default (=2) is not run-to-run deterministic"
    b = _bwd(args, "5", monkeypatch)
    for n, x, y in zip(NAMES, a, b):
        assert x.shape == y.shape and x.dtype == y.dtype, n
        assert torch.isfinite(x).all(), n
        assert torch.equal(x, y), (f"{case} {dtype} {n}: CH=5 differs from CH=2 at {int((x != y).sum())} of "
                                   f"{x.numel()} elements (max |diff| {float((x.float() - y.float()).abs().max())})")
    c = _bwd(args, "5", monkeypatch)
    assert all(torch.equal(x, y) for x, y in zip(b, c)), "CH=5: two calls differ"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", ["random_T65", "T1", "T1000", "extreme_gates", "extreme_gates_1e4", "gva_4x",
                                  "varlen_empty", "odd_dims", "v256_blocks"])
def test_grad3_ch5_reference(case, dtype, monkeypatch):
    # =5 with the other kernels at their defaults against autograd through the float64 reference (DESIGN.md
    # section 6 tolerances, initial state and grad of the final state)
    if dtype == "fp16" and case in ("T1000", "odd_dims", "v256_blocks"):
        pytest.skip("fp16 differs from bf16 only in the q / k conversion; a subset suffices")
    monkeypatch.setenv(KNOB, "5")
    if case == "extreme_gates_1e4":
        _run("kda", "extreme_gates", DTYPES[dtype], g_fill=-1e4)
    else:
        _run("kda", case, DTYPES[dtype])


def test_grad3_ch5_reference_without_state(monkeypatch):
    monkeypatch.setenv(KNOB, "5")
    _run("kda", "varlen_empty", torch.bfloat16, with_state=False)


@pytest.mark.parametrize("val", ["6", "0", "fast"])
def test_grad3_ch_unknown_values_are_refused(val, monkeypatch):
    monkeypatch.setenv(KNOB, val)
    q, k, v, g, beta = make_inputs("kda", B=1, T=70, H=1, HV=2, dtype=torch.bfloat16, seed=43)
    do = torch.randn_like(v)
    with pytest.raises(RuntimeError, match=f"{KNOB}={val} is not an accepted value: {KNOB} takes 2, 5"):
        OPS.kda_chunk_bwd(q, k, v, g, beta, 0.1, None, None, do, None)


def test_gdn_ignores_ch5(monkeypatch):
    # GDN's per-head grad stage (grad3_gdn) does not read the value: =5 gives its default's bits
    args, _ = bwd_inputs("gdn", dict(CASES["random_T65"]), torch.bfloat16)
    monkeypatch.setenv(KNOB, "2")
    a = OPS.gdn_chunk_bwd(*args)
    monkeypatch.setenv(KNOB, "5")
    b = OPS.gdn_chunk_bwd(*args)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("val, inst", [("2", "grad3_ch2_kernel<true, false>"), ("5", "grad3_ch2_kernel<true, true>"),
                                       (None, "grad3_ch2_kernel<true, true>")])  # unset: 5 since session 13
def test_grad3_ch_routes_to_its_instance(val, inst, monkeypatch):
    """Each value runs its instance -- seen as the kernel the profiler records, since the two give the same bits
    (torch.equal above would pass if both values ran one kernel); unset: the default, <true, true> (F5)."""
    if val is None:
        monkeypatch.delenv(KNOB, raising=False)
    else:
        monkeypatch.setenv(KNOB, val)
    args, _ = bwd_inputs("kda", dict(CASES["random_T65"]), torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        OPS.kda_chunk_bwd(*args)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "grad3_ch2_kernel" in e.name]
    assert names and all(inst in n for n in names), names
