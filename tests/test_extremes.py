"""Extreme inputs: finite in, finite out, and within DESIGN.md §6 of the float64 reference.

Gates down to -20 (KDA) and far below (GDN's gate is unbounded in practice: -50, -1e3, -1e4), g = 0 exactly,
beta = 0, 1 and 2, zero keys, large values, T = 1 and T not a multiple of the chunk. Forward and backward,
every public function, every variant that runs here (conftest.py `variant`).
"""
import pytest
import torch
import torch.nn.functional as F

from test_fuzz import FUNCS, check_against_reference, make_inputs, single_thread  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.filterwarnings("ignore:kda-kernels. no native:RuntimeWarning")

ALL = pytest.mark.parametrize("family,mode", list(FUNCS), ids=list(FUNCS.values()))
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _gshape(family, B, T, HV, K):
    return (B, T, HV, K) if family == "kda" else (B, T, HV)


@DTYPES
@ALL
def test_decay_down_to_minus_20_is_finite_and_accurate(variant, family, mode, dtype):
    B, T, HV, K = 2, 129, 2, 32
    gen = torch.Generator().manual_seed(0)
    g = -20 * torch.rand(_gshape(family, B, T, HV, K), generator=gen)
    g[:, 5:9] = -20.0  # a run of the strongest decay
    x = make_inputs(family, B=B, T=T, HV=HV, K=K, V=16, dtype=dtype, g=g, initial_state=True, seed=1)
    check_against_reference(variant, family, mode, x, {}, dtype)


@pytest.mark.parametrize("gate", [-20.0, -50.0, -1e3, -1e4], ids=lambda v: f"g{v:g}")
@ALL
def test_unbounded_decay_is_finite(variant, family, mode, gate):
    """Constant huge decay (each token wipes the state) and huge decays mixed with g = 0 (resets).

    With every g = -50, the true dg is ~e^-50 ~ 1e-22: compared in absolute terms (error <= 1e-20)."""
    B, T, HV, K = 1, 70, 2, 16
    shape = _gshape(family, B, T, HV, K)
    gen = torch.Generator().manual_seed(2)
    for g in (torch.full(shape, gate), torch.where(torch.rand(shape, generator=gen) < 0.3, gate, 0.0)):
        x = make_inputs(family, B=B, T=T, HV=HV, K=K, V=8, g=g, initial_state=True, seed=3)
        check_against_reference(variant, family, mode, x, {}, torch.float32, floor=1e-20)


@pytest.mark.parametrize("lo,hi", [(-5.0, 3.0), (-5.0, 7.0)], ids=["to_e3", "to_e7"])
@ALL
def test_decays_of_mixed_magnitudes_keep_dg_accurate(variant, family, mode, lo, hi):
    """Log-uniform decays -g in [e^lo, e^hi] (from ~0 to -20 or -1100 per token), as a fused gate with a large
    A_log produces: cumulative sums grow large while neighbouring differences stay small."""
    B, T, HV, K = 1, 128, 2, 16
    gen = torch.Generator().manual_seed(40)
    g = -torch.exp(lo + (hi - lo) * torch.rand(_gshape(family, B, T, HV, K), generator=gen))
    x = make_inputs(family, B=B, T=T, HV=HV, K=K, V=8, g=g, initial_state=True, seed=41)
    check_against_reference(variant, family, mode, x, {}, torch.float32, floor=1e-20)


@ALL
def test_gate_saturated_at_lower_bound_keeps_dg_accurate(variant, family, mode):
    """The fused gate with lower_bound = -5 saturates (sigmoid ~ 1): every decay is ~ -5, the realistic worst
    case of Kimi's safe gate; dg is small (~e^-5) but must stay within 1e-5 relative."""
    B, T, HV, K = 1, 129, 2, 16
    x = make_inputs(family, B=B, T=T, HV=HV, K=K, V=8, gate_in_kernel=True, initial_state=True, seed=42)
    x["g"] = 8 + x["g"].abs()
    x["A_log"] = torch.tensor([1.0, 2.0])
    check_against_reference(variant, family, mode, x, dict(use_gate_in_kernel=True, lower_bound=-5.0),
                            torch.float32)


