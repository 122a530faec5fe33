"""Training windows of the public chunked API (KDA_TRAIN_WINDOW, docs/ops.md): a call whose gradients are recorded
runs its forward as consecutive windows of the (batch, time) axes through the core op, each window starting from
the previous one's final state, so autograd runs one window's backward at a time.

Runs on every variant that runs on this machine (conftest's `variant`: torch-universal's pure-PyTorch fallback and
the native CPU variant), with the knob set explicitly (the automatic default applies on CUDA only):
the windows' plan, windowed == unwindowed (forward and every gradient, initial state included) within fp32
summation-order tolerance, both against the float64 reference, the cases that must not be windowed (inference,
varlen, recurrent), and torch.compile(fullgraph=True) through the windows.
"""
import pytest
import torch

from ref_delta import assert_close, ref_delta_rule
from test_api import TOL, make_inputs

FNS = {"kda": "chunk_kda", "gdn": "chunk_gated_delta_rule"}


@pytest.fixture(scope="module")
def kda(variant):
    return variant


class _Counting:
    """Stands in for api.ops: counts the calls of each core op (a windowed call runs the forward op per window)."""

    def __init__(self, ops):
        self._ops, self.calls = ops, {}

    def __getattr__(self, name):
        op = getattr(self._ops, name)

        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return op(*args)
        return call


@pytest.fixture
def count_ops(kda, monkeypatch):
    c = _Counting(kda.api.ops)
    monkeypatch.setattr(kda.api, "ops", c)
    return c


# ---------------------------------------------------------------- the plan (pure Python)
def _check_cover(plan, B, T):
    seen = torch.zeros(B, T, dtype=torch.int32)
    for b0, nb, t0, nt in plan:
        assert t0 % 64 == 0 and nb >= 1 and nt >= 1 and (nb == 1 or (t0 == 0 and nt == T)), plan
        seen[b0:b0 + nb, t0:t0 + nt] += 1
    assert bool((seen == 1).all()), plan
    # in order: a sequence's windows follow each other in time (each starts from the previous one's final state)
    assert plan == sorted(plan), plan


def test_plan(kda):
    tw = kda.api.train_windows
    # automatic: the CUDA backward's token-heads (65536 / (B * HV) tokens, at least 512), one sequence at a time
    p = tw(1, 8192, 32, "cuda", knob=-1)
    assert p == [(0, 1, t, 2048) for t in range(0, 8192, 2048)]
    p = tw(4, 4096, 32, "cuda", knob=-1)
    assert p == [(b, 1, t, 2048) for b in range(4) for t in (0, 2048)]
    assert tw(1, 32768, 32, "cuda", knob=-1) == [(0, 1, t, 2048) for t in range(0, 32768, 2048)]
    assert tw(1, 2048, 32, "cuda", knob=-1) == []  # fits one window
    assert tw(1, 4096, 8, "cuda", knob=-1) == []  # 65536 / 8 = 8192 tokens per window
    # balanced windows at multiples of 64 (T = 8200: 5 of 1664, the last 1544), as bwd_window_tokens
    p = tw(1, 8200, 32, "cuda", knob=-1)
    assert [w[3] for w in p] == [1664] * 4 + [1544]
    # short sequences: whole sequences grouped, balanced (B = 5, at most 2 per window -> 2, 2, 1)
    p = tw(5, 100, 4, "cpu", knob=256)
    assert p == [(0, 2, 0, 100), (2, 2, 0, 100), (4, 1, 0, 100)]
    # explicit token counts round up to the chunk; a sequence longer than the window runs alone
    assert tw(3, 150, 4, "cpu", knob=100) == [(b, 1, t, n) for b in range(3) for t, n in ((0, 128), (128, 22))]
    assert tw(1, 200, 4, "cpu", knob=64) == [(0, 1, t, n) for t, n in ((0, 64), (64, 64), (128, 64), (192, 8))]
    assert tw(2, 40, 4, "cpu", knob=8) == [(0, 1, 0, 40), (1, 1, 0, 40)]  # T <= 64: whole sequences
    for args in [(1, 8192, 32, -1), (4, 4096, 32, -1), (1, 8200, 32, -1), (5, 100, 4, 256), (3, 150, 4, 100),
                 (1, 200, 4, 64), (7, 1000, 2, 300), (3, 65, 1, 1), (2, 40, 4, 8)]:
        B, T, HV, knob = args
        _check_cover(tw(B, T, HV, "cpu", knob=knob), B, T)
    # off: 0, below -1, or the whole call fits
    assert tw(4, 4096, 32, "cuda", knob=0) == [] and tw(4, 4096, 32, "cuda", knob=-7) == []
    assert tw(2, 100, 4, "cpu", knob=200) == []


