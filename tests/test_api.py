"""The public API against the independent float64 reference (DESIGN.md sections 1, 2 and 6).

Runs on every variant that runs on this machine (conftest's `variant`: torch-universal and the native cpu
variant, built from the current sources), forward and the gradient of every input, for KDA and GDN, chunked and recurrent.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import get_variant
from ref_delta import assert_close, ref_delta_rule

TOL = {
    torch.float32: dict(o=1e-5, state=1e-5, dq=1e-5, dk=1e-5, dv=1e-5, dh0=1e-5, dg=1e-5, dbeta=1e-5, dA=1e-5),
    torch.bfloat16: dict(o=0.005, state=0.005, dq=0.008, dk=0.008, dv=0.008, dh0=0.008, dg=0.02, dbeta=0.02,
                         dA=0.02),
}


@pytest.fixture(scope="module")
def kda(variant):
    return variant


def fn_of(mod, family, mode):
    return {("kda", "chunk"): mod.chunk_kda, ("kda", "recurrent"): mod.fused_recurrent_kda,
            ("gdn", "chunk"): mod.chunk_gated_delta_rule,
            ("gdn", "recurrent"): mod.fused_recurrent_gated_delta_rule}[(family, mode)]


def make_inputs(family, B=1, T=77, H=2, HV=2, K=32, V=16, dtype=torch.float32, gate_scale=1.0, seed=0,
                initial_state=False, cu_seqlens=None, raw_gate=False, raw_beta=False, state_v_first=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.rand(B, T, H, K, generator=gen), dim=-1)  # correlated keys: all positive
    v = torch.randn(B, T, HV, V, generator=gen)
    gshape = (B, T, HV, K) if family == "kda" else (B, T, HV)
    graw = torch.randn(gshape, generator=gen)
    g = graw if raw_gate else F.logsigmoid(graw) / gate_scale
    beta = torch.randn(B, T, HV, generator=gen) if raw_beta else torch.rand(B, T, HV, generator=gen)
    x = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta)
    if initial_state:
        N = B if cu_seqlens is None else len(cu_seqlens) - 1
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        x["initial_state"] = torch.randn(shape, generator=gen)
    if raw_gate:
        x["A_log"] = torch.randn(HV, generator=gen) * 0.5
        x["dt_bias"] = torch.randn(HV * K if family == "kda" else HV, generator=gen) * 0.5
    return x


CASES = {
    "plain": dict(),
    "gate_small_decay": dict(gate_scale=10.0),
    "gate_strong_decay": dict(gate_scale=0.1),
    "gva2": dict(H=2, HV=4),
    "gva4": dict(H=1, HV=4),
    "initial_state": dict(initial_state=True),
    "state_v_first": dict(initial_state=True, state_v_first=True, opts=dict(state_v_first=True)),
    "batch2_T130": dict(B=2, T=130, initial_state=True),
    "varlen_empty_len1": dict(T=100, cu_seqlens=[0, 0, 1, 40, 40, 100], initial_state=True),
    "qk_l2norm": dict(opts=dict(use_qk_l2norm_in_kernel=True)),
    "beta_sigmoid": dict(raw_beta=True, opts=dict(use_beta_sigmoid_in_kernel=True)),
    "neg_eigval": dict(raw_beta=True, opts=dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)),
    "gate_in_kernel": dict(raw_gate=True, opts=dict(use_gate_in_kernel=True)),
    "gate_lower_bound": dict(raw_gate=True, opts=dict(use_gate_in_kernel=True, lower_bound=-5.0)),
    "K48_V40_T1": dict(T=1, K=48, V=40, initial_state=True),
}

_REF_OPTION = dict(use_qk_l2norm_in_kernel="use_qk_l2norm", use_beta_sigmoid_in_kernel="use_beta_sigmoid",
                   allow_neg_eigval="allow_neg_eigval", use_gate_in_kernel="use_gate", lower_bound="lower_bound",
                   state_v_first="state_v_first")


def run_case(mod, family, mode, case, dtype):
    spec = dict(CASES[case])
    opts = spec.pop("opts", {})
    cu = spec.get("cu_seqlens")
    x = make_inputs(family, dtype=dtype, **spec)
    cu_t = torch.tensor(cu, dtype=torch.int32) if cu is not None else None
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o, state = fn_of(mod, family, mode)(**leaves, output_final_state=True, cu_seqlens=cu_t, **opts)
    gen = torch.Generator().manual_seed(123)
    do, dstate = torch.randn(o.shape, generator=gen), torch.randn(state.shape, generator=gen)
    ((o.float() * do).sum() + (state * dstate).sum()).backward()

    ref_leaves = {n: t.detach().double().requires_grad_(True) for n, t in x.items()}
    ref_opts = {_REF_OPTION[k]: v for k, v in opts.items()}
    ro, rstate = ref_delta_rule(**ref_leaves, cu_seqlens=cu, **ref_opts)
    ((ro * do.double()).sum() + (rstate * dstate.double()).sum()).backward()

    tol = TOL[dtype]
    assert o.dtype == dtype
    assert_close("o", ro, o, tol["o"])
    assert_close("final_state", rstate, state, tol["state"])
    names = dict(q="dq", k="dk", v="dv", g="dg", beta="dbeta", initial_state="dh0", A_log="dA", dt_bias="dA")
    for n in x:
        assert leaves[n].grad is not None, f"no gradient for {n}"
        assert_close("d" + n, ref_leaves[n].grad, leaves[n].grad, tol[names[n]])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_fp32_matches_reference(kda, family, mode, case):
    run_case(kda, family, mode, case, torch.float32)


@pytest.mark.parametrize("case", ["plain", "gva2", "varlen_empty_len1", "gate_in_kernel"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_bf16_matches_reference(kda, family, mode, case):
    run_case(kda, family, mode, case, torch.bfloat16)


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_chunk_equals_recurrent(kda, family):
    x = make_inputs(family, B=2, T=200, H=2, HV=4, K=64, V=32, initial_state=True, gate_scale=0.5)
    oc, sc = fn_of(kda, family, "chunk")(**x, output_final_state=True)
    orr, sr = fn_of(kda, family, "recurrent")(**x, output_final_state=True)
    assert_close("o chunk vs recurrent", orr, oc, 1e-5)
    assert_close("state chunk vs recurrent", sr, sc, 1e-5)


def test_final_state_is_none_unless_asked(kda):
    x = make_inputs("kda")
    o, s = kda.chunk_kda(**x)
    assert s is None and o.shape == (1, 77, 2, 16)


def test_inputs_not_modified_and_noncontiguous_ok(kda):
    x = make_inputs("kda", B=2, T=40, initial_state=True)
    # non-contiguous views of the same values
    nc = {n: t.transpose(0, -1).contiguous().transpose(0, -1) if t.dim() > 1 else t for n, t in x.items()}
    assert not nc["q"].is_contiguous()
    before = {n: t.clone() for n, t in nc.items()}
    o1, s1 = kda.chunk_kda(**nc, output_final_state=True)
    o2, s2 = kda.chunk_kda(**x, output_final_state=True)
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    torch.testing.assert_close(s1, s2, rtol=0, atol=0)
    for n in nc:
        assert torch.equal(nc[n], before[n]), f"{n} was modified"


def test_public_api_matches_all(kda):
    for name in kda.__all__:
        assert hasattr(kda, name), name
    assert {"chunk_kda", "chunk_gated_delta_rule", "fused_recurrent_kda", "fused_recurrent_gated_delta_rule",
            "fused_kda_gate", "fused_gdn_gate", "layers"} <= set(kda.__all__)


def test_universal_variant_warns_once_about_missing_native_backend():
    mod = get_variant("universal")
    x = make_inputs("gdn", T=5)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        mod.chunk_gated_delta_rule(**x)
        mod.chunk_gated_delta_rule(**x)
    msgs = [str(w.message) for w in rec if "no native cpu kernel for gdn_chunk_fwd" in str(w.message)]
    # at most once per process (an earlier test may already have triggered it)
    assert len(msgs) <= 1
    from importlib import import_module

    ops_mod = import_module(mod.__name__ + ".ops")
    assert ("gdn_chunk_fwd", "cpu") in ops_mod._warned


def test_fused_gates_match_reference(kda):
    from ref_delta import ref_gate

    gen = torch.Generator().manual_seed(1)
    HV, K = 3, 8
    g = torch.randn(2, 5, HV, K, generator=gen)
    A = torch.randn(HV, generator=gen)
    dt = torch.randn(HV * K, generator=gen)
    assert_close("kda gate", ref_gate(g, A, dt), kda.fused_kda_gate(g, A, dt), 1e-6)
    assert_close("kda gate lb", ref_gate(g, A, dt, lower_bound=-3.0),
                 kda.fused_kda_gate(g.flatten(-2), A, dt, lower_bound=-3.0, head_k_dim=K), 1e-6)
    gh = torch.randn(2, 5, HV, generator=gen)
    dth = torch.randn(HV, generator=gen)
    assert_close("gdn gate", ref_gate(gh, A, dth, per_channel=False), kda.fused_gdn_gate(gh, A, dth), 1e-6)


# flash-linear-attention 0.6.0's positional parameters of the four public functions (read from its source), the
# contract of DESIGN.md section 2: calls written for fla must bind the same way here.
FLA_060_POSITIONAL = {
    "chunk_kda": ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                  "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
                  "safe_gate", "lower_bound", "disable_recompute", "return_intermediate_states", "state_v_first",
                  "cu_seqlens"],
    "chunk_gated_delta_rule": ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                               "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
                               "state_v_first", "cu_seqlens"],
    "fused_recurrent_kda": ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "scale", "initial_state",
                            "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                            "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "lower_bound", "state_v_first",
                            "cu_seqlens"],
    "fused_recurrent_gated_delta_rule": ["q", "k", "v", "g", "gk", "gv", "beta", "scale", "initial_state",
                                         "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                                         "A_log", "dt_bias", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
                                         "state_v_first", "cu_seqlens"],
}


@pytest.mark.parametrize("name", sorted(FLA_060_POSITIONAL))
def test_positional_order_is_fla_060(kda, name):
    import inspect
    params = inspect.signature(getattr(kda, name)).parameters.values()
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == FLA_060_POSITIONAL[name]


def test_positional_calls_bind_like_fla(kda):
    x = make_inputs("gdn", T=20, initial_state=True)
    ref, sref = kda.fused_recurrent_gated_delta_rule(**x, scale=0.3, output_final_state=True)
    o, s = kda.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], None, None, x["beta"], 0.3,
                                                x["initial_state"], True)
    torch.testing.assert_close(o, ref, rtol=0, atol=0)
    torch.testing.assert_close(s, sref, rtol=0, atol=0)
    x = make_inputs("kda", T=20, initial_state=True)
    ref, _ = kda.fused_recurrent_kda(**x, scale=0.3)
    o, _ = kda.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, 0.3, x["initial_state"])
    torch.testing.assert_close(o, ref, rtol=0, atol=0)


def test_gdn_recurrent_old_positional_order_is_refused(kda):
    x = make_inputs("gdn", T=5)
    with pytest.raises(ValueError, match="fused_recurrent_gated_delta_rule.*gk.*beta=") as e:
        kda.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert "fused_recurrent_kda" in str(e.value)
    with pytest.raises(ValueError, match="gk / gv"):
        kda.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], gv=x["beta"], beta=x["beta"])
    with pytest.raises(ValueError, match="beta.*required"):
        kda.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"])


def test_unknown_and_unsupported_keywords_raise(kda):
    x = make_inputs("kda", T=5)
    for name in ("chunk_kda", "fused_recurrent_kda"):
        fn = getattr(kda, name)
        with pytest.raises(TypeError, match=f"{name}.*initial_states"):
            fn(**x, initial_states=torch.zeros(1, 2, 32, 16))  # misspelt: must not be dropped silently
        with pytest.raises(ValueError, match="return_intermediate_states"):
            fn(**x, return_intermediate_states=True)
        with pytest.raises(ValueError, match="cp_context.*context_parallel"):
            fn(**x, cp_context=object())
    # fla's scheduling hints and Transformers' bookkeeping are accepted and change nothing
    o1, _ = kda.chunk_kda(**x)
    o2, _ = kda.chunk_kda(**x, safe_gate=True, disable_recompute=True, cu_seqlens_cpu=None, chunk_indices=None,
                          use_cache=True, layer_idx=3)
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
