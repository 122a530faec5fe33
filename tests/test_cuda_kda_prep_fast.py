"""The FAST instance of the KDA forward prep (kda_chunk_prep2_kernel<..., FAST = true>, kernels_src/cuda/
kda_chunk_prep2.cuh; KDA_CUDA_KDA_PREP=6, the default since session 13) against the former default (=3, the same
kernel without FAST): the same outputs bit for bit. FAST only changes how the same tf32 operands are formed (to_tf32_fast
instead of cvt.rna, T rounded once in shared memory and read by ldmatrix, S5's jobs in pairs, u0 as float2), never
an operand or the order of an accumulation, so o, the final state and the whole workspace the prep writes must be
torch.equal. Cases: bf16 / fp16; the bf16 workspace with scan7 (w as bf16, the WB instances) and with the single
scan (fp32 w), the fp32 workspace; varlen with empty sequences, GVA (HV = 2 H, 4 H), initial state, extreme gates
(-20, -1e4), T = 1, 65, 200, 1000, K = V = 64, odd K / V, odd V (u0's element stores), V = 200 / 256 (u0 in two
128-column passes); the benchmark shape B1 T8192 H16 HV32. Plus =6 against the float64 reference (DESIGN.md section
6) and its refusal of unknown values. Needs a CUDA GPU (skipped with the reason otherwise).
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the KDA prep FAST tests need an NVIDIA GPU",
                allow_module_level=True)

from ref_delta import assert_close, ref_delta_rule  # noqa: E402
from test_cuda_chunk_fwd import DEV, OPS, TOL, case_inputs, make  # noqa: E402  (loads the build)

KNOB = "KDA_CUDA_KDA_PREP"
CASES = ["T1", "T65", "T200", "correlated_keys", "gate_div_0.1", "gate_div_10", "extreme_gates",
         "extreme_gates_div_0.1", "gva_4x", "kv64", "odd_kv", "wide_v", "cp_width_v256", "v200", "odd_v", "varlen",
         "varlen_extreme", "T1000_gva2x", "T1000_varlen"]
# (workspace, scan): the bf16 workspace with scan7 runs the WB instances (w as bf16), with the single scan and with
# the fp32 workspace the others
MODES = [("ws_bf16", "11"), ("ws_bf16", "1"), ("ws_fp32", "11")]


def inputs(case, dtype):
    """(q, k, v, g, beta), h0, cu: test_cuda_chunk_fwd's CASES, plus T = 1000 cases (not a multiple of 64)."""
    if case == "T1000_gva2x":  # GVA HV = 2 H, 16 chunks, the last one 40 tokens
        x = make("kda", B=2, T=1000, H=2, HV=4, dtype=dtype, seed=3)
        cu = None
    elif case == "T1000_varlen":  # varlen with an empty sequence, extreme gates, GVA
        cu_list = [0, 0, 333, 333, 700, 1000]
        x = make("kda", H=1, HV=2, dtype=dtype, extreme=True, seed=4, cu=cu_list)
        cu = torch.tensor(cu_list, dtype=torch.long, device=DEV)
    else:
        return case_inputs("kda", case, dtype)
    q, k, v, g, beta = x
    N = q.shape[0] if cu is None else cu.numel() - 1
    h0 = (torch.randn(N, v.shape[2], q.shape[3], v.shape[3], generator=torch.Generator().manual_seed(9)) * 0.5).to(DEV)
    return (q, k, v, g, beta), h0, cu


def set_mode(monkeypatch, ws, scan):
    monkeypatch.setenv("KDA_CUDA_CHUNK_WS_BF16", "1" if ws == "ws_bf16" else "0")
    monkeypatch.setenv("KDA_CUDA_CHUNK_SCAN", scan)


def ws_stride(q, v, ws):
    """WsLayout<KP>(half).floats(V) (delta_chunk_fwd.cuh): w, q~, k~^T, A~ (bf16 sections when half), decay, u0."""
    KP = 64 if q.shape[3] <= 64 else 128
    d = 2 if ws == "ws_bf16" else 1
    return 64 * KP + 2 * 64 * KP // d + 64 * 64 // d + KP + 64 * v.shape[3]


def poison_next_workspace(q, v, cu, ws):
    """Fill and free a NaN block of the workspace's size, so that the caching allocator most likely hands it to the
    next call's workspace: words neither kernel writes then hold the same bits in both runs (written_workspace
    leaves out those it knows of; this only guards against a false alarm from one it does not)."""
    T = q.shape[1]
    mc = (T + 63) // 64 + (cu.numel() - 1) if cu is not None else q.shape[0] * ((T + 63) // 64)
    torch.cuda.synchronize()
    junk = torch.full((max(mc * v.shape[2] * ws_stride(q, v, ws), 1),), float("nan"), device=DEV)
    del junk


