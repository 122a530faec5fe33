"""The native CPU backend (kernels_src/cpu) against the float64 reference of DESIGN.md section 1.

Every core op the CPU library registers ({kda,gdn}_{chunk,recurrent}_{fwd,bwd}, {kda,gdn}_recurrent_serve) is
called directly, forward and backward, at DESIGN.md section 6 tolerances (fp32 <= 1e-5 relative RMS for every
output and gradient; bf16: o/state 0.005, dq/dk/dv/dh0 0.008, dg/dbeta 0.02), on random and adversarial inputs:
correlated keys (torch.rand then normalised), gates logsigmoid(randn)/{0.1,1,10} and down to -20, GVA (HV = 2H,
4H), varlen with empty and length-1 sequences, initial states, T = 1, 63, 65, 200 and K, V in {32, 48, 64, 100,
128}. Also: chunk == recurrent, the serving path (fp32 and bf16 pools, V-first pools, speculative [N, T]
indices, skipped slots), and that the native kernels really ran (no fallback warning).
"""
import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import get_variant
from ref_delta import ref_delta_rule, rel_err

pytestmark = pytest.mark.filterwarnings("error:kda-kernels. no native:RuntimeWarning")

OPS = [f"{fam}_{op}" for fam in ("kda", "gdn") for op in
       ("chunk_fwd", "chunk_bwd", "recurrent_fwd", "recurrent_bwd", "recurrent_serve")]
TOL = {torch.float32: dict(o=1e-5, state=1e-5, dq=1e-5, dk=1e-5, dv=1e-5, dg=1e-5, dbeta=1e-5, dh0=1e-5),
       torch.bfloat16: dict(o=0.005, state=0.005, dq=0.008, dk=0.008, dv=0.008, dg=0.02, dbeta=0.02, dh0=0.008)}
TOL[torch.float16] = TOL[torch.bfloat16]


@pytest.fixture(scope="module")
def cpu():
    """The native CPU variant, built once from the current sources (conftest caches builds by source hash)."""
    mod = get_variant("cpu")
    assert mod.NATIVE, "the CPU variant loaded without its native library"
    return mod


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------------ inputs
CASES = {
    #            B  T    H  HV K    V    cu                         h0     gate
    "random":   (2, 63, 2, 2, 32, 48, None, True, "s1"),
    "T1":       (2, 1, 1, 2, 64, 64, None, True, "s1"),
    "gva2_T65": (1, 65, 2, 4, 64, 32, None, True, "s0.1"),
    "gva4_K100": (1, 200, 1, 4, 100, 48, None, True, "s10"),
    "varlen":   (1, 200, 2, 2, 48, 100, [0, 0, 1, 64, 130, 130, 200], True, "s1"),
    "extreme":  (1, 130, 1, 2, 32, 64, None, True, "extreme"),
    "K128_noh0": (1, 130, 1, 1, 128, 128, None, False, "s1"),
    "const_m20": (1, 70, 1, 2, 16, 8, None, True, "const-20"),  # every token wipes the state: dg ~ 1e-9
    # o and dv of 8.6 MiB: past the 8 MiB from which the outputs get huge pages (advise_huge), varlen with an
    # empty and a short sequence, sequences crossing the GDN forward's 256-token head turns
    "big_out":  (1, 1100, 1, 16, 16, 128, [0, 0, 5, 600, 1100], True, "s1"),
}


def make_case(name, family, dtype, seed=0):
    B, T, H, HV, K, V, cu, h0, gate = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.rand(B, T, H, K, generator=gen), dim=-1)  # correlated keys
    v = torch.randn(B, T, HV, V, generator=gen)
    gshape = (B, T, HV, K) if family == "kda" else (B, T, HV)
    if gate == "extreme":  # a mix of no decay, ordinary decays and decays down to -20
        u = torch.rand(gshape, generator=gen)
        g = torch.where(u < 0.3, -20 * torch.rand(gshape, generator=gen),
                        F.logsigmoid(torch.randn(gshape, generator=gen)) / 0.1)
        g = torch.where(u > 0.9, torch.zeros(()), g)
    elif gate.startswith("const"):
        g = torch.full(gshape, float(gate[5:]))
    else:
        g = F.logsigmoid(torch.randn(gshape, generator=gen)) / float(gate[1:])
    beta = torch.rand(B, T, HV, generator=gen)
    N = len(cu) - 1 if cu else B
    s0 = torch.randn(N, HV, K, V, generator=gen) if h0 else None
    x = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.float(), beta=beta, initial_state=s0,
             cu_seqlens=torch.tensor(cu, dtype=torch.long) if cu else None, scale=K ** -0.5)
    do = torch.randn(B, T, HV, V, generator=gen).to(dtype)
    dsN = torch.randn(N, HV, K, V, generator=gen)
    return x, do, dsN


