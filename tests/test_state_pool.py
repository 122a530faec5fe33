"""State pools (docs/ops.md, "The serving op"): no lost or stray state.

fused_recurrent_kda / fused_recurrent_gated_delta_rule with ssm_state_indices and inplace_final_state=True write
exactly the indexed pool rows (every other row stays bitwise untouched), skip negative indices (zero outputs, no
read, no write), reject duplicate writes, write one row per token for speculative decoding ([N, T] indices with
num_accepted_tokens), work with [P, HV, V, K] pools (state_v_first), and leave the pool bitwise unchanged when a
call fails. Written rows are compared with the float64 reference run on the gathered initial states.
Both the in-place serving op (no autograd) and the differentiable path (inputs requiring grad) are covered.
"""
import pytest
import torch

from ref_delta import ref_delta_rule
from test_fuzz import FUNCS, assert_close, make_inputs, single_thread  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.filterwarnings("ignore:kda-kernels. no native:RuntimeWarning")

P, HV, K, V = 9, 2, 8, 4
FAMILIES = pytest.mark.parametrize("family", ["kda", "gdn"])
LAYOUT = pytest.mark.parametrize("state_v_first", [False, True], ids=["KV_pool", "VK_pool"])
PATH = pytest.mark.parametrize("grad", [False, True], ids=["serve_op", "autograd_path"])


def make_pool(state_v_first=False, seed=100, dtype=torch.float32):
    shape = (P, HV, V, K) if state_v_first else (P, HV, K, V)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def decode_fn(mod, family):
    return getattr(mod, FUNCS[(family, "recurrent")])


def call(mod, family, x, pool, idx, grad=False, **kw):
    """Run one serving call; with grad=True the inputs require grad (the differentiable path)."""
    ins = {n: (t.clone().requires_grad_(True) if grad and t.is_floating_point() else t) for n, t in x.items()}
    kw.setdefault("inplace_final_state", True)
    if grad:
        return decode_fn(mod, family)(**ins, initial_state=pool, ssm_state_indices=idx, **kw)
    with torch.no_grad():
        return decode_fn(mod, family)(**ins, initial_state=pool, ssm_state_indices=idx, **kw)


def ref_sequences(x, h0, state_v_first, lens=None):
    """Reference o and final states, sequence by sequence (h0 [N, ...] in the pool's layout)."""
    cu = x.get("cu_seqlens")
    ro, rs = ref_delta_rule(**{n: t for n, t in x.items() if n != "cu_seqlens"}, initial_state=h0,
                            cu_seqlens=cu.tolist() if cu is not None else None, state_v_first=state_v_first)
    return ro, rs


def assert_untouched(pool, before, written):
    rows = [r for r in range(pool.shape[0]) if r not in set(written)]
    assert torch.equal(pool[rows], before[rows]), \
        f"pool rows outside {sorted(set(written))} changed: " \
        f"{[r for r in rows if not torch.equal(pool[r], before[r])]}"


@pytest.mark.parametrize("T", [1, 5])
@PATH
@LAYOUT
@FAMILIES
def test_decode_writes_exactly_the_indexed_rows(variant, family, state_v_first, grad, T):
    x = make_inputs(family, B=3, T=T, HV=HV, K=K, V=V, seed=1)
    pool = make_pool(state_v_first)
    before = pool.clone()
    idx = torch.tensor([5, 0, 3])
    o, ret = call(variant, family, x, pool, idx, grad=grad, state_v_first=state_v_first, output_final_state=True)
    assert ret is pool, "output_final_state with inplace_final_state returns the pool itself"
    ro, rs = ref_sequences(x, before[idx], state_v_first)
    assert_close("o", ro, o, 1e-5)
    assert_close("written rows", rs, pool[idx], 1e-5)
    assert_untouched(pool, before, idx.tolist())


@PATH
@FAMILIES
def test_decode_with_int32_indices_and_varlen(variant, family, grad):
    lens = [3, 0, 2, 1]
    x = make_inputs(family, lens=lens, HV=HV, K=K, V=V, seed=2)
    pool = make_pool()
    before = pool.clone()
    idx = torch.tensor([8, 2, 0, 6], dtype=torch.int32)
    o, _ = call(variant, family, x, pool, idx, grad=grad)
    ro, rs = ref_sequences(x, before[idx.long()], False)
    assert_close("o", ro, o, 1e-5)
    assert_close("written rows", rs, pool[idx.long()], 1e-5)
    assert_untouched(pool, before, idx.tolist())


