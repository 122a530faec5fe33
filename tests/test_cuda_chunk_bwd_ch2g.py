"""grad3_ch2g (KDA_CUDA_CHUNK_BWD_CH=4; kernels_src/cuda/delta_chunk_bwd_grad3_ch2g.cuh): KDA's per-channel grad
stage with the GVA sum of dq, dk fused in, against the default path (grad3_ch2 + gva_reduce_kernel / the torch
path) and against autograd through the float64 reference (tests/ref_delta.py) at DESIGN.md section 6 tolerances.

grad3_ch2g runs grad3_ch2's per-value-head arithmetic and sums dq, dk over a key head's value heads in the order of
gva_reduce_kernel before the same rounding, so its outputs should match the default path's bit for bit
(test_ch2g_bit_identical); the tolerance comparison (test_ch2g_matches_default) bounds the difference should the
compiler contract a product differently in the new kernel. Cases: varlen with empty sequences, GVA (G = 2, 3, 4, 8),
odd K (channel groups past K; K % 4 != 0), T not a multiple of 64 (T = 1, 63, 65, 200), 16 chunks, gates at -50 /
-1e4 mixed with ordinary ones, initial state and grad of the final state, V > 128 (column blocks: the host runs
grad3_ch2 there), the staged op. Needs a CUDA GPU: without one the module is skipped with the reason.
"""
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the grad3_ch2g tests need an NVIDIA GPU",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from ref_delta import assert_close  # noqa: E402
from test_cuda_backend import OPS, make_inputs  # noqa: E402  (loads / builds the CUDA variant)
from test_cuda_chunk_bwd import DTYPES, _run, bwd_default_and_knob  # noqa: E402

torch.set_num_threads(1)
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")

# cases of test_cuda_chunk_bwd.py (CASES, WY2_CASES, GVA_CASES; T200_*: B=1 T=200 H=1 HV=2, see bwd_default_and_knob)
KNOB_CASES = ["random_T65", "T1", "T63", "varlen_empty", "gva_4x", "odd_dims", "T1000", "T200_bf16",
              "T200_gates_50_rows", "T200_gates_1e4", "gva_h2_g2", "gva_g3_k30", "gva_g8_varlen", "k40_v32_gva",
              "k96_v96_varlen", "v256_blocks", "v200_blocks_varlen"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", KNOB_CASES)
def test_ch2g_matches_default(case, dtype, monkeypatch):
    # CH=4 against the default (CH=2 + the GVA reduce), same inputs: fp32 rounding for the fp32 outputs, one bf16 /
    # fp16 rounding step for dq, dk
    if dtype == "fp16" and case not in ("random_T65", "varlen_empty", "gva_4x", "gva_g3_k30"):
        pytest.skip("fp16 differs from bf16 only in the load / store conversion; a subset suffices")
    dt = DTYPES[dtype]
    a, b = bwd_default_and_knob("kda", case, dt, 47, "CH=4", monkeypatch)
    tol = 2e-5 if dt == torch.float32 else 0.008
    for name, x, y in zip(NAMES, a, b):
        assert torch.isfinite(y).all(), name
        assert y.shape == x.shape and y.dtype == x.dtype, name
        assert_close(name, y.double().cpu(), x.double().cpu(), 2e-5 if name in ("dg", "dbeta", "dh0") else tol)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", ["varlen_empty", "gva_4x", "T200_gates_50_rows", "gva_g3_k30", "T1000"])
def test_ch2g_bit_identical(case, dtype, monkeypatch):
    # same per-head arithmetic, same GVA summation order, same rounding: expected bit-identical to the default path
    # (a failure here with test_ch2g_matches_default passing means a different FMA contraction, not a wrong result)
    a, b = bwd_default_and_knob("kda", case, DTYPES[dtype], 53, "CH=4", monkeypatch)
    for name, x, y in zip(NAMES, a, b):
        assert torch.equal(x, y), (name, float((x.double() - y.double()).abs().max()))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", ["random_T65", "T63", "varlen_empty", "gva_4x", "extreme_gates", "odd_dims",
                                  "gva_g8_varlen", "v200_blocks_varlen"])