_REF = {}


def reference(name, family, dtype):
    """float64 o, final state and gradients (autograd through ref_delta_rule), cached per case."""
    key = (name, family, dtype)
    if key not in _REF:
        x, do, dsN = make_case(name, family, dtype)
        leaves = {n: x[n].double().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
        B, T, H, K = x["q"].shape
        HV, V = x["v"].shape[2:]
        N = dsN.shape[0]
        h0 = (x["initial_state"] if x["initial_state"] is not None else torch.zeros(N, HV, K, V)).double()
        h0.requires_grad_(True)
        cu = x["cu_seqlens"].tolist() if x["cu_seqlens"] is not None else None
        o, s = ref_delta_rule(**leaves, scale=x["scale"], initial_state=h0, cu_seqlens=cu)
        grads = torch.autograd.grad((o, s), [leaves[n] for n in ("q", "k", "v", "g", "beta")] + [h0],
                                    (do.double(), dsN.double()))
        _REF[key] = (o.detach(), s.detach()) + tuple(grads)
    return _REF[key]


def run_op(cpu, family, mode, x, do, dsN):
    fwd = getattr(cpu.ops, f"{family}_{mode}_fwd")
    bwd = getattr(cpu.ops, f"{family}_{mode}_bwd")
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["initial_state"], x["cu_seqlens"])
    o, s = fwd(*args)
    grads = bwd(*args, do, dsN)
    return (o, s) + tuple(grads)


