"""Metal backend, executed by the CPU emulator (tests/metal_emu): the .metal kernels compiled unchanged as C++
against a metal_stdlib shim, launched through the same host plans (kernels_src/metal/delta_plan.h) as the
Objective-C++ host, and compared with the float64 reference (tests/ref_delta.py) at DESIGN.md section 6 tolerances.

Builds: `asan` (AddressSanitizer + UBSan: out-of-bounds buffer accesses) runs the numerics; `tsan`
(ThreadSanitizer, told about happens-before only at barriers) runs race checks. The harness's own detectors are
tested on planted bugs (tests/metal_emu/selftest.metal) and by dropping each barrier of the real kernels.
Nothing here has run on Apple hardware.
"""
import functools
import os
import re
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "metal_emu"))
import emu  # noqa: E402
from ref_delta import assert_close, ref_delta_rule, rel_err  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which(emu.CXX) is None, reason="needs a C++ compiler (g++)")

SELFTEST = HERE / "metal_emu" / "selftest.metal"
METAL = Path(emu.METAL_DIR)


@pytest.fixture(scope="session")
def exes():
    """All emulator builds, compiled concurrently (cached under .build-tmp/metal_emu)."""
    specs = {
        "asan": ("asan", None, ()),
        "tsan": ("tsan", None, ()),
        "self_asan": ("asan", [SELFTEST], ()),
        "self_tsan": ("tsan", [SELFTEST], ()),
        "self_barrier": ("tsan", [SELFTEST], ("KDA_PLANT_MISSING_BARRIER",)),
        "self_oob": ("asan", [SELFTEST], ("KDA_PLANT_OOB",)),
        "self_divergent": ("asan", [SELFTEST], ("KDA_PLANT_DIVERGENT",)),
    }
    with ThreadPoolExecutor(max_workers=2) as ex:
        futs = {k: ex.submit(emu.build, *v) for k, v in specs.items()}
        return {k: f.result() for k, f in futs.items()}


# ---------------------------------------------------------------------------------------------------------------
# inputs and reference

TOL = {
    torch.float32: dict(o=1e-5, final_state=1e-5, dq=1e-5, dk=1e-5, dv=1e-5, dh0=1e-5, dg=1e-5, dbeta=1e-5),
    torch.bfloat16: dict(o=0.005, final_state=0.005, dq=0.008, dk=0.008, dv=0.008, dh0=0.008, dg=0.02, dbeta=0.02),
    torch.float16: dict(o=0.005, final_state=0.005, dq=0.008, dk=0.008, dv=0.008, dh0=0.008, dg=0.02, dbeta=0.02),
}

CONFIGS = {
    # GVA (HV = 2H), initial state, correlated keys, gates logsigmoid(randn)
    "f32-gva-h0": dict(B=2, T=37, H=2, HV=4, K=32, V=32, dtype=torch.float32),
    # varlen with empty sequences, strong decay logsigmoid(randn)/0.1
    "bf16-varlen-empty-strong": dict(B=1, T=64, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16, gate_div=0.1,
                                     cu=[0, 0, 13, 13, 45, 64]),
    # weak decay logsigmoid(randn)/10, no initial state, no grad of the final state
    "f16-weak-noh0": dict(B=2, T=20, H=2, HV=2, K=64, V=32, dtype=torch.float16, gate_div=10.0, h0=False),
    # extreme gates: a fifth of the tokens decay with g uniform in [-20, 0]
    "f32-extreme": dict(B=1, T=40, H=1, HV=2, K=64, V=64, dtype=torch.float32, extreme=True),
    # the full model head size
    "f32-k128": dict(B=1, T=33, H=1, HV=2, K=128, V=128, dtype=torch.float32),
    # K not a multiple of 32, V not a multiple of the column block (partial blocks), varlen GVA
    "bf16-k48-v40-varlen": dict(B=1, T=50, H=1, HV=3, K=48, V=40, dtype=torch.bfloat16, cu=[0, 17, 17, 50]),
    # V not a multiple of 8: the chunk op falls back to the recurrent kernels; idle rows in a threadgroup
    "f32-v38": dict(B=1, T=21, H=2, HV=2, K=32, V=38, dtype=torch.float32),
    # 5 chunks, the last partial: the chunked backward's checkpoint segments (2 chunks each) and replay;
    # strongest decay logsigmoid(randn)/0.1 plus extreme gates; one active simdgroup of four (V = 8)
    "f32-segments-strong": dict(B=1, T=70, H=1, HV=2, K=16, V=8, dtype=torch.float32, gate_div=0.1,
                                extreme=True),
}


