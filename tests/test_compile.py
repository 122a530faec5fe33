"""Custom-op plumbing: opcheck, and torch.compile(fullgraph=True) through forward and backward without graph breaks."""
import pytest
import torch
import torch.nn.functional as F


@pytest.fixture(scope="module")
def kda(variant):
    return variant


def _inputs(B=1, T=20, H=2, HV=4, K=16, V=8, gdn=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn((B, T, HV) if gdn else (B, T, HV, K), generator=gen))
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen)
    return q, k, v, g, beta, h0


@pytest.mark.parametrize("name", ["kda_chunk_fwd", "kda_recurrent_fwd", "gdn_chunk_fwd", "gdn_recurrent_fwd"])
def test_opcheck_forward_ops(kda, name):
    q, k, v, g, beta, h0 = _inputs(gdn=name.startswith("gdn"))
    op = getattr(kda.ops, name)
    args = (q, k, v, g, beta, 0.25, h0, None)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    cu = torch.tensor([0, 7, 7, 20])
    qv, kv, vv, gv, bv = (x[:1] for x in (q, k, v, g, beta))
    torch.library.opcheck(op, (qv, kv, vv, gv, bv, 0.25, torch.randn(3, 4, 16, 8), cu),
                          test_utils=("test_schema", "test_faketensor"))


def _loss(kda, q, k, v, g, beta, h0, gq):
    o1, s1 = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o2, s2 = kda.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o3, _ = kda.chunk_gated_delta_rule(q, k, v, gq, beta, use_qk_l2norm_in_kernel=True)
    return (o1 * 1.5 + o2 - o3).square().sum() + (s1 * s2).sum()


def test_compile_fullgraph_forward_and_backward_no_graph_break(kda):
    q, k, v, g, beta, h0 = _inputs()
    gq = F.logsigmoid(torch.randn(1, 20, 4))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]

    def step(q, k, v, g, beta, h0):
        loss = _loss(kda, q, k, v, g, beta, h0, gq)
        return loss, torch.autograd.grad(loss, (q, k, v, g, beta, h0))

    eager_loss, eager_grads = step(*leaves)

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()

    compiled = torch.compile(_loss_only(kda, gq), fullgraph=True, backend="aot_eager")
    leaves2 = [x.detach().clone().requires_grad_(True) for x in leaves]
    with torch._dynamo.config.patch(error_on_recompile=True):
        loss = compiled(*leaves2)
        loss.backward()
        # a second call with same shapes must not recompile
        leaves3 = [x.detach().clone().requires_grad_(True) for x in leaves]
        compiled(*leaves3).backward()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(leaves2, eager_grads):
        torch.testing.assert_close(a.grad, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(leaves3[0].grad, leaves2[0].grad, rtol=0, atol=0)


def _loss_only(kda, gq):
    def f(q, k, v, g, beta, h0):
        return _loss(kda, q, k, v, g, beta, h0, gq)
    return f


def test_compile_inductor_forward(kda):
    q, k, v, g, beta, h0 = _inputs(T=10)

    def f(q, k, v, g, beta, h0):
        o, s = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        return o.sum(-1), s

    torch._dynamo.reset()
    ref = f(q, k, v, g, beta, h0)
    out = torch.compile(f, fullgraph=True)(q, k, v, g, beta, h0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_compile_fullgraph_training_windows(kda, monkeypatch):
    # KDA_TRAIN_WINDOW (docs/ops.md): the windowed forward (splits, one core op per window, concatenation) traces
    # with fullgraph=True, forward and backward, no graph break, and gives the unwindowed eager results
    monkeypatch.setenv("KDA_TRAIN_WINDOW", "64")
    q, k, v, g, beta, h0 = _inputs(B=2, T=150)
    gq = F.logsigmoid(torch.randn(2, 150, 4))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    monkeypatch.setenv("KDA_TRAIN_WINDOW", "0")
    eager_loss = _loss(kda, *leaves, gq)
    eager_grads = torch.autograd.grad(eager_loss, leaves)
    monkeypatch.setenv("KDA_TRAIN_WINDOW", "64")
    calls = []
    real = kda.api.train_windows
    monkeypatch.setattr(kda.api, "train_windows", lambda *a, **kw: calls.append(real(*a, **kw)) or calls[-1])
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(_loss_only(kda, gq), fullgraph=True, backend="aot_eager")
    leaves2 = [x.detach().clone().requires_grad_(True) for x in leaves]
    loss = compiled(*leaves2)
    loss.backward()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert calls and all(len(p) == 6 for p in calls), calls  # 2 sequences x 3 windows (64, 64, 22), traced
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(leaves2, eager_grads):
        torch.testing.assert_close(a.grad, b, rtol=1e-4, atol=1e-5)
