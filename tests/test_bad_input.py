"""Bad input: every invalid argument raises ValueError/TypeError naming the argument and what was expected
(the table is tests/bad_input_table.py, which also generates docs/bad_inputs.md); non-contiguous inputs give
the results of contiguous ones; inputs are never modified, forward or backward.
"""
from pathlib import Path

import pytest
import torch

from bad_input_table import CASES, CORE, GATES, call_case, check, markdown, valid_args
from test_fuzz import single_thread  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.filterwarnings("ignore:kda-kernels. no native:RuntimeWarning")
ROOT = Path(__file__).resolve().parents[1]

_PARAMS = [pytest.param(case, fn, id=f"{case.id}-{fn}",
                        marks=[pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else [])
           for case in CASES for fn in case.fns]


@pytest.mark.parametrize("case,fn", _PARAMS)
def test_bad_input_raises_a_clear_error(variant, case, fn):
    exc = call_case(variant, case, fn)
    problem = check(exc, case)
    assert not problem, f"{case.input}: {problem}"
    assert str(exc).startswith(f"[{fn}]"), f"message does not name the function: {exc}"


def test_every_case_is_valid_without_its_change(kda_universal):
    """The table's base calls are valid, so each case fails for the one reason it names."""
    for fn in CORE + GATES:
        for setup in ({}, dict(varlen=True), dict(gate=True)) + ((dict(pool=True),) if "recurrent" in fn else ()):
            if fn in GATES and setup:
                continue
            with torch.no_grad():
                getattr(kda_universal, fn)(**valid_args(fn, **setup))


def test_docs_table_is_generated_from_this_table(kda_universal):
    doc = ROOT / "docs" / "bad_inputs.md"
    assert doc.read_text() == markdown(kda_universal), \
        "docs/bad_inputs.md is stale: .venv/bin/python tests/bad_input_table.py > docs/bad_inputs.md"


# ---------------------------------------------------------------- non-contiguous inputs, unmodified inputs
def _noncontiguous(t):
    """Same values, non-contiguous strides (a transposed copy transposed back, or a strided slice for 1-D)."""
    if t.dim() >= 2:
        out = t.transpose(0, -1).contiguous().transpose(0, -1)
    else:
        out = torch.empty(t.shape[0] * 2, dtype=t.dtype)[::2]
        out.copy_(t)
    assert t.numel() <= 1 or not out.is_contiguous()
    return out


OPTIONS = {
    "plain": dict(),
    "all_options": dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                        use_gate_in_kernel=True, lower_bound=-5.0, state_v_first=True),
}


def _full_call(fn, opts, varlen):
    a = valid_args(fn, varlen=varlen, gate=opts.get("use_gate_in_kernel", False))
    a.update(opts)
    N = 2
    gen = torch.Generator().manual_seed(5)
    HV, K, V = a["v"].shape[2], a["q"].shape[3], a["v"].shape[3]
    a["initial_state"] = torch.randn((N, HV, V, K) if opts.get("state_v_first") else (N, HV, K, V), generator=gen)
    if opts.get("use_beta_sigmoid_in_kernel"):
        a["beta"] = torch.randn(a["beta"].shape, generator=gen)
    return a


def _run(mod, fn, a, grads=True):
    ins = {n: (t.requires_grad_(True) if grads and isinstance(t, torch.Tensor) and t.is_floating_point() else t)
           for n, t in a.items()}
    o, s = getattr(mod, fn)(**ins, output_final_state=True)
    gen = torch.Generator().manual_seed(6)
    ((o * torch.randn(o.shape, generator=gen)).sum() + (s * torch.randn(s.shape, generator=gen)).sum()).backward()
    return [o.detach(), s.detach()] + [ins[n].grad for n in sorted(ins)
                                       if isinstance(ins[n], torch.Tensor) and ins[n].is_floating_point()]


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
@pytest.mark.parametrize("opts", list(OPTIONS))
@pytest.mark.parametrize("fn", CORE)
def test_noncontiguous_inputs_give_the_contiguous_results(variant, fn, opts, varlen):
    a = _full_call(fn, OPTIONS[opts], varlen)
    nc = {n: (_noncontiguous(t) if isinstance(t, torch.Tensor) else t) for n, t in a.items()}
    assert not nc["q"].is_contiguous() and not nc["initial_state"].is_contiguous()
    want = _run(variant, fn, {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in a.items()})
    got = _run(variant, fn, nc)
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.shape == w.shape and g.dtype == w.dtype
        # the package makes inputs contiguous before the core op; only the (differentiable, elementwise or
        # K-reduction) option pre-processing sees the strides, so results agree to rounding
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=f"output/grad #{i} differs")


@pytest.mark.parametrize("fn", GATES)
def test_noncontiguous_gate_inputs_give_the_contiguous_results(variant, fn):
    a = valid_args(fn)
    want = getattr(variant, fn)(**a, lower_bound=-3.0)
    got = getattr(variant, fn)(**{n: _noncontiguous(t) for n, t in a.items()}, lower_bound=-3.0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
@pytest.mark.parametrize("opts", list(OPTIONS))
@pytest.mark.parametrize("fn", CORE)
def test_inputs_are_never_modified(variant, fn, opts, varlen):
    a = _full_call(fn, OPTIONS[opts], varlen)
    before = {n: t.clone() for n, t in a.items() if isinstance(t, torch.Tensor)}
    _run(variant, fn, a)  # forward and backward
    for n, t in before.items():
        assert torch.equal(a[n].detach(), t), f"{fn} modified its input {n}"


@pytest.mark.parametrize("grad", [False, True], ids=["serve_op", "autograd_path"])
@pytest.mark.parametrize("fn", ["fused_recurrent_kda", "fused_recurrent_gated_delta_rule"])
def test_serving_call_modifies_only_the_pool(variant, fn, grad):
    a = valid_args(fn, pool=True, gate=True)
    a["ssm_state_indices"] = torch.tensor([[0, 1, 2, 3, 4], [5, -1, -1, -1, -1]]) if not grad else \
        torch.tensor([4, 1])
    if not grad:
        a["num_accepted_tokens"] = torch.tensor([2, 1])
    before = {n: t.clone() for n, t in a.items() if isinstance(t, torch.Tensor) and n != "initial_state"}
    ins = {n: (t.requires_grad_(True) if grad and isinstance(t, torch.Tensor) and t.is_floating_point()
               and n != "initial_state" else t) for n, t in a.items()}
    with torch.set_grad_enabled(grad):
        o, _ = getattr(variant, fn)(**ins, use_qk_l2norm_in_kernel=True)
        if grad:
            o.sum().backward()
    for n, t in before.items():
        assert torch.equal(a[n].detach(), t), f"{fn} modified its input {n}"


@pytest.mark.parametrize("fn", GATES)
def test_gate_inputs_are_never_modified(variant, fn):
    a = {n: t.requires_grad_(True) for n, t in valid_args(fn).items()}
    before = {n: t.detach().clone() for n, t in a.items()}
    getattr(variant, fn)(**a).sum().backward()
    for n, t in before.items():
        assert torch.equal(a[n].detach(), t), f"{fn} modified its input {n}"