@PATH
@LAYOUT
@FAMILIES
def test_negative_index_skips_the_sequence(variant, family, state_v_first, grad):
    x = make_inputs(family, B=4, T=3, HV=HV, K=K, V=V, seed=3)
    pool = make_pool(state_v_first)
    before = pool.clone()
    idx = torch.tensor([2, -1, 7, -5])
    o, _ = call(variant, family, x, pool, idx, grad=grad, state_v_first=state_v_first)
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.equal(o[3], torch.zeros_like(o[3])), \
        "outputs of skipped sequences must be exactly zero"
    keep = torch.tensor([0, 2])
    ro, rs = ref_sequences({n: t[keep] for n, t in x.items()}, before[idx[keep]], state_v_first)
    assert_close("o", ro, o[keep], 1e-5)
    assert_close("written rows", rs, pool[idx[keep]], 1e-5)
    assert_untouched(pool, before, [2, 7])


@FAMILIES
def test_negative_index_skips_in_varlen(variant, family):
    x = make_inputs(family, lens=[2, 3, 1], HV=HV, K=K, V=V, seed=4)
    pool = make_pool()
    before = pool.clone()
    o, _ = call(variant, family, x, pool, torch.tensor([4, -1, 1]))
    assert torch.equal(o[:, 2:5], torch.zeros_like(o[:, 2:5]))
    assert_untouched(pool, before, [4, 1])
    assert not torch.equal(pool[4], before[4]) and not torch.equal(pool[1], before[1])


@FAMILIES
def test_all_indices_negative_touches_nothing(variant, family):
    x = make_inputs(family, B=2, T=2, HV=HV, K=K, V=V, seed=5)
    pool = make_pool()
    before = pool.clone()
    o, _ = call(variant, family, x, pool, torch.tensor([-1, -1]))
    assert torch.equal(o, torch.zeros_like(o))
    assert torch.equal(pool, before)


@PATH
@FAMILIES
def test_not_inplace_returns_states_and_leaves_pool_alone(variant, family, grad):
    x = make_inputs(family, B=3, T=2, HV=HV, K=K, V=V, seed=6)
    pool = make_pool()
    before = pool.clone()
    idx = torch.tensor([1, -1, 4])
    o, final = call(variant, family, x, pool, idx, grad=grad, inplace_final_state=False, output_final_state=True)
    assert torch.equal(pool, before), "inplace_final_state=False must not write the pool"
    keep = torch.tensor([0, 2])
    ro, rs = ref_sequences({n: t[keep] for n, t in x.items()}, before[idx[keep]], False)
    assert_close("final states", rs, final[keep], 1e-5)
    assert torch.equal(final[1], torch.zeros_like(final[1]))
    assert_close("o", ro, o[keep], 1e-5)


@PATH
@FAMILIES
def test_duplicate_write_indices_are_rejected(variant, family, grad):
    x = make_inputs(family, B=3, T=1, HV=HV, K=K, V=V, seed=7)
    pool = make_pool()
    before = pool.clone()
    with pytest.raises(ValueError, match=r"ssm_state_indices.*\[3\].*more than once"):
        call(variant, family, x, pool, torch.tensor([3, 0, 3]), grad=grad)
    assert torch.equal(pool, before)
    # repeated negative indices are padding, not duplicates
    call(variant, family, x, pool, torch.tensor([-1, 0, -1]), grad=grad)
    assert_untouched(pool, before, [0])


def _spec_reference(x, pool0, idx, nacc, lens, state_v_first=False):
    """Expected pool after a speculative step: row idx[n, t] = state of sequence n after its token t."""
    expect = pool0.clone().double()
    o_ref = torch.zeros(x["v"].shape, dtype=torch.float64)
    cu = [0] + torch.tensor(lens).cumsum(0).tolist() if lens is not None else None
    N = idx.shape[0]
    for n in range(N):
        start = int(idx[n, int(nacc[n]) - 1])
        if start < 0:
            continue
        h0 = pool0[start:start + 1]
        if cu is None:
            seq = {k_: t[n:n + 1] for k_, t in x.items()}
            L = x["q"].shape[1]
        else:
            seq = {k_: t[:, cu[n]:cu[n + 1]] for k_, t in x.items() if k_ != "cu_seqlens"}
            L = lens[n]
        for t in range(L):
            ro, rs = ref_delta_rule(**{k_: v_[:, :t + 1] for k_, v_ in seq.items()}, initial_state=h0,
                                    state_v_first=state_v_first)
            if int(idx[n, t]) >= 0:
                expect[int(idx[n, t])] = rs[0]
        if cu is None:
            o_ref[n] = ro[0]
        else:
            o_ref[:, cu[n]:cu[n + 1]] = ro
    return o_ref, expect


