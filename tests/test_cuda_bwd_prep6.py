"""The KDA backward's prep v6 (KDA_CUDA_CHUNK_BWD_PREP=6; kernels_src/cuda/delta_chunk_bwd_prep4.cuh,
prep4_kda_kernel<T16, true>; session 13, the default since the candidate call): prep v4 (=4, the former default) with each 3xTF32 hi / lo split
formed once per fragment and reused, the same MMAs on the same tf32 words in the same order per accumulator. Claimed
bit-identical to v4, so: every gradient of kda_chunk_bwd (dq, dk, dv, dg, dbeta, dh0) torch.equal between =6 and =4,
and every prep output (stage 0's work buffers: A_qk, A_kk, w, K Eend, Q Gam, Gam_last, u) torch.equal; =6 against
autograd through the float64 reference at DESIGN.md section 6 tolerances; GDN runs its prep v3 under =6 (bit for bit
its default); unknown values refused. Every knob value is set explicitly.

Cases (bwd_inputs of tests/test_cuda_chunk_bwd.py): bf16 and fp16; T in {1, 63, 65, 1000} (partial last chunks,
many chunks), varlen with empty sequences, GVA (HV = 4 H, HV = 8 H varlen), initial state and grad of the final
state (and neither), 30 % of the gates at -20 and at -1e4 (e^g = 0 exactly), gates / 0.1, odd K / V (K = 40, V = 30:
prep v6's lone last job in S5), V = 64, V > 128 (column blocks). Needs a CUDA GPU: without one the module is skipped.
"""
import re
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the prep v6 tests need an NVIDIA GPU",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from test_cuda_backend import OPS, make_inputs  # noqa: E402  (loads / builds the CUDA variant)
from test_cuda_chunk_bwd import CASES, DTYPES, GVA_CASES, WY2_CASES, _run, bwd_inputs  # noqa: E402
from test_cuda_stages import _PREP_OUT  # noqa: E402

KNOB = "KDA_CUDA_CHUNK_BWD_PREP"
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
    "gva_4x": ("gva_4x", True, None),
    "gva_g8_varlen": ("gva_g8_varlen", True, None),
    "varlen_empty": ("varlen_empty", True, None),
    "varlen_empty_no_state": ("varlen_empty", False, None),
    "odd_dims": ("odd_dims", True, None),
    "v64_T130": ("v64_T130", True, None),
    "v200_blocks_varlen": ("v200_blocks_varlen", True, None),
}


def _bwd(args, ver, monkeypatch):
    monkeypatch.setenv(KNOB, ver)
    out = OPS.kda_chunk_bwd(*args)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", list(EQ_CASES))
def test_kda_bwd_prep6_is_prep4(case, dtype, monkeypatch):
    name, with_state, g_fill = EQ_CASES[case]
    args, _ = bwd_inputs("kda", dict(SPECS[name]), DTYPES[dtype], with_state, g_fill)
    a = _bwd(args, "4", monkeypatch)
    b = _bwd(args, "6", monkeypatch)
    for n, x, y in zip(NAMES, a, b):
        assert x.shape == y.shape and x.dtype == y.dtype, n
        assert torch.isfinite(x).all(), n
        assert torch.equal(x, y), (f"{case} {dtype} {n}: prep v6 differs from v4 at {int((x != y).sum())} of "
                                   f"{x.numel()} elements (max |diff| {float((x.float() - y.float()).abs().max())})")
    # and the repeat call gives the same bits (no state carried between calls)
    c = _bwd(args, "6", monkeypatch)
    assert all(torch.equal(x, y) for x, y in zip(b, c)), "prep v6: two calls differ"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", ["random_T65", "T1000", "extreme_gates_1e4", "varlen_empty", "gva_g8_varlen",
                                  "odd_dims", "v64_T130"])
