"""The K-first 2-byte-pool decode kernel of session 12 (KDA_CUDA_DEC_KF16=1..4, delta_decode_kf16_kernel in
kernels_src/cuda/delta_decode_kf16.cuh; off by default) against the default decode kernel (KDA_CUDA_DEC_KF16=0: the
LEAN cfg-1 kernel) on the same inputs and against the float64 reference (DESIGN.md section 6: o and pool rows <=
0.005 relative RMS for 2-byte pools / bf16 inputs).

The state update is the same arithmetic as the default's except for the order of the fp32 sum p = S^T (d * k) (16
lanes of one warp instead of 8 lanes and 2 warps; KF16=3/4 reduce-scatter it), so the pool rows agree to one bf16/fp16 rounding here and there;
o is reduced in another order (fp32 rounding only). Cases: both families, bf16 and fp16 pools, bf16 and fp32 inputs,
B in {1, 3, 64, 256} with skipped slots (negative ssm_state_indices), GVA (HV = 6 over H = 3: HV not a power of two,
the 32-bit block decode), extreme gates; [N, C] indices with num_accepted_tokens; the public API with
inplace_final_state on (the kernel) and off (the core op: the knob must not matter); pools the knob does not apply
to (V-first, fp32: bit-identical to the knob off); bad knob values refused. The lane mapping itself is emulated on
the CPU in tests/test_cuda_kf16_emu.py. Needs a CUDA GPU (skipped with the reason otherwise).
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the KF16 decode tests need an NVIDIA GPU",
                allow_module_level=True)

from ref_delta import assert_close  # noqa: E402
from test_cuda_backend import DEV, OPS, _kfirst, _pool, kk, make_inputs, ref  # noqa: E402  (loads the build)

KNOB = "KDA_CUDA_DEC_KF16"
OTHER_KNOBS = ("KDA_CUDA_DEC_HINT", "KDA_CUDA_DEC_FUSE", "KDA_CUDA_DEC_CFG", "KDA_CUDA_DEC_STAGE")


def _env(monkeypatch, kf16):
    monkeypatch.setenv("KDA_CUDA_DECODE", "1")
    for name in OTHER_KNOBS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KDA_CUDA_DEC_LEAN", "1")  # the default kernels (LEAN=1 is the default since session 10)
    monkeypatch.setenv(KNOB, kf16)


def _serve_both(monkeypatch, family, q, k, v, g, beta, pool, idx, nacc, v_first, kf16):
    scale = q.shape[-1] ** -0.5
    serve = getattr(OPS, f"{family}_recurrent_serve")
    outs = {}
    for knob in ("0", kf16):
        _env(monkeypatch, knob)
        p = pool.clone()
        o = serve(q, k, v, g, beta, scale, p, idx, nacc, None, v_first)
        torch.cuda.synchronize()
        outs[knob] = (o.float().cpu(), _kfirst(p, v_first))
    return scale, outs["0"], outs[kf16]


@pytest.mark.parametrize("kf16", ["1", "2", "3", "4"])
@pytest.mark.parametrize("B", [1, 3, 64, 256])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=["in_bf16", "in_fp32"])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_decode_kf16_vs_default(family, pool_dtype, in_dtype, B, kf16, monkeypatch):
    H, HV, K, V = 3, 6, 128, 128
    q, k, v, g, beta = make_inputs(family, B=B, T=1, H=H, HV=HV, K=K, V=V, dtype=in_dtype, seed=500 + B,
                                   extreme=True, gate_div=0.3)
    P = B + 9
    _, pool = _pool(P, HV, K, V, pool_dtype, False, seed=501 + B)
    gen = torch.Generator().manual_seed(502 + B)
    rows = torch.randperm(P, generator=gen)[:B]
    rows[1::5] = -1
    before = _kfirst(pool, False).clone()
    scale, (o0, s0), (o1, s1) = _serve_both(monkeypatch, family, q, k, v, g, beta, pool, rows.to(DEV), None, False,
                                            kf16)
    active = rows >= 0
    assert torch.all(o1[~active] == 0)
    assert_close("o kf16 vs default", o0, o1, 1e-5 if in_dtype == torch.float32 else 4e-3)
    assert_close("pool kf16 vs default", s0, s1, 1e-3)
    untouched = [r for r in range(P) if r not in set(rows[active].tolist())]
    assert torch.equal(s1[untouched], before[untouched])
    ro, rs = ref(q, k, v, g, beta, scale, before[rows.clamp(min=0)])
    assert_close("o kf16 vs reference", ro * active.view(B, 1, 1, 1), o1, 0.005)
    if active.any():
        assert_close("pool kf16 vs reference", rs[active], s1[rows[active]], 0.005)


@pytest.mark.parametrize("kf16", ["1", "2", "3", "4"])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_decode_kf16_nt_indices(family, pool_dtype, kf16, monkeypatch):
    # [N, C] indices with num_accepted_tokens and T = 1: read row idx[n, nacc - 1], write row idx[n, 0];
    # a negative read row skips the sequence (o = 0), a negative write row skips the write
    B, HV, H, K, V, P = 6, 4, 2, 128, 128, 20
    q, k, v, g, beta = make_inputs(family, B=B, T=1, H=H, HV=HV, K=K, V=V, dtype=torch.bfloat16, seed=531)
    _, pool = _pool(P, HV, K, V, pool_dtype, False, seed=532)
    idx = torch.tensor([[0, 1, 2], [3, 4, 5], [-1, 6, 7], [8, -1, 9], [10, 11, 12], [13, 14, -1]])
    nacc = torch.tensor([1, 3, 2, 3, 2, 3])
    before = _kfirst(pool, False).clone()
    scale, (o0, s0), (o1, s1) = _serve_both(monkeypatch, family, q, k, v, g, beta, pool, idx.to(DEV), nacc.to(DEV),
                                            False, kf16)
    assert_close("o kf16 vs default", o0, o1, 4e-3)
    assert_close("pool kf16 vs default", s0, s1, 1e-3)
    written = set()
    for n in range(B):
        src, dst = int(idx[n, nacc[n] - 1]), int(idx[n, 0])
        if src < 0:
            assert torch.all(o1[n] == 0)
            continue
        ro, rs = ref(q[n:n + 1], k[n:n + 1], v[n:n + 1], g[n:n + 1], beta[n:n + 1], scale, before[src:src + 1])
        assert_close(f"o[{n}]", ro[0], o1[n], 0.005)
        if dst >= 0:
            assert_close(f"pool[{dst}]", rs[0], s1[dst], 0.005)
            written.add(dst)
    untouched = [r for r in range(P) if r not in written]
    assert written == {0, 3, 8, 10} and torch.equal(s1[untouched], before[untouched])


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "not_inplace"])
@pytest.mark.parametrize("kf16", ["0", "1", "2", "3", "4"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_decode_kf16_api(family, kf16, inplace, monkeypatch):
    # the public API with a bf16 pool: inplace_final_state=True serves in place (the kernel under the knob),
    # False returns the final states and leaves the pool alone (the core op; the knob must not change anything)
    _env(monkeypatch, kf16)
    B, H, HV, K, V, P = 5, 2, 4, 128, 128, 9
    q, k, v, g, beta = make_inputs(family, B=B, T=1, H=H, HV=HV, K=K, V=V, dtype=torch.bfloat16, seed=541)
    _, pool = _pool(P, HV, K, V, torch.bfloat16, False, seed=542)
    idx = torch.tensor([4, -1, 0, 7, 2])
    before = pool.float().cpu().clone()
    rec = kk.fused_recurrent_kda if family == "kda" else kk.fused_recurrent_gated_delta_rule
    with torch.no_grad():
        o, fin = rec(q, k, v, g, beta=beta, initial_state=pool, output_final_state=True,
                     ssm_state_indices=idx.to(DEV), inplace_final_state=inplace)
    torch.cuda.synchronize()
    scale = K ** -0.5
    active = idx >= 0
    ro, rs = ref(q, k, v, g, beta, scale, before[idx.clamp(min=0)])
    assert_close("o", ro * active.view(B, 1, 1, 1), o.float().cpu(), 0.005)
    if inplace:
        after = pool.float().cpu()
        assert_close("pool rows", rs[active], after[idx[active]], 0.005)
        untouched = [r for r in range(P) if r not in set(idx[active].tolist())]
        assert torch.equal(after[untouched], before[untouched])
    else:
        assert torch.equal(pool.float().cpu(), before)
        assert_close("final states", rs[active], fin.float().cpu()[active], 0.005)


@pytest.mark.parametrize("v_first,pool_dtype", [(True, torch.bfloat16), (True, torch.float16),
                                                (False, torch.float32), (True, torch.float32)],
                         ids=["vfirst_bf16", "vfirst_fp16", "kfirst_fp32", "vfirst_fp32"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_decode_kf16_other_pools_unchanged(family, v_first, pool_dtype, monkeypatch):
    # the knob applies to K-first 2-byte pools only: other pools run the same kernel with it on (bit-identical)
    B, H, HV, K, V = 64, 2, 4, 128, 128
    q, k, v, g, beta = make_inputs(family, B=B, T=1, H=H, HV=HV, K=K, V=V, dtype=torch.bfloat16, seed=551)
    _, pool = _pool(B + 3, HV, K, V, pool_dtype, v_first, seed=552)
    rows = torch.randperm(B + 3, generator=torch.Generator().manual_seed(553))[:B]
    rows[2::9] = -1
    _, (o0, s0), (o1, s1) = _serve_both(monkeypatch, family, q, k, v, g, beta, pool, rows.to(DEV), None, v_first,
                                        "4")
    assert torch.equal(o0, o1) and torch.equal(s0, s1)


@pytest.mark.parametrize("value", ["5", "-1", "12", "x", "1 "])
def test_decode_kf16_bad_values_refused(value, monkeypatch):
    _env(monkeypatch, value)
    q, k, v, g, beta = make_inputs("kda", B=2, T=1, H=1, HV=2, K=128, V=128, dtype=torch.bfloat16, seed=561)
    _, pool = _pool(3, 2, 128, 128, torch.bfloat16, False, seed=562)
    with pytest.raises(RuntimeError, match="KDA_CUDA_DEC_KF16"):
        OPS.kda_recurrent_serve(q, k, v, g, beta, 128 ** -0.5, pool, torch.tensor([0, 2], device=DEV), None, None,
                                False)