NAMES = ("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def check_all(out, ref, dtype, what):
    errs = {}
    for n, a, r in zip(NAMES, out, ref):
        assert a.shape == r.shape, f"{what} {n}: shape {tuple(a.shape)} != {tuple(r.shape)}"
        assert torch.isfinite(a).all(), f"{what} {n}: non-finite values"
        errs[n] = rel_err(r, a)
    bad = {n: e for n, e in errs.items() if e > TOL[dtype][n]}
    assert not bad, f"{what}: relative RMS errors above tolerance {bad} (all: {errs})"


# ------------------------------------------------------------------------------------------------ tests
def test_native_kernels_registered_and_ran(cpu):
    """Every core op has a CPU kernel from the native library, and calling each one warns of no fallback."""
    ns = cpu._ops.NAMESPACE
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{ns}::{op}", "CPU"), f"{op}: no CPU kernel"
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for family in ("kda", "gdn"):
            xf, dof, dsf = make_case("random", family, torch.float32)
            for mode in ("chunk", "recurrent"):
                run_op(cpu, family, mode, xf, dof, dsf)
            pool = torch.randn(3, 2, 32, 48)
            getattr(cpu.ops, f"{family}_recurrent_serve")(
                xf["q"], xf["k"], xf["v"], xf["g"], xf["beta"], xf["scale"], pool,
                torch.tensor([2, 0]), None, None, False)
    fallback = [str(w.message) for w in rec if "no native" in str(w.message)]
    assert not fallback, f"fallback ran: {fallback}"


# bf16 (and fp16) run on a subset of the cases to keep the file fast
DTYPE_CASES = [pytest.param(c, torch.float32, id=f"{c}-fp32") for c in CASES if c != "big_out"] + \
    [pytest.param(c, torch.bfloat16, id=f"{c}-bf16") for c in ("random", "varlen", "gva4_K100")] + \
    [pytest.param("random", torch.float16, id="random-fp16")]


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("case,dtype", DTYPE_CASES)
def test_matches_float64_reference(cpu, case, family, mode, dtype):
    x, do, dsN = make_case(case, family, dtype)
    out = run_op(cpu, family, mode, x, do, dsN)
    assert out[0].dtype == dtype and out[2].dtype == dtype and out[4].dtype == dtype
    assert out[1].dtype == torch.float32 and out[5].dtype == torch.float32 and out[7].dtype == torch.float32
    check_all(out, reference(case, family, dtype), dtype, f"{family}_{mode} {case}")


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_chunk_equals_recurrent(cpu, family):
    """Chunked WY and token-by-token give the same o, state and gradients (K = V = 128, T = 300, GVA)."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, HV, K, V = 1, 300, 1, 2, 128, 128
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.rand(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn((B, T, HV, K) if family == "kda" else (B, T, HV), generator=gen))
    beta = torch.rand(B, T, HV, generator=gen)
    x = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=torch.randn(B, HV, K, V, generator=gen),
             cu_seqlens=None, scale=K ** -0.5)
    do, dsN = torch.randn(B, T, HV, V, generator=gen), torch.randn(B, HV, K, V, generator=gen)
    a = run_op(cpu, family, "chunk", x, do, dsN)
    b = run_op(cpu, family, "recurrent", x, do, dsN)
    for n, ra, rb in zip(NAMES, a, b):
        assert rel_err(rb, ra) <= 1e-5, f"{n}: chunk vs recurrent {rel_err(rb, ra):.3g}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("thp", ["1", "0"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_big_outputs_huge_pages(cpu, family, mode, thp, threads, monkeypatch):
    """Outputs past 8 MB are asked for transparent huge pages before the kernel writes them (KDA_DEV_CPU_THP=0:
    not): same results either way, against the float64 reference, 1 and 2 threads."""
    monkeypatch.setenv("KDA_DEV_CPU_THP", thp)
    x, do, dsN = make_case("big_out", family, torch.float32)
    assert x["v"].numel() * 4 >= 8 * 2 ** 20  # o and dv are big enough to be advised (advise_huge: >= 8 MiB)
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = run_op(cpu, family, mode, x, do, dsN)
    finally:
        torch.set_num_threads(n)
    check_all(out, reference("big_out", family, torch.float32), torch.float32, f"{family} {mode} thp={thp}")


@pytest.mark.parametrize("turn", ["16", "64", "4096"])
def test_gdn_chunk_fwd_turn_knob(cpu, turn, monkeypatch):
    """KDA_DEV_GDN_TB (A/B knob of the GDN forward's head-turn length): any multiple of 16 gives the reference."""
    monkeypatch.setenv("KDA_DEV_GDN_TB", turn)
    x, do, dsN = make_case("big_out", "gdn", torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["initial_state"], x["cu_seqlens"])
    o, s = cpu.ops.gdn_chunk_fwd(*args)
    ref = reference("big_out", "gdn", torch.float32)
    assert rel_err(ref[0], o) <= TOL[torch.float32]["o"] and rel_err(ref[1], s) <= TOL[torch.float32]["state"]


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_chunk_fwd_solve16_knob(cpu, family, monkeypatch):
    """residual_solve16 (16-row chunks: every GDN forward chunk, KDA's chunks of <= 16 tokens) computes the same
    products in the same order as the residual loop + solve_lower it replaces (KDA_DEV_SOLVE16=0): bit for bit."""
    x, do, dsN = make_case("big_out", family, torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["initial_state"], x["cu_seqlens"])
    op = getattr(cpu.ops, f"{family}_chunk_fwd")
    monkeypatch.delenv("KDA_DEV_SOLVE16", raising=False)
    o1, s1 = op(*args)
    monkeypatch.setenv("KDA_DEV_SOLVE16", "0")
    o0, s0 = op(*args)
    assert torch.equal(o1, o0) and torch.equal(s1, s0)
    ref = reference("big_out", family, torch.float32)
    assert rel_err(ref[0], o1) <= TOL[torch.float32]["o"] and rel_err(ref[1], s1) <= TOL[torch.float32]["state"]


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_chunk_fwd_prefetch_knob(cpu, family, monkeypatch):
    """KDA_DEV_PF (A/B knob of the chunked forward's next-chunk prefetch instruction: 0 none, 1 prefetcht1 =
    default, 2 t0, 3 nta, 4 t2) changes no result: every value gives the default's outputs bit for bit."""
    x, do, dsN = make_case("big_out", family, torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["initial_state"], x["cu_seqlens"])
    op = getattr(cpu.ops, f"{family}_chunk_fwd")
    monkeypatch.delenv("KDA_DEV_PF", raising=False)
    o1, s1 = op(*args)
    ref = reference("big_out", family, torch.float32)
    assert rel_err(ref[0], o1) <= TOL[torch.float32]["o"] and rel_err(ref[1], s1) <= TOL[torch.float32]["state"]
    for hint in ("0", "2", "3", "4"):
        monkeypatch.setenv("KDA_DEV_PF", hint)
        o, s = op(*args)
        assert torch.equal(o, o1) and torch.equal(s, s1), f"KDA_DEV_PF={hint}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("turns,turn", [("1", ""), ("1", "64"), ("1", "128"), ("0", "")])
def test_kda_chunk_fwd_turns_knob(cpu, turns, turn, threads, monkeypatch):
    """The KDA chunked forward with heads taking turns (default; KDA_DEV_GDN_TB tokens rounded up to 64) and
    prefetch of the next chunk, and the old order (KDA_DEV_KDA_TURNS=0); varlen with an empty and a short
    sequence, 16 heads."""
    monkeypatch.setenv("KDA_DEV_KDA_TURNS", turns)
    if turn:
        monkeypatch.setenv("KDA_DEV_GDN_TB", turn)
    x, do, dsN = make_case("big_out", "kda", torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["initial_state"], x["cu_seqlens"])
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        o, s = cpu.ops.kda_chunk_fwd(*args)
    finally:
        torch.set_num_threads(n)
    ref = reference("big_out", "kda", torch.float32)
    assert rel_err(ref[0], o) <= TOL[torch.float32]["o"] and rel_err(ref[1], s) <= TOL[torch.float32]["state"]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["batch", "varlen"])
def test_gdn_chunk_fwd_head_blocks(cpu, layout, dtype, threads):
    """The GDN chunked forward runs 16-token chunks with the heads of a sequence taking turns every 256 tokens:
    sequences longer than one turn (and ending inside one), several heads per thread and a thread range that
    starts in the middle of a sequence's heads (2 threads, HV = 3), GVA, an empty and a length-3 sequence."""
    gen = torch.Generator().manual_seed(11)
    B, T, cu = (2, 600, None) if layout == "batch" else (1, 700, [0, 0, 3, 300, 300, 557, 700])
    H, HV, K, V = 1, 3, 32, 48
    q = torch.randn(B, T, H, K, generator=gen).to(dtype)
    k = F.normalize(torch.rand(B, T, H, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen)) / 0.3
    beta = torch.rand(B, T, HV, generator=gen)
    N = len(cu) - 1 if cu else B
    h0 = torch.randn(N, HV, K, V, generator=gen)
    cut = torch.tensor(cu, dtype=torch.long) if cu else None
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        o, s = cpu.ops.gdn_chunk_fwd(q, k, v, g, beta, K ** -0.5, h0, cut)
    finally:
        torch.set_num_threads(n)
    key = ("gdn_head_blocks", layout, dtype)
    if key not in _REF:
        _REF[key] = ref_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                   scale=K ** -0.5, initial_state=h0.double(), cu_seqlens=cu)
    ro, rs = _REF[key]
    assert rel_err(ro, o) <= TOL[dtype]["o"] and rel_err(rs, s) <= TOL[dtype]["state"], (rel_err(ro, o),
                                                                                          rel_err(rs, s))


