"""Property-based tests: random shapes and option combinations against the float64 reference (DESIGN.md §1, §6).

Every variant that runs here (the `variant` fixture of conftest.py; the test id names it) is fuzzed over
KDA/GDN, chunked/recurrent, fp32/bf16, T in {0, 1, ..., 100}, GVA, varlen with empty sequences, initial states
in both layouts, q/k L2 norm, beta sigmoid (with allow_neg_eigval), the fused gate (with lower_bound) and a
caller-supplied scale; outputs, final states and the gradients of every differentiable input are compared.
Also: the same call twice is bitwise identical (outputs and gradients).
Hypothesis is derandomized, so CI runs the same examples every time.
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ref_delta import assert_close as _assert_close
from ref_delta import ref_delta_rule

pytestmark = pytest.mark.filterwarnings("ignore:kda-kernels. no native:RuntimeWarning")


@pytest.fixture(autouse=True)
def single_thread():
    """One intra-op thread: on this shared 2-core machine, oversubscribed OpenMP runs these small problems 10-30x
    slower. Tests that exercise threading (determinism) ask for more themselves."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

FUNCS = {("kda", "chunk"): "chunk_kda", ("kda", "recurrent"): "fused_recurrent_kda",
         ("gdn", "chunk"): "chunk_gated_delta_rule", ("gdn", "recurrent"): "fused_recurrent_gated_delta_rule"}

# DESIGN.md §6: relative RMS error vs the float64 reference
TOL = {
    torch.float32: dict(o=1e-5, state=1e-5, q=1e-5, k=1e-5, v=1e-5, initial_state=1e-5, g=1e-5, beta=1e-5,
                        A_log=1e-5, dt_bias=1e-5),
    torch.bfloat16: dict(o=0.005, state=0.005, q=0.008, k=0.008, v=0.008, initial_state=0.008, g=0.02, beta=0.02,
                         A_log=0.02, dt_bias=0.02),
}

_REF_NAMES = dict(use_qk_l2norm_in_kernel="use_qk_l2norm", use_beta_sigmoid_in_kernel="use_beta_sigmoid",
                  allow_neg_eigval="allow_neg_eigval", use_gate_in_kernel="use_gate", lower_bound="lower_bound",
                  state_v_first="state_v_first", scale="scale")


def assert_close(name, ref, out, tol, floor=0.0):
    """ref_delta.assert_close, also for empty tensors (T = 0), where the RMS ratio is undefined.

    `floor`: when RMS(ref) < floor, the absolute RMS error must be <= floor instead (for gradients that are
    ~e^-50 because every token decays by -50: no fp32 computation on O(1) values resolves those).
    """
    if ref.numel() == 0:
        assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
        return
    ref, out = ref.detach(), out.detach()
    if floor and float(ref.double().pow(2).mean().sqrt()) < floor:
        assert torch.isfinite(out).all(), f"{name}: non-finite values in output"
        err = float((ref.double() - out.double()).pow(2).mean().sqrt())
        assert err <= floor, f"{name}: absolute RMS error {err:.3g} > {floor:g} (reference RMS below it)"
        return
    _assert_close(name, ref, out, tol)


def make_inputs(family, B=1, T=33, H=1, HV=2, K=16, V=8, dtype=torch.float32, seed=0, lens=None,
                initial_state=False, state_v_first=False, l2norm=False, beta_sigmoid=False, gate_in_kernel=False,
                gate_div=1.0, g=None, beta=None, k=None, v_scale=1.0):
    """Tensors for one call: q, k, v in `dtype`; g fp32; beta in `dtype`; states fp32.

    Keys are unit-norm and correlated (rand, normalised) unless the kernel normalises them (then raw randn), so
    the recurrence is stable for beta in [0, 2]. `g`, `beta`, `k` override the random ones (extreme-input tests).
    With `lens`, B must be 1 and T == sum(lens) (varlen, cu_seqlens returned under "cu_seqlens").
    """
    gen = torch.Generator().manual_seed(seed)
    if lens is not None:
        B, T = 1, sum(lens)
    q = torch.randn(B, T, H, K, generator=gen)
    if k is None:
        k = torch.randn(B, T, H, K, generator=gen) * 3 if l2norm else \
            F.normalize(torch.rand(B, T, H, K, generator=gen) + 1e-3, dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen) * v_scale
    gshape = (B, T, HV, K) if family == "kda" else (B, T, HV)
    if g is None:
        graw = torch.randn(gshape, generator=gen)
        g = graw if gate_in_kernel else F.logsigmoid(graw) / gate_div
    if beta is None:
        beta = torch.randn(B, T, HV, generator=gen) if beta_sigmoid else torch.rand(B, T, HV, generator=gen)
    x = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.float(), beta=beta.to(dtype))
    if initial_state:
        N = B if lens is None else len(lens)
        x["initial_state"] = torch.randn((N, HV, V, K) if state_v_first else (N, HV, K, V), generator=gen)
    if gate_in_kernel:
        x["A_log"] = torch.randn(HV, generator=gen) * 0.5
        x["dt_bias"] = torch.randn(HV * K if family == "kda" else HV, generator=gen) * 0.5
    if lens is not None:
        x["cu_seqlens"] = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    return x