def test_knob(kda, monkeypatch):
    api = kda.api
    monkeypatch.delenv(api.TRAIN_WINDOW_ENV, raising=False)
    assert api.train_windows(1, 8192, 32, "cuda") == ([] if api.TRAIN_WINDOW_DEFAULT == 0 else
                                                      api.train_windows(1, 8192, 32, "cuda", api.TRAIN_WINDOW_DEFAULT))
    # the automatic default applies on CUDA only; an explicit knob on every device
    monkeypatch.setattr(api, "TRAIN_WINDOW_DEFAULT", -1)
    assert len(api.train_windows(1, 8192, 32, "cuda")) == 4
    assert api.train_windows(1, 8192, 32, "cpu") == []
    monkeypatch.setenv(api.TRAIN_WINDOW_ENV, "-1")
    assert len(api.train_windows(1, 8192, 32, "cpu")) == 4
    monkeypatch.setenv(api.TRAIN_WINDOW_ENV, "0")
    assert api.train_windows(1, 8192, 32, "cuda") == []
    monkeypatch.setenv(api.TRAIN_WINDOW_ENV, "1024")
    assert len(api.train_windows(1, 8192, 32, "cpu")) == 8
    monkeypatch.setenv(api.TRAIN_WINDOW_ENV, "lots")
    with pytest.raises(ValueError, match="KDA_TRAIN_WINDOW must be an integer"):
        api.train_windows(1, 8192, 32, "cpu")


# ---------------------------------------------------------------- windowed == unwindowed == reference
# (B, T, H, HV, K, V, knob, windows): T not a multiple of 64 nor of the window, GVA, B > 1 in time windows, in
# groups of whole sequences, and a window of one chunk
SHAPES = {
    "B1_T200_gva2_w64": (1, 200, 2, 4, 32, 16, 64, 4),
    "B3_T150_w100": (3, 150, 1, 2, 16, 24, 100, 6),
    "B4_T40_groups": (4, 40, 2, 2, 16, 16, 100, 2),
    "B2_T130_gva4_w128": (2, 130, 1, 4, 24, 8, 128, 4),
}


