"""The bad-input table: every invalid argument of the public API, the exception it raises and a pattern its
message must match (naming the argument and what was expected). tests/test_bad_input.py runs it;
docs/bad_inputs.md is generated from it:

    .venv/bin/python tests/bad_input_table.py > docs/bad_inputs.md

(the script runs every case on the torch-universal variant and prints the actual messages).
"""
import re
from dataclasses import dataclass, field

import torch

CORE = ("chunk_kda", "chunk_gated_delta_rule", "fused_recurrent_kda", "fused_recurrent_gated_delta_rule")
RECURRENT = ("fused_recurrent_kda", "fused_recurrent_gated_delta_rule")
KDA = ("chunk_kda", "fused_recurrent_kda")
GDN = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
GATES = ("fused_kda_gate", "fused_gdn_gate")
B, T, H, HV, K, V, P = 2, 5, 2, 4, 8, 4, 6


def family(fn):
    return "kda" if "kda" in fn else "gdn"


def valid_args(fn, varlen=False, pool=False, gate=False):
    """Keyword arguments of a valid call of `fn` (fresh tensors every time)."""
    gen = torch.Generator().manual_seed(0)
    if fn == "fused_kda_gate":
        return dict(g=torch.randn(B, T, HV, K, generator=gen), A_log=torch.randn(HV, generator=gen),
                    dt_bias=torch.randn(HV * K, generator=gen))
    if fn == "fused_gdn_gate":
        return dict(g=torch.randn(B, T, HV, generator=gen), A_log=torch.randn(HV, generator=gen),
                    dt_bias=torch.randn(HV, generator=gen))
    b = 1 if varlen else B
    a = dict(q=torch.randn(b, T, H, K, generator=gen), k=torch.nn.functional.normalize(
        torch.rand(b, T, H, K, generator=gen), dim=-1), v=torch.randn(b, T, HV, V, generator=gen),
        g=-torch.rand((b, T, HV, K) if family(fn) == "kda" else (b, T, HV), generator=gen),
        beta=torch.rand(b, T, HV, generator=gen))
    if varlen:
        a["cu_seqlens"] = torch.tensor([0, 2, 5])
    if pool:
        a.update(initial_state=torch.randn(P, HV, K, V, generator=gen), ssm_state_indices=torch.tensor([1, 3]),
                 inplace_final_state=True)
    if gate:
        a.update(use_gate_in_kernel=True, A_log=torch.randn(HV, generator=gen),
                 dt_bias=torch.randn(HV * K if family(fn) == "kda" else HV, generator=gen))
    return a


@dataclass
class Case:
    id: str
    input: str  # what is wrong, for the docs table
    fns: tuple
    change: object  # (args, fn) -> None: mutates a valid call's arguments
    exc: type
    match: str  # regex the message must match (names the argument and what was expected)
    setup: dict = field(default_factory=dict)  # valid_args options: varlen / pool / gate
    xfail: str = ""  # known gap, reported, not fixed here: the test is xfail(strict)


def _set(**kw):
    def change(a, fn):
        for name, val in kw.items():
            a[name] = val(a, fn) if callable(val) else val
    return change


def _gshape(fn, b=B, t=T, hv=HV, k=K):
    return (b, t, hv, k) if family(fn) == "kda" else (b, t, hv)


def _mismatched_hv(a, fn):
    a["v"] = torch.randn(B, T, 3, V)
    a["g"] = -torch.rand(_gshape(fn, hv=3))
    a["beta"] = torch.rand(B, T, 3)


def _zero_k(a, fn):
    a["q"], a["k"] = torch.randn(B, T, H, 0), torch.randn(B, T, H, 0)
    a["g"] = -torch.rand(_gshape(fn, k=0))