def written_workspace(work, q, v, cu, ws, scan):
    """The prep's workspace from a staged forward's stage-0 work list, as int32 bit patterns, restricted to what the
    prep writes: the chunk slots that hold a chunk, and (where w goes out as bf16 for scan7) not the unused second
    half of w's fp32 section. WsLayout (delta_chunk_fwd.cuh): w, q~, k~^T, A~, decay, u0."""
    KP, V = (64 if q.shape[3] <= 64 else 128), v.shape[3]
    half = ws == "ws_bf16"
    stride = ws_stride(q, v, ws)
    lens = [q.shape[1]] * q.shape[0] if cu is None else (cu[1:] - cu[:-1]).tolist()
    chunks = sum((n + 63) // 64 for n in lens)
    HV = v.shape[2]
    flat = work[0]
    assert flat.numel() >= chunks * HV * stride, "workspace smaller than WsLayout says: layout changed?"
    x = flat[:chunks * HV * stride].view(torch.int32).view(chunks * HV, stride)
    wb = half and scan in ("10", "11") and torch.cuda.get_device_capability()[0] >= 9 and V <= 256
    if wb:  # w as bf16 in the first half of its section
        x = torch.cat([x[:, :32 * KP], x[:, 64 * KP:]], dim=1)
    return x.clone()


@pytest.mark.parametrize("ws,scan", MODES, ids=[f"{w}_scan{s}" for w, s in MODES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES)
def test_kda_prep_fast_is_bit_identical(case, dtype, ws, scan, monkeypatch):
    """o and the final state of kda_chunk_fwd with KDA_CUDA_KDA_PREP=6 equal those with =3 bit for bit, and (where
    the staged forward applies: K, V <= 128) so does every workspace word the prep writes."""
    (q, k, v, g, beta), h0, cu = inputs(case, dtype)
    set_mode(monkeypatch, ws, scan)
    scale = q.shape[3] ** -0.5
    out, wsp = {}, {}
    for value in ("3", "6"):
        monkeypatch.setenv(KNOB, value)
        out[value] = OPS.kda_chunk_fwd(q, k, v, g, beta, scale, h0, cu)
        if q.shape[3] <= 128 and v.shape[3] <= 128:
            poison_next_workspace(q, v, cu, ws)
            work = OPS.kda_chunk_fwd_stage([], 0, q, k, v, g, beta, scale, None, cu)
            wsp[value] = written_workspace(work, q, v, cu, ws, scan)
    (o3, s3), (o6, s6) = out["3"], out["6"]
    assert torch.equal(o6, o3), f"o differs: max |diff| {(o6.float() - o3.float()).abs().max().item()}"
    assert torch.equal(s6, s3), f"final state differs: max |diff| {(s6 - s3).abs().max().item()}"
    if wsp:
        diff = (wsp["6"] != wsp["3"]).nonzero()
        assert diff.numel() == 0, f"workspace words differ at (slot, word) {diff[:8].tolist()} of {len(diff)}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["T65", "extreme_gates", "gva_4x", "odd_kv", "odd_v", "varlen", "T1000_varlen"])
def test_kda_prep_fast_reference(case, dtype, monkeypatch):
    """=6 (default workspace and scan) against the float64 reference at DESIGN.md section 6 tolerances, finite."""
    (q, k, v, g, beta), h0, cu = inputs(case, dtype)
    monkeypatch.setenv(KNOB, "6")
    o, s = OPS.kda_chunk_fwd(q, k, v, g, beta, q.shape[3] ** -0.5, h0, cu)
    assert torch.isfinite(o.float()).all() and torch.isfinite(s).all()
    ro, rs = ref_delta_rule(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), scale=q.shape[3] ** -0.5,
                            initial_state=h0.cpu(), cu_seqlens=None if cu is None else cu.cpu())
    assert_close("o (prep FAST)", ro, o.cpu(), TOL[dtype])
    assert_close("final_state (prep FAST)", rs, s.cpu(), TOL[dtype])


def test_kda_prep_fast_benchmark_shape(monkeypatch):
    """B1 T8192 H16 HV32 K=V=128 bf16 (4096 blocks, two resident per SM), default workspace and scan: =6 gives =3's
    o and final state bit for bit, and a second =6 call the same bits."""
    q, k, v, g, beta = make("kda", B=1, T=8192, H=16, HV=32, seed=11)
    h0 = (torch.randn(1, 32, 128, 128, generator=torch.Generator().manual_seed(4)) * 0.5).to(DEV)
    res = []
    for value in ("3", "6", "6"):
        monkeypatch.setenv(KNOB, value)
        res.append(OPS.kda_chunk_fwd(q, k, v, g, beta, 128 ** -0.5, h0, None))
    for o, s in res[1:]:
        assert torch.equal(o, res[0][0]) and torch.equal(s, res[0][1])


@pytest.mark.parametrize("value", ["7", "66", "fast"])
def test_kda_prep_unknown_values_refused(value, monkeypatch):
    """Values other than 3 and 6 raise an error naming the knob and the accepted values (3 for bf16 and fp32
    inputs alike: fp32 runs the generic prep for either accepted value)."""
    (q, k, v, g, beta), h0, cu = case_inputs("kda", "T65", torch.bfloat16)
    monkeypatch.setenv(KNOB, value)
    with pytest.raises(RuntimeError, match=f"{KNOB}={value} is not an accepted value: {KNOB} takes 3, 6"):
        OPS.kda_chunk_fwd(q, k, v, g, beta, 0.1, h0, cu)
    monkeypatch.setenv(KNOB, "6")  # fp32 inputs: accepted, the generic prep runs
    o, s = OPS.kda_chunk_fwd(q.float(), k.float(), v.float(), g, beta, 0.1, h0, cu)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
