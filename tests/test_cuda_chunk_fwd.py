"""The CUDA chunked forward (kernels_src/cuda/delta_chunk_fwd.cuh: kda_chunk_fwd, gdn_chunk_fwd) against the
float64 reference (tests/ref_delta.py) at DESIGN.md section 6 tolerances: o and final state RMS ratio <= 0.005
for bf16/fp16 inputs, <= 1e-5 for fp32 inputs.

Needs a CUDA GPU (skipped with the reason otherwise). Covers random and correlated keys, gates
logsigmoid(randn)/{0.1, 1, 10}, 30 % of gates at -20 and some at -1e4, T not a multiple of the chunk (1, 63, 65,
200), batches, varlen with empty sequences, GVA, initial state, K=V=128, K=V=64, odd K/V (40/30, padded to the
64-wide path), V spanning several column tiles, fp32/bf16/fp16, T=2048, the fp32 workspace for bf16 inputs
(KDA_CUDA_CHUNK_WS_BF16=0; the default stores q~, k~^T, A~ as bf16), and replay under a CUDA graph. GDN with
bf16/fp16 inputs runs its own prep kernel (gdn_chunk_prep2.cuh; test_gdn_prep_reference, tests/test_cuda_gdn_prep2.py).
Likewise KDA with bf16/fp16 inputs (kda_chunk_prep2.cuh with the 8x8 split; test_kda_prep2_reference). The v1 KDA
prep (KDA_CUDA_KDA_PREP=1) and the generic prep for 16-bit inputs (KDA_CUDA_KDA_PREP=0 / KDA_CUDA_GDN_PREP=0) were
retired in session 9, the GDN prep v1 (KDA_CUDA_GDN_PREP=1) and the KDA prep v2 without the split (KDA_CUDA_KDA_PREP=2)
in session 11, as was scan6 with warp pairs (KDA_CUDA_CHUNK_SCAN=9) (test_retired_fwd_knob_values_are_refused).
The scan is delta_chunk_scan7_kernel<KP, true> (KDA_CUDA_CHUNK_SCAN=11, the default since session 12; tests/test_cuda_scan7.py)
where the workspace is bf16, V <= 256 and the GPU is sm_90+ (every bf16/fp16 test above runs it; fp32 inputs and
KDA_CUDA_CHUNK_WS_BF16=0 run the single kernel delta_chunk_scan_kernel). test_chunk_fwd_single_scan runs the single
kernel (KDA_CUDA_CHUNK_SCAN=1, the path of pre-Hopper GPUs) against the float64 reference. Retired in session 12:
the bulk-prefetch scan (=4), the split forward (=5 / 6), scan5 (=7) and scan6 (=8), with their tests
(test_chunk_fwd_scan3, test_chunk_scan3_vs_single, test_chunk_fwd_split*, test_chunk_split_vs_scan3,
test_chunk_fwd_scan5, test_chunk_scan5_vs_scan3*, tests/test_cuda_scan6.py); their values are refused like the
earlier ones, and values no kernel ever had, of
these knobs and of KDA_CUDA_CHUNK_WS_BF16 / KDA_CUDA_CHUNK_BV / KDA_CUDA_CHUNK_FWD, raise an error naming the knob
and its accepted values (test_unknown_fwd_knob_values_are_refused).
"""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from ref_delta import assert_close, ref_delta_rule  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the CUDA chunked forward tests need an "
                "NVIDIA GPU", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
DEV = "cuda"
torch.set_num_threads(1)
TOL = {torch.float32: 1e-5, torch.bfloat16: 0.005, torch.float16: 0.005}