CASES = [
    # ---- shapes and ranks
    Case("q_not_tensor", "q is a list, not a tensor", CORE, _set(q=lambda a, f: a["q"].tolist()), TypeError,
         r"\bq must be a torch\.Tensor"),
    Case("q_rank3", "q of rank 3", CORE, _set(q=lambda a, f: a["q"][0]), ValueError, r"\bq must be \[B, T, H, K\]"),
    Case("k_other_K", "k with another K than q (mismatched K)", CORE,
         _set(k=lambda a, f: torch.randn(B, T, H, K + 1)), ValueError, r"\bk must have q's shape"),
    Case("k_other_H", "k with another head count than q", CORE, _set(k=lambda a, f: torch.randn(B, T, H + 1, K)),
         ValueError, r"\bk must have q's shape"),
    Case("v_rank3", "v of rank 3", CORE, _set(v=lambda a, f: a["v"][..., 0]), ValueError,
         r"\bv must be \[B, T, HV, V\]"),
    Case("v_other_T", "v with another T than q", CORE, _set(v=lambda a, f: a["v"][:, :-1]), ValueError,
         r"\bv must be \[B, T, HV, V\]"),
    Case("hv_not_multiple_of_h", "HV = 3 value heads for H = 2 q/k heads", CORE, _mismatched_hv, ValueError,
         r"HV=3 \(v\.shape\[2\]\) must be a positive multiple of .*H=2"),
    Case("zero_K", "K = 0 (empty head dim)", CORE, _zero_k, ValueError, r"head dims must be positive.*K=0"),
    Case("g_per_head_for_kda", "KDA g without its K axis [B, T, HV]", KDA,
         _set(g=lambda a, f: a["g"][..., 0]), ValueError, r"\bg must be \[B, T, HV, K\]"),
    Case("g_per_channel_for_gdn", "GDN g with a K axis [B, T, HV, K]", GDN,
         _set(g=lambda a, f: -torch.rand(B, T, HV, K)), ValueError, r"\bg must be \[B, T, HV\]"),
    Case("g_other_K", "KDA g with another K than q", KDA, _set(g=lambda a, f: -torch.rand(B, T, HV, K + 1)),
         ValueError, r"\bg must be \[B, T, HV, K\]"),
    Case("beta_shape", "beta with a trailing axis [B, T, HV, 1]", CORE,
         _set(beta=lambda a, f: a["beta"].unsqueeze(-1)), ValueError, r"\bbeta must be \[B, T, HV\]"),
    # ---- dtypes
    Case("q_float64", "q float64", CORE, _set(q=lambda a, f: a["q"].double()), TypeError,
         r"\bq must be float32, bfloat16 or float16, got float64"),
    Case("k_int", "k int32", CORE, _set(k=lambda a, f: a["k"].int()), TypeError,
         r"\bk must be float32, bfloat16 or float16, got int32"),
    Case("v_float64", "v float64", CORE, _set(v=lambda a, f: a["v"].double()), TypeError,
         r"\bv must be float32, bfloat16 or float16, got float64"),
    Case("qkv_mixed", "v bfloat16 with q, k float32", CORE, _set(v=lambda a, f: a["v"].bfloat16()), TypeError,
         r"q, k and v must share one dtype"),
    Case("g_float64", "g float64", CORE, _set(g=lambda a, f: a["g"].double()), TypeError,
         r"\bg must be float32, bfloat16 or float16, got float64"),
    Case("g_int", "g int64", CORE, _set(g=lambda a, f: a["g"].long()), TypeError,
         r"\bg must be float32, bfloat16 or float16, got int64"),
    Case("beta_float64", "beta float64", CORE, _set(beta=lambda a, f: a["beta"].double()), TypeError,
         r"\bbeta must be float32, bfloat16 or float16, got float64"),
    Case("beta_bool", "beta bool", CORE, _set(beta=lambda a, f: a["beta"] > 0.5), TypeError,
         r"\bbeta must be float32, bfloat16 or float16, got bool"),
    # ---- scale
    Case("scale_zero", "scale = 0", CORE, _set(scale=0.0), ValueError, r"\bscale must be a finite number > 0"),
    Case("scale_negative", "scale = -1", CORE, _set(scale=-1.0), ValueError, r"\bscale must be a finite number > 0"),
    Case("scale_nan", "scale = NaN", CORE, _set(scale=float("nan")), ValueError,
         r"\bscale must be a finite number > 0, got nan"),
    Case("scale_inf", "scale = inf", CORE, _set(scale=float("inf")), ValueError,
         r"\bscale must be a finite number > 0"),
    Case("scale_tensor", "scale a tensor", CORE, _set(scale=torch.tensor(0.3)), TypeError,
         r"\bscale must be a Python float or None"),
    # ---- flags
    Case("flag_not_bool", "use_qk_l2norm_in_kernel = 1 (an int)", CORE, _set(use_qk_l2norm_in_kernel=1), TypeError,
         r"use_qk_l2norm_in_kernel must be a bool"),
    Case("output_final_state_not_bool", "output_final_state = None", CORE, _set(output_final_state=None),
         TypeError, r"output_final_state must be a bool"),
    Case("head_first", "head_first=True (fla's [B, H, T, K] layout)", CORE, _set(head_first=True), ValueError,
         r"head_first=True is not supported"),
    Case("unknown_keyword", "a misspelt keyword (initial_states=...)", CORE, _set(initial_states=None), TypeError,
         r"unexpected keyword argument\(s\) \['initial_states'\]"),
    Case("return_intermediate_states", "return_intermediate_states=True (fla's extra output)", CORE,
         _set(return_intermediate_states=True), ValueError, r"return_intermediate_states=True is not supported"),
    Case("gdn_gk", "gk / gv given (fla 0.6.0's per-key / per-value gates; or beta passed fifth)",
         ("fused_recurrent_gated_delta_rule",), _set(gk=lambda a, f: a["beta"], beta=None), ValueError,
         r"gk / gv \(per-key / per-value gates\) are not supported .*pass beta=\.\.\. by keyword"),
    # ---- varlen
    Case("cu_seqlens_float", "cu_seqlens float32", CORE, _set(cu_seqlens=lambda a, f: a["cu_seqlens"].float()),
         TypeError, r"cu_seqlens must be an integer tensor", dict(varlen=True)),
    Case("cu_seqlens_list", "cu_seqlens a Python list", CORE, _set(cu_seqlens=[0, 2, 5]), TypeError,
         r"cu_seqlens must be a torch\.Tensor", dict(varlen=True)),
    Case("cu_seqlens_2d", "cu_seqlens of rank 2", CORE, _set(cu_seqlens=lambda a, f: a["cu_seqlens"][None]),
         ValueError, r"cu_seqlens must be 1-D \[N\+1\]", dict(varlen=True)),
    Case("cu_seqlens_empty", "cu_seqlens with no element", CORE,
         _set(cu_seqlens=torch.zeros(0, dtype=torch.long)), ValueError, r"cu_seqlens must be 1-D \[N\+1\]",
         dict(varlen=True)),
    Case("cu_seqlens_batch2", "cu_seqlens with B = 2", CORE, _set(cu_seqlens=torch.tensor([0, 2, 5])), ValueError,
         r"with cu_seqlens the batch size must be 1.*B=2"),
    Case("cu_seqlens_not_from_0", "cu_seqlens not starting at 0", CORE, _set(cu_seqlens=torch.tensor([1, 2, 5])),
         ValueError, r"cu_seqlens must start at 0", dict(varlen=True)),
    Case("cu_seqlens_decreasing", "cu_seqlens decreasing", CORE, _set(cu_seqlens=torch.tensor([0, 4, 2, 5])),
         ValueError, r"cu_seqlens must be non-decreasing", dict(varlen=True)),
    Case("cu_seqlens_not_to_T", "cu_seqlens not ending at T", CORE, _set(cu_seqlens=torch.tensor([0, 2, 4])),
         ValueError, r"cu_seqlens must end at T=5", dict(varlen=True)),
    # ---- initial state
    Case("initial_state_wrong_N", "initial_state with N+1 rows", CORE,
         _set(initial_state=torch.randn(B + 1, HV, K, V)), ValueError,
         r"initial_state must be \[N, HV, K, V\] = \[2, 4, 8, 4\]"),
    Case("initial_state_VK", "initial_state [N, HV, V, K] without state_v_first", CORE,
         _set(initial_state=torch.randn(B, HV, V, K)), ValueError, r"initial_state must be \[N, HV, K, V\]"),
    Case("initial_state_KV_with_v_first", "initial_state [N, HV, K, V] with state_v_first=True", CORE,
         _set(initial_state=torch.randn(B, HV, K, V), state_v_first=True), ValueError,
         r"initial_state must be \[N, HV, V, K\]"),
    Case("initial_state_rank3", "initial_state of rank 3", CORE, _set(initial_state=torch.randn(HV, K, V)),
         ValueError, r"initial_state must be \[N, HV, K, V\]"),
    Case("initial_state_float64", "initial_state float64", CORE,
         _set(initial_state=torch.randn(B, HV, K, V, dtype=torch.float64)), TypeError,
         r"initial_state must be float32.*got float64"),
    Case("initial_state_int", "initial_state int32", CORE,
         _set(initial_state=torch.zeros(B, HV, K, V, dtype=torch.int32)), TypeError,
         r"initial_state must be float32.*got int32"),
    # ---- devices ("meta" stands in for a second device)
    Case("k_other_device", "k on another device than q", CORE, _set(k=lambda a, f: a["k"].to("meta")), ValueError,
         r"all tensors must be on one device: q is on cpu, k is on meta"),
    Case("v_other_device", "v on another device", CORE, _set(v=lambda a, f: a["v"].to("meta")), ValueError,
         r"one device: q is on cpu, v is on meta"),
    Case("g_other_device", "g on another device", CORE, _set(g=lambda a, f: a["g"].to("meta")), ValueError,
         r"one device: q is on cpu, g is on meta"),
    Case("beta_other_device", "beta on another device", CORE, _set(beta=lambda a, f: a["beta"].to("meta")),
         ValueError, r"one device: q is on cpu, beta is on meta"),
    Case("initial_state_other_device", "initial_state on another device", CORE,
         _set(initial_state=torch.randn(B, HV, K, V, device="meta")), ValueError,
         r"initial_state must be on q's device cpu, got meta"),
    Case("cu_seqlens_other_device", "cu_seqlens on another device", CORE,
         _set(cu_seqlens=lambda a, f: a["cu_seqlens"].to("meta")), ValueError,
         r"cu_seqlens must be on q's device cpu, got meta", dict(varlen=True)),
    # ---- fused gate inside the kernel
    Case("gate_without_A_log", "use_gate_in_kernel=True without A_log", CORE, _set(A_log=None), ValueError,
         r"use_gate_in_kernel=True needs A_log", dict(gate=True)),
    Case("A_log_shape", "A_log [HV, 1]", CORE, _set(A_log=lambda a, f: a["A_log"][:, None]), ValueError,
         r"A_log must be \[HV\] = \[4\]", dict(gate=True)),
    Case("A_log_int", "A_log int64", CORE, _set(A_log=lambda a, f: a["A_log"].long()), TypeError,
         r"A_log must be float32, bfloat16 or float16, got int64", dict(gate=True)),
    Case("A_log_float64", "A_log float64", CORE, _set(A_log=lambda a, f: a["A_log"].double()), TypeError,
         r"A_log must be float32, bfloat16 or float16, got float64", dict(gate=True)),
    Case("A_log_other_device", "A_log on another device", CORE, _set(A_log=lambda a, f: a["A_log"].to("meta")),
         ValueError, r"one device: .* A_log is on meta", dict(gate=True)),
    Case("dt_bias_size", "dt_bias with the wrong number of elements", CORE,
         _set(dt_bias=lambda a, f: a["dt_bias"][:-1]), ValueError, r"dt_bias must be \[HV", dict(gate=True)),
    Case("dt_bias_transposed", "KDA dt_bias [K, HV] instead of [HV, K]", KDA,
         _set(dt_bias=lambda a, f: a["dt_bias"].view(K, HV)), ValueError,
         r"dt_bias must be \[HV\*K\] = \[32\] \(or \[HV, K\] = \[4, 8\]\), got \[8, 4\]", dict(gate=True)),
    Case("dt_bias_float64", "dt_bias float64", CORE, _set(dt_bias=lambda a, f: a["dt_bias"].double()), TypeError,
         r"dt_bias must be float32, bfloat16 or float16, got float64", dict(gate=True)),
    Case("lower_bound_without_gate", "lower_bound without use_gate_in_kernel", CORE, _set(lower_bound=-5.0),
         ValueError, r"lower_bound applies to the fused gate"),
    Case("lower_bound_positive", "lower_bound = 5 (decays > 1)", CORE, _set(lower_bound=5.0), ValueError,
         r"lower_bound must be a finite number < 0, got 5", dict(gate=True)),
    Case("lower_bound_nan", "lower_bound = NaN", CORE, _set(lower_bound=float("nan")), ValueError,
         r"lower_bound must be a finite number < 0", dict(gate=True)),
    Case("lower_bound_string", "lower_bound a string", CORE, _set(lower_bound="-5"), TypeError,
         r"lower_bound must be a Python float or None", dict(gate=True)),
    # ---- state pool (serving)
    Case("indices_without_pool", "ssm_state_indices without initial_state", RECURRENT, _set(initial_state=None),
         ValueError, r"ssm_state_indices needs initial_state", dict(pool=True)),
    Case("indices_float", "ssm_state_indices float32", RECURRENT,
         _set(ssm_state_indices=lambda a, f: a["ssm_state_indices"].float()), TypeError,
         r"ssm_state_indices must be an integer tensor", dict(pool=True)),
    Case("indices_wrong_N", "ssm_state_indices with N+1 entries", RECURRENT,
         _set(ssm_state_indices=torch.tensor([1, 3, 4])), ValueError,
         r"ssm_state_indices must be \[N\] or \[N, T\] with N=2", dict(pool=True)),
    Case("indices_out_of_range", "ssm_state_indices >= pool size", RECURRENT,
         _set(ssm_state_indices=torch.tensor([1, P])), ValueError,
         r"ssm_state_indices must be < the pool size P=6", dict(pool=True)),
    Case("indices_duplicate", "the same pool row twice", RECURRENT, _set(ssm_state_indices=torch.tensor([3, 3])),
         ValueError, r"ssm_state_indices write pool rows \[3\] more than once", dict(pool=True)),
    Case("indices_other_device", "ssm_state_indices on another device", RECURRENT,
         _set(ssm_state_indices=lambda a, f: a["ssm_state_indices"].to("meta")), ValueError,
         r"ssm_state_indices must be on q's device cpu", dict(pool=True)),
    Case("pool_shape", "pool [P, HV, K+1, V]", RECURRENT, _set(initial_state=torch.randn(P, HV, K + 1, V)),
         ValueError, r"initial_state must be \[P, HV, K, V\]", dict(pool=True)),
    Case("pool_float64", "pool float64", RECURRENT,
         _set(initial_state=torch.randn(P, HV, K, V, dtype=torch.float64)), TypeError,
         r"initial_state must be float32.*got float64", dict(pool=True)),
    Case("per_token_not_inplace", "[N, T] indices with inplace_final_state=False", RECURRENT,
         _set(ssm_state_indices=torch.tensor([[0, 1, 2, 3, 4], [5, -1, -1, -1, -1]]), inplace_final_state=False),
         ValueError, r"per-token ssm_state_indices \[N, T\] .* need inplace_final_state=True", dict(pool=True)),
    Case("per_token_too_few_columns", "[N, T'] indices with T' < T", RECURRENT,
         _set(ssm_state_indices=torch.tensor([[0, 1], [2, 3]])), ValueError,
         r"per-token ssm_state_indices need a column per token", dict(pool=True)),
    Case("num_accepted_without_indices", "num_accepted_tokens without ssm_state_indices", RECURRENT,
         _set(ssm_state_indices=None, initial_state=None, num_accepted_tokens=torch.tensor([1, 1])), ValueError,
         r"num_accepted_tokens needs ssm_state_indices", dict(pool=True)),
    Case("num_accepted_with_1d_indices", "num_accepted_tokens with [N] indices", RECURRENT,
         _set(num_accepted_tokens=torch.tensor([1, 1])), ValueError,
         r"num_accepted_tokens needs per-token ssm_state_indices", dict(pool=True)),
    Case("num_accepted_float", "num_accepted_tokens float32", RECURRENT,
         _set(ssm_state_indices=torch.tensor([[0, 1, 2, 3, 4], [5, -1, -1, -1, -1]]),
              num_accepted_tokens=torch.tensor([1.0, 1.0])), ValueError,
         r"num_accepted_tokens must be an integer tensor \[N\] = \[2\]", dict(pool=True)),
    Case("num_accepted_out_of_range", "num_accepted_tokens = 0", RECURRENT,
         _set(ssm_state_indices=torch.tensor([[0, 1, 2, 3, 4], [5, -1, -1, -1, -1]]),
              num_accepted_tokens=torch.tensor([0, 1])), ValueError,
         r"num_accepted_tokens must be in \[1, 5\]", dict(pool=True)),
    Case("num_accepted_other_device", "num_accepted_tokens on another device", RECURRENT,
         _set(ssm_state_indices=torch.tensor([[0, 1, 2, 3, 4], [5, -1, -1, -1, -1]]),
              num_accepted_tokens=torch.tensor([1, 1], device="meta")), ValueError,
         r"num_accepted_tokens must be on q's device cpu", dict(pool=True)),
    # ---- the gate functions
    Case("gate_g_not_tensor", "g is a list", GATES, _set(g=lambda a, f: a["g"].tolist()), TypeError,
         r"\bg must be a torch\.Tensor"),
    Case("gate_A_log_rank2", "A_log [HV, 1]", GATES, _set(A_log=lambda a, f: a["A_log"][:, None]), ValueError,
         r"A_log \[HV\]|A_log must be \[HV\]"),
    Case("kda_gate_g_wrong_HV", "g [..., HV+1, K]", ("fused_kda_gate",),
         _set(g=lambda a, f: torch.randn(B, T, HV + 1, K)), ValueError, r"\bg must be \[\.\.\., HV, K\] with HV=4"),
    Case("kda_gate_head_k_dim", "g [..., HV*K] with a wrong head_k_dim", ("fused_kda_gate",),
         _set(g=lambda a, f: a["g"].flatten(-2), head_k_dim=K + 1), ValueError,
         r"g's last dim must be HV\*head_k_dim"),
    Case("gdn_gate_g_wrong_HV", "g [..., HV+1]", ("fused_gdn_gate",), _set(g=lambda a, f: torch.randn(B, T, HV + 1)),
         ValueError, r"\bg must be \[\.\.\., HV\]"),
    Case("gate_dt_bias_size", "dt_bias with the wrong number of elements", GATES,
         _set(dt_bias=lambda a, f: a["dt_bias"][:-1]), ValueError, r"dt_bias must"),
    Case("gate_dt_bias_not_tensor", "dt_bias is a list", GATES, _set(dt_bias=lambda a, f: a["dt_bias"].tolist()),
         TypeError, r"dt_bias must be a torch\.Tensor"),
    Case("gate_g_float64", "g float64", GATES, _set(g=lambda a, f: a["g"].double()), TypeError,
         r"\bg must be float32, bfloat16 or float16"),
    Case("gate_g_int", "g int64", GATES, _set(g=lambda a, f: a["g"].long()), TypeError,
         r"\bg must be float32, bfloat16 or float16"),
    Case("gate_A_log_int", "A_log int64", GATES, _set(A_log=lambda a, f: a["A_log"].long()), TypeError,
         r"A_log must be float32, bfloat16 or float16"),
    Case("gate_A_log_other_device", "A_log on another device than g", GATES,
         _set(A_log=lambda a, f: a["A_log"].to("meta")), ValueError, r"one device.*A_log"),
    Case("gate_lower_bound_positive", "lower_bound = 5", GATES, _set(lower_bound=5.0), ValueError,
         r"lower_bound must be a finite number < 0"),
]