def _serve_inputs(family, N, T, HV=2, H=1, K=32, V=48, seed=5):
    gen = torch.Generator().manual_seed(seed)
    x = dict(q=torch.randn(N, T, H, K, generator=gen),
             k=F.normalize(torch.rand(N, T, H, K, generator=gen), dim=-1),
             v=torch.randn(N, T, HV, V, generator=gen),
             g=F.logsigmoid(torch.randn((N, T, HV, K) if family == "kda" else (N, T, HV), generator=gen)),
             beta=torch.rand(N, T, HV, generator=gen))
    return x


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32_pool", "bf16_pool"])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["KV", "VK"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_serve_decode(cpu, family, state_v_first, pool_dtype):
    """[N] indices: each active sequence reads and writes back its row; a negative index is skipped."""
    N, T, HV, K, V, P = 3, 2, 2, 32, 48, 6
    x = _serve_inputs(family, N, T, HV=HV, K=K, V=V)
    pool = torch.randn((P, HV, V, K) if state_v_first else (P, HV, K, V)).to(pool_dtype)
    before = pool.clone()
    idx = torch.tensor([4, -1, 1])
    serve = getattr(cpu.ops, f"{family}_recurrent_serve")
    o = serve(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, pool, idx, None, None, state_v_first)
    h0 = before[idx.clamp(min=0)].float()
    ro, rs = ref_delta_rule(**x, scale=K ** -0.5, initial_state=h0, state_v_first=state_v_first)
    tol = 1e-5 if pool_dtype == torch.float32 else 0.005
    assert rel_err(ro[[0, 2]], o[[0, 2]]) <= tol
    assert torch.all(o[1] == 0), "a skipped sequence must output zeros"
    assert rel_err(rs[[0, 2]], pool[[4, 1]].float()) <= tol
    untouched = [r for r in range(P) if r not in (4, 1)]
    assert torch.equal(pool[untouched], before[untouched]), "rows outside the indices changed"


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_serve_speculative(cpu, family):
    """[N, T] indices with num_accepted_tokens: start from idx[n, acc-1], write the state after token t to
    idx[n, t] (negative: no write); a negative start skips the sequence."""
    N, T, HV, K, V, P = 3, 3, 2, 32, 48, 12
    x = _serve_inputs(family, N, T, HV=HV, K=K, V=V, seed=7)
    pool = torch.randn(P, HV, K, V)
    before = pool.clone()
    idx = torch.tensor([[0, 1, 2], [3, 4, -1], [-1, 6, 7]])
    acc = torch.tensor([2, 1, 1])  # sequence 0 starts from row 1; sequence 2 from row -1 (skipped)
    # sequence 1 writes row 3 (its start row) and row 4
    serve = getattr(cpu.ops, f"{family}_recurrent_serve")
    o = serve(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, pool, idx, acc, None, False)
    starts = [1, 3]
    for n, st in zip((0, 1), starts):
        xs = {kk: vv[n:n + 1] for kk, vv in x.items()}
        S = before[st:st + 1].double()
        for t in range(T):
            ro, S = ref_delta_rule(**{kk: vv[:, t:t + 1] for kk, vv in xs.items()}, scale=K ** -0.5,
                                   initial_state=S)
            assert rel_err(ro[0, 0], o[n, t]) <= 1e-5
            row = int(idx[n, t])
            if row >= 0:
                assert rel_err(S[0], pool[row]) <= 1e-5, f"seq {n} token {t}: row {row}"
    assert torch.all(o[2] == 0)
    assert torch.equal(pool[[5, 8, 9, 10, 11]], before[[5, 8, 9, 10, 11]])
    assert torch.equal(pool[[6, 7]], before[[6, 7]]), "a skipped sequence must not write"