def _load():
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    cu = torch.version.cuda.replace(".", "")[:3]
    path = ROOT / "build" / f"torch{major}{minor}-cxx11-cu{cu}-x86_64-linux"
    if not (path / "__init__.py").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build.py"), "--backends", "cuda"], check=True)
    spec = importlib.util.spec_from_file_location("kda_kernels_cuda_chunk_fwd_under_test", path / "__init__.py",
                                                  submodule_search_locations=[str(path)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


OPS = _load().ops


def make(family, B=2, T=65, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, gate_div=1.0, keys="normal",
         extreme=False, seed=0, cu=None):
    gen = torch.Generator().manual_seed(seed)
    if cu is not None:
        B, T = 1, cu[-1]
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) * 2
    k = torch.rand(B, T, H, K, generator=gen) if keys == "correlated" else torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    gshape = (B, T, HV, K) if family == "kda" else (B, T, HV)
    g = F.logsigmoid(torch.randn(*gshape, generator=gen)) / gate_div
    if extreme:
        r = torch.rand(*gshape, generator=gen)
        g = torch.where(r < 0.3, torch.full(gshape, -20.0), g)
        g = torch.where(r > 0.97, torch.full(gshape, -1e4), g)
    beta = torch.rand(B, T, HV, generator=gen)
    return [x.to(DEV).contiguous() for x in (q.to(dtype), k.to(dtype), v.to(dtype), g.float(), beta.float())]


CASES = {
    "T1": dict(T=1),
    "T63": dict(T=63),
    "T65": dict(T=65),
    "T200": dict(B=1, T=200),
    "T2048": dict(B=1, T=2048, H=1, HV=2),  # 32 chunks: the bf16 workspace's rounding accumulates
    "correlated_keys": dict(keys="correlated", T=130),
    "gate_div_0.1": dict(gate_div=0.1, T=100),
    "gate_div_10": dict(gate_div=10.0, T=100),
    "extreme_gates": dict(extreme=True, T=150),
    "extreme_gates_div_0.1": dict(extreme=True, gate_div=0.1, T=70),
    "gva_4x": dict(H=1, HV=4, T=90),
    "kv64": dict(K=64, V=64, T=130),
    "odd_kv": dict(K=40, V=30, T=77),
    "wide_v": dict(K=128, V=80, T=66, HV=2, H=2),
    "cp_width_v256": dict(K=128, V=256, T=130, HV=2, H=1),  # the context-parallel transition's width K + V
    "v200": dict(K=128, V=200, T=130, HV=2, H=1),  # a partial last column block (7 of 32 columns, 4 of 64)
    "odd_v": dict(K=64, V=37, T=70, HV=2, H=2),  # odd V: element loads of u0 and stores of o
    "varlen": dict(cu=[0, 0, 70, 70, 135, 136, 300]),
    "varlen_extreme": dict(cu=[0, 64, 64, 65, 193], extreme=True),
}


def case_inputs(family, case, dtype, h0_on=True):
    """CASES[case] on the GPU: (q, k, v, g, beta), the initial state (None unless h0_on) and cu_seqlens."""
    spec = dict(CASES[case])
    cu_list = spec.get("cu")
    cu = None if cu_list is None else torch.tensor(cu_list, dtype=torch.long, device=DEV)
    q, k, v, g, beta = make(family, dtype=dtype, **spec)
    N = q.shape[0] if cu is None else cu.numel() - 1
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    h0 = (torch.randn(N, HV, K, V, generator=torch.Generator().manual_seed(9)) * 0.5).to(DEV) if h0_on else None
    return (q, k, v, g, beta), h0, cu


def fwd_per_knob(family, case, dtype, ws, knob, values, monkeypatch):
    """(o, final state) of the chunked forward for each value of the host knob `knob` (read at every call), on the
    same inputs, initial state and workspace choice `ws`: only the kernel the knob selects differs."""
    (q, k, v, g, beta), h0, cu = case_inputs(family, case, dtype)
    monkeypatch.setenv("KDA_CUDA_CHUNK_WS_BF16", "1" if ws == "ws_bf16" else "0")
    out = []
    for value in values:
        monkeypatch.setenv(knob, value)
        out.append(getattr(OPS, f"{family}_chunk_fwd")(q, k, v, g, beta, q.shape[3] ** -0.5, h0, cu))
    return out


def run_case(family, case, dtype, h0_on):
    (q, k, v, g, beta), h0, cu = case_inputs(family, case, dtype, h0_on)
    scale = q.shape[3] ** -0.5
    o, s = getattr(OPS, f"{family}_chunk_fwd")(q, k, v, g, beta, scale, h0, cu)
    ro, rs = ref_delta_rule(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), scale=scale,
                            initial_state=None if h0 is None else h0.cpu(), cu_seqlens=None if cu is None else cu.cpu())
    assert o.dtype == dtype and s.dtype == torch.float32
    assert o.shape == ro.shape and s.shape == rs.shape
    assert_close("o", ro, o.cpu(), TOL[dtype])
    assert_close("final_state", rs, s.cpu(), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_chunk_fwd(family, case, dtype):
    if dtype == torch.float16 and case not in ("T65", "extreme_gates", "varlen", "odd_kv"):
        pytest.skip("fp16 differs from bf16 only in the load/store conversion; a subset suffices")
    run_case(family, case, dtype, h0_on=case not in ("T1", "T63"))


@pytest.mark.parametrize("case", ["T200", "extreme_gates", "varlen", "odd_kv"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_chunk_fwd_fp32_workspace(family, case, monkeypatch):
    """bf16/fp16 inputs with KDA_CUDA_CHUNK_WS_BF16=0 (fp32 q~, k~^T, A~ in the workspace, the other scan path)."""
    monkeypatch.setenv("KDA_CUDA_CHUNK_WS_BF16", "0")
    run_case(family, case, torch.bfloat16, h0_on=True)


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_chunk_fwd_no_state_t1(family):
    run_case(family, "T1", torch.bfloat16, h0_on=False)


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_chunk_fwd_all_empty_varlen(family):
    q, k, v, g, beta = make(family, cu=[0, 0, 0])
    cu = torch.tensor([0, 0, 0], dtype=torch.long, device=DEV)
    h0 = torch.randn(2, 4, 128, 128, device=DEV)
    o, s = getattr(OPS, f"{family}_chunk_fwd")(q, k, v, g, beta, 0.1, h0, cu)
    assert o.shape == (1, 0, 4, 128)
    assert torch.equal(s, h0)


@pytest.mark.parametrize("scan", ["single", "scan7"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_chunk_fwd_cuda_graph(family, scan, monkeypatch):
    monkeypatch.setenv("KDA_CUDA_CHUNK_SCAN", "1" if scan == "single" else "11")
    q, k, v, g, beta = make(family, B=1, T=300, H=2, HV=4)
    cu = torch.tensor([0, 100, 100, 300], dtype=torch.long, device=DEV)
    fn = getattr(OPS, f"{family}_chunk_fwd")
    o_ref, s_ref = fn(q, k, v, g, beta, 0.088, None, cu)
    fn(q, k, v, g, beta, 0.088, None, cu)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, s = fn(q, k, v, g, beta, 0.088, None, cu)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("ws", ["ws_bf16", "ws_fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["T200", "T2048", "correlated_keys", "extreme_gates", "extreme_gates_div_0.1",
                                  "gva_4x", "kv64", "odd_kv", "cp_width_v256", "varlen", "varlen_extreme"])
def test_gdn_prep_reference(case, dtype, ws, monkeypatch):
    """The GDN prep kernel (default for bf16/fp16) with either workspace against the float64 reference (its
    session-4 partner, the generic prep for 16-bit inputs, KDA_CUDA_GDN_PREP=0, was retired in session 9)."""
    monkeypatch.setenv("KDA_CUDA_CHUNK_WS_BF16", "1" if ws == "ws_bf16" else "0")
    run_case("gdn", case, dtype, h0_on=True)


@pytest.mark.parametrize("ws", ["ws_bf16", "ws_fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["T65", "T200", "T2048", "correlated_keys", "gate_div_0.1", "gate_div_10",
                                  "extreme_gates", "extreme_gates_div_0.1", "gva_4x", "kv64", "odd_kv",
                                  "cp_width_v256", "varlen", "varlen_extreme"])
def test_kda_prep2_reference(case, dtype, ws, monkeypatch):
    """The KDA prep kernel v2 (kda_chunk_prep2.cuh: gate factors within a sub-chunk as products of e^{g_i}, the
    diagonal blocks split in 8x8 quarters; KDA_CUDA_KDA_PREP=3, set explicitly) with either workspace (varlen cases
    include empty sequences; extreme gates -20 and -1e4): finite and within DESIGN.md section 6 of the float64
    reference. (Its partners, the v1 kernel kda_chunk_prep.cuh, =1, and v2 without the split, =2, were retired in
    sessions 9 and 11.)"""
    ((o3, s3),) = fwd_per_knob("kda", case, dtype, ws, "KDA_CUDA_KDA_PREP", ("3",), monkeypatch)
    assert torch.isfinite(o3.float()).all() and torch.isfinite(s3).all()
    (q, k, v, g, beta), h0, cu = case_inputs("kda", case, dtype)
    ro, rs = ref_delta_rule(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), scale=q.shape[3] ** -0.5,
                            initial_state=h0.cpu(), cu_seqlens=None if cu is None else cu.cpu())
    assert_close("o (prep v2)", ro, o3.cpu(), TOL[dtype])
    assert_close("final_state (prep v2)", rs, s3.cpu(), TOL[dtype])


# knob values whose kernels were retired in sessions 9 to 12 (docs/cuda.md, "Retired kernels"): refused at the call
RETIRED_FWD = [("kda", "KDA_CUDA_KDA_PREP", "1"), ("kda", "KDA_CUDA_KDA_PREP", "0"),
               ("gdn", "KDA_CUDA_GDN_PREP", "0"), ("kda", "KDA_CUDA_KDA_PREP", "4"), ("kda", "KDA_CUDA_KDA_PREP", "5"),
               ("gdn", "KDA_CUDA_GDN_PREP", "1"), ("kda", "KDA_CUDA_KDA_PREP", "2"),
               ("kda", "KDA_CUDA_CHUNK_SCAN", "9"), ("gdn", "KDA_CUDA_CHUNK_SCAN", "9")]
# session 12: the bulk-prefetch scan (4), the split forward (5 / 6), scan5 (7), scan6 (8)
RETIRED_FWD += [(family, "KDA_CUDA_CHUNK_SCAN", value) for value in ("4", "5", "6", "7", "8")
                for family in ("kda", "gdn")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family,knob,value", RETIRED_FWD)
def test_retired_fwd_knob_values_are_refused(family, knob, value, dtype, monkeypatch):
    monkeypatch.setenv(knob, value)
    (q, k, v, g, beta), h0, cu = case_inputs(family, "T65", dtype)
    with pytest.raises(RuntimeError, match=f"{knob}={value} .*retired in session (9|10|11|12)"):
        getattr(OPS, f"{family}_chunk_fwd")(q, k, v, g, beta, 0.1, h0, cu)
    with pytest.raises(RuntimeError, match=f"{knob}={value} .*retired in session (9|10|11|12)"):
        getattr(OPS, f"{family}_chunk_fwd_stage")([], 0, q, k, v, g, beta, 0.1, None, cu)


# values no kernel has (typos, text): refused with the knob's name, the value and the accepted values (env_choice in
# delta_host.cuh) instead of silently running the default. Accepted: KDA_CUDA_CHUNK_SCAN 0 (unset), 1, 10, 11 and any
# value a later session adds (so no small number is used here); KDA_CUDA_KDA_PREP 3, 6; KDA_CUDA_GDN_PREP 2, 3;
# KDA_CUDA_CHUNK_WS_BF16 0, 1; KDA_CUDA_CHUNK_BV 0, 16, 32; KDA_CUDA_CHUNK_FWD 0, 1.
UNKNOWN_FWD = [("KDA_CUDA_CHUNK_SCAN", "99"), ("KDA_CUDA_CHUNK_SCAN", "-3"), ("KDA_CUDA_CHUNK_SCAN", "scan6"),
               ("KDA_CUDA_CHUNK_SCAN", "8x"), ("KDA_CUDA_KDA_PREP", "7"), ("KDA_CUDA_KDA_PREP", "v2"),
               ("KDA_CUDA_GDN_PREP", "9"), ("KDA_CUDA_GDN_PREP", "x"), ("KDA_CUDA_CHUNK_WS_BF16", "2"),
               ("KDA_CUDA_CHUNK_WS_BF16", "yes"), ("KDA_CUDA_CHUNK_BV", "24"), ("KDA_CUDA_CHUNK_BV", "wide"),
               ("KDA_CUDA_CHUNK_FWD", "2"), ("KDA_CUDA_CHUNK_FWD", "on")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("knob,value", UNKNOWN_FWD)
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_unknown_fwd_knob_values_are_refused(family, knob, value, dtype, monkeypatch):
    if (knob, family) in (("KDA_CUDA_KDA_PREP", "gdn"), ("KDA_CUDA_GDN_PREP", "kda")):
        pytest.skip("the other family's prep knob is not read")
    monkeypatch.setenv(knob, value)
    (q, k, v, g, beta), h0, cu = case_inputs(family, "T65", dtype)
    pattern = f"{knob}={value} is not an accepted value: {knob} takes "
    with pytest.raises(RuntimeError, match=pattern):
        getattr(OPS, f"{family}_chunk_fwd")(q, k, v, g, beta, 0.1, h0, cu)
    if knob != "KDA_CUDA_CHUNK_FWD":  # (read by the one-call op only: the staged op always runs the chunked kernels)
        with pytest.raises(RuntimeError, match=pattern):
            work = getattr(OPS, f"{family}_chunk_fwd_stage")([], 0, q, k, v, g, beta, 0.1, None, cu)
            getattr(OPS, f"{family}_chunk_fwd_stage")(work, 1, q, k, v, g, beta, 0.1, h0, cu)
    monkeypatch.delenv(knob)
    o, s = getattr(OPS, f"{family}_chunk_fwd")(q, k, v, g, beta, 0.1, h0, cu)  # the process is still usable
    assert torch.isfinite(o.float()).all() and torch.isfinite(s).all()


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_accepted_fwd_knob_values_run(family, monkeypatch):
    """Every accepted value of the forward's knobs runs (the unknown-value check does not refuse them): o within
    DESIGN.md section 6 of the float64 reference (bf16 inputs), and the defaults written out give the default's bits."""
    (q, k, v, g, beta), h0, cu = case_inputs(family, "T200", torch.bfloat16)
    fn = getattr(OPS, f"{family}_chunk_fwd")
    o_def, s_def = fn(q, k, v, g, beta, 128 ** -0.5, h0, cu)
    prep = ("KDA_CUDA_KDA_PREP", "3") if family == "kda" else ("KDA_CUDA_GDN_PREP", "2")
    # (KDA_CUDA_KDA_PREP=6: the default prep's FAST instance, the same bits; tests/test_cuda_kda_prep_fast.py)
    fast = ({"KDA_CUDA_KDA_PREP": "6"},) if family == "kda" else ()
    for env in ({"KDA_CUDA_CHUNK_SCAN": "0"}, {"KDA_CUDA_CHUNK_SCAN": "11"}, dict([prep]),
                {"KDA_CUDA_CHUNK_WS_BF16": "1"}, {"KDA_CUDA_CHUNK_FWD": "1"}, {"KDA_CUDA_CHUNK_BV": "32"}) + fast:
        for key, val in env.items():
            monkeypatch.setenv(key, val)
        o, s = fn(q, k, v, g, beta, 128 ** -0.5, h0, cu)
        assert torch.equal(o, o_def) and torch.equal(s, s_def), env
        for key in env:
            monkeypatch.delenv(key)
    ro, rs = ref_delta_rule(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), scale=128 ** -0.5,
                            initial_state=h0.cpu(), cu_seqlens=None)
    for env in ({"KDA_CUDA_CHUNK_SCAN": "1"}, {"KDA_CUDA_CHUNK_SCAN": "10"},
                {"KDA_CUDA_CHUNK_SCAN": "1", "KDA_CUDA_CHUNK_BV": "16"},
                {"KDA_CUDA_CHUNK_SCAN": "1", "KDA_CUDA_CHUNK_BV": "0"}, {"KDA_CUDA_CHUNK_WS_BF16": "0"},
                {"KDA_CUDA_CHUNK_FWD": "0"}):
        for key, val in env.items():
            monkeypatch.setenv(key, val)
        o, s = fn(q, k, v, g, beta, 128 ** -0.5, h0, cu)
        assert_close(f"o {env}", ro, o.cpu(), TOL[torch.bfloat16])
        assert_close(f"final_state {env}", rs, s.cpu(), TOL[torch.bfloat16])
        for key in env:
            monkeypatch.delenv(key)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["T65", "T200", "T2048", "correlated_keys", "extreme_gates", "gva_4x", "kv64", "odd_kv",
                                  "wide_v", "v200", "odd_v", "varlen", "varlen_extreme"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_chunk_fwd_single_scan(family, case, dtype, monkeypatch):
    """The single scan kernel (KDA_CUDA_CHUNK_SCAN=1; the default only for fp32 workspaces and pre-Hopper GPUs)
    with the bf16 workspace against the float64 reference."""
    if dtype == torch.float16 and case not in ("extreme_gates", "varlen"):
        pytest.skip("fp16 differs from bf16 only in the load/store conversion; a subset suffices")
    monkeypatch.setenv("KDA_CUDA_CHUNK_SCAN", "1")
    run_case(family, case, dtype, h0_on=True)
