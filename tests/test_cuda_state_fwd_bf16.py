"""state_fwd on bf16 tensor-core operands (KDA_CUDA_CHUNK_BWD_STATE_FWD=8: U plain bf16, =9: U as bf16 hi + lo, =10: U
and K Eend as bf16 hi + lo; kernels_src/cuda/delta_chunk_bwd_state_fwd_bf16.cuh; session 13, off by default) in
kda_chunk_bwd / gdn_chunk_bwd against autograd through the float64 reference (tests/ref_delta.py) at DESIGN.md
section 6 tolerances (bf16/fp16 inputs: dq, dk, dv, dh0 <= 0.008, dg, dbeta <= 0.02 relative RMS) and against the
default state_fwd3 narrow (tf32, =7: close, not equal). Every knob value is set explicitly. Prints each gradient's
error and its ratio to the bound for 7 / 8 / 9 / 10 (run with -s, or -rP under xdist) and, when STATE_FWD_BF16_ERRS
names a file, appends one line per (case, value) there, so the lead can judge the accuracy (the CPU emulation,
tests/test_cuda_state_fwd_bf16_emu.py, predicts hs errors of ~8x / ~5.6x / ~0.02x tf32's for 8 / 9 / 10).

Cases: test_cuda_state_bwd_bf16.py's (random T = 65, correlated keys, gate scales, 30 % of gates at -20 and at -1e4,
varlen with empty sequences, GVA, odd K / V, V > 128, T = 1000, 64 and 128 chunks), with initial state and grad of
the final state (and without), KDA and GDN, bf16 and an fp16 subset. fp32 inputs run state_fwd2 under every value.
Needs a CUDA GPU: without one the module is skipped.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the state_fwd bf16 tests need an NVIDIA GPU",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from ref_delta import rel_err  # noqa: E402
from test_cuda_backend import OPS, make_inputs  # noqa: E402  (loads / builds the CUDA variant)
from test_cuda_state_bwd_bf16 import BOUND, LONG, MY_CASES, NAMES, _inputs, _reference  # noqa: E402

KNOB = "KDA_CUDA_CHUNK_BWD_STATE_FWD"
VALUES = ("7", "8", "9", "10")
KERNEL = {"8": "state_fwd_bf16_kernel<{pc},false,false>", "9": "state_fwd_bf16_kernel<{pc},true,false>",
          "10": "state_fwd_bf16_kernel<{pc},true,true>"}


def _grads(family, case, dtype, value, monkeypatch, with_state=True):
    monkeypatch.setenv(KNOB, value)
    args, _ = _inputs(family, case, dtype, with_state)
    out = getattr(OPS, f"{family}_chunk_bwd")(*args)
    torch.cuda.synchronize()
    return [o.detach().double().cpu() for o in out]


def _report(family, case, dtype, value, errs):
    line = (f"[state_fwd bf16] {family} {case} {str(dtype)[6:]} {KNOB}={value}: "
            + " ".join(f"{n} {e:.2e} ({e / BOUND[n]:.3f})" for n, e in errs.items()))
    print("\n" + line, flush=True)
    path = os.environ.get("STATE_FWD_BF16_ERRS")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def _check_reference(family, case, dtype, monkeypatch, with_state=True):
    ref = _reference(family, case, dtype, with_state)
    outs = {}
    for value in VALUES:
        out = _grads(family, case, dtype, value, monkeypatch, with_state)
        errs = {n: rel_err(r, o) for n, r, o in zip(NAMES, ref, out)}
        _report(family, case, dtype, value, errs)
        outs[value] = out
        for n, o in zip(NAMES, out):
            assert torch.isfinite(o).all(), (value, n)
        if value != "7":  # (the default's own accuracy is test_cuda_chunk_bwd.py's)
            bad = {n: e for n, e in errs.items() if not e <= BOUND[n]}
            assert not bad, f"{family} {case} {KNOB}={value}: relative RMS above DESIGN.md section 6: {bad}"
    # repeatable: a second call with the last value gives the same gradients up to the grad kernels' own order of
    # shared-memory atomics (a race in the state kernel would move them far more)
    again = _grads(family, case, dtype, VALUES[-1], monkeypatch, with_state)
    for n, a, b in zip(NAMES, outs[VALUES[-1]], again):
        assert rel_err(a, b) <= 1e-4, f"a second call with {KNOB}={VALUES[-1]} differs in {n}"
    return outs


@pytest.mark.parametrize("case", [c for c in MY_CASES if c not in LONG])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_fwd_bf16_reference(family, dtype, case, monkeypatch):
    if dtype == torch.float16 and case not in ("random_T65", "extreme_gates", "extreme_gates_1e4", "varlen_empty",
                                               "gva_4x", "gate_div_10"):
        pytest.skip("fp16 differs from bf16 only in the prep's and the grad kernels' loads; a subset suffices")
    outs = _check_reference(family, case, dtype, monkeypatch)
    # against the default (tf32 products): close (both within the bounds; their distance well inside them) but not
    # equal (the bf16 rounding of the operands)
    for value in VALUES[1:]:
        d = {n: rel_err(a, b) for n, a, b in zip(NAMES, outs["7"], outs[value])}
        print(f"[state_fwd bf16] {family} {case}: ={value} vs =7 " + " ".join(f"{n} {e:.1e}" for n, e in d.items()))
        for n in NAMES:
            assert d[n] <= 0.75 * BOUND[n], (value, n, d[n])
        if case not in ("gva_varlen_extreme",):
            assert d["dq"] > 0 or d["dk"] > 0, f"={value} gave the default's gradients bit for bit: is the knob read?"


@pytest.mark.parametrize("case", LONG)
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_fwd_bf16_long_runs(family, case, monkeypatch):
    # 64 / 128 chunks with slow gates (logsigmoid(randn) / 10): the fp32 state carries every chunk's operand rounding
    if case == "long_T8192" and family == "gdn":
        pytest.skip("128 chunks once (KDA); GDN runs 64")
    _check_reference(family, case, torch.bfloat16, monkeypatch)


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_fwd_bf16_without_state(family, monkeypatch):
    for case in ("random_T65", "varlen_empty"):
        _check_reference(family, case, torch.bfloat16, monkeypatch, with_state=False)


@pytest.mark.parametrize("value", ["8", "9", "10"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_fwd_bf16_runs_under_its_knob(family, value, monkeypatch):
    # the knob really selects the instance (bf16 and fp16 inputs); fp32 inputs run state_fwd2_kernel under it
    monkeypatch.setenv(KNOB, value)

    def names(dtype):
        q, k, v, g, beta = make_inputs(family, B=1, T=100, H=1, HV=2, dtype=dtype, seed=41)
        do = torch.randn_like(v)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            getattr(OPS, f"{family}_chunk_bwd")(q, k, v, g, beta, 0.1, None, None, do, None)
            torch.cuda.synchronize()
        return [e.name.replace(" ", "") for e in prof.events() if "state_fwd" in e.name]

    want = KERNEL[value].format(pc="true" if family == "kda" else "false")
    for dtype in (torch.bfloat16, torch.float16):
        ev = names(dtype)
        assert ev and all(want in n for n in ev), (dtype, ev)
    ev = names(torch.float32)
    assert ev and all("state_fwd2_kernel" in n for n in ev), ev


@pytest.mark.parametrize("value", ["0", "1", "6", "11"])
def test_state_fwd_bad_value_is_refused(value, monkeypatch):
    monkeypatch.setenv(KNOB, value)
    q, k, v, g, beta = make_inputs("kda", B=1, T=70, H=1, HV=2, dtype=torch.bfloat16, seed=43)
    do = torch.randn_like(v)
    with pytest.raises(RuntimeError, match=f"{KNOB}={value} is not a state_fwd kernel: use 7 .* 10 "):
        OPS.kda_chunk_bwd(q, k, v, g, beta, 0.1, None, None, do, None)
    with pytest.raises(RuntimeError, match=f"{KNOB}={value} is not a state_fwd kernel"):
        OPS.kda_chunk_bwd_stage([], 0, q, k, v, g, beta, 0.1, None, None, do, None)


@pytest.mark.parametrize("value", ["8", "10"])
@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_fwd_bf16_staged(family, value, monkeypatch):
    # the staged op (the knob is read at stage 0) against the one-call backward with the same value: the same kernels
    args, _ = _inputs(family, "gva_varlen_extreme", torch.bfloat16)
    q, k, v, g, beta, scale, h0, cu, do, dht = args
    monkeypatch.setenv(KNOB, value)
    a = getattr(OPS, f"{family}_chunk_bwd")(*args)
    stage = getattr(OPS, f"{family}_chunk_bwd_stage")
    x = (q, k, v, g, beta, scale)
    work = stage([], 0, *x, None, cu, do, None)
    assert stage(work, 1, *x, h0, cu, do, None) == []
    (dh0,) = stage(work, 2, *x, h0, cu, do, dht)
    b = list(stage(work, 3, *x, h0, cu, do, None)) + [dh0]
    torch.cuda.synchronize()
    for name, x1, y1 in zip(NAMES, a, b):
        assert rel_err(x1.double().cpu(), y1.double().cpu()) <= (0.004 if name in ("dq", "dk", "dv") else 1e-6), name