def make_inputs(fam, B, T, H, HV, K, V, dtype, gate_div=1.0, extreme=False, cu=None, h0=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.rand(B, T, H, K, generator=gen)
    k = k / k.norm(dim=-1, keepdim=True)  # correlated keys: positive entries, unit norm
    v = torch.randn(B, T, HV, V, generator=gen)
    gshape = (B, T, HV, K) if fam == "kda" else (B, T, HV)
    g = F.logsigmoid(torch.randn(gshape, generator=gen)) / gate_div
    if extreme:
        hit = torch.rand(gshape, generator=gen) < 0.2
        g = torch.where(hit, -20.0 * torch.rand(gshape, generator=gen), g)
    beta = torch.rand(B, T, HV, generator=gen)
    N = B if cu is None else len(cu) - 1
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    h = torch.randn(N, HV, K, V, generator=gen) if h0 else None
    do = torch.randn(B, T, HV, V, generator=gen).to(dtype)
    dht = torch.randn(N, HV, K, V, generator=gen) if h0 else None
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta, scale=K ** -0.5,
                initial_state=h, cu_seqlens=cu_t), do, dht


@functools.lru_cache(maxsize=None)
def reference(cfg_name, fam):
    cfg = dict(CONFIGS[cfg_name])
    cfg.pop("dtype")
    ins, do, dht = make_inputs(fam, dtype=CONFIGS[cfg_name]["dtype"], **cfg)
    leaves = {n: ins[n].double().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    h0 = ins["initial_state"]
    if h0 is not None:
        leaves["initial_state"] = h0.double().requires_grad_()
    o, ht = ref_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], ins["scale"],
                           initial_state=leaves.get("initial_state"), cu_seqlens=ins["cu_seqlens"])
    loss = (o * do.double()).sum() + ((ht * dht.double()).sum() if dht is not None else 0.0)
    names = list(leaves)
    grads = torch.autograd.grad(loss, [leaves[n] for n in names])
    gd = dict(zip(names, grads))
    ref = dict(o=o.detach(), final_state=ht.detach(), dq=gd["q"], dk=gd["k"], dv=gd["v"], dg=gd["g"],
               dbeta=gd["beta"])
    if "initial_state" in gd:
        ref["dh0"] = gd["initial_state"]
    return ins, do, dht, ref


# ---------------------------------------------------------------------------------------------------------------
# numerics

@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("fam", ["kda", "gdn"])
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_forward_matches_reference(exes, cfg_name, fam, mode):
    ins, _, _, ref = reference(cfg_name, fam)
    out = emu.run_op(f"{fam}_{mode}_fwd", exe=exes["asan"], **ins)
    tol = TOL[ins["q"].dtype]
    assert out["o"].dtype == ins["q"].dtype
    for name in ("o", "final_state"):
        assert_close(name, ref[name], out[name], tol[name])


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("fam", ["kda", "gdn"])
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_backward_matches_reference(exes, cfg_name, fam, mode):
    ins, do, dht, ref = reference(cfg_name, fam)
    out = emu.run_op(f"{fam}_{mode}_bwd", exe=exes["asan"], grad_o=do, grad_final_state=dht, **ins)
    tol = TOL[ins["q"].dtype]
    for name in ("dq", "dk", "dv"):
        assert out[name].dtype == ins["q"].dtype
    names = ["dq", "dk", "dv", "dg", "dbeta"] + (["dh0"] if "dh0" in ref else [])
    for name in names:
        assert_close(name, ref[name], out[name], tol[name])
    if "dh0" not in ref:  # no initial state: dh0 is still returned, and is the gradient w.r.t. a zero state
        assert out["dh0"].shape == (len(ins["cu_seqlens"]) - 1 if ins["cu_seqlens"] is not None
                                    else ins["q"].shape[0],) + tuple(ref["final_state"].shape[1:])
        assert torch.isfinite(out["dh0"]).all()


