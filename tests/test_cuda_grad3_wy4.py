"""grad3_wy4 (KDA_CUDA_CHUNK_BWD_WY=4; kernels_src/cuda/delta_chunk_bwd_grad3_wy2.cuh, grad3_wy4_kernel; session 13,
the default since its verification call): grad3_wy2 (=2, the former default) with T^T's 3xTF32 hi / lo splits formed once into shared memory and the dL
products rebalanced over the warps, the same MMAs on the same tf32 words in the same order per accumulator and the
same fp adds / FMAs in the same order. Claimed bit-identical to =2, so: every gradient of kda_chunk_bwd /
gdn_chunk_bwd (dq, dk, dv, dg, dbeta, dh0) torch.equal between =4 and =2, both set explicitly (the backward's other
kernels are run-to-run deterministic: a repeat call is checked too); =4 against autograd through the float64
reference at DESIGN.md section 6 tolerances; the knob really launches grad3_wy4_kernel (profiler names), and only
where grad3_wy2 would run (V % 4 == 0; else the SIMT grad3_wy under both).

Cases (bwd_inputs of tests/test_cuda_chunk_bwd.py): KDA and GDN, bf16 and fp16 (fp32 on a subset); T in {1, 63, 65,
130, 1000} (partial last chunks, many chunks), varlen with empty sequences, GVA (HV = 2 H, 4 H, 8 H varlen), initial
state and grad of the final state (and neither), 30 % of the gates at -20 and at -1e4 (e^g = 0 exactly), gates / 0.1,
V = 64 (one u slice), V = 32 / K = 40 and K = V = 96 (partial slices), V > 128 (column blocks: 256, 200 varlen).
Needs a CUDA GPU: without one the module is skipped.
"""
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the grad3_wy4 tests need an NVIDIA GPU",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from test_cuda_backend import OPS, make_inputs  # noqa: E402  (loads / builds the CUDA variant)
from test_cuda_chunk_bwd import CASES, DTYPES, GVA_CASES, WY2_CASES, _run, bwd_inputs  # noqa: E402

KNOB = "KDA_CUDA_CHUNK_BWD_WY"
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
SPECS = {**CASES, **WY2_CASES, **GVA_CASES}
# (case, spec name, with_state, g_fill)
EQ_CASES = {
    "random_T65": ("random_T65", True, None),
    "random_T65_no_state": ("random_T65", False, None),
    "T1": ("T1", True, None),
    "T63": ("T63", True, None),
    "T1000": ("T1000", True, None),
    "T200_correlated": ("T200_correlated", True, None),
    "gate_div_0.1": ("gate_div_0.1", True, None),
    "extreme_gates": ("extreme_gates", True, None),
    "extreme_gates_1e4": ("extreme_gates", True, -1e4),
    "extreme_gates_1e4_no_state": ("extreme_gates", False, -1e4),
    "gva_4x": ("gva_4x", True, None),
    "gva_h2_g2": ("gva_h2_g2", True, None),
    "gva_g8_varlen": ("gva_g8_varlen", True, None),
    "varlen_empty": ("varlen_empty", True, None),
    "varlen_empty_no_state": ("varlen_empty", False, None),
    "v64_T130": ("v64_T130", True, None),
    "k40_v32_gva": ("k40_v32_gva", True, None),
    "k96_v96_varlen": ("k96_v96_varlen", True, None),
    "v256_blocks": ("v256_blocks", True, None),
    "v200_blocks_varlen": ("v200_blocks_varlen", True, None),
}
FP32_EQ = ("random_T65", "varlen_empty", "extreme_gates_1e4", "v64_T130", "k96_v96_varlen")