def _run(mod, family, shape, knob, monkeypatch, initial_state=True, final=True, state_v_first=False, seed=3,
         dtype=torch.float32):
    B, T, H, HV, K, V = shape[:6]
    monkeypatch.setenv("KDA_TRAIN_WINDOW", str(knob))
    x = make_inputs(family, B=B, T=T, H=H, HV=HV, K=K, V=V, seed=seed, initial_state=initial_state,
                    state_v_first=state_v_first, dtype=dtype)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o, state = getattr(mod, FNS[family])(**leaves, output_final_state=final, state_v_first=state_v_first)
    gen = torch.Generator().manual_seed(seed + 100)
    do = torch.randn(o.shape, generator=gen)
    loss = (o.float() * do).sum()
    dstate = None
    if final:
        dstate = torch.randn(state.shape, generator=gen)
        loss = loss + (state * dstate).sum()
    else:
        assert state is None
    loss.backward()
    return x, o.detach(), (state.detach() if final else None), {n: t.grad for n, t in leaves.items()}, do, dstate


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_windowed_matches_unwindowed_and_reference(kda, family, shape, monkeypatch, count_ops):
    spec = SHAPES[shape]
    knob, windows = spec[6], spec[7]
    fwd = f"{family}_chunk_fwd"
    _, o0, s0, g0, _, _ = _run(kda, family, spec, 0, monkeypatch)
    assert count_ops.calls == {fwd: 1}
    x, o1, s1, g1, do, dstate = _run(kda, family, spec, knob, monkeypatch)
    assert count_ops.calls[fwd] == 1 + windows, count_ops.calls
    assert set(g1) == {"q", "k", "v", "g", "beta", "initial_state"}
    # the same chunks, only the sums' order differs (window-start states from the forward)
    assert_close("o", o0.double(), o1, 2e-6)
    assert_close("final_state", s0.double(), s1, 2e-6)
    for n in g0:
        assert g1[n] is not None and g1[n].dtype == g0[n].dtype, n
        assert_close("d" + n, g0[n].double(), g1[n], 2e-6)
    # and the float64 reference at DESIGN.md section 6's fp32 tolerances
    ref = {n: t.detach().double().requires_grad_(True) for n, t in x.items()}
    ro, rs = ref_delta_rule(**ref)
    ((ro * do.double()).sum() + (rs * dstate.double()).sum()).backward()
    tol = TOL[torch.float32]
    assert_close("o vs float64", ro, o1, tol["o"])
    assert_close("state vs float64", rs, s1, tol["state"])
    for n in x:
        assert_close(f"d{n} vs float64", ref[n].grad, g1[n], tol["dh0" if n == "initial_state" else "d" + n])


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_without_state_and_final(kda, family, monkeypatch, count_ops):
    # no initial state (the first window starts from zeros, no dh0) and no final state asked (None; the last
    # window's final state gets zero gradient); V-first states
    spec = SHAPES["B3_T150_w100"]
    for kw in (dict(initial_state=False, final=False), dict(initial_state=False, final=True),
               dict(initial_state=True, final=False, state_v_first=True)):
        _, o0, s0, g0, _, _ = _run(kda, family, spec, 0, monkeypatch, **kw)
        _, o1, s1, g1, _, _ = _run(kda, family, spec, 100, monkeypatch, **kw)
        assert_close("o", o0.double(), o1, 2e-6)
        assert (s0 is None) == (s1 is None) == (not kw["final"])
        if s0 is not None:
            assert_close("final_state", s0.double(), s1, 2e-6)
        assert set(g0) == set(g1)
        for n in g0:
            assert_close("d" + n, g0[n].double(), g1[n], 2e-6)
    assert count_ops.calls[f"{family}_chunk_fwd"] == 3 * (1 + 6)


def test_bf16_windowed(kda, monkeypatch):
    # bf16 inputs: the window pieces keep the dtype, gradients come back in it, within DESIGN.md's bf16 bounds
    spec = SHAPES["B1_T200_gva2_w64"]
    x, o, s, g, do, dstate = _run(kda, "kda", spec, 64, monkeypatch, dtype=torch.bfloat16)
    assert o.dtype == torch.bfloat16 and g["q"].dtype == torch.bfloat16 and g["g"].dtype == torch.float32
    ref = {n: t.detach().double().requires_grad_(True) for n, t in x.items()}
    ro, rs = ref_delta_rule(**ref)
    ((ro * do.double()).sum() + (rs * dstate.double()).sum()).backward()
    tol = TOL[torch.bfloat16]
    assert_close("o", ro, o, tol["o"])
    for n in x:
        assert_close("d" + n, ref[n].grad, g[n], tol["dh0" if n == "initial_state" else "d" + n])