def test_errors_are_measured_not_trivial(exes):
    """The comparison can fail: an output scale off by 1e-4 is rejected by the same check."""
    ins, _, _, ref = reference("f32-gva-h0", "kda")
    bad = dict(ins)
    bad["scale"] = ins["scale"] * (1 + 1e-4)
    out = emu.run_op("kda_recurrent_fwd", exe=exes["asan"], **bad)
    with pytest.raises(AssertionError):
        assert_close("o", ref["o"], out["o"], 1e-5)


# ---------------------------------------------------------------------------------------------------------------
# race freedom of the real kernels, and the detectors on planted bugs

RACE_CFG = dict(B=1, T=37, H=1, HV=2, K=32, V=40, dtype=torch.bfloat16, cu=[0, 5, 5, 37])


def _race_inputs(fam):
    cfg = dict(RACE_CFG)
    dtype = cfg.pop("dtype")
    return make_inputs(fam, dtype=dtype, **cfg)


@pytest.mark.parametrize("op", ["kda_recurrent_fwd", "kda_chunk_fwd", "kda_recurrent_bwd", "kda_chunk_bwd",
                                "gdn_recurrent_fwd", "gdn_chunk_fwd", "gdn_recurrent_bwd", "gdn_chunk_bwd"])
def test_real_kernels_race_free(exes, op):
    ins, do, dht = _race_inputs(op[:3])
    kw = dict(grad_o=do, grad_final_state=dht) if op.endswith("bwd") else {}
    out = emu.run_op(op, exe=exes["tsan"], **kw, **ins)
    o_ref, ht_ref = ref_delta_rule(ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], ins["scale"],
                                   initial_state=ins["initial_state"], cu_seqlens=ins["cu_seqlens"])
    if op.endswith("fwd"):
        assert_close("o", o_ref, out["o"], 0.005)
    else:
        for name in ("dq", "dk", "dv", "dg", "dbeta", "dh0"):
            assert torch.isfinite(out[name].float()).all(), name


def _barrier_sites():
    sites = []
    for f in ("recurrent_bwd.metal", "chunk_fwd.metal", "chunk_bwd.metal"):
        for i, line in enumerate((METAL / f).read_text().splitlines(), 1):
            if re.search(r"\b(threadgroup|simdgroup)_barrier\s*\(", line):
                sites.append((f, i))
    return sites


@pytest.mark.parametrize("site", _barrier_sites(), ids=lambda s: f"{s[0]}:{s[1]}")
def test_every_barrier_is_needed_and_a_dropped_one_is_reported(exes, site):
    f, line = site
    op = {"recurrent_bwd.metal": "kda_recurrent_bwd", "chunk_fwd.metal": "kda_chunk_fwd",
          "chunk_bwd.metal": "kda_chunk_bwd"}[f]
    ins, do, dht = _race_inputs("kda")
    kw = dict(grad_o=do, grad_final_state=dht) if op.endswith("bwd") else {}
    with pytest.raises(emu.EmuError) as e:
        emu.run_op(op, exe=exes["tsan"], env={"EMU_DROP_BARRIER": f"{f}:{line}"}, **kw, **ins)
    assert "ThreadSanitizer: data race" in e.value.stderr


def test_barrier_sites_found():
    sites = _barrier_sites()
    assert len(sites) >= 18 and sum(f == "chunk_bwd.metal" for f, _ in sites) >= 10