def test_ch2g_reference(case, dtype, monkeypatch):
    # CH=4 in the whole backward against autograd through the float64 reference (as test_chunk_bwd: initial state,
    # grad of the final state, DESIGN.md section 6 tolerances)
    if dtype == "fp16" and case not in ("random_T65", "varlen_empty", "gva_4x"):
        pytest.skip("fp16 differs from bf16 only in the load / store conversion; a subset suffices")
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_CH", "4")
    _run("kda", case, DTYPES[dtype])


def test_ch2g_reference_extreme_gates_1e4(monkeypatch):
    # gates at -1e4 (e^g = 0 exactly) mixed with ordinary ones, GVA, against the float64 reference
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_CH", "4")
    _run("kda", "extreme_gates", torch.bfloat16, g_fill=-1e4)


@pytest.mark.parametrize("knob", ["2", "4"])
def test_ch2g_runs_under_its_knob(knob, monkeypatch):
    # the knob really selects the kernel (bit-identical results cannot show it): grad3_ch2g_kernel and no
    # gva_reduce_kernel with CH=4; grad3_ch2_kernel and gva_reduce_kernel with CH=2. V > 128 (column blocks) runs
    # grad3_ch2 under either value.
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_CH", knob)
    monkeypatch.delenv("KDA_CUDA_CHUNK_BWD_GVA", raising=False)

    def names(V):
        q, k, v, g, beta = make_inputs("kda", B=1, T=100, H=1, HV=2, V=V, dtype=torch.bfloat16, seed=41)
        do = torch.randn_like(v)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            OPS.kda_chunk_bwd(q, k, v, g, beta, 0.1, None, None, do, None)
            torch.cuda.synchronize()
        return [e.name for e in prof.events()]

    ev = names(128)
    fused = any("grad3_ch2g_kernel" in n for n in ev)
    assert fused == (knob == "4")
    assert any("gva_reduce_kernel" in n for n in ev) == (knob != "4")
    assert any("grad3_ch2_kernel" in n for n in ev) == (knob != "4")
    ev = names(256)
    assert not any("grad3_ch2g_kernel" in n for n in ev) and any("grad3_ch2_kernel" in n for n in ev)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("cu_list", [None, [0, 0, 17, 17, 90, 91, 200]], ids=["fixed", "varlen_empty"])
def test_ch2g_staged_matches_one_call(cu_list, dtype, monkeypatch):
    # the staged backward (kda_chunk_bwd_stage; stage 3 allocates dq, dk per key head for CH=4) against the
    # one-call op with the same knob, GVA (HV = 2 H), initial state and grad of the final state
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_CH", "4")
    dt = DTYPES[dtype]
    cu = None if cu_list is None else torch.tensor(cu_list, dtype=torch.long, device="cuda")
    q, k, v, g, beta = make_inputs("kda", B=2, T=150, H=2, HV=4, dtype=dt, seed=7, extreme=True, cu=cu_list)
    N = q.shape[0] if cu is None else cu.numel() - 1
    gen = torch.Generator().manual_seed(13)
    h0 = (torch.randn(N, 4, 128, 128, generator=gen) * 0.5).cuda()
    dht = torch.randn(N, 4, 128, 128, generator=gen).cuda()
    do = torch.randn(*v.shape, generator=gen).cuda().to(dt)
    x = (q, k, v, g, beta, 128 ** -0.5)
    ref = OPS.kda_chunk_bwd(*x, h0, cu, do, dht)
    stage = OPS.kda_chunk_bwd_stage
    work = stage([], 0, *x, None, cu, do, None)
    assert stage(work, 1, *x, h0, cu, do, None) == []
    (dh0,) = stage(work, 2, *x, h0, cu, do, dht)
    dq, dk, dv, dg, dbeta = stage(work, 3, *x, h0, cu, do, None)
    torch.cuda.synchronize()
    for name, got, want in zip(NAMES, (dq, dk, dv, dg, dbeta, dh0), ref):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.equal(got, want), name  # same kernels, same inputs