def test_not_windowed(kda, monkeypatch, count_ops):
    # inference (no gradient recorded), varlen (cu_seqlens), the recurrent functions and calls that fit one window
    # run the core op once
    monkeypatch.setenv("KDA_TRAIN_WINDOW", "64")
    x = make_inputs("kda", B=1, T=200, H=2, HV=2, K=16, V=16, initial_state=True)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    with torch.no_grad():
        kda.chunk_kda(**leaves, output_final_state=True)
    with torch.inference_mode():
        kda.chunk_kda(**x)
    kda.chunk_kda(**x)  # nothing requires grad
    assert count_ops.calls == {"kda_chunk_fwd": 3}
    cu = torch.tensor([0, 70, 70, 200])
    xv = make_inputs("kda", B=1, T=200, H=2, HV=2, K=16, V=16, initial_state=True, cu_seqlens=[0, 70, 70, 200])
    lv = {n: t.clone().requires_grad_(True) for n, t in xv.items()}
    kda.chunk_kda(**lv, cu_seqlens=cu)[0].sum().backward()
    assert count_ops.calls == {"kda_chunk_fwd": 4}
    kda.fused_recurrent_kda(**leaves, output_final_state=True)[0].sum().backward()
    assert count_ops.calls == {"kda_chunk_fwd": 4, "kda_recurrent_fwd": 1}
    monkeypatch.setenv("KDA_TRAIN_WINDOW", "256")
    kda.chunk_kda(**leaves)[0].sum().backward()
    assert count_ops.calls["kda_chunk_fwd"] == 5
    monkeypatch.setenv("KDA_TRAIN_WINDOW", "64")
    kda.chunk_kda(**leaves)[0].sum().backward()
    assert count_ops.calls["kda_chunk_fwd"] == 9


def test_gradients_assembled_once(kda, monkeypatch):
    # each input's gradient comes from one split (one concatenation in the backward), not a full-size zeros + add
    # per window: the graph holds one SplitWithSizesBackward per input, no SliceBackward / CopySlices
    spec = SHAPES["B3_T150_w100"]
    monkeypatch.setenv("KDA_TRAIN_WINDOW", "100")
    x = make_inputs("kda", B=3, T=150, H=1, HV=2, K=16, V=24, initial_state=True)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o, s = kda.chunk_kda(**leaves, output_final_state=True)
    names, stack, seen = [], [o.grad_fn, s.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    assert names.count("SplitWithSizesBackward0") == 6, names  # q, k, v, g, beta, initial_state
    assert not any("Slice" in n or "CopySlices" in n or "Index" in n for n in names), names
    assert spec[7] == 6


def test_memory_model_plans_the_same_windows(kda):
    # tests/cuda_mem_model.py keeps a copy of the plan (pure Python, no package import) for its peak prediction
    from cuda_mem_model import train_window_peak, train_windows
    for B, T, HV, knob in [(1, 8192, 32, -1), (4, 4096, 32, -1), (1, 32768, 32, -1), (1, 8200, 32, -1),
                           (5, 100, 4, 256), (3, 150, 4, 100), (1, 200, 4, 64), (7, 1000, 2, 300), (2, 40, 4, 8),
                           (1, 2048, 32, -1), (8, 1024, 16, -1), (2, 4096, 8, 0)]:
        assert train_windows(B, T, HV, knob) == kda.api.train_windows(B, T, HV, "cuda", knob=knob), (B, T, HV, knob)
    assert train_window_peak("kda", 1, 2048, 16, 32, 128, 128) is None  # one window: not windowed
    peak, parts = train_window_peak("kda", 1, 8192, 16, 32, 128, 128)
    assert parts["windows"] == 4 and peak < 900 * 2 ** 20  # the model's claim at issue #7's shape


# ---------------------------------------------------------------- the memory model's autograd accounting
class _StandIn(torch.autograd.Function):
    """A core op with known allocations (no math): the forward a workspace of WS bytes while it runs, then o and
    the final state; the backward a work buffer of WORK bytes alive while its outputs are allocated."""
    WS, WORK = 3 << 20, 5 << 20

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0):
        ws = torch.empty(_StandIn.WS, dtype=torch.uint8)
        B, T, HV, V = v.shape
        o = torch.zeros(B, T, HV, V, dtype=v.dtype)
        h = torch.zeros(B, HV, q.shape[3], V, dtype=torch.float32)
        del ws
        ctx.has_h0 = h0 is not None
        ctx.save_for_backward(q, k, v, g, beta, h0)
        return o, h

    @staticmethod
    def backward(ctx, do, dh):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        work = torch.empty(_StandIn.WORK, dtype=torch.uint8)
        grads = [torch.zeros_like(x) for x in (q, k, v, g, beta)]
        dh0 = torch.zeros(q.shape[0], v.shape[2], q.shape[3], v.shape[3])
        del work
        return (*grads, dh0 if ctx.has_h0 else None)


