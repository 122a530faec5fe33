"""Memory model of the CUDA chunked backward (kernels_src/cuda/delta_chunk_bwd_host.cuh): every allocation of one
public forward + backward (chunk_kda / chunk_gated_delta_rule with autograd, output_final_state=True), in bytes,
as the host allocates them. Pure Python (no GPU): tests/test_cuda_chunk_bwd_mem.py bounds the measured peak by it,
benchmarks/cuda/mem_chunk_bwd.py prints it next to the measurement, docs/cuda.md's table comes from `table()`.

Peak "above the inputs" as benchmarks/cuda/bench_chunk_bwd.py's peak_above measures it: torch.cuda
max_memory_allocated minus what was allocated before the call, so q, k, v, g, beta, grad_o and grad_final_state do
not count; the forward's outputs (o, final_state: alive while backward runs) and the gradients returned (dq, dk,
dv in the inputs' dtype, dg, dbeta fp32; dh0 fp32 is computed and dropped by autograd without an initial state)
do. Fixed-length batches (N = B); V <= 128 (one column block); K <= 128 (the chunked path).
"""
import math

CH, KP = 64, 128
MiB = 2 ** 20


def _r(n):  # the caching allocator rounds every block to 512 bytes
    return (max(int(n), 1) + 511) // 512 * 512


def work_bytes(B, T, HV, K, V):
    """chunk_bwd_params' work list of one call (grad v3): name -> bytes."""
    tokens, nc = B * T, max(B * math.ceil(T / CH), 1)
    tile = nc * HV * CH * KP * 4
    return {
        "chunk_off": _r((B + 1) * 4),
        "aqk [nc,HV,64,64]": _r(nc * HV * CH * CH * 4), "akk [nc,HV,64,64]": _r(nc * HV * CH * CH * 4),
        "wc [nc,HV,64,128]": _r(tile), "kendc (then dKend)": _r(tile), "qgc (then dQG)": _r(tile),
        "glc [nc,HV,128]": _r(nc * HV * KP * 4),
        "u [T,HV,V]": _r(tokens * HV * V * 4), "U [T,HV,V]": _r(tokens * HV * V * 4),
        "dU [T,HV,V]": _r(tokens * HV * V * 4),
        "hs [nc,HV,K,V]": _r(nc * HV * K * V * 4), "dhs [nc,HV,K,V]": _r(nc * HV * K * V * 4),
        "gdw [nc,HV,64,128]": _r(tile),
    }


def block_peak(fam, B, T, H, HV, K, V, dt, free=True, dg_per_head=True):
    """Peak of one chunk_bwd_block + chunk_bwd_finish (bytes) and its parts. free=False: outputs before the first
    stage, no work freed (KDA_CUDA_CHUNK_BWD_FREE=0); dg_per_head=False: GDN's dg per channel [T,HV,K] (session 7's
    grad3_ch, retired in session 9)."""
    w = work_bytes(B, T, HV, K, V)
    tokens = B * T
    dh0 = _r(B * HV * K * V * 4)
    f32 = {"dq": _r(tokens * HV * K * 4), "dk": _r(tokens * HV * K * 4),
           "dg": _r(tokens * HV * (K if fam == "kda" or not dg_per_head else 1) * 4),
           "dbeta": _r(tokens * HV * 4), "dv": _r(tokens * HV * V * dt)}
    W = sum(w.values())
    if not free:
        at_vc = W + sum(f32.values()) + dh0
        at_ch = at_vc
    else:
        at_vc = W + dh0  # grad3_vc: every work buffer alive, no output yet
        dead = sum(w[n] for n in ("hs [nc,HV,K,V]", "dhs [nc,HV,K,V]", "U [T,HV,V]", "u [T,HV,V]", "dU [T,HV,V]",
                                  "wc [nc,HV,64,128]"))
        at_ch = W - dead + sum(f32.values()) + dh0
    # finish: the fp32 results alive, the GVA sum (fp32 [T,H,K] when HV > H) and the cast outputs
    outs = _r(tokens * H * K * dt)
    gva = _r(tokens * H * K * 4) if HV != H else 0
    at_finish = sum(f32.values()) + dh0 + 2 * outs + gva
    return max(at_vc, at_ch, at_finish), dict(work=W, at_vc=at_vc, at_ch=at_ch, at_finish=at_finish, **f32)


def fwd_ws_bytes(B, T, HV, V, ws_bf16=True):
    d = 2 if ws_bf16 else 1
    per = CH * KP + 2 * CH * KP // d + CH * CH // d + KP + CH * V  # WsLayout<128>::floats(V)
    return _r(B * math.ceil(T / CH) * HV * per * 4)