@pytest.mark.parametrize("gate", [-1e3, -1e4], ids=lambda v: f"g{v:g}")
@ALL
def test_one_huge_decay_then_slow_decay_keeps_fp32_precision(variant, family, mode, gate):
    """After one huge decay, cumulative log decays sit near `gate` while their differences stay small; a
    chunked kernel that forms exp(G_t - G_j) from fp32 cumulative sums loses ~|gate|·2^-24 in every exponent.
    Uncorrelated keys and a small beta keep old tokens in the state, so that loss would show in o."""
    B, T, HV, K = 1, 128, 1, 64
    gen = torch.Generator().manual_seed(4)
    g = -0.01 * torch.rand(_gshape(family, B, T, HV, K), generator=gen)
    g[:, 3] = gate
    g[:, 70] = gate
    k = F.normalize(torch.randn(B, T, 1, K, generator=gen), dim=-1)
    beta = 0.2 * torch.rand(B, T, HV, generator=gen)
    x = make_inputs(family, B=B, T=T, H=1, HV=HV, K=K, V=16, g=g, k=k, beta=beta, seed=5)
    check_against_reference(variant, family, mode, x, {}, torch.float32)


@DTYPES
@ALL
def test_zero_decay_is_accurate(variant, family, mode, dtype):
    """g = 0 exactly: no forgetting at all, the state only changes through the delta rule."""
    B, T, HV, K = 1, 129, 2, 16
    g = torch.zeros(_gshape(family, B, T, HV, K))
    x = make_inputs(family, B=B, T=T, HV=HV, K=K, V=8, dtype=dtype, g=g, initial_state=True, seed=6)
    check_against_reference(variant, family, mode, x, {}, dtype)