@LAYOUT
@FAMILIES
def test_speculative_decoding_writes_one_row_per_token(variant, family, state_v_first):
    T = 3
    x = make_inputs(family, B=3, T=T, HV=HV, K=K, V=V, seed=8)
    pool = make_pool(state_v_first)
    before = pool.clone()
    # seq 0: starts from its 2nd slot (2 tokens accepted last step); seq 1: a skipped write (-1) in the middle;
    # seq 2: starts from its 3rd slot, which its own token 2 overwrites
    idx = torch.tensor([[0, 1, 2], [3, -1, 4], [5, 6, 7]])
    nacc = torch.tensor([2, 1, 3])
    o, _ = call(variant, family, x, pool, idx, num_accepted_tokens=nacc, state_v_first=state_v_first)
    o_ref, expect = _spec_reference(x, before, idx, nacc, None, state_v_first)
    assert_close("o", o_ref, o, 1e-5)
    written = [r for r in idx.flatten().tolist() if r >= 0]
    assert_close("written rows", expect[written], pool[written], 1e-5)
    assert_untouched(pool, before, written)


@FAMILIES
def test_speculative_decoding_varlen_and_skipped_start(variant, family):
    lens = [3, 1, 2]
    x = make_inputs(family, lens=lens, HV=HV, K=K, V=V, seed=9)
    pool = make_pool()
    before = pool.clone()
    idx = torch.tensor([[0, 1, 2], [3, 8, 8], [-1, 6, 7]])  # seq 1 writes only its first column (1 token)
    nacc = torch.tensor([3, 1, 1])  # seq 2 starts at idx[2, 0] = -1: skipped entirely
    o, _ = call(variant, family, x, pool, idx, num_accepted_tokens=nacc)
    o_ref, expect = _spec_reference(x, before, idx, nacc, lens)
    assert_close("o", o_ref, o, 1e-5)
    assert torch.equal(o[:, 4:6], torch.zeros_like(o[:, 4:6])), "skipped sequence must output zeros"
    written = [0, 1, 2, 3]
    assert_close("written rows", expect[written], pool[written], 1e-5)
    assert_untouched(pool, before, written)


@FAMILIES
def test_speculative_without_num_accepted_starts_from_first_column(variant, family):
    x = make_inputs(family, B=2, T=2, HV=HV, K=K, V=V, seed=10)
    pool = make_pool()
    before = pool.clone()
    idx = torch.tensor([[4, 5], [1, 2]])
    o, _ = call(variant, family, x, pool, idx)
    o_ref, expect = _spec_reference(x, before, idx, torch.ones(2, dtype=torch.long), None)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("written rows", expect[[4, 5, 1, 2]], pool[[4, 5, 1, 2]], 1e-5)
    assert_untouched(pool, before, [4, 5, 1, 2])


@FAMILIES
def test_decode_sequence_equals_one_long_call(variant, family):
    """Five single-token decode steps on a pool give the state and outputs of one 5-token call."""
    x = make_inputs(family, B=2, T=5, HV=HV, K=K, V=V, seed=11)
    pool = make_pool()
    before = pool.clone()
    idx = torch.tensor([6, 2])
    outs = []
    for t in range(5):
        o, _ = call(variant, family, {n: v_[:, t:t + 1] for n, v_ in x.items()}, pool, idx)
        outs.append(o)
    ro, rs = ref_sequences(x, before[idx], False)
    assert_close("o", ro, torch.cat(outs, 1), 1e-5)
    assert_close("rows", rs, pool[idx], 1e-5)
    assert_untouched(pool, before, [6, 2])


@FAMILIES
def test_noncontiguous_pool_view_is_written_in_place(variant, family):
    """A pool that is a strided view (every other row of a bigger buffer): the indexed rows are updated through
    the view and the interleaved rows of the buffer stay untouched."""
    x = make_inputs(family, B=2, T=2, HV=HV, K=K, V=V, seed=12)
    buf = torch.randn(2 * P, HV, K, V, generator=torch.Generator().manual_seed(13))
    pool = buf[::2]
    assert not pool.is_contiguous()
    before = buf.clone()
    idx = torch.tensor([3, 1])
    o, _ = call(variant, family, x, pool, idx)
    ro, rs = ref_sequences(x, before[::2][idx], False)
    assert_close("o", ro, o, 1e-5)
    assert_close("written rows", rs, buf[::2][idx], 1e-5)
    assert_untouched(buf, before, [6, 2])