class _StandInOps:
    def __getattr__(self, name):
        assert name.endswith("_chunk_fwd"), name
        return lambda q, k, v, g, beta, scale, h0, cu: _StandIn.apply(q, k, v, g, beta, h0)


def _cpu_peak(fn):
    """Peak bytes allocated on the CPU above what existed before fn (the profiler's memory timeline)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfileTimeline
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    cur = peak = 0
    for _, action, (key, _), size in MemoryProfileTimeline(prof._memory_profile()).timeline:
        if key.device.type != "cpu":
            continue
        if action == Action.CREATE:
            cur += size
        elif action == Action.DESTROY:
            cur -= size
        peak = max(peak, cur)
    return peak


@pytest.mark.parametrize("regime", ["backward", "forward", "concat"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("shape", [(1, 1024, 2, 4, 256), (4, 512, 2, 4, 256), (6, 128, 1, 2, 256)],
                         ids=["B1_time", "B4_time", "B6_groups"])
def test_memory_model_autograd_accounting(kda, family, shape, regime, monkeypatch):
    # cuda_mem_model.train_window_peak's autograd part (o pieces, saved start states, carried dh, gradients held
    # for one concatenation per input, the concatenations) against the CPU allocator's measured peak of one
    # public forward + backward whose core op is a stand-in with known allocations: equal to the byte, with the
    # stand-in's buffers sized so that each phase is the peak in turn
    from cuda_mem_model import train_window_peak
    ws, work = {"backward": (3 << 20, 5 << 20), "forward": (40 << 20, 0), "concat": (0, 0)}[regime]
    monkeypatch.setattr(_StandIn, "WS", ws)
    monkeypatch.setattr(_StandIn, "WORK", work)
    B, T, H, HV, knob = shape
    K = V = 64
    monkeypatch.setattr(kda.api, "ops", _StandInOps())
    monkeypatch.setenv("KDA_TRAIN_WINDOW", str(knob))
    xs = make_inputs(family, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=torch.bfloat16)
    leaves = [xs[n].requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
    do = torch.randn(B, T, HV, V).bfloat16()
    dht = torch.randn(B, HV, K, V)
    fn = kda.chunk_kda if family == "kda" else kda.chunk_gated_delta_rule

    def fwdbwd():
        o, s = fn(*leaves, output_final_state=True)
        return torch.autograd.grad((o, s), leaves, (do, dht))

    fwdbwd()
    measured = _cpu_peak(fwdbwd)

    def block(nb, nt):  # the stand-in backward: work + its outputs (dq, dk bf16 [n,H,K], dv, dg, dbeta fp32, dh0)
        n = nb * nt
        return (_StandIn.WORK + 2 * n * H * K * 2 + n * HV * V * 2 + n * HV * (K if family == "kda" else 1) * 4
                + n * HV * 4 + nb * HV * K * V * 4)

    pred, parts = train_window_peak(family, B, T, H, HV, K, V, knob=knob, block=block,
                                    fwd_ws=lambda nb, nt: _StandIn.WS)
    assert parts["windows"] >= 2
    assert measured == pred, (measured, pred, parts)