def window_tokens(B, T, HV, knob=None):
    """bwd_window_tokens (host): knob None = unset = 0 = off, -1 = auto."""
    if T <= CH:
        return 0
    if not knob or knob < -1:
        return 0
    tw = knob if knob > 0 else max(512, 65536 // (B * HV))
    tw = max(CH, math.ceil(tw / CH) * CH)
    if T <= tw:
        return 0
    nw = math.ceil(T / tw)
    return math.ceil(math.ceil(T / nw) / CH) * CH


def fwdbwd_peak(fam, B, T, H, HV, K, V, dt=2, window=None, free=True, dg_per_head=True):
    """Predicted peak above the inputs (bytes) of one public forward + backward, and its parts."""
    o, ht = _r(B * T * HV * V * dt), _r(B * HV * K * V * 4)
    fwd = o + ht + fwd_ws_bytes(B, T, HV, V)
    tw = window_tokens(B, T, HV, window)
    if tw == 0:
        bp, parts = block_peak(fam, B, T, H, HV, K, V, dt, free, dg_per_head)
        return max(fwd, o + ht + bp), dict(forward=fwd, outputs_fwd=o + ht, block=bp, windows=0, **parts)
    nw = math.ceil(T / tw)
    outs = (2 * _r(B * T * H * K * dt) + _r(B * T * HV * V * dt) + _r(B * T * HV * (K if fam == "kda" else 1) * 4)
            + _r(B * T * HV * 4))
    states = (nw - 1) * ht + ht  # window-start states + the carried dh
    bp, parts = block_peak(fam, B, tw, H, HV, K, V, dt, free, dg_per_head)
    win_in = 0 if B == 1 else (2 * B * tw * H * K * dt + 2 * B * tw * HV * V * dt
                               + B * tw * HV * ((K if fam == "kda" else 1) + 1) * 4)  # narrow(1).contiguous() copies
    peak = o + ht + outs + states + win_in + bp
    return max(fwd, peak), dict(forward=fwd, outputs_fwd=o + ht, outputs_final=outs, states=states, window=tw,
                                windows=nw, window_inputs=win_in, block=bp, **parts)


def train_windows(B, T, HV, knob):
    """api.train_windows (KDA_TRAIN_WINDOW): [(b0, nb, t0, nt)] windows of the autograd-level training windows, [] for
    none; knob 0 off, -1 automatic, N > 0 tokens (all sequences of a window together). tests/test_train_windows.py
    checks this copy against the package's."""
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    if not knob or knob < -1 or B <= 0 or T <= 0:
        return []
    budget = B * max(512, 65536 // (B * HV)) if knob == -1 else knob
    if B * T <= budget:
        return []
    if T <= budget or T <= CH:
        nb = cdiv(B, cdiv(B, max(1, budget // T)))
        return [(b0, min(nb, B - b0), 0, T) for b0 in range(0, B, nb)]
    nw = cdiv(T, cdiv(budget, CH) * CH)
    per = cdiv(cdiv(T, nw), CH) * CH
    return [(b, 1, t0, min(per, T - t0)) for b in range(B) for t0 in range(0, T, per)]


def train_window_peak(fam, B, T, H, HV, K, V, dt=2, knob=-1, free=True, dg_per_head=True, initial_state=False,
                      block=None, fwd_ws=None):
    """Predicted peak above the inputs (bytes) of one public forward + backward with the autograd-level windows
    (KDA_TRAIN_WINDOW=knob; output_final_state=True, the cotangent of the final state given; the CUDA host's own
    windows off), and its parts. None when the call is not windowed.

    Forward, window i: the o pieces and saved states of the windows before it, its workspace, o_i, ht_i; then the
    concatenation (every o piece + o). Backward, window i (last first): o and the final state (the caller's), the
    window-start states still saved (those of windows <= i), the dh carried into it, the gradients the windows after
    it returned (held for the one concatenation per input), and the window's own backward (block_peak); at the
    end, the concatenation of each input's gradient (every piece + the largest full gradient). block(nb, nt) and
    fwd_ws(nb, nt) replace the CUDA host's backward peak and forward workspace of one window (bytes; the CPU test of
    this accounting runs a stand-in op with known allocations)."""
    if block is None:
        def block(nb, nt):
            return block_peak(fam, nb, nt, H, HV, K, V, dt, free, dg_per_head)[0]
    if fwd_ws is None:
        def fwd_ws(nb, nt):
            return fwd_ws_bytes(nb, nt, HV, V)
    plan = train_windows(B, T, HV, knob)
    if not plan:
        return None
    kdim = K if fam == "kda" or not dg_per_head else 1
    o_full, s_full = _r(B * T * HV * V * dt), _r(B * HV * K * V * 4)
    o_w = [_r(nb * nt * HV * V * dt) for (_, nb, _, nt) in plan]
    ht_w = [_r(nb * HV * K * V * 4) for (_, nb, _, _) in plan]
    last = [t0 + nt == T for (_, _, t0, nt) in plan]
    saved = [t0 > 0 for (_, _, t0, _) in plan]  # window i saved the previous window's final state
    fwd = 0
    for i, (_, nb, _, nt) in enumerate(plan):  # every earlier o piece and final state is still alive
        fwd = max(fwd, sum(o_w[:i]) + sum(ht_w[:i]) + fwd_ws(nb, nt) + o_w[i] + ht_w[i])
    fwd = max(fwd, sum(o_w) + sum(ht_w) + o_full)  # o's concatenation
    kept_states = sum(ht_w[i - 1] for i in range(len(plan)) if saved[i])
    finals = sum(ht_w[j] for j in range(len(plan)) if last[j])
    if finals != ht_w[-1]:  # several groups: the final states' concatenation
        fwd = max(fwd, o_full + kept_states + finals + s_full)
    full = {"dq": _r(B * T * H * K * dt), "dk": _r(B * T * H * K * dt), "dv": _r(B * T * HV * V * dt),
            "dg": _r(B * T * HV * kdim * 4), "dbeta": _r(B * T * HV * 4)}
    if initial_state:
        full["dh0"] = s_full

    def ret(i):  # what window i's backward returns and autograd holds until the concatenation
        _, nb, t0, nt = plan[i]
        n = nb * nt
        r = 2 * _r(n * H * K * dt) + _r(n * HV * V * dt) + _r(n * HV * kdim * 4) + _r(n * HV * 4)
        return r + (ht_w[i] if t0 == 0 and initial_state else 0)

    bwd, at = 0, []
    for i in range(len(plan) - 1, -1, -1):
        _, nb, t0, nt = plan[i]
        states = sum(ht_w[j - 1] for j in range(i + 1) if saved[j])
        carried = ht_w[i] if not last[i] else 0  # the dh0 of window i + 1 (the last's is the caller's dht)
        held = sum(ret(j) for j in range(i + 1, len(plan)))
        at.append(o_full + s_full + states + carried + held + block(nb, nt))
    bwd = max(at)
    end = o_full + s_full + sum(ret(j) for j in range(len(plan))) + max(full.values())
    peak = max(fwd, bwd, end)
    return peak, dict(forward=fwd, backward=bwd, concat=end, windows=len(plan), window=plan[0][3],
                      window_seqs=plan[0][1], block=max(block(nb, nt) for (_, nb, _, nt) in plan),
                      grads=sum(full.values()), states=kept_states)


def table(fam="kda", B=1, T=8192, H=16, HV=32, K=128, V=128):
    """Markdown rows: every buffer of the backward at this shape (MiB) and the predicted peaks."""
    rows = [f"| {n} | {b / MiB:.1f} |" for n, b in work_bytes(B, T, HV, K, V).items()]
    old, po = fwdbwd_peak(fam, B, T, H, HV, K, V, window=0, free=False, dg_per_head=False)  # session 7
    free, pf = fwdbwd_peak(fam, B, T, H, HV, K, V, window=0, free=True)
    new, pn = fwdbwd_peak(fam, B, T, H, HV, K, V, window=-1)  # KDA_CUDA_CHUNK_BWD_WINDOW=-1 (auto size)
    return rows, old / MiB, free / MiB, new / MiB, (po, pf, pn)


if __name__ == "__main__":
    for fam in ("kda", "gdn"):
        for (B, T, H, HV) in ((1, 8192, 16, 32), (4, 4096, 32, 32), (1, 32768, 16, 32)):
            pw, parts = train_window_peak(fam, B, T, H, HV, 128, 128)
            off, _ = fwdbwd_peak(fam, B, T, H, HV, 128, 128, window=0)
            cpp, _ = fwdbwd_peak(fam, B, T, H, HV, 128, 128, window=-1)
            print(f"{fam} B{B} T{T} H{H} HV{HV}: off {off / MiB:.0f} MiB, C++ windows {cpp / MiB:.0f}, autograd "
                  f"windows {pw / MiB:.0f}", {k: (round(v / MiB, 1) if k not in ("windows", "window", "window_seqs")
                                                  else v) for k, v in parts.items()})
    for fam in ("kda", "gdn"):
        for T in (8192, 32768):
            rows, old, free, new, parts = table(fam, T=T)
            print(f"{fam} T={T}: session7 {old:.0f} MiB, free-only {free:.0f}, windows+free {new:.0f}  "
                  f"(window {parts[2].get('window')}, {parts[2]['windows']} windows)")
            if T == 8192 and fam == "kda":
                print("\n".join(rows))
                print({k: round(v / MiB, 1) for k, v in parts[2].items() if isinstance(v, int) and v > 64})
