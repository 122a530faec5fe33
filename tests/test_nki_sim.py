"""The NKI kernels (kernels_src/nki) run on the NumPy NKI simulator (tests/nki_sim) against the float64 reference.

Also checks the simulator itself: instruction semantics and that it rejects kernels breaking NeuronCore limits.
With the real `nki` package installed (on Trainium), set KDA_NKI_REAL=1 to load the kernels against it instead;
the simulator-only tests are then skipped (see docs/neuron.md).
"""
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ref_delta import assert_close, ref_delta_rule, rel_err  # noqa: E402
import nki_sim  # noqa: E402
from nki_sim.loader import load_kernels  # noqa: E402

REAL = os.environ.get("KDA_NKI_REAL") == "1"
DEVICE = os.environ.get("KDA_NKI_DEVICE", "cpu")   # on Trainium with the real nki: the Neuron device
load_kernels(force_sim=not REAL)
import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402
from kda_nki import torch_wrappers as W  # noqa: E402

sim_only = pytest.mark.skipif(REAL, reason="checks the simulator itself")

TOL_FP32 = 1e-5
TOL_BF16 = {"o": 0.005, "state": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dh0": 0.008, "dg": 0.02,
            "dbeta": 0.02}


# ---------------------------------------------------------------- inputs
def make_inputs(B=1, T=150, H=1, HV=2, K=128, V=128, gate_div=1.0, gdn=False, dtype=torch.float32, h0=True,
                seed=0, N=None, extreme=False):
    """Correlated keys (torch.rand then normalise), gates logsigmoid(randn)/gate_div or down to -20."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.rand(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    gshape = (B, T, HV) if gdn else (B, T, HV, K)
    if extreme:
        g = -20.0 * torch.rand(gshape, generator=gen)
        g.view(-1)[::7] = -20.0
        g.view(-1)[3::11] = 0.0
    else:
        g = F.logsigmoid(torch.randn(gshape, generator=gen)) / gate_div
    beta = torch.rand(B, T, HV, generator=gen)
    s0 = torch.randn(N if N is not None else B, HV, K, V, generator=gen) if h0 else None
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return q, k, v, g, beta, s0


def _on_device(fn, *args):
    """Run a wrapper with its tensor arguments on DEVICE; results come back to the CPU."""
    if DEVICE == "cpu":
        return fn(*args)
    args = [a.to(DEVICE) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    return tuple(r.cpu() for r in fn(*args))


def check_fwd(fn, q, k, v, g, beta, s0, cu=None, tol=None):
    K = q.shape[-1]
    ro, rs = ref_delta_rule(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu)
    o, s = _on_device(fn, q, k, v, g, beta, K ** -0.5, s0, cu)
    assert o.dtype == q.dtype and s.dtype == torch.float32
    bf = q.dtype != torch.float32
    assert_close("o", ro, o, TOL_BF16["o"] if bf else (tol or TOL_FP32))
    assert_close("state", rs, s, TOL_BF16["state"] if bf else (tol or TOL_FP32))
    return rel_err(ro, o), rel_err(rs, s)


def check_bwd(q, k, v, g, beta, s0, cu=None):
    K = q.shape[-1]
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, g, beta)]
    h0 = s0.detach().double().requires_grad_() if s0 is not None else None
    ro, rs = ref_delta_rule(*leaves, initial_state=h0, cu_seqlens=cu)
    gen = torch.Generator().manual_seed(123)
    do = torch.randn(ro.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(rs.shape, generator=gen, dtype=torch.float64)
    ((ro * do).sum() + (rs * dht).sum()).backward()
    if h0 is None:   # reference dh0: gradient w.r.t. a zero initial state
        z = torch.zeros_like(rs, requires_grad=True)
        ro2, rs2 = ref_delta_rule(*[x.detach() for x in leaves], initial_state=z, cu_seqlens=cu)
        ((ro2 * do).sum() + (rs2 * dht).sum()).backward()
        ref_dh0 = z.grad
    else:
        ref_dh0 = h0.grad
    out = _on_device(W.kda_chunk_bwd, q, k, v, g, beta, K ** -0.5, s0, cu, do.to(q.dtype), dht.float())
    dq, dk, dv, dg, db, dh0 = out
    assert dq.dtype == q.dtype and dk.dtype == k.dtype and dv.dtype == v.dtype
    assert dg.dtype == db.dtype == dh0.dtype == torch.float32
    bf = q.dtype != torch.float32
    errs = {}
    for name, ref, got in (("dq", leaves[0].grad, dq), ("dk", leaves[1].grad, dk), ("dv", leaves[2].grad, dv),
                           ("dg", leaves[3].grad, dg), ("dbeta", leaves[4].grad, db), ("dh0", ref_dh0, dh0)):
        assert_close(name, ref, got, TOL_BF16[name] if bf else TOL_FP32)
        errs[name] = rel_err(ref, got)
    return errs


# ---------------------------------------------------------------- kernels vs the float64 reference
@pytest.mark.parametrize("gate_div", [0.1, 1.0, 10.0], ids=["gate/0.1", "gate/1", "gate/10"])
def test_kda_chunk_fwd_fp32(gate_div):
    check_fwd(W.kda_chunk_fwd, *make_inputs(T=150, gate_div=gate_div, seed=1))


def test_kda_chunk_fwd_extreme_gates():
    """Per-channel log-decays down to -20 per token: every exponent stays <= 0, nothing overflows."""
    check_fwd(W.kda_chunk_fwd, *make_inputs(T=140, extreme=True, seed=2))


def test_kda_chunk_fwd_bf16_gva():
    check_fwd(W.kda_chunk_fwd, *make_inputs(T=130, H=1, HV=2, dtype=torch.bfloat16, seed=3))


def test_gdn_chunk_fwd_fp32():
    check_fwd(W.kda_chunk_fwd, *make_inputs(T=150, gdn=True, seed=4))


def test_kda_chunk_fwd_varlen_with_empty_sequence():
    cu = torch.tensor([0, 37, 37, 170])
    check_fwd(W.kda_chunk_fwd, *make_inputs(B=1, T=170, HV=1, seed=5, N=3), cu=cu)


def test_kda_chunk_fwd_small_k_no_initial_state():
    check_fwd(W.kda_chunk_fwd, *make_inputs(T=70, K=64, V=96, HV=1, h0=False, seed=6))


def test_kda_recurrent_decode_batch():
    """Decode: T = 1, a batch of requests x value heads as the SPMD grid, GVA (H=1, HV=2)."""
    check_fwd(W.kda_recurrent_fwd, *make_inputs(B=4, T=1, H=1, HV=2, seed=7))
    check_fwd(W.kda_recurrent_fwd, *make_inputs(B=3, T=1, H=1, HV=2, dtype=torch.bfloat16, seed=8))


def test_recurrent_multi_token_gdn_and_v_tiling():
    """V = 160 runs as two launches (128 + 32 value columns); GDN gate; extreme gates."""
    check_fwd(W.kda_recurrent_fwd, *make_inputs(B=2, T=6, HV=2, K=32, V=160, gdn=True, extreme=True, seed=9))


def test_kda_chunk_bwd_fp32():
    errs = check_bwd(*make_inputs(T=70, H=1, HV=2, seed=10))
    print(errs)


def test_kda_chunk_bwd_extreme_gates_no_h0():
    check_bwd(*make_inputs(T=40, HV=1, extreme=True, h0=False, seed=11))


def test_kda_chunk_bwd_bf16():
    check_bwd(*make_inputs(T=40, HV=1, dtype=torch.bfloat16, gate_div=0.1, seed=12))


def test_gdn_chunk_bwd_varlen():
    cu = torch.tensor([0, 25, 25, 60])
    check_bwd(*make_inputs(B=1, T=60, HV=1, gdn=True, gate_div=10.0, seed=13, N=3), cu=cu)


def test_recurrent_serve_state_pool():
    q, k, v, g, beta, _ = make_inputs(B=3, T=1, H=1, HV=2, K=32, V=32, seed=14)
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(5, 2, 32, 32, generator=gen)
    idx = torch.tensor([3, -1, 0])
    expect = pool.clone()
    ro, rs = ref_delta_rule(q, k, v, g, beta, initial_state=pool[idx.clamp(min=0)])
    o = W.kda_recurrent_serve(q, k, v, g, beta, 32 ** -0.5, pool, idx)
    assert_close("o live", ro[[0, 2]], o[[0, 2]], TOL_FP32)
    assert torch.all(o[1] == 0)
    expect[3], expect[0] = rs[0].float(), rs[2].float()
    assert_close("pool", expect, pool, TOL_FP32)


def test_recurrent_serve_speculative():
    q, k, v, g, beta, _ = make_inputs(B=2, T=3, H=1, HV=1, K=32, V=32, seed=15)
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(8, 1, 32, 32, generator=gen)
    start = pool.clone()
    idx = torch.tensor([[0, 1, 2], [3, 4, -1]])
    acc = torch.tensor([2, 1])           # sequence 0 starts from row idx[0, 1], sequence 1 from idx[1, 0]
    o = W.kda_recurrent_serve(q, k, v, g, beta, 32 ** -0.5, pool, idx, acc)
    h0 = torch.stack([start[1], start[3]])
    ro, _ = ref_delta_rule(q, k, v, g, beta, initial_state=h0)
    assert_close("o", ro, o, TOL_FP32)
    for n, rows in enumerate(([0, 1, 2], [3, 4])):
        for t, row in enumerate(rows):
            _, st = ref_delta_rule(q[n:n + 1, :t + 1], k[n:n + 1, :t + 1], v[n:n + 1, :t + 1], g[n:n + 1, :t + 1],
                                   beta[n:n + 1, :t + 1], initial_state=h0[n:n + 1])
            assert_close(f"pool[{row}]", st[0], pool[row], TOL_FP32)
    assert torch.equal(pool[5:], start[5:])


def test_k_too_large_is_refused_naming_the_argument():
    q, k, v, g, beta, s0 = make_inputs(T=2, HV=1, K=256, V=8, seed=16)
    with pytest.raises(ValueError, match=r"K = 256 \(last dimension of q and k\)"):
        W.kda_chunk_fwd(q, k, v, g, beta, 0.1, s0, None)
    with pytest.raises(ValueError, match="K = 256"):
        W.kda_recurrent_fwd(q, k, v, g, beta, 0.1, s0, None)


def test_register_neuron_impls():
    schemas = {
        "fwd": "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
               "Tensor? cu_seqlens) -> (Tensor o, Tensor final_state)",
        "bwd": "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
               "Tensor? cu_seqlens, Tensor grad_o, Tensor? grad_final_state) -> (Tensor dq, Tensor dk, Tensor dv, "
               "Tensor dg, Tensor dbeta, Tensor dh0)",
        "serve": "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor(a!) state_pool, "
                 "Tensor ssm_state_indices, Tensor? num_accepted_tokens, Tensor? cu_seqlens, bool state_v_first) "
                 "-> Tensor",
    }
    ns = "_kda_nki_registration_test"
    lib = torch.library.Library(ns, "DEF")
    for fam in ("kda", "gdn"):
        for op in ("chunk_fwd", "chunk_bwd", "recurrent_fwd", "recurrent_bwd", "recurrent_serve"):
            lib.define(f"{fam}_{op}" + schemas[op.split("_")[1]])
    names = W.register_neuron_impls(lib, ns)
    assert len(names) == 10
    for name in names:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{ns}::{name}", "PrivateUse1"), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"{ns}::{name}", "CPU"), name
    # The registered callables are the wrappers tested above: run one through the impl to check the plumbing.
    impl = W._make_impl("kda_recurrent_fwd", W.kda_recurrent_fwd)
    q, k, v, g, beta, s0 = make_inputs(B=1, T=2, HV=1, K=16, V=16, seed=17)
    o, s = impl(q, k, v, g, beta, 0.25, s0, None)
    ro, rs = ref_delta_rule(q, k, v, g, beta, scale=0.25, initial_state=s0)
    assert_close("o", ro, o, TOL_FP32)


# ---------------------------------------------------------------- the simulator itself
def _run(fn, *arrays, grid=None):
    k = nki.jit(fn)
    return (k[grid] if grid else k)(*arrays)


@sim_only
def test_sim_matmul_is_stationary_transposed_times_moving_with_accumulation():
    a = np.random.default_rng(0).standard_normal((128, 96)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((128, 512)).astype(np.float32)

    def kern(a, b):
        out = nl.ndarray((96, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        sa, sbb = nl.load(a), nl.load(b)
        p = nl.ndarray((96, 512), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p, stationary=sa, moving=sbb, accumulate=False)
        nisa.nc_matmul(dst=p, stationary=sa, moving=sbb, accumulate=True)
        r = nl.ndarray((96, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=r, src=p)
        nl.store(out, r)
        return out
    out = _run(kern, a, b)
    np.testing.assert_allclose(out, 2 * a.T.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)


@sim_only
def test_sim_spmd_program_ids_and_shared_output():
    def kern(x):
        out = nl.ndarray((2, 3, 1, 2), dtype=nl.float32, buffer=nl.shared_hbm)
        i, j = nl.program_id(0), nl.program_id(1)
        t = nl.ndarray((1, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t[:, 0:1], value=float(i))
        nisa.memset(dst=t[:, 1:2], value=float(j + 10 * nl.num_programs(1)))
        nisa.dma_copy(dst=out[i, j], src=t)
        return out
    out = _run(kern, np.zeros((1,), np.float32), grid=(2, 3))
    assert out[1, 2, 0, 0] == 1 and out[1, 2, 0, 1] == 32 and out[0, 0, 0, 1] == 30


@sim_only
def test_sim_iota_affine_select_bf16_rounding():
    def kern(x):
        out = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        out2 = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        out3 = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        it = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=it, pattern=[[1, 8]], offset=5, channel_multiplier=100)
        nl.store(out, it)
        sel = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.affine_select(dst=sel, pattern=[[-1, 8]], offset=0, channel_multiplier=1, on_true_tile=it,
                           on_false_value=-7.0, cmp_op=nl.greater_equal)    # keep column <= partition
        nl.store(out2, sel)
        xb = nl.load(x, dtype=nl.bfloat16)
        xf = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=xf, src=xb)
        nl.store(out3, xf)
        return out, out2, out3
    x = np.full((4, 8), 1.0 + 2.0 ** -10, np.float32)
    x[0, 0] = 1.0 + 3 * 2.0 ** -8
    o1, o2, o3 = _run(kern, x)
    ref = 5 + 100 * np.arange(4)[:, None] + np.arange(8)[None, :]
    np.testing.assert_array_equal(o1, ref)
    np.testing.assert_array_equal(o2, np.where(np.arange(8)[None, :] <= np.arange(4)[:, None], ref, -7.0))
    assert o3[1, 1] == 1.0 and o3[0, 0] == 1.0 + 4 * 2.0 ** -8   # bf16: 8 significand bits, ties to even


def _expect_sim_error(fn, match, *arrays, grid=None):
    with pytest.raises(nki_sim.SimError, match=match):
        _run(fn, *arrays, grid=grid)


@sim_only
def test_sim_rejects_129_partitions():
    def bad(x):
        nl.ndarray((129, 4), dtype=nl.float32, buffer=nl.sbuf)
    _expect_sim_error(bad, "partition dimension 129 exceeds 128", np.zeros(1, np.float32))


@sim_only
def test_sim_rejects_513_wide_moving_matmul():
    def bad(a, b):
        sa, sbb = nl.load(a), nl.load(b)
        p = nl.ndarray((64, 513), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p, stationary=sa, moving=sbb, accumulate=False)
    # the 513-wide PSUM tile is refused first (one bank = 512 fp32) ...
    _expect_sim_error(bad, "one PSUM tile must fit one bank", np.zeros((128, 64), np.float32),
                      np.zeros((128, 513), np.float32))

    def bad2(a, b):
        sa, sbb = nl.load(a), nl.load(b)
        p = nl.ndarray((64, 2, 257), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p[:, 0, :], stationary=sa, moving=sbb, accumulate=False)
    # ... and so is the matmul itself when its destination would fit
    _expect_sim_error(bad2, "bank|moving free size", np.zeros((128, 64), np.float32),
                      np.zeros((128, 513), np.float32))

    def bad3(a, b):
        sa, sbb = nl.load(a), nl.load(b)
        p = nl.ndarray((64, 512), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p[:, 0:257], stationary=sa, moving=sbb[:, 0:513], accumulate=False)
    _expect_sim_error(bad3, "moving free size 513 exceeds 512", np.zeros((128, 64), np.float32),
                      np.zeros((128, 600), np.float32))


@sim_only
@pytest.mark.parametrize("case", ["stationary129", "contraction", "psum_operand", "sbuf_dst", "mixed_dtype",
                                  "acc_uninit", "psum_banks", "sbuf_capacity", "cross_partition", "misaligned",
                                  "gpsimd_psum", "dma_psum", "reduce_partition", "both_psum", "dve_transpose"])
def test_sim_rejects(case):
    f32, bf16 = nl.float32, nl.bfloat16

    def kern(x):
        def t(shape, buf=nl.sbuf, dt=f32, val=0.0):
            a = nl.ndarray(shape, dtype=dt, buffer=buf)
            if buf == nl.sbuf:
                nisa.memset(dst=a, value=val)
            return a
        if case == "stationary129":
            nisa.nc_matmul(dst=t((129 - 1, 4), nl.psum)[0:128], stationary=t((128, 129)), moving=t((128, 4)))
        elif case == "contraction":
            nisa.nc_matmul(dst=t((4, 4), nl.psum), stationary=t((128, 4)), moving=t((64, 4)))
        elif case == "psum_operand":
            p = t((128, 4), nl.psum)
            nisa.nc_matmul(dst=t((4, 4), nl.psum), stationary=p, moving=t((128, 4)))
        elif case == "sbuf_dst":
            nisa.nc_matmul(dst=t((4, 4)), stationary=t((128, 4)), moving=t((128, 4)))
        elif case == "mixed_dtype":
            nisa.nc_matmul(dst=t((4, 4), nl.psum), stationary=t((128, 4)), moving=t((128, 4), dt=bf16))
        elif case == "acc_uninit":
            nisa.nc_matmul(dst=t((4, 4), nl.psum), stationary=t((128, 4)), moving=t((128, 4)), accumulate=True)
        elif case == "psum_banks":
            _keep = [t((128, 8), nl.psum) for _ in range(9)]
        elif case == "sbuf_capacity":
            _keep = [t((128, 16 * 1024)) for _ in range(4)]   # 4 x 64 KiB > 192 KiB per partition
        elif case == "cross_partition":
            a = t((64, 4))
            nisa.tensor_copy(dst=a[0:32], src=a[32:64])
        elif case == "misaligned":
            a = t((64, 4))
            nisa.tensor_scalar(dst=a[16:48], data=a[16:48], op0=nl.multiply, operand0=2.0)
        elif case == "gpsimd_psum":
            nisa.memset(dst=t((4, 4), nl.psum), value=0.0, engine=nisa.gpsimd_engine)
        elif case == "dma_psum":
            nisa.dma_copy(dst=t((4, 4)), src=t((4, 4), nl.psum))
        elif case == "reduce_partition":
            nisa.tensor_reduce(dst=t((1, 4)), op=nl.add, data=t((4, 4)), axis=0)
        elif case == "both_psum":
            nisa.tensor_tensor(dst=t((4, 4)), data1=t((4, 4), nl.psum), data2=t((4, 4), nl.psum), op=nl.add)
        elif case == "dve_transpose":
            nisa.nc_transpose(dst=t((64, 64)), data=t((64, 64)), engine=nisa.vector_engine)
    with pytest.raises(nki_sim.SimError):
        _run(kern, np.zeros(1, np.float32))


@sim_only
def test_sim_poisons_unwritten_memory():
    """A kernel that reads on-chip memory nobody wrote sees NaN (and the kernel tests check finiteness)."""
    def kern(x):
        out = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        a = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        nl.store(out, a)
        return out
    assert np.isnan(_run(kern, np.zeros(1, np.float32))).all()


@sim_only
def test_kernels_stay_within_limits_and_use_the_tensor_engine():
    """The last launches' peaks are inside the enforced limits (they would have raised otherwise)."""
    q, k, v, g, beta, s0 = make_inputs(B=1, T=20, HV=1, seed=18)
    W.kda_chunk_fwd(q, k, v, g, beta, 0.1, s0, None)
    kern = W.kda_chunk_fwd_kernel
    assert kern.last_counts["nc_matmul"] > 30 and kern.last_counts["affine_select"] == 8
    assert 0 < kern.last_sbuf_peak <= nki_sim.limits.SBUF_BYTES_PER_PARTITION
    assert 0 < kern.last_psum_peak <= nki_sim.limits.PSUM_BANKS
    W.kda_chunk_bwd(q, k, v, g, beta, 0.1, s0, None, torch.randn_like(v), None)
    kb = W.kda_chunk_bwd_kernel
    assert kb.last_sbuf_peak <= nki_sim.limits.SBUF_BYTES_PER_PARTITION and kb.last_psum_peak <= 8
    print("chunk fwd SBUF peak", kern.last_sbuf_peak, "B/partition; bwd", kb.last_sbuf_peak)