CASE_IDS = [c.id for c in CASES]
assert len(set(CASE_IDS)) == len(CASE_IDS), "duplicate case ids"


def call_case(mod, case, fn):
    """Run `fn` with the case's bad argument. Returns the exception raised, or None."""
    args = valid_args(fn, **case.setup)
    case.change(args, fn)
    try:
        getattr(mod, fn)(**args)
    except Exception as e:  # noqa: BLE001 - the caller checks the type
        return e
    return None


def check(exc, case):
    """'' if `exc` is what the table promises, else what is wrong."""
    if exc is None:
        return "no exception"
    if not isinstance(exc, case.exc):
        return f"{type(exc).__name__} instead of {case.exc.__name__}: {exc}"
    if not re.search(case.match, str(exc)):
        return f"message {str(exc)!r} does not match {case.match!r}"
    return ""


def markdown(mod):
    lines = [
        "# Bad inputs: what the public API raises",
        "",
        "Generated from the table in `tests/bad_input_table.py`, which `tests/test_bad_input.py` runs on every",
        "variant; do not edit by hand (`.venv/bin/python tests/bad_input_table.py > docs/bad_inputs.md`; the test",
        "fails when this file is stale). Every check runs before anything is",
        "computed or written (a failed serving call leaves the state pool untouched). Messages start with",
        "`[function]`; the excerpt shows the first function the row applies to. `*` = all four core functions",
        "(`chunk_kda`, `chunk_gated_delta_rule`, `fused_recurrent_kda`, `fused_recurrent_gated_delta_rule`).",
        "Rows marked *known gap* do not raise as listed yet (the test expects them to fail until fixed).",
        "",
        "| input | functions | exception | message excerpt |",
        "|---|---|---|---|",
    ]
    for case in CASES:
        fns = "*" if case.fns == CORE else ", ".join(f"`{f}`" for f in case.fns)
        exc = call_case(mod, case, case.fns[0])
        problem = check(exc, case)
        if case.xfail:
            got = f"{type(exc).__name__}: {exc}" if exc is not None else "no exception"
            msg = f"*known gap: {case.xfail}; today: {_clip(got)}*"
        elif problem:
            msg = f"**MISMATCH: {_clip(problem)}**"
        else:
            msg = "`" + _clip(str(exc)).replace("`", "'") + "`"
        lines.append(f"| {case.input} | {fns} | `{case.exc.__name__}` | {msg.replace('|', '/')} |")
    lines += ["", "Non-contiguous inputs are accepted and give the results of contiguous ones; no input is ever",
              "modified (forward or backward) except the state pool of a serving call with inplace_final_state=True."]
    return "\n".join(lines) + "\n"


def _clip(s, n=150):
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[:n - 3] + "..."


if __name__ == "__main__":
    import os
    import warnings

    os.environ.setdefault("KDA_KERNELS_QUIET_FALLBACK", "1")
    warnings.simplefilter("ignore")
    from conftest import build_variant, load_variant

    print(markdown(load_variant(build_variant("universal"))), end="")