def test_serve_varlen_bf16_inputs(cpu):
    """cu_seqlens with an empty sequence, bf16 q/k/v, through the public fused_recurrent_kda."""
    gen = torch.Generator().manual_seed(11)
    cu = torch.tensor([0, 3, 3, 4])
    T, H, HV, K, V, P = 4, 1, 2, 64, 32, 5
    x = dict(q=torch.randn(1, T, H, K, generator=gen).bfloat16(),
             k=F.normalize(torch.rand(1, T, H, K, generator=gen), dim=-1).bfloat16(),
             v=torch.randn(1, T, HV, V, generator=gen).bfloat16(),
             g=F.logsigmoid(torch.randn(1, T, HV, K, generator=gen)), beta=torch.rand(1, T, HV, generator=gen))
    pool = torch.randn(P, HV, K, V)
    before = pool.clone()
    idx = torch.tensor([2, 0, 4])
    with torch.no_grad():
        o, _ = cpu.fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=idx, cu_seqlens=cu)
    ro, rs = ref_delta_rule(**x, initial_state=before[idx], cu_seqlens=cu.tolist())
    assert rel_err(ro, o) <= 0.005
    assert rel_err(rs, pool[idx]) <= 0.005
    assert torch.equal(pool[[1, 3]], before[[1, 3]])