def check_against_reference(mod, family, mode, x, opts, dtype, grads=True, tol=None, seed=1, floor=0.0):
    """Run the public function and the float64 reference on the same values; compare o, state and gradients."""
    tol = tol or TOL[dtype]
    cu = x.get("cu_seqlens")
    tensors = {n: t for n, t in x.items() if n != "cu_seqlens"}
    leaves = {n: t.clone().requires_grad_(grads) for n, t in tensors.items()}
    fn = getattr(mod, FUNCS[(family, mode)])
    o, state = fn(**leaves, cu_seqlens=cu, output_final_state=True, **opts)
    assert o.dtype == x["q"].dtype and o.shape == x["v"].shape
    assert torch.isfinite(o).all(), "non-finite output from finite inputs"
    assert torch.isfinite(state).all(), "non-finite final state from finite inputs"

    ref_leaves = {n: t.detach().double().requires_grad_(grads) for n, t in tensors.items()}
    ref_opts = {_REF_NAMES[n]: val for n, val in opts.items() if n in _REF_NAMES}
    ro, rstate = ref_delta_rule(**ref_leaves, cu_seqlens=cu.tolist() if cu is not None else None, **ref_opts)
    assert_close("o", ro, o, tol["o"])
    assert_close("final_state", rstate, state, tol["state"])
    if not grads or o.numel() + state.numel() == 0:
        return o, state
    gen = torch.Generator().manual_seed(seed)
    do, dstate = torch.randn(o.shape, generator=gen), torch.randn(state.shape, generator=gen)
    ((o.float() * do).sum() + (state * dstate).sum()).backward()
    ref_loss = (ro * do.double()).sum() + (rstate * dstate.double()).sum()
    if ref_loss.requires_grad:  # not when T = 0 without an initial state: nothing depends on the inputs
        ref_loss.backward()
    for n in tensors:
        got = leaves[n].grad
        assert got is not None, f"no gradient for {n}"
        assert got.shape == leaves[n].shape and got.dtype == leaves[n].dtype, f"d{n}: {got.shape} {got.dtype}"
        assert torch.isfinite(got).all(), f"d{n}: non-finite gradient from finite inputs"
        want = ref_leaves[n].grad
        assert_close("d" + n, want if want is not None else torch.zeros_like(ref_leaves[n]), got, tol[n], floor)
    return o, state