def _selftest_reduce(exe, n=96, tg=64):
    x = np.arange(n, dtype=np.float32) * 0.5
    with tempfile.TemporaryDirectory() as d:
        np.save(os.path.join(d, "x.npy"), x)
        (Path(d) / "x.bin").write_bytes(x.tobytes())
        (Path(d) / "p.bin").write_bytes(np.array([n], dtype=np.int32).tobytes())
        ngroups = (n + tg - 1) // tg
        job = f"""buffer x {4 * n} {d}/x.bin
buffer out {4 * ngroups} poison
buffer p 4 {d}/p.bin
launch emu_selftest_tg_reduce {ngroups} 1 1 {tg} 1 1
bind 0 x
bind 1 out
bind 2 p
run
dump out {d}/out.bin
"""
        emu.run_job(exe, job)
        out = np.frombuffer((Path(d) / "out.bin").read_bytes(), dtype=np.float32)
    want = [x[i * tg:(i + 1) * tg].sum() for i in range(ngroups)]
    return out, np.array(want, dtype=np.float32)


def test_selftest_reduce_correct_and_race_free(exes):
    for exe in (exes["self_asan"], exes["self_tsan"]):
        out, want = _selftest_reduce(exe)
        np.testing.assert_allclose(out, want, rtol=1e-6)


def test_planted_missing_barrier_is_reported(exes):
    with pytest.raises(emu.EmuError) as e:
        _selftest_reduce(exes["self_barrier"])
    assert "ThreadSanitizer: data race" in e.value.stderr


def test_planted_out_of_bounds_read_is_reported(exes):
    with pytest.raises(emu.EmuError) as e:
        _selftest_reduce(exes["self_oob"], n=128)
    assert "AddressSanitizer: heap-buffer-overflow" in e.value.stderr


@pytest.mark.parametrize("op,name", [("kda_recurrent_fwd", "v"), ("gdn_chunk_fwd", "k"),
                                     ("kda_recurrent_bwd", "grad_o"), ("kda_chunk_bwd", "q")])
def test_real_kernel_out_of_bounds_read_is_reported(exes, op, name):
    """Allocating an input 2 bytes short makes the kernels' last read of it out of bounds."""
    ins, do, dht = _race_inputs(op[:3])
    kw = dict(grad_o=do, grad_final_state=dht) if op.endswith("bwd") else {}
    with pytest.raises(emu.EmuError) as e:
        emu.run_op(op, exe=exes["asan"], shrink={name: 2}, **kw, **ins)
    assert "AddressSanitizer: heap-buffer-overflow" in e.value.stderr


def test_divergent_simd_collective_is_reported(exes):
    with pytest.raises(emu.EmuError) as e:
        _run_simd(exes["self_divergent"])
    assert "EMU ERROR" in e.value.stderr and ("divergent" in e.value.stderr or "deadlock" in e.value.stderr)


def _run_simd(exe):
    x = (np.random.default_rng(0).standard_normal(64)).astype(np.float32)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "x.bin").write_bytes(x.tobytes())
        job = f"""buffer x 256 {d}/x.bin
buffer out {4 * 64 * 11} zero
buffer h 128 poison
buffer b 128 poison
launch emu_selftest_simd 1 1 1 64 1 1
bind 0 x
bind 1 out
bind 2 h
bind 3 b
run
dump out {d}/out.bin
dump h {d}/h.bin
dump b {d}/b.bin
"""
        emu.run_job(exe, job)
        out = np.frombuffer((Path(d) / "out.bin").read_bytes(), dtype=np.float32).reshape(11, 64)
        h = np.frombuffer((Path(d) / "h.bin").read_bytes(), dtype=np.float16)
        b = torch.from_numpy(np.frombuffer((Path(d) / "b.bin").read_bytes(), dtype=np.int16).copy()).view(
            torch.bfloat16)
    return x, out, h, b