@FAMILIES
def test_transposed_view_pool_and_speculative_indices(variant, family):
    """A [P, HV, V, K] pool that is the transposed view of a [P, HV, K, V] buffer (state_v_first), per-token
    indices, and a strided pool whose indices are all negative (nothing read or written)."""
    x = make_inputs(family, B=2, T=2, HV=HV, K=K, V=V, seed=16)
    buf = make_pool()
    pool = buf.transpose(-1, -2)
    before = buf.clone()
    idx = torch.tensor([[7, 2], [0, -1]])
    nacc = torch.tensor([2, 1])
    o, _ = call(variant, family, x, pool, idx, num_accepted_tokens=nacc, state_v_first=True)
    o_ref, expect = _spec_reference(x, before.transpose(-1, -2), idx, nacc, None, state_v_first=True)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("written rows", expect[[7, 2, 0]], pool[[7, 2, 0]], 1e-5)
    assert_untouched(buf, before, [7, 2, 0])
    strided = buf[::2]
    snapshot = buf.clone()
    o, _ = call(variant, family, x, strided, torch.tensor([-1, -1]))
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(buf, snapshot)


@FAMILIES
def test_bf16_pool_rows_are_written(variant, family):
    x = make_inputs(family, B=2, T=1, HV=HV, K=K, V=V, seed=14)
    pool = make_pool(dtype=torch.bfloat16)
    before = pool.clone()
    idx = torch.tensor([0, 8])
    call(variant, family, x, pool, idx)
    assert pool.dtype == torch.bfloat16
    _, rs = ref_sequences(x, before[idx].float(), False)
    assert_close("written rows", rs, pool[idx], 0.005)
    assert_untouched(pool, before, [0, 8])


# ---------------------------------------------------------------- failed calls leave the pool unchanged
def _bad_calls(x):
    """(id, kwargs overriding a valid call, exception type)."""
    idx = torch.tensor([1, 4])
    q64 = x["q"].double()
    return [
        ("index_out_of_range", dict(ssm_state_indices=torch.tensor([1, P])), ValueError),
        ("duplicate_index", dict(ssm_state_indices=torch.tensor([4, 4])), ValueError),
        ("float_indices", dict(ssm_state_indices=idx.float()), TypeError),
        ("indices_wrong_length", dict(ssm_state_indices=torch.tensor([1, 4, 5])), ValueError),
        ("indices_on_other_device", dict(ssm_state_indices=idx.to("meta")), ValueError),
        ("q_float64", dict(q=q64), TypeError),
        ("k_wrong_shape", dict(k=x["k"][:, :, :, :-1]), ValueError),
        ("scale_nan", dict(scale=float("nan")), ValueError),
        ("per_token_not_inplace", dict(ssm_state_indices=torch.tensor([[1], [4]]), inplace_final_state=False),
         ValueError),
        ("per_token_duplicate", dict(ssm_state_indices=torch.tensor([[1, 2], [3, 2]])), ValueError),
        ("per_token_too_few_columns", dict(ssm_state_indices=torch.tensor([[1], [4]])), ValueError),
        ("num_accepted_zero", dict(ssm_state_indices=torch.tensor([[1, 2], [3, 5]]),
                                   num_accepted_tokens=torch.tensor([0, 1])), ValueError),
        ("num_accepted_too_large", dict(ssm_state_indices=torch.tensor([[1, 2], [3, 5]]),
                                        num_accepted_tokens=torch.tensor([1, 3])), ValueError),
        ("num_accepted_on_other_device", dict(ssm_state_indices=torch.tensor([[1, 2], [3, 5]]),
                                              num_accepted_tokens=torch.tensor([1, 2], device="meta")), ValueError),
        ("num_accepted_without_per_token", dict(num_accepted_tokens=torch.tensor([1, 1])), ValueError),
    ]


_BAD_IDS = [c[0] for c in _bad_calls(make_inputs("gdn", B=2, T=2, HV=HV, K=K, V=V))]