@st.composite
def configs(draw):
    family = draw(st.sampled_from(["kda", "gdn"]))
    mode = draw(st.sampled_from(["chunk", "recurrent"]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    H = draw(st.sampled_from([1, 2]))
    HV = H * draw(st.sampled_from([1, 2] if H == 2 else [1, 2, 3]))
    # bf16: the §6 bounds are RMS ratios; over a handful of elements the bf16 rounding of o alone (and of q, k
    # after the L2 norm, as in flash-linear-attention) can exceed them, so bf16 examples have >= 15 tokens and
    # K >= 16 (the bounds then hold with margin; tiny shapes are covered in fp32).
    small = dtype == torch.float32
    K = draw(st.sampled_from([4, 16, 32] if small else [16, 32]))
    V = draw(st.sampled_from([4, 8, 24] if small else [8, 24]))
    varlen = draw(st.booleans())
    spec = dict(H=H, HV=HV, K=K, V=V, dtype=dtype, seed=draw(st.integers(0, 2 ** 31 - 1)),
                initial_state=draw(st.booleans()), l2norm=draw(st.booleans()),
                beta_sigmoid=draw(st.booleans()), gate_in_kernel=draw(st.booleans()),
                gate_div=draw(st.sampled_from([0.1, 1.0, 10.0])))
    if varlen:
        lens = draw(st.lists(st.sampled_from([0, 0, 1, 5, 17, 64, 70]), min_size=1, max_size=3))
        spec["lens"] = lens if small or sum(lens) >= 15 else lens + [17]
    else:
        spec["B"] = draw(st.sampled_from([1, 2]))
        spec["T"] = draw(st.sampled_from([0, 1, 2, 15, 63, 64, 65, 90] if small else [15, 63, 64, 65, 90]))
    spec["state_v_first"] = spec["initial_state"] and draw(st.booleans())
    opts = dict(use_qk_l2norm_in_kernel=spec["l2norm"], use_beta_sigmoid_in_kernel=spec["beta_sigmoid"],
                use_gate_in_kernel=spec["gate_in_kernel"], state_v_first=spec["state_v_first"])
    if spec["beta_sigmoid"]:
        opts["allow_neg_eigval"] = draw(st.booleans())
    if spec["gate_in_kernel"]:
        opts["lower_bound"] = draw(st.sampled_from([None, -5.0]))
    if draw(st.booleans()):
        opts["scale"] = draw(st.sampled_from([0.05, 0.3, 1.0]))
    return family, mode, spec, opts


FUZZ = settings(max_examples=60, deadline=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(cfg=configs())
def test_fuzz_matches_reference(variant, cfg):
    family, mode, spec, opts = cfg
    x = make_inputs(family, **spec)
    T = x["q"].shape[1] * x["q"].shape[0]
    check_against_reference(variant, family, mode, x, opts, spec["dtype"], grads=T <= 130)


@settings(max_examples=12, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["kda", "gdn"]), split=st.lists(st.sampled_from([0, 1, 9, 64, 65]), min_size=1,
                                                                  max_size=4),
       seed=st.integers(0, 2 ** 31 - 1))
def test_fuzz_varlen_equals_separate_calls(variant, family, split, seed):
    """Packing sequences with cu_seqlens gives each sequence exactly what a call on it alone gives."""
    x = make_inputs(family, lens=split, initial_state=True, seed=seed, HV=2, K=8, V=8)
    cu = x["cu_seqlens"].tolist()
    fn = getattr(variant, FUNCS[(family, "chunk")])
    o, s = fn(**x, output_final_state=True)
    for n in range(len(split)):
        a, b = cu[n], cu[n + 1]
        one = {k: t[:, a:b] for k, t in x.items() if k in ("q", "k", "v", "g", "beta")}
        o1, s1 = fn(**one, initial_state=x["initial_state"][n:n + 1], output_final_state=True)
        torch.testing.assert_close(o[:, a:b], o1, rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(s[n:n + 1], s1, rtol=2e-5, atol=2e-6)


# ---------------------------------------------------------------- determinism
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family,mode", list(FUNCS), ids=list(FUNCS.values()))
def test_same_call_twice_is_bitwise_identical(variant, family, mode, dtype):
    x = make_inputs(family, lens=[0, 40, 70, 3], H=2, HV=4, K=16, V=16, dtype=dtype, initial_state=True,
                    gate_in_kernel=True, seed=7)
    opts = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)
    fn = getattr(variant, FUNCS[(family, mode)])
    gen = torch.Generator().manual_seed(3)
    torch.set_num_threads(2)  # threaded, as users run it (races or unordered reductions would show here)
    runs = []
    for _ in range(2):
        leaves = {n: t.clone().requires_grad_(True) if t.is_floating_point() else t for n, t in x.items()}
        o, s = fn(**leaves, output_final_state=True, **opts)
        if not runs:
            do, ds = torch.randn(o.shape, generator=gen).to(o.dtype), torch.randn(s.shape, generator=gen)
        ((o * do).float().sum() + (s * ds).sum()).backward()
        runs.append([o.detach(), s.detach()] + [leaves[n].grad for n in sorted(leaves) if n != "cu_seqlens"])
    names = ["o", "final_state"] + ["d" + n for n in sorted(x) if n != "cu_seqlens"]
    for name, a, b in zip(names, *runs):
        assert torch.equal(a, b), f"{name} differs between two identical calls"