def _bwd(family, args, wy, monkeypatch):
    monkeypatch.setenv(KNOB, wy)
    out = getattr(OPS, f"{family}_chunk_bwd")(*args)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case", list(EQ_CASES))
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_grad3_wy4_is_grad3_wy2(family, case, dtype, monkeypatch):
    if dtype == "fp32" and case not in FP32_EQ:
        pytest.skip("fp32 inputs differ from bf16 only in the v / dv conversion; a subset suffices")
    name, with_state, g_fill = EQ_CASES[case]
    args, _ = bwd_inputs(family, dict(SPECS[name]), DTYPES[dtype], with_state, g_fill)
    a = _bwd(family, args, "2", monkeypatch)
    b = _bwd(family, args, "4", monkeypatch)
    for n, x, y in zip(NAMES, a, b):
        assert x.shape == y.shape and x.dtype == y.dtype, n
        assert torch.isfinite(x).all(), n
        assert torch.equal(x, y), (f"{family} {case} {dtype} {n}: grad3_wy4 differs from grad3_wy2 at "
                                   f"{int((x != y).sum())} of {x.numel()} elements (max |diff| "
                                   f"{float((x.float() - y.float()).abs().max())})")
    # the default path is run-to-run deterministic, and so is =4 (no state carried between calls)
    c = _bwd(family, args, "2", monkeypatch)
    d = _bwd(family, args, "4", monkeypatch)
    assert all(torch.equal(x, y) for x, y in zip(a, c)), "grad3_wy2: two calls differ"
    assert all(torch.equal(x, y) for x, y in zip(b, d)), "grad3_wy4: two calls differ"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", ["random_T65", "T1", "T1000", "extreme_gates", "extreme_gates_1e4", "gva_4x",
                                  "varlen_empty", "v64_T130", "k96_v96_varlen", "v256_blocks", "v200_blocks_varlen"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_grad3_wy4_reference(family, case, dtype, monkeypatch):
    # =4 with the other kernels at their defaults against autograd through the float64 reference (as
    # test_grad3_wy2_reference: DESIGN.md section 6 tolerances, initial state and grad of the final state)
    if dtype == "fp16" and case in ("T1000", "v256_blocks", "k96_v96_varlen"):
        pytest.skip("fp16 differs from bf16 only in the v / dv conversion; a subset suffices")
    monkeypatch.setenv(KNOB, "4")
    if case == "extreme_gates_1e4":
        _run(family, "extreme_gates", DTYPES[dtype], g_fill=-1e4)
    else:
        _run(family, case, DTYPES[dtype])


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_grad3_wy4_runs_under_its_knob(family, monkeypatch):
    # the knob really selects the kernel (bit-identical results cannot show it): grad3_wy4_kernel under =4 and
    # grad3_wy2_kernel under =2 where V % 4 == 0 (bf16, fp16, fp32 inputs); the SIMT grad3_wy_kernel under both
    # where V % 4 != 0
    def names(wy, dtype, V):
        monkeypatch.setenv(KNOB, wy)
        q, k, v, g, beta = make_inputs(family, B=1, T=100, H=1, HV=2, V=V, dtype=dtype, seed=41)
        do = torch.randn_like(v)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            getattr(OPS, f"{family}_chunk_bwd")(q, k, v, g, beta, 0.1, None, None, do, None)
            torch.cuda.synchronize()
        return [e.name.replace(" ", "") for e in prof.events() if "grad3_wy" in e.name]

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        ev = names("4", dtype, 64)
        assert ev and all("grad3_wy4_kernel" in n for n in ev), ev
        ev = names("2", dtype, 64)
        assert ev and all("grad3_wy2_kernel" in n for n in ev), ev
    for wy in ("2", "4"):
        ev = names(wy, torch.bfloat16, 30)
        assert ev and all("grad3_wy_kernel" in n for n in ev), ev


@pytest.mark.parametrize("value", ["0", "3", "5", "wy4"])
def test_grad3_wy_values_refused(value, monkeypatch):
    # 3 is retired (session 11), 0 / 5 / text were never values: the error names the knob
    monkeypatch.setenv(KNOB, value)
    q, k, v, g, beta = make_inputs("kda", B=1, T=70, H=1, HV=2, dtype=torch.bfloat16, seed=43)
    do = torch.randn_like(v)
    match = "retired in session 11" if value == "3" else f"{KNOB}={value} is not an accepted value: {KNOB} takes 2, 1, 4"
    with pytest.raises(RuntimeError, match=match):
        OPS.kda_chunk_bwd(q, k, v, g, beta, 0.1, None, None, do, None)