def test_shim_simd_semantics(exes):
    x, out, h, b = _run_simd(exes["self_asan"])
    xs = x.reshape(2, 32)
    lane = np.arange(32)
    np.testing.assert_allclose(out[0].reshape(2, 32), np.repeat(xs.sum(1, keepdims=True), 32, 1), rtol=1e-5)
    np.testing.assert_allclose(out[1].reshape(2, 32), np.cumsum(xs, 1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[2].reshape(2, 32), np.cumsum(xs, 1) - xs, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[3].reshape(2, 32), xs[:, (lane * 7) % 32])
    np.testing.assert_array_equal(out[4].reshape(2, 32), np.repeat(xs[:, 5:6], 32, 1))
    np.testing.assert_array_equal(out[5].reshape(2, 32), xs[:, lane ^ 3])
    np.testing.assert_array_equal(out[6].reshape(2, 32), np.repeat(xs.max(1, keepdims=True), 32, 1))
    np.testing.assert_array_equal(out[7].reshape(2, 32), np.repeat(xs.min(1, keepdims=True), 32, 1))
    assert (out[8] == 496).all()
    down = np.where(lane + 1 < 32, xs[:, np.minimum(lane + 1, 31)], xs)
    np.testing.assert_array_equal(out[9].reshape(2, 32), down)
    np.testing.assert_array_equal(h, (x * np.float32(3.3)).astype(np.float16))
    assert torch.equal(b, torch.from_numpy(x * np.float32(3.3)).to(torch.bfloat16))


def test_shim_simdgroup_matrix_semantics(exes):
    rng = np.random.default_rng(1)
    a, bm, c = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3))
    with tempfile.TemporaryDirectory() as d:
        for n, arr in (("a", a), ("b", bm), ("c", c)):
            (Path(d) / f"{n}.bin").write_bytes(arr.tobytes())
        job = f"""buffer a 256 {d}/a.bin
buffer b 256 {d}/b.bin
buffer c 256 {d}/c.bin
buffer out {4 * 192} poison
launch emu_selftest_matrix 1 1 1 32 1 1
bind 0 a
bind 1 b
bind 2 c
bind 3 out
run
dump out {d}/out.bin
"""
        for exe in (exes["self_asan"], exes["self_tsan"]):
            emu.run_job(exe, job)
            out = np.frombuffer((Path(d) / "out.bin").read_bytes(), dtype=np.float32)
            np.testing.assert_allclose(out[:64].reshape(8, 8), a @ bm + c, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(out[64:128].reshape(8, 8), a.T)
            np.testing.assert_array_equal(out[128:192].reshape(8, 8), bm.T)


# ---------------------------------------------------------------------------------------------------------------
# host consistency: plans vs kernel signatures, and the Objective-C++ host vs the op contract

def test_every_plan_binds_what_its_kernels_declare(exes):
    import subprocess
    p = subprocess.run([str(exes["asan"]), "--check-plans"], capture_output=True, text=True,
                       env={**os.environ, **emu.SAN_ENV})
    assert p.returncode == 0, p.stderr
    m = re.search(r"checked (\d+) plans, (\d+) launches", p.stdout)
    assert m and int(m.group(1)) > 100 and int(m.group(2)) > 100, p.stdout


def test_host_kernel_names_exist_in_metal_sources():
    sigs = emu.kernel_signatures()
    plan_src = (METAL / "delta_plan.h").read_text()
    mm_src = (METAL / "delta_ops.mm").read_text()
    # kernel names are built as fam + "_<stage>_" + dt_suffix(dt), or "delta_cast_" + dt_suffix(dt)
    stages = set(re.findall(r'fam \+ "_(\w+?)_" \+ dt_suffix', plan_src))
    assert stages >= {"recurrent_fwd", "recurrent_bwd", "chunk_fwd", "chunk_bwd", "recurrent_serve"}
    # the serving kernels also name the state pool's dtype: <fam>_recurrent_serve_<dt>_state_<pool dt>
    assert 'fam + "_recurrent_serve_" + dt_suffix(p.dt) + "_state_" + dt_suffix(p.pool_dt)' in plan_src
    for stage in stages:
        for fam in ("kda", "gdn"):
            for dt in ("f32", "f16", "bf16"):
                if stage == "recurrent_serve":
                    for pdt in ("f32", "f16", "bf16"):
                        assert f"{fam}_{stage}_{dt}_state_{pdt}" in sigs
                else:
                    assert f"{fam}_{stage}_{dt}" in sigs
    for dt in ("f16", "bf16"):
        assert f"delta_cast_{dt}" in sigs
    for dt in ("f32", "f16", "bf16"):
        assert f"delta_serve_gather_{dt}" in sigs
    # the .mm does not name kernels itself: everything it launches comes from the plan
    assert not re.search(r'"(kda|gdn)_\w+_(f32|f16|bf16)"', mm_src)


def test_backend_ops_are_defined_by_the_host():
    ops_h = (METAL / "backend_ops.h").read_text()
    listed = re.findall(r"X\((\w+)\)", ops_h)
    assert listed, "backend_ops.h lists no op"
    mm_src = (METAL / "delta_ops.mm").read_text()
    decl = (HERE.parent / "torch-ext" / "torch_binding.h").read_text()
    for op in listed:
        fam, rest = op.split("_", 1)
        assert fam in ("kda", "gdn")
        assert f"family##_{rest}(" in decl, f"{op} is not declared in torch_binding.h"
        # the host defines each entry point through KDA_METAL_DEFINE_FAMILY(kda|gdn)
        assert re.search(rf"family##_{rest}\(", mm_src), f"{op} is not defined in delta_ops.mm"
    assert "KDA_METAL_DEFINE_FAMILY(kda)" in mm_src and "KDA_METAL_DEFINE_FAMILY(gdn)" in mm_src


# ---------------------------------------------------------------------------------------------------------------
# serving op: state pool updated in place

def _serve_expected(ins, pool, idx, nat, cu, state_v_first):
    """float64 expectation of docs/ops.md's serving semantics: (o, pool after the call) from ref_delta_rule."""
    q, k, v, g, beta = (ins[n] for n in ("q", "k", "v", "g", "beta"))
    B, T = q.shape[:2]
    N = B if cu is None else len(cu) - 1
    spans = [(b, 0, T) for b in range(B)] if cu is None else [(0, int(cu[n]), int(cu[n + 1])) for n in range(N)]
    kfirst = pool.double().transpose(-1, -2) if state_v_first else pool.double()
    o = torch.zeros(B, T, v.shape[2], v.shape[3], dtype=torch.float64)
    new = kfirst.clone()
    for n, (b, s, e) in enumerate(spans):
        start = int(idx[n]) if idx.dim() == 1 else int(idx[n, (int(nat[n]) if nat is not None else 1) - 1])
        if start < 0:
            continue
        sl = lambda x: x[b:b + 1, s:e]  # noqa: E731
        h0 = kfirst[start:start + 1]
        on, hn = ref_delta_rule(sl(q), sl(k), sl(v), sl(g), sl(beta), ins["scale"], initial_state=h0)
        o[b, s:e] = on[0]
        if idx.dim() == 1:
            new[start] = hn[0]
        else:
            for i in range(e - s):
                w = int(idx[n, i])
                if w >= 0:
                    new[w] = ref_delta_rule(sl(q)[:, :i + 1], sl(k)[:, :i + 1], sl(v)[:, :i + 1], sl(g)[:, :i + 1],
                                            sl(beta)[:, :i + 1], ins["scale"], initial_state=h0)[1][0]
    return o, (new.transpose(-1, -2) if state_v_first else new)


SERVE_CASES = {
    # decode with 2 tokens per sequence, [N] rows, one skipped sequence, fp32 pool
    "n-rows-f32": dict(B=3, T=2, H=1, HV=2, K=32, V=16, dtype=torch.float32, P=6, idx=[4, -1, 1],
                       pool_dtype=torch.float32, vfirst=False),
    # speculative decoding: [N, T] rows, num_accepted_tokens, varlen with an empty sequence, V-first pool;
    # sequence 2 starts from row 5, which sequence 0 overwrites (start states are gathered first); sequence 0
    # rewrites its own start row 2; sequence 3 has a negative start (skipped: rows 9 and 3 stay untouched)
    "per-token-vfirst": dict(B=1, T=8, H=1, HV=2, K=32, V=16, dtype=torch.bfloat16, P=12, cu=[0, 3, 3, 5, 8],
                             idx=[[7, 2, 5], [8, -1, 11], [6, -1, 5], [9, 3, -1]], nat=[2, 1, 3, 3],
                             pool_dtype=torch.float32, vfirst=True),
    # [N, T] rows without num_accepted_tokens (start column 0), more columns than tokens, fp16 pool, K-first
    "per-token-f16-pool": dict(B=2, T=3, H=2, HV=4, K=16, V=8, dtype=torch.float32, P=9,
                               idx=[[0, 5, -1, 8], [2, 1, 3, 7]], pool_dtype=torch.float16, vfirst=False),
    # bf16 pool (computed in fp32, stored rounded), K = 48 (not a multiple of 32), fp16 inputs
    "n-rows-bf16-pool": dict(B=2, T=3, H=1, HV=2, K=48, V=8, dtype=torch.float16, P=4, idx=[3, 0],
                             pool_dtype=torch.bfloat16, vfirst=True),
}


def _serve_run(exe, fam, case, env=None):
    c = dict(SERVE_CASES[case])
    ins, _, _ = make_inputs(fam, c["B"], c["T"], c["H"], c["HV"], c["K"], c["V"], c["dtype"], cu=c.get("cu"),
                            extreme=True, h0=False, seed=3)
    gen = torch.Generator().manual_seed(7)
    shape = (c["P"], c["HV"], c["V"], c["K"]) if c["vfirst"] else (c["P"], c["HV"], c["K"], c["V"])
    pool = torch.randn(shape, generator=gen).to(c["pool_dtype"])
    idx = torch.tensor(c["idx"], dtype=torch.int64)
    nat = torch.tensor(c["nat"], dtype=torch.int64) if "nat" in c else None
    o, new_pool = emu.run_serve(f"{fam}_recurrent_serve", ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"],
                                ins["scale"], pool, idx, nat, ins["cu_seqlens"], c["vfirst"], exe=exe, env=env)
    o_ref, pool_ref = _serve_expected(ins, pool, idx, nat, ins["cu_seqlens"], c["vfirst"])
    return ins, pool, idx, nat, o, new_pool, o_ref, pool_ref


@pytest.mark.parametrize("case", list(SERVE_CASES))
@pytest.mark.parametrize("fam", ["kda", "gdn"])
def test_serve_matches_reference_and_leaves_other_rows(exes, fam, case):
    ins, pool, idx, nat, o, new_pool, o_ref, pool_ref = _serve_run(exes["asan"], fam, case)
    tol = TOL[ins["q"].dtype]["o"]
    assert o.dtype == ins["q"].dtype and new_pool.dtype == pool.dtype
    assert_close("o", o_ref, o, tol)
    written = set()
    if idx.dim() == 1:
        written = {int(r) for r in idx if r >= 0}
    else:
        cu = ins["cu_seqlens"]
        lens = [int(x) for x in (cu[1:] - cu[:-1])] if cu is not None else [ins["q"].shape[1]] * idx.shape[0]
        for n in range(idx.shape[0]):
            start = int(idx[n, (int(nat[n]) if nat is not None else 1) - 1])
            if start >= 0:
                written |= {int(r) for r in idx[n, :lens[n]] if r >= 0}
    for r in range(pool.shape[0]):
        if r in written:
            assert_close(f"pool[{r}]", pool_ref[r], new_pool[r], 1e-5 if pool.dtype == torch.float32 else 0.005)
        else:  # canary rows: untouched, bit for bit
            assert torch.equal(new_pool[r].view(torch.int16 if pool.dtype != torch.float32 else torch.int32),
                               pool[r].view(torch.int16 if pool.dtype != torch.float32 else torch.int32)), r
    # skipped sequences output exact zeros
    cu = ins["cu_seqlens"]
    for n in range(idx.shape[0]):
        start = int(idx[n]) if idx.dim() == 1 else int(idx[n, (int(nat[n]) if nat is not None else 1) - 1])
        if start < 0:
            assert (o[n] == 0).all() if cu is None else (o[0, int(cu[n]):int(cu[n + 1])] == 0).all()


def test_serve_race_free(exes):
    _, _, _, _, o, _, o_ref, _ = _serve_run(exes["tsan"], "kda", "per-token-vfirst")
    assert_close("o", o_ref, o, 0.005)
