"""kda_chunk_bwd / gdn_chunk_bwd (kernels_src/cuda/delta_chunk_bwd.cuh) against autograd through the float64
reference (tests/ref_delta.py) at DESIGN.md section 6 tolerances.

Needs a CUDA GPU: without one the module is skipped with the reason. Cases: random and correlated keys, gates
logsigmoid(randn)/{0.1, 1, 10}, 30 % of gates at -20, T in {1, 63, 65, 200, 1000} (chunk boundaries, a partial
last chunk, many chunks), varlen with empty sequences, GVA, initial state and grad of the final state (and
neither), odd head dims, V > 128 (column blocks), fp32 / bf16 / fp16 inputs.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the CUDA chunked-backward tests need an "
                "NVIDIA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from ref_delta import assert_close, ref_delta_rule  # noqa: E402
from test_cuda_backend import DEV, OPS, make_inputs  # noqa: E402  (loads / builds the CUDA variant)

torch.set_num_threads(1)
TOL_DX = {torch.float32: 1e-5, torch.bfloat16: 0.008, torch.float16: 0.008}
TOL_DG = {torch.float32: 1e-5, torch.bfloat16: 0.02, torch.float16: 0.02}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

CASES = {
    "random_T65": dict(B=2, T=65, H=2, HV=2),
    "T1": dict(B=2, T=1, H=2, HV=2),
    "T63": dict(B=1, T=63, H=2, HV=2),
    "T200_correlated": dict(B=1, T=200, H=1, HV=2, keys="correlated"),
    "T1000": dict(B=1, T=1000, H=1, HV=1),
    "gate_div_0.1": dict(B=1, T=130, H=1, HV=2, gate_div=0.1),
    "gate_div_10": dict(B=1, T=130, H=1, HV=2, gate_div=10.0),
    "extreme_gates": dict(B=1, T=200, H=1, HV=2, extreme=True, gate_div=0.1),
    "extreme_gates_mild": dict(B=1, T=150, H=1, HV=2, extreme=True),
    "gva_4x": dict(B=1, T=100, H=1, HV=4),
    "varlen_empty": dict(H=2, HV=2, cu=[0, 0, 17, 17, 90, 91, 200]),
    "odd_dims": dict(B=2, T=77, H=1, HV=2, K=40, V=30),
    "k192_recurrent_route": dict(B=1, T=40, H=1, HV=1, K=192, V=64),
    # V > 128: the chunked backward on column blocks (the context-parallel transition runs at width K + V)
    "v256_blocks": dict(B=1, T=130, H=1, HV=2, K=64, V=256),
    "v200_blocks_varlen": dict(H=1, HV=2, K=32, V=200, cu=[0, 0, 70, 150]),
}
# shapes for grad3_wy2 only (its 64-column slices of [dU | dw]: V = 64 one u slice, V = 32 / 96 and K = 40 / 96
# partial slices; kept out of CASES so that test_chunk_bwd does not grow)
WY2_CASES = {
    "v64_T130": dict(B=1, T=130, H=1, HV=2, K=128, V=64),
    "k40_v32_gva": dict(B=2, T=100, H=1, HV=2, K=40, V=32),
    "k96_v96_varlen": dict(H=2, HV=2, K=96, V=96, cu=[0, 0, 64, 64, 129, 200]),
}

# shapes for the GVA reduce kernel only (G = HV / H value heads per key head; K % 4 != 0 runs its scalar instance)
GVA_CASES = {
    "gva_h2_g2": dict(B=2, T=130, H=2, HV=4, K=128, V=64),
    "gva_g3_k30": dict(B=1, T=70, H=2, HV=6, K=30, V=20),
    "gva_g8_varlen": dict(H=1, HV=8, K=64, V=32, cu=[0, 0, 50, 50, 177]),
}


def bwd_inputs(family, spec, dtype, with_state=True, g_fill=None):
    """The backward's arguments for one case spec (make_inputs' keywords, "cu" the varlen offsets):
    ((q, k, v, g, beta, scale, h0, cu, do, dht), N). g_fill: the -20 gates of an extreme case set to this value
    instead (e.g. -1e4: e^g = 0 exactly). Also used by tests/test_cuda_state_bwd_bf16.py."""
    cu_list = spec.get("cu")
    cu = None if cu_list is None else torch.tensor(cu_list, dtype=torch.long, device=DEV)
    q, k, v, g, beta = make_inputs(family, dtype=dtype, seed=3, **spec)
    if g_fill is not None:
        g = torch.where(g == -20.0, torch.full_like(g, g_fill), g)
    N = q.shape[0] if cu is None else cu.numel() - 1
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    gen = torch.Generator().manual_seed(9)
    h0 = (torch.randn(N, HV, K, V, generator=gen) * 0.5).to(DEV) if with_state else None
    dht = torch.randn(N, HV, K, V, generator=gen).to(DEV) if with_state else None
    do = torch.randn(*v.shape, generator=gen).to(DEV).to(dtype)
    return (q, k, v, g, beta, K ** -0.5, h0, cu, do, dht), N


def _run(family, case, dtype, with_state=True, g_fill=None):
    spec = dict(CASES[case] if case in CASES else {**WY2_CASES, **GVA_CASES}[case])
    (q, k, v, g, beta, scale, h0, cu, do, dht), N = bwd_inputs(family, spec, dtype, with_state, g_fill)
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    out = getattr(OPS, f"{family}_chunk_bwd")(q, k, v, g, beta, scale, h0, cu, do, dht)
    torch.cuda.synchronize()
    xs = [x.detach().cpu().double().requires_grad_(True) for x in (q, k, v, g, beta)]
    h0r = (h0.cpu().double() if with_state else torch.zeros(N, HV, K, V, dtype=torch.float64)).requires_grad_(True)
    ro, rs = ref_delta_rule(*xs, scale=scale, initial_state=h0r, cu_seqlens=None if cu is None else cu.cpu())
    loss = (ro * do.cpu().double()).sum()
    if with_state:
        loss = loss + (rs * dht.cpu().double()).sum()
    grads = torch.autograd.grad(loss, xs + [h0r])
    tols = (TOL_DX, TOL_DX, TOL_DX, TOL_DG, TOL_DG, TOL_DX)
    for name, r, o, tol in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, out, tols):
        assert_close(f"{family} {case} {name}", r, o.cpu(), tol[dtype])
    dq, dk, dv, dg, dbeta, dh0 = out
    assert dq.dtype == dtype and dk.dtype == dtype and dv.dtype == dtype
    assert dg.dtype == torch.float32 and dg.shape == g.shape and dbeta.shape == beta.shape
    assert dh0.shape == (N, HV, K, V)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_chunk_bwd(family, case, dtype):
    if dtype == "fp16" and case not in ("random_T65", "extreme_gates", "varlen_empty", "gva_4x"):
        pytest.skip("fp16 differs from bf16 only in the load/store conversion; a subset suffices")
    if case == "T1000" and dtype != "fp32":
        pytest.skip("the long case runs once per family (fp32, the tightest tolerance)")
    _run(family, case, DTYPES[dtype])


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_chunk_bwd_without_state(family):
    _run(family, "random_T65", torch.float32, with_state=False)
    _run(family, "varlen_empty", torch.bfloat16, with_state=False)


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_chunk_bwd_matches_recurrent_bwd(family):
    # the two CUDA backward kernels compute the same function by different algorithms
    q, k, v, g, beta = make_inputs(family, B=1, T=300, H=2, HV=4, dtype=torch.float32, seed=5, extreme=True)
    do = torch.randn_like(v)
    dht = torch.randn(1, 4, 128, 128, device=DEV)
    a = getattr(OPS, f"{family}_chunk_bwd")(q, k, v, g, beta, 0.1, None, None, do, dht)
    b = getattr(OPS, f"{family}_recurrent_bwd")(q, k, v, g, beta, 0.1, None, None, do, dht)
    for name, x, y in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), a, b):
        assert_close(name, y.double().cpu(), x.double().cpu(), 2e-5)


def _gates_50(g, rows):
    """The -20 gates of make_inputs(extreme=True) at -50 (e^g ~ 2e-22: products of two or three underflow in fp32),
    mixed with the logsigmoid ones; rows: also every channel of every 7th token at -50 (whole 16-row sub-blocks'
    decay totals reach 0)."""
    g = torch.where(g == -20.0, torch.full_like(g, -50.0), g)
    if rows:
        g = g.clone()
        g[:, ::7] = -50.0
    return g


def bwd_default_and_knob(family, case, dtype, seed, knob, monkeypatch):
    """The chunked backward's gradients with the default kernels and with `knob` ("NAME=VAL[,NAME=VAL]", each
    setting KDA_CUDA_CHUNK_BWD_<NAME>, read by the host at every call), same inputs and cotangents (all drawn from
    `seed`: two calls with one seed see the same ones). Cases outside CASES: T200_* (B=1 T=200 H=1 HV=2);
    T200_gates_1e4 puts the -20 gates of make_inputs(extreme=True) at -1e4 (e^g = 0 exactly), T200_gates_50[_rows]
    at -50 (_gates_50)."""
    spec = dict(CASES[case]) if case in CASES else dict({**WY2_CASES, **GVA_CASES}.get(case, dict(B=1, T=200, H=1,
                                                                                                  HV=2)))
    cu_list = spec.pop("cu", None)
    cu = None if cu_list is None else torch.tensor(cu_list, dtype=torch.long, device=DEV)
    # Kernel-against-kernel comparisons at fp32-rounding tolerances: both sides run state_bwd3 and grad3_vc_tc with
    # 3xTF32 products (STATE_BWD=3, VC=2) unless the test or the knob chooses them; their plain-tf32 defaults
    # (rounding ~5e-4 per product) are checked against the float64 reference by test_chunk_bwd and the others
    # that run _run, at DESIGN.md section 6's tolerances.
    for name, precise in (("STATE_BWD", "3"), ("VC", "2")):
        if f"KDA_CUDA_CHUNK_BWD_{name}" not in os.environ:
            monkeypatch.setenv(f"KDA_CUDA_CHUNK_BWD_{name}", precise)
    q, k, v, g, beta = make_inputs(family, dtype=dtype, seed=seed, extreme=True, cu=cu_list, **spec)
    if case == "T200_gates_1e4":
        g = torch.where(g == -20.0, torch.full_like(g, -1e4), g)
    if case.startswith("T200_gates_50"):
        g = _gates_50(g, case.endswith("_rows"))
    N = q.shape[0] if cu is None else cu.numel() - 1
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    gen = torch.Generator().manual_seed(seed)  # as _run: the same h0, dht and cotangent for the same seed
    h0 = (torch.randn(N, HV, K, V, generator=gen) * 0.5).to(DEV)
    dht = torch.randn(N, HV, K, V, generator=gen).to(DEV)
    do = torch.randn(*v.shape, generator=gen).to(DEV).to(v.dtype)
    op = getattr(OPS, f"{family}_chunk_bwd")
    a = op(q, k, v, g, beta, K ** -0.5, h0, cu, do, dht)
    for kv in knob.split(","):
        name, val = kv.split("=")
        monkeypatch.setenv(f"KDA_CUDA_CHUNK_BWD_{name}", val)
    return a, op(q, k, v, g, beta, K ** -0.5, h0, cu, do, dht)


# knob values whose kernels were retired in sessions 9 to 13 (docs/cuda.md, "Retired kernels"): refused at the call
RETIRED_BWD = ["STATE=1", "GRAD=1", "GRAD=2", "CH=1", "PREP=1", "PREP=3", "STATE_FWD=5", "STATE_BWD=5",
               "STATE_BWD=6", "CH=4", "PREP=5", "STATE_FWD=4", "CH=3", "WY=3", "STATE_BWD=9", "STATE_FWD=8",
               "STATE_FWD=9", "STATE_FWD=10"]


@pytest.mark.parametrize("knob", RETIRED_BWD)
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_retired_bwd_knob_values_are_refused(family, knob, monkeypatch):
    # (PREP=3 / 5: KDA's prep v3 / v4 without the split only; GDN runs its prep v3, its default, for every value
    # but 2: test_gdn_bwd_prep4_is_prep3)
    if knob in ("PREP=3", "PREP=5") and family == "gdn":
        pytest.skip("GDN's prep v3 stays (its default bf16/fp16 prep)")
    name, val, one_call, stage0 = _knob_calls(family, knob, monkeypatch)
    with pytest.raises(RuntimeError, match=f"KDA_CUDA_CHUNK_BWD_{name}={val} .*retired in session (9|10|11|12|13)"):
        one_call()
    with pytest.raises(RuntimeError, match="retired in session (9|10|11|12|13)"):
        stage0()


def _knob_calls(family, knob, monkeypatch):
    """knob "NAME=VALUE" set as KDA_CUDA_CHUNK_BWD_NAME; the one-call backward and its stage 0 on small inputs."""
    name, val = knob.split("=")
    monkeypatch.setenv(f"KDA_CUDA_CHUNK_BWD_{name}", val)
    q, k, v, g, beta = make_inputs(family, B=1, T=70, H=1, HV=2, dtype=torch.bfloat16, seed=43)
    do = torch.randn_like(v)
    return (name, val, lambda: getattr(OPS, f"{family}_chunk_bwd")(q, k, v, g, beta, 0.1, None, None, do, None),
            lambda: getattr(OPS, f"{family}_chunk_bwd_stage")([], 0, q, k, v, g, beta, 0.1, None, None, do, None))


# values no backward kernel ever had (and text that is not a number): an error naming the knob and the accepted
# values (env_choice, delta_host.cuh) rather than another kernel run silently -- since session 13 for every knob of
# the backward but the window size
UNKNOWN_BWD = ["PREP=7", "STATE_FWD=6", "STATE_BWD=7", "VC=4", "WY=0", "GVA=2", "FREE=2", "RECURRENT=3", "VC=fast",
               "CH=6"]


@pytest.mark.parametrize("knob", UNKNOWN_BWD)
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_unknown_bwd_knob_values_are_refused(family, knob, monkeypatch):
    name, val, one_call, _ = _knob_calls(family, knob, monkeypatch)
    with pytest.raises(RuntimeError, match=f"KDA_CUDA_CHUNK_BWD_{name}={val} is not an accepted value"):
        one_call()


@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("case", ["varlen_empty", "odd_dims", "v200_blocks_varlen", "gva_4x", "T200_gates_1e4",
                                  "T200_bf16"])
@pytest.mark.parametrize("knob", ["PREP=2", "STATE_FWD=2", "STATE_BWD=2", "VC=1"])
def test_chunk_bwd_grad_v1_matches_v2(family, case, knob, monkeypatch):
    # (the name is historical: grad v1 / grad2 and prep v1 were retired in session 9) each knob's kernel against the
    # default, same gradients up to fp32 rounding. T200_gates_1e4: 30 % of the gates at -1e4 (e^g = 0 exactly):
    # everything finite. PREP=2 (the fp32 SIMT prep) against the default tensor-core prep (v4 for KDA, v3 for GDN),
    # which runs for bf16/fp16 inputs only (fp32 inputs take the SIMT prep either way): every case in bf16; its
    # products are 3xTF32 / exact bf16 with fp32 accumulation, so the fp32 outputs dg, dbeta, dh0 must agree to
    # 1e-4. Likewise STATE_FWD=2 (the fp32 SIMT state_fwd2) against the default state_fwd3 on tensor cores, which runs for
    # bf16/fp16 inputs only; its tf32 products (10-bit mantissas) move dg, dbeta by up to ~7e-5 relative RMS
    # (H200, session 6; DESIGN.md's bound is 0.02), so 1e-3 there. STATE_BWD=2 (the fp32 SIMT state_bwd2) against
    # state_bwd3 on tensor cores with 3xTF32 (bwd_default_and_knob pins it; bf16/fp16 inputs only, so every case
    # in bf16): 1e-4. VC=1 (the fp32 SIMT grad3_vc) against grad3_vc_tc on tensor cores (3xTF32, pinned; bf16/fp16
    # inputs with V % 4 == 0, so every case in bf16; odd_dims' V = 30 runs the SIMT kernel either way): 1e-4
    prep3 = knob in ("PREP=2", "STATE_FWD=2", "STATE_BWD=2", "VC=1")
    tight = 1e-3 if knob == "STATE_FWD=2" else 1e-4
    dtype = torch.bfloat16 if case == "T200_bf16" or prep3 else torch.float32
    a, b = bwd_default_and_knob(family, case, dtype, 11, knob, monkeypatch)
    tol = 2e-5 if dtype == torch.float32 else 0.008  # bf16: dq, dk, dv are rounded to bf16 after the fp32 math
    for name, x, y in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), a, b):
        assert torch.isfinite(x).all(), name
        assert torch.isfinite(y).all(), name
        fp32_out = name in ("dg", "dbeta", "dh0")
        assert_close(name, y.double().cpu(), x.double().cpu(), tight if prep3 and fp32_out else tol)


@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_chunk_bwd_state_fwd3_many_chunks(family, dtype, monkeypatch):
    # the tensor-core state_fwd3 (default for bf16/fp16 inputs) against the fp32 SIMT state_fwd2 over 16 chunks
    # (its operand buffers cycle several times), extreme gates included; tf32 products: 1e-3 for the fp32 outputs
    # (as test_chunk_bwd_grad_v1_matches_v2)
    a, b = bwd_default_and_knob(family, "T1000", dtype, 17, "STATE_FWD=2", monkeypatch)
    for name, x, y in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), a, b):
        assert torch.isfinite(x).all(), name
        assert_close(name, y.double().cpu(), x.double().cpu(), 0.008 if name in ("dq", "dk", "dv") else 1e-3)


@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_chunk_bwd_vc_tc_many_chunks(family, dtype, monkeypatch):
    # the tensor-core grad3_vc_tc (its V slices double-buffered; 3xTF32, pinned by bwd_default_and_knob) against the
    # fp32 SIMT grad3_vc (VC=1) over 16 chunks, extreme gates included: 1e-4 for the fp32 outputs
    a, b = bwd_default_and_knob(family, "T1000", dtype, 19, "VC=1", monkeypatch)
    for name, x, y in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), a, b):
        assert torch.isfinite(x).all(), name
        assert_close(name, y.double().cpu(), x.double().cpu(), 0.008 if name in ("dq", "dk", "dv") else 1e-4)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", ["random_T65", "varlen_empty", "gva_4x", "odd_dims", "extreme_gates",
                                  "extreme_gates_mild", "gate_div_0.1", "T1000", "v256_blocks"])
def test_gdn_grad3_reference(case, dtype, monkeypatch):
    # grad3_gdn (selected explicitly, KDA_CUDA_CHUNK_BWD_CH=2) against autograd through the float64 reference, with
    # initial state and grad of the final state, at DESIGN.md section 6 tolerances (as test_chunk_bwd; its session-7
    # comparison partner grad3_ch, KDA_CUDA_CHUNK_BWD_CH=1, was retired in session 9)
    if dtype == "fp16" and case not in ("random_T65", "extreme_gates", "varlen_empty", "gva_4x"):
        pytest.skip("fp16 differs from bf16 only in the q / k conversion; a subset suffices")
    if case == "T1000" and dtype != "fp32":
        pytest.skip("the long case runs once (fp32, the tightest tolerance)")
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_CH", "2")
    _run("gdn", case, DTYPES[dtype])


@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("case", ["random_T65", "varlen_empty", "odd_dims", "T200_gates_1e4"])
def test_chunk_bwd_prep3_fp16_matches_prep2(family, case, monkeypatch):
    # fp16 inputs run the prep v3 instance for __half (the default) against the SIMT prep (PREP=2)
    a, b = bwd_default_and_knob(family, case, torch.float16, 13, "PREP=2", monkeypatch)
    for name, x, y in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), a, b):
        assert torch.isfinite(x).all(), name
        assert torch.isfinite(y).all(), name
        assert_close(name, y.double().cpu(), x.double().cpu(), 0.004 if name in ("dq", "dk", "dv") else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["varlen_empty", "gva_4x", "T200_gates_50", "T200_gates_50_rows"])
def test_chunk_bwd_ch2_reference(case, dtype):
    # grad3_ch2 (the default for KDA) against autograd through the float64 reference with gates at -50 mixed with
    # ordinary ones (and whole rows at -50), varlen with empty sequences, GVA; initial state and grad of the final
    # state (DESIGN.md section 6 tolerances, as test_chunk_bwd)
    spec = dict(CASES[case]) if case in CASES else dict(B=1, T=200, H=1, HV=2)
    cu_list = spec.pop("cu", None)
    cu = None if cu_list is None else torch.tensor(cu_list, dtype=torch.long, device=DEV)
    q, k, v, g, beta = make_inputs("kda", dtype=dtype, seed=29, extreme=True, cu=cu_list, **spec)
    if case.startswith("T200_gates_50"):
        g = _gates_50(g, case.endswith("_rows"))
    N = q.shape[0] if cu is None else cu.numel() - 1
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    gen = torch.Generator().manual_seed(31)
    h0 = (torch.randn(N, HV, K, V, generator=gen) * 0.5).to(DEV)
    dht = torch.randn(N, HV, K, V, generator=gen).to(DEV)
    do = torch.randn(*v.shape, generator=gen).to(DEV).to(dtype)
    scale = K ** -0.5
    out = OPS.kda_chunk_bwd(q, k, v, g, beta, scale, h0, cu, do, dht)
    torch.cuda.synchronize()
    xs = [x.detach().cpu().double().requires_grad_(True) for x in (q, k, v, g, beta)]
    h0r = h0.cpu().double().requires_grad_(True)
    ro, rs = ref_delta_rule(*xs, scale=scale, initial_state=h0r, cu_seqlens=None if cu is None else cu.cpu())
    loss = (ro * do.cpu().double()).sum() + (rs * dht.cpu().double()).sum()
    grads = torch.autograd.grad(loss, xs + [h0r])
    tols = (TOL_DX, TOL_DX, TOL_DX, TOL_DG, TOL_DG, TOL_DX)
    for name, r, o, tol in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, out, tols):
        assert_close(f"kda {case} {name}", r, o.cpu(), tol[dtype])


WY2_KNOB_CASES = ["random_T65", "T1", "T63", "varlen_empty", "gva_4x", "T200_correlated", "gate_div_0.1",
                  "T200_gates_1e4", "T1000", "v256_blocks", "v200_blocks_varlen"] + list(WY2_CASES)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", WY2_KNOB_CASES)
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_grad3_wy2_matches_grad3_wy(family, case, dtype, monkeypatch):
    # the WY backward on tensor cores grad3_wy2 (the default, KDA_CUDA_CHUNK_BWD_WY=2; blocked inverse of I + L,
    # T^T dX and dR X^T with 3xTF32 products) against the SIMT back substitution grad3_wy (=1, kept to compare), same
    # inputs with initial state and grad of the final state, 30 % of the gates at -20 (bwd_default_and_knob's
    # extreme=True; T200_gates_1e4: at -1e4, e^g = 0 exactly). They differ only in fp32 rounding: 1e-4 for the fp32
    # outputs dg, dbeta, dh0, 2e-5 for fp32 dq, dk, dv and the bf16 / fp16 rounding of dq, dk, dv otherwise
    if dtype == "fp16" and case not in ("random_T65", "varlen_empty", "T200_gates_1e4", "v64_T130"):
        pytest.skip("fp16 differs from bf16 only in the v / dv conversion; a subset suffices")
    dt = DTYPES[dtype]
    a, b = bwd_default_and_knob(family, case, dt, 29, "WY=1", monkeypatch)
    for name, x, y in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), a, b):
        assert torch.isfinite(x).all(), name
        assert torch.isfinite(y).all(), name
        fp32_out = name in ("dg", "dbeta", "dh0")
        tol = 1e-4 if fp32_out else (2e-5 if dt == torch.float32 else 0.008)
        assert_close(name, y.double().cpu(), x.double().cpu(), tol)
    # the knob really selects another kernel: dg or dbeta differ in rounding somewhere
    if case != "T1":
        assert any(not torch.equal(x, y) for x, y in zip(a[3:5], b[3:5])), \
            "KDA_CUDA_CHUNK_BWD_WY=1 gave bit-identical dg, dbeta: the knob had no effect?"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", ["random_T65", "varlen_empty", "gva_4x", "extreme_gates", "T200_correlated",
                                  "gate_div_10", "T1000", "v256_blocks", "v200_blocks_varlen"] + list(WY2_CASES))
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_grad3_wy2_reference(family, case, dtype, monkeypatch):
    # grad3_wy2 (selected explicitly, KDA_CUDA_CHUNK_BWD_WY=2) against autograd through the float64 reference, with
    # initial state and grad of the final state, at DESIGN.md section 6 tolerances (as test_chunk_bwd)
    if case == "T1000" and dtype != "fp32":
        pytest.skip("the long case runs once per family (fp32, the tightest tolerance)")
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_WY", "2")
    _run(family, case, DTYPES[dtype])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("case", ["random_T65", "T1", "T63", "T200_correlated", "T1000", "gate_div_0.1",
                                  "gate_div_10", "extreme_gates", "extreme_gates_mild", "extreme_gates_1e4", "gva_4x",
                                  "varlen_empty", "odd_dims", "v256_blocks", "v200_blocks_varlen"])
def test_kda_bwd_prep4_reference(case, dtype, monkeypatch):
    # the KDA backward prep v4 (delta_chunk_bwd_prep4.cuh; KDA_CUDA_CHUNK_BWD_PREP=4, with the 8x8 split; =5, without,
    # was retired in session 11; bf16/fp16 inputs only, fp32 runs the SIMT prep either way) with the other kernels at their defaults, against
    # autograd through the float64 reference at DESIGN.md section 6 tolerances, with initial state and grad of the
    # final state (as test_chunk_bwd). extreme_gates_1e4: extreme_gates' -20 gates at -1e4 (e^g = 0 exactly)
    if dtype == "fp16" and case not in ("random_T65", "extreme_gates", "extreme_gates_1e4", "varlen_empty", "gva_4x"):
        pytest.skip("fp16 differs from bf16 only in the q / k conversion; a subset suffices")
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_PREP", "4")
    if case == "extreme_gates_1e4":
        _run("kda", "extreme_gates", DTYPES[dtype], g_fill=-1e4)
    else:
        _run("kda", case, DTYPES[dtype])
    if case in ("random_T65", "varlen_empty"):
        _run("kda", case, DTYPES[dtype], with_state=False)


@pytest.mark.parametrize("case", ["varlen_empty", "odd_dims", "v200_blocks_varlen", "gva_4x", "T200_gates_1e4",
                                  "T200_gates_50_rows", "T200_bf16", "T1000"])
def test_kda_bwd_prep4_matches_prep2(case, monkeypatch):
    # prep v4 against the fp32 SIMT prep (KDA_CUDA_CHUNK_BWD_PREP=2, set explicitly; its session-8 partner, prep v3,
    # was retired in session 9) in the whole backward, bf16 inputs, extreme gates (bwd_default_and_knob: 30 % at
    # -20; T200_gates_1e4 at -1e4, T200_gates_50_rows at -50 plus whole tokens): both form every gate factor
    # exactly and every product in 3xTF32 / fp32, so the fp32 outputs dg, dbeta, dh0 agree to 1e-4 (as PREP=2 in
    # test_chunk_bwd_grad_v1_matches_v2), dq, dk, dv to their bf16 rounding; and the two really differ in rounding
    # somewhere (the knob selects another kernel)
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_PREP", "2")
    a, b = bwd_default_and_knob("kda", case, torch.bfloat16, 29, "PREP=4", monkeypatch)
    for name, x, y in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), a, b):
        assert torch.isfinite(x).all(), name
        assert torch.isfinite(y).all(), name
        assert_close(name, y.double().cpu(), x.double().cpu(), 1e-4 if name in ("dg", "dbeta", "dh0") else 0.008)
    assert any(not torch.equal(x, y) for x, y in zip(a, b)), \
        "KDA_CUDA_CHUNK_BWD_PREP=4 gave bit-identical gradients: the knob had no effect?"


def test_gdn_bwd_prep4_is_prep3(monkeypatch):
    # GDN has no prep v4: KDA_CUDA_CHUNK_BWD_PREP=4 (and 3, refused for KDA only) run its prep v3, bit for bit
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_PREP", "3")
    a, b = bwd_default_and_knob("gdn", "varlen_empty", torch.bfloat16, 31, "PREP=4", monkeypatch)
    for name, x, y in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), a, b):
        assert torch.equal(x, y), name


def _ulps(x, y, dtype):
    """|x - y| in units of the last place of dtype at max(|x|, |y|) (normal range; 0 where both are equal)."""
    x, y = x.double().cpu(), y.double().cpu()
    eps = torch.finfo(dtype).eps
    tiny = torch.finfo(dtype).tiny
    ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(x.abs().maximum(y.abs()), torch.tensor(tiny))))) * eps
    return ((x - y).abs() / ulp).max().item()


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", ["random_T65", "gva_4x", "odd_dims", "varlen_empty", "v256_blocks"] + list(GVA_CASES))
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_gva_reduce_kernel_matches_torch(family, case, dtype, monkeypatch):
    # the GVA reduce of dq, dk in one CUDA launch (delta_gva_reduce.cuh, KDA_CUDA_CHUNK_BWD_GVA=1, the default since
    # session 9) against the torch path (sum_gva(...).to(dtype), GVA=0), same kernels before it: dq, dk sum the same fp32 terms in the same
    # order for G = HV / H <= 2 and round to nearest even, so bit-identical there; for G > 2 torch's reduction order
    # may differ from the kernel's j = 0, 1, ...: at most 1 ulp of a bf16 / fp16 output (the fp32 sums differ far
    # below it), fp32 outputs to 1e-6 relative RMS (with cancellation a reordered fp32 sum can be many ulps of the
    # result). dv, dg, dbeta, dh0 come from the same kernels: bit-identical.
    if dtype == "fp16" and case not in ("gva_4x", "gva_g3_k30"):
        pytest.skip("fp16 differs from bf16 only in the store conversion; a subset suffices")
    dt = DTYPES[dtype]
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_GVA", "0")  # the first call: the torch path
    a, b = bwd_default_and_knob(family, case, dt, 37, "GVA=1", monkeypatch)
    spec = dict(CASES[case]) if case in CASES else dict(GVA_CASES[case])
    G = spec["HV"] // spec["H"]
    for name, x, y in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and x.is_contiguous() and y.is_contiguous(), name
        assert torch.isfinite(y).all(), name
        if name in ("dq", "dk") and G > 2 and dt == torch.float32:
            assert_close(name, x.double().cpu(), y.double().cpu(), 1e-6)
        elif name in ("dq", "dk") and G > 2:
            assert _ulps(x, y, dt) <= 1, name
        else:
            assert torch.equal(x, y), name


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", ["gva_4x", "odd_dims", "varlen_empty"] + list(GVA_CASES))
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_gva_reduce_kernel_reference(family, case, dtype, monkeypatch):
    # the GVA reduce kernel in the whole backward against autograd through the float64 reference (as test_chunk_bwd)
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_GVA", "1")
    _run(family, case, DTYPES[dtype])


@pytest.mark.parametrize("knob", ["0", "1"])
def test_gva_reduce_kernel_runs_under_its_knob(knob, monkeypatch):
    # the knob really selects the kernel (bit-identical results cannot show it): gva_reduce_kernel is launched with
    # KDA_CUDA_CHUNK_BWD_GVA=1 and only then
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_GVA", knob)
    q, k, v, g, beta = make_inputs("kda", B=1, T=64, H=1, HV=2, dtype=torch.bfloat16, seed=41)
    do = torch.randn_like(v)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        OPS.kda_chunk_bwd(q, k, v, g, beta, 0.1, None, None, do, None)
        torch.cuda.synchronize()
    ran = any("gva_reduce_kernel" in e.name for e in prof.events())
    assert ran == (knob == "1")