@ALL
def test_beta_zero_keeps_the_decayed_state(variant, family, mode):
    """beta = 0: nothing is written; the final state is the initial state times the total decay."""
    B, T, HV, K = 1, 65, 2, 16
    beta = torch.zeros(B, T, HV)
    x = make_inputs(family, B=B, T=T, HV=HV, K=K, V=8, beta=beta, initial_state=True, seed=7, gate_div=10.0)
    o, state = check_against_reference(variant, family, mode, x, {}, torch.float32)
    x0 = dict(x, g=torch.zeros_like(x["g"]))
    o0, state0 = getattr(variant, FUNCS[(family, mode)])(**x0, output_final_state=True)
    torch.testing.assert_close(state0, x["initial_state"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("beta_value", [1.0, 2.0], ids=["beta1", "beta2_neg_eigval"])
@ALL
def test_beta_at_its_bounds_is_accurate(variant, family, mode, beta_value):
    """beta = 1 (unit keys: the old value at k is replaced) and beta = 2 (allow_neg_eigval: eigenvalue -1)."""
    B, T, HV, K = 1, 65, 2, 16
    if beta_value == 1.0:
        beta, opts = torch.ones(B, T, HV), {}
    else:  # sigmoid(40) == 1 in fp32, so 2 * sigmoid = 2
        beta, opts = torch.full((B, T, HV), 40.0), dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    x = make_inputs(family, B=B, T=T, HV=HV, K=K, V=8, beta=beta, initial_state=True, seed=8)
    check_against_reference(variant, family, mode, x, opts, torch.float32)


@pytest.mark.parametrize("l2norm", [False, True], ids=["raw", "l2norm"])
@ALL
def test_zero_keys_are_finite(variant, family, mode, l2norm):
    """All-zero keys (and some zero queries): the L2 norm's epsilon keeps them finite, gradients included."""
    B, T, HV, K = 1, 65, 2, 16
    k = torch.zeros(B, T, 1, K)
    gen = torch.Generator().manual_seed(9)
    k[:, 40:] = F.normalize(torch.rand(B, T - 40, 1, K, generator=gen), dim=-1)  # zero keys, then some real ones
    x = make_inputs(family, B=B, T=T, H=1, HV=HV, K=K, V=8, k=k, initial_state=True, seed=10)
    x["q"][:, :3] = 0
    check_against_reference(variant, family, mode, x, dict(use_qk_l2norm_in_kernel=l2norm), torch.float32)


@DTYPES
@ALL
def test_large_values_are_finite_and_accurate(variant, family, mode, dtype):
    """|v| ~ 1e3 and an initial state ~ 1e3: relative accuracy must not depend on the magnitude."""
    B, T, HV, K = 1, 65, 2, 16
    x = make_inputs(family, B=B, T=T, HV=HV, K=K, V=8, dtype=dtype, v_scale=1e3, initial_state=True, seed=11)
    x["initial_state"] = x["initial_state"] * 1e3
    check_against_reference(variant, family, mode, x, {}, dtype)


@pytest.mark.parametrize("T", [1, 63, 65, 129])
@ALL
def test_length_not_a_multiple_of_the_chunk_is_accurate(variant, family, mode, T):
    x = make_inputs(family, B=2, T=T, H=2, HV=4, K=16, V=8, initial_state=True, seed=12 + T)
    check_against_reference(variant, family, mode, x, {}, torch.float32)


@pytest.mark.parametrize("T", [1, 63, 65, 129])
@ALL
def test_varlen_lengths_not_a_multiple_of_the_chunk_are_accurate(variant, family, mode, T):
    x = make_inputs(family, lens=[T, 0, 1, T], H=2, HV=4, K=16, V=8, initial_state=True, seed=20 + T)
    check_against_reference(variant, family, mode, x, {}, torch.float32)


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "lower_bound"])
@ALL
def test_fused_gate_with_extreme_parameters_is_finite(variant, family, mode, lower_bound):
    """A_log = 7 (exp ~ 1100) with large raw gates gives decays ~ -1e4 per token (or lower_bound exactly);
    A_log = -10 gives decays ~ 0. Both in one call, on different heads."""
    B, T, HV, K = 1, 65, 2, 16
    x = make_inputs(family, B=B, T=T, HV=HV, K=K, V=8, gate_in_kernel=True, initial_state=True, seed=30)
    x["g"] = x["g"] * 10
    x["A_log"] = torch.tensor([7.0, -10.0])
    opts = dict(use_gate_in_kernel=True, lower_bound=lower_bound)
    check_against_reference(variant, family, mode, x, opts, torch.float32)


@pytest.mark.parametrize("gate", [0.0, -20.0, -1e3], ids=lambda v: f"g{v:g}")
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_decode_on_state_pool_with_extreme_decay_is_finite(variant, family, gate):
    """The in-place serving path (no autograd) with extreme gates and a large pool state."""
    from ref_delta import ref_delta_rule

    N, HV, K, V = 3, 2, 16, 8
    x = make_inputs(family, B=N, T=1, HV=HV, K=K, V=V, v_scale=1e3, seed=31,
                    g=torch.full(_gshape(family, N, 1, HV, K), gate))
    pool = torch.randn(5, HV, K, V, generator=torch.Generator().manual_seed(32)) * 1e3
    idx = torch.tensor([4, 0, 2])
    h0 = pool[idx].clone()
    fn = getattr(variant, FUNCS[(family, "recurrent")])
    with torch.no_grad():
        o, _ = fn(**x, initial_state=pool, ssm_state_indices=idx, inplace_final_state=True)
    ro, rs = ref_delta_rule(**x, initial_state=h0)
    assert torch.isfinite(o).all() and torch.isfinite(pool).all()
    from test_fuzz import assert_close
    assert_close("o", ro, o, 1e-5)
    assert_close("pool rows", rs, pool[idx], 1e-5)