def test_public_api_grad_through_native(cpu):
    """chunk_kda with the options on (l2norm, beta sigmoid, fused gate) runs the native ops under autograd."""
    gen = torch.Generator().manual_seed(13)
    B, T, H, HV, K, V = 1, 70, 2, 4, 32, 32
    q = torch.randn(B, T, H, K, generator=gen, requires_grad=True)
    k = torch.randn(B, T, H, K, generator=gen, requires_grad=True)
    v = torch.randn(B, T, HV, V, generator=gen, requires_grad=True)
    g = torch.randn(B, T, HV, K, generator=gen, requires_grad=True)
    beta = torch.randn(B, T, HV, generator=gen, requires_grad=True)
    A_log = torch.randn(HV, generator=gen).requires_grad_(True)
    dt_bias = torch.randn(HV * K, generator=gen).requires_grad_(True)
    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
              A_log=A_log, dt_bias=dt_bias, output_final_state=True)
    leaves = [q, k, v, g, beta, A_log, dt_bias]
    o, s = cpu.chunk_kda(q, k, v, g, beta, **kw)
    grads = torch.autograd.grad((o * o).sum() + s.sum(), leaves)
    ro, rs = ref_delta_rule(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=True,
                            use_beta_sigmoid=True, use_gate=True)
    rgrads = torch.autograd.grad((ro * ro).sum() + rs.sum(), leaves)
    o, s, ro, rs = o.detach(), s.detach(), ro.detach(), rs.detach()
    assert rel_err(ro, o) <= 1e-5 and rel_err(rs, s) <= 1e-5
    for n, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias"), grads, rgrads):
        assert rel_err(r, a) <= 1e-5, f"{n}: {rel_err(r, a):.3g}"


def _anon_huge_kb(addr):
    """AnonHugePages (kB) of the mapping of this process that holds addr (Linux /proc/self/smaps)."""
    cur = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            cur = lo <= addr < hi
        elif cur and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("thp", ["1", "0"])
def test_big_output_is_advised(cpu, thp, monkeypatch):
    """With THP in "madvise" mode, a big output (o of a 64 MiB GDN forward) lands on huge pages, and not with
    KDA_DEV_CPU_THP=0 (the check that advise_huge really runs: its effect cannot be seen in the values)."""
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no /sys/kernel/mm/transparent_hugepage (not Linux?)")
    if "[madvise]" not in mode:
        pytest.skip(f"transparent huge pages mode is not madvise: {mode.strip()}")
    monkeypatch.setenv("KDA_DEV_CPU_THP", thp)
    T, HV, K, V = 2048, 64, 16, 128  # o: 64 MiB (a fresh mmap: above glibc's 32 MiB threshold)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, T, HV, K, generator=gen)
    k = F.normalize(torch.randn(1, T, HV, K, generator=gen), dim=-1)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(1, T, HV, generator=gen))
    beta = torch.rand(1, T, HV, generator=gen)
    for _ in range(3):  # huge pages are granted when the kernel has free 2 MiB blocks: a few tries before judging
        o, _ = cpu.ops.gdn_chunk_fwd(q, k, v, g, beta, K ** -0.5, None, None)
        inner = (o.data_ptr() + 2 ** 21 - 1) & ~(2 ** 21 - 1)  # the advised part (madvise splits the mapping)
        huge = _anon_huge_kb(inner)
        if huge > 0 or thp == "0":
            break
        del o
    if thp == "1" and huge == 0 and _huge_pages_now() == 0:
        pytest.skip("the kernel gives no huge pages right now (fragmented memory?) even to a plain madvise")
    assert (huge > 0) == (thp == "1"), f"AnonHugePages of o's mapping: {huge} kB with KDA_DEV_CPU_THP={thp}"


def _huge_pages_now():
    """AnonHugePages (kB) of a fresh 64 MiB anonymous mapping advised MADV_HUGEPAGE here and touched."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    m = mmap.mmap(-1, 64 << 20)
    buf = ctypes.c_char.from_buffer(m)
    try:
        addr = ctypes.addressof(buf)
        a, e = (addr + 2 ** 21 - 1) & ~(2 ** 21 - 1), (addr + (64 << 20)) & ~(2 ** 21 - 1)
        libc.madvise(a, e - a, 14)  # MADV_HUGEPAGE
        for off in range(0, 64 << 20, 4096):
            m[off] = 1
        return _anon_huge_kb(a)
    finally:
        del buf
        m.close()