@pytest.mark.parametrize("case", _BAD_IDS)
@PATH
@FAMILIES
def test_failed_call_leaves_pool_unchanged(variant, family, grad, case):
    x = make_inputs(family, B=2, T=2, HV=HV, K=K, V=V, seed=15)
    kw = dict(ssm_state_indices=torch.tensor([1, 4]))
    _, override, exc = next(c for c in _bad_calls(x) if c[0] == case)
    pool = make_pool()
    before = pool.clone()
    args = dict(x, initial_state=pool, inplace_final_state=True)
    args.update(kw)
    args.update(override)
    ins = {n: (t.clone().requires_grad_(True) if grad and isinstance(t, torch.Tensor) and t.is_floating_point()
               and n not in ("initial_state",) else t) for n, t in args.items()}
    with torch.set_grad_enabled(grad), pytest.raises(exc):
        decode_fn(variant, family)(**ins)
    assert torch.equal(pool, before), f"a failed call ({case}) modified the pool"


# ---------------------------------------------------------------- one sequence (the API's decode fast path)
def _bad_calls_one_sequence(x):
    """B=1 calls: on the native CPU build the fast path leaves these checks to the kernel, whose RuntimeError
    must still reach the user as the full path's error, with the pool unchanged."""
    return [
        ("index_out_of_range", dict(ssm_state_indices=torch.tensor([P])), ValueError),
        ("per_token_row_out_of_range", dict(ssm_state_indices=torch.tensor([[1, P]])), ValueError),
        ("indices_wrong_length", dict(ssm_state_indices=torch.tensor([1, 4])), ValueError),
        ("float_indices", dict(ssm_state_indices=torch.tensor([1.0])), TypeError),
        ("q_float64", dict(q=x["q"].double()), TypeError),
        ("k_wrong_shape", dict(k=x["k"][:, :, :, :-1]), ValueError),
        ("v_on_other_device", dict(v=x["v"].to("meta")), ValueError),
        ("pool_wrong_shape", dict(initial_state=make_pool()[:, :1]), ValueError),
        ("pool_int", dict(initial_state=make_pool().to(torch.int32)), TypeError),
        ("scale_nan", dict(scale=float("nan")), ValueError),
        ("scale_zero", dict(scale=0.0), ValueError),
    ]


@pytest.mark.parametrize("case", [c[0] for c in _bad_calls_one_sequence(make_inputs("gdn", B=1, T=2, HV=HV, K=K,
                                                                                        V=V))])
@FAMILIES
def test_one_sequence_bad_call_raises_and_leaves_pool_unchanged(variant, family, case):
    x = make_inputs(family, B=1, T=2, HV=HV, K=K, V=V, seed=16)
    _, override, exc = next(c for c in _bad_calls_one_sequence(x) if c[0] == case)
    pool = make_pool()
    args = dict(x, initial_state=pool, ssm_state_indices=torch.tensor([3]), inplace_final_state=True)
    args.update(override)
    before = args["initial_state"].clone()
    with torch.no_grad(), pytest.raises(exc):
        decode_fn(variant, family)(**args)
    assert torch.equal(args["initial_state"], before), f"a failed call ({case}) modified the pool"


@pytest.mark.parametrize("form", ["int32_indices", "strided_q", "bf16_g_beta", "strided_pool", "int_scale"])
@FAMILIES
def test_one_sequence_converted_inputs_match(variant, family, form):
    """Valid B=1 calls the fast path hands to the full path (which converts them) give the plain call's result."""
    x = make_inputs(family, B=1, T=1, HV=HV, K=K, V=V, seed=17)
    idx = torch.tensor([3])
    pool_a = make_pool()
    o_a, _ = call(variant, family, x, pool_a, idx, scale=0.5 if form != "int_scale" else 1.0)
    y, pool_b, kw = dict(x), make_pool(), {"scale": 0.5}
    if form == "int32_indices":
        idx = idx.to(torch.int32)
    elif form == "strided_q":
        y["q"] = torch.repeat_interleave(x["q"], 2, dim=-1)[..., ::2]
    elif form == "bf16_g_beta":
        y["g"], y["beta"] = x["g"].bfloat16(), x["beta"].bfloat16()
        x = dict(x, g=y["g"].float(), beta=y["beta"].float())
        pool_a = make_pool()
        o_a, _ = call(variant, family, x, pool_a, idx, scale=0.5)
    elif form == "strided_pool":
        wide = torch.cat([make_pool(), make_pool()], dim=-1)
        pool_b = wide[..., :V]
    else:
        kw = {"scale": 1}
    o_b, _ = call(variant, family, y, pool_b, idx, **kw)
    assert not y["q"].is_contiguous() or form != "strided_q"
    assert torch.allclose(o_a, o_b, rtol=1e-6, atol=1e-6)
    assert torch.allclose(pool_a, pool_b, rtol=1e-6, atol=1e-6)