def test_kda_bwd_prep6_outputs_are_prep4s(case, dtype, monkeypatch):
    """Stage 0 (the prep alone) of kda_chunk_bwd_stage: every prep output buffer bit for bit v4's, over the rows of
    real chunks (padding included), so a difference shows in the buffer that has it."""
    name, _, g_fill = EQ_CASES[case]
    spec = dict(SPECS[name])
    (q, k, v, g, beta, scale, h0, cu, do, dht), _ = bwd_inputs("kda", spec, DTYPES[dtype], True, g_fill)
    B, T, HV = v.shape[0], v.shape[1], v.shape[2]
    assert v.shape[3] <= 128, "V > 128 runs the prep per column block: stage 0's buffers hold one block"
    lens = [T] * B if cu is None else (cu[1:] - cu[:-1]).tolist()
    chunks = sum((n + 63) // 64 for n in lens)
    outs = {}
    for ver in ("4", "6"):
        monkeypatch.setenv(KNOB, ver)
        work = OPS.kda_chunk_bwd_stage([], 0, q, k, v, g, beta, scale, None, cu, do, None)
        torch.cuda.synchronize()
        outs[ver] = {}
        for bname, (i, kind, n) in _PREP_OUT.items():
            rows = chunks * HV * n if kind == "chunk" else B * T * HV * v.shape[3]
            assert work[i].numel() >= rows, f"work[{i}] ({bname}) is smaller than expected: enum BwdWork changed?"
            outs[ver][bname] = work[i][:rows].clone()
    for bname, x in outs["4"].items():
        y = outs["6"][bname]
        assert torch.equal(x, y), f"{case} {dtype} prep output {bname}: v6 differs from v4 at {int((x != y).sum())}"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", ["random_T65", "T1000", "extreme_gates", "extreme_gates_1e4", "gva_4x",
                                  "varlen_empty", "odd_dims", "v256_blocks"])
def test_kda_bwd_prep6_reference(case, dtype, monkeypatch):
    # =6 with the other kernels at their defaults against autograd through the float64 reference (as
    # test_kda_bwd_prep4_reference: DESIGN.md section 6 tolerances, initial state and grad of the final state)
    if dtype == "fp16" and case in ("T1000", "odd_dims", "v256_blocks"):
        pytest.skip("fp16 differs from bf16 only in the q / k conversion; a subset suffices")
    monkeypatch.setenv(KNOB, "6")
    if case == "extreme_gates_1e4":
        _run("kda", "extreme_gates", DTYPES[dtype], g_fill=-1e4)
    else:
        _run("kda", case, DTYPES[dtype])


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gdn_and_fp32_ignore_prep6(dtype, monkeypatch):
    # GDN has no prep v4 / v6: =6 runs its prep v3, bit for bit its default (=4); fp32 inputs run the SIMT prep
    # under every value, KDA and GDN alike
    for family in ("gdn", "kda") if dtype == "fp32" else ("gdn",):
        args, _ = bwd_inputs(family, dict(CASES["varlen_empty"]), DTYPES[dtype])
        monkeypatch.setenv(KNOB, "4")
        a = getattr(OPS, f"{family}_chunk_bwd")(*args)
        monkeypatch.setenv(KNOB, "6")
        b = getattr(OPS, f"{family}_chunk_bwd")(*args)
        for n, x, y in zip(NAMES, a, b):
            assert torch.equal(x, y), (family, dtype, n)


@pytest.mark.parametrize("value", ["7", "0", "-4", "64", "v6", "6x", "4.0"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_unknown_prep_values_are_refused(family, value, monkeypatch):
    # values no prep has: refused by the one-call op and by stage 0 with the knob's name, the value and the accepted
    # values (env_choice; 1, 3 and 5 are retired: test_retired_bwd_knob_values_are_refused)
    monkeypatch.setenv(KNOB, value)
    q, k, v, g, beta = make_inputs(family, B=1, T=70, H=1, HV=2, dtype=torch.bfloat16, seed=43)
    do = torch.randn_like(v)
    pattern = re.escape(f"{KNOB}={value} is not an accepted value: {KNOB} takes 2, 3, 4, 5, 6")
    with pytest.raises(RuntimeError, match=pattern):
        getattr(OPS, f"{family}_chunk_bwd")(q, k, v, g, beta, 0.1, None, None, do, None)
    with pytest.raises(RuntimeError, match=pattern):
        getattr(OPS, f"{family}_chunk_bwd_stage")([], 0, q, k, v, g, beta, 0.1, None, None, do, None)
    monkeypatch.delenv(KNOB)
    out = getattr(OPS, f"{family}_chunk_bwd")(q, k, v, g, beta, 0.1, None, None, do, None)  # still usable
    assert all(torch.isfinite(x).all() for x in out)
