"""CPU emulation of the index math of the opt-in scan delta_chunk_scan6_kernel<KP, KS> (KDA_CUDA_CHUNK_SCAN=8 / 9,
kernels_src/cuda/delta_chunk_scan6.cuh): the new warp tiles of one chunk step, lane by lane, with the m16n8k8
fragment layouts of tests/test_cuda_scan3_emu.py (mma8, frag_index):
  - U = u0 - w h: KS = false 4 warps of 16 rows x 32 columns; KS = true warp pairs (wr, kh), kh = 1 storing its chain
    into Us at its fragment positions (float2 stores), kh = 0 reading them back and writing u0 - (a0 + a1);
  - the h update with the U fragments loaded once per k-step for both row tiles of a warp;
  - o = q~ h + A~ U: KS = false 4 warps of 16 rows x 32 columns; KS = true pairs (wr, ch) with the A~ U chain
    handed through the float4 scratch xs[wr][(mt * 4 + nt) * 32 + lane].
Checks against float64 matrix products, and that every accumulator sees scan5's sequence of k-steps (the claim that
o and the final state are bit-identical to scan5's): U chains a0 = even, a1 = odd k-steps in order, h the decay
then k-steps 0..7, o chains q~ h = 0 .. KP/8 - 1 and A~ U = 0 .. 2 rt + 1 for row tile rt. A mutated index (wrong
row tile, wrong parity, wrong scratch slot) must fail. Runs without a GPU; the CUDA code is tested by
tests/test_cuda_scan6.py on a GPU.
"""
import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_cuda_scan3_emu import GQ, T4, mma8, to_frag  # noqa: E402

C = 64
LDH = 40  # Scan4Smem::LDH (32 + 8)


class Acc:
    """An m16n8 accumulator tile of one warp ([32, 4] per lane) that records its k-steps (tag, ks) in order."""

    def __init__(self):
        self.v = np.zeros((32, 4))
        self.trace = []

    def mma(self, a, b0, b1, tag, ks):
        mma8(self.v, a, b0, b1)
        self.trace.append((tag, ks))


def a_frag_ws(F, KD, rt, ks):
    """The [32, 4] A fragment (row tile rt, k-step ks) of a fragment-ordered section F of a [R x KD] matrix, as the
    kernel reads it: float4 / uint2 at (rt * (KD / 8) + ks) * 32 + lane."""
    base = (rt * (KD // 8) + ks) * 32
    return np.stack([F[(base + lane) * 4: (base + lane) * 4 + 4] for lane in range(32)])


def b_frags(Bs, col0, ks, nt):
    """b0 / b1 of a row-major shared tile Bs (stride LDH) at columns col0 + 8 nt, k-step ks."""
    return Bs[(ks * 8 + T4) * LDH + col0 + nt * 8 + GQ], Bs[(ks * 8 + T4 + 4) * LDH + col0 + nt * 8 + GQ]


def tile_put(Ms, acc, r0, c0):
    """acc's [16 x 8] tile into the row-major shared array Ms (stride LDH) at row r0, column c0."""
    for e in range(4):
        Ms[(r0 + GQ + (e >> 1) * 8) * LDH + c0 + 2 * T4 + (e & 1)] = acc[:, e]


def tile_get(Ms, r0, c0):
    out = np.zeros((32, 4))
    for e in range(4):
        out[:, e] = Ms[(r0 + GQ + (e >> 1) * 8) * LDH + c0 + 2 * T4 + (e & 1)]
    return out


def emu_u(KP, KS, Wf, hs, u0, mutate=None):
    """U = u0 - w h into Us (row-major, stride LDH) and the accumulators' traces {(rt, ct): [chain traces]}."""
    Us = np.full(C * LDH, np.nan)
    traces = {}
    if not KS:
        for wi in range(4):
            a0 = [Acc() for _ in range(4)]
            a1 = [Acc() for _ in range(4)]
            for ks in range(0, KP // 8, 2):
                for j, acc in ((ks, a0), (ks + 1, a1)):
                    a = a_frag_ws(Wf, KP, wi, j)
                    for nt in range(4):
                        acc[nt].mma(a, *b_frags(hs, 0, j, nt), "w", j)
            for nt in range(4):
                u = u0[wi * 16:(wi + 1) * 16, nt * 8:(nt + 1) * 8]
                uf = np.stack([u[GQ, 2 * T4], u[GQ, 2 * T4 + 1], u[GQ + 8, 2 * T4], u[GQ + 8, 2 * T4 + 1]], 1)
                tile_put(Us, uf - (a0[nt].v + a1[nt].v), wi * 16, nt * 8)
                traces[(wi, nt)] = (a0[nt].trace, a1[nt].trace)
        return Us, traces
    accs = {}
    for wr in range(2):
        for kh in (1, 0):  # the kernel's order of effect: kh = 1 stores before kh = 0 reads (named barrier)
            acc = [[Acc() for _ in range(4)] for _ in range(2)]
            for j in range(KP // 16):
                ks = 2 * j + kh
                for mt in range(2):
                    rt = 2 * wr + mt
                    if mutate == "u_row_tile":
                        rt = 2 * wr + (1 - mt)
                    a = a_frag_ws(Wf, KP, rt, ks)
                    for nt in range(4):
                        acc[mt][nt].mma(a, *b_frags(hs, 0, ks, nt), "w", ks)
            accs[(wr, kh)] = acc
            for mt in range(2):
                for nt in range(4):
                    r0 = (2 * wr + mt) * 16
                    if kh == 1:
                        tile_put(Us, acc[mt][nt].v, r0, nt * 8)
                    else:
                        part = tile_get(Us, r0, nt * 8)
                        u = u0[r0:r0 + 16, nt * 8:(nt + 1) * 8]
                        uf = np.stack([u[GQ, 2 * T4], u[GQ, 2 * T4 + 1], u[GQ + 8, 2 * T4], u[GQ + 8, 2 * T4 + 1]], 1)
                        tile_put(Us, uf - (acc[mt][nt].v + part), r0, nt * 8)
                        traces[(2 * wr + mt, nt)] = (acc[mt][nt].trace, accs[(wr, 1)][mt][nt].trace)
    return Us, traces


def emu_h(KP, Kf, dec, H, Us):
    """h <- Diag(dec) h + k~^T U with ScanRec's tiles (8 warps: wi rows [wi KP/4, ..), cw = 16 wc); returns h and
    the traces per (row tile, column tile)."""
    MT = KP // 64
    out = np.zeros_like(H)
    traces = {}
    for w in range(8):
        wi, cw = w & 3, (w >> 2) * 16
        hacc = [[Acc() for _ in range(2)] for _ in range(MT)]
        for mt in range(MT):
            rt = wi * MT + mt
            for nt in range(2):
                blk = H[rt * 16:(rt + 1) * 16, cw + nt * 8: cw + nt * 8 + 8]
                hacc[mt][nt].v = np.stack([blk[GQ, 2 * T4], blk[GQ, 2 * T4 + 1], blk[GQ + 8, 2 * T4],
                                           blk[GQ + 8, 2 * T4 + 1]], 1)
                d0, d1 = dec[rt * 16 + GQ], dec[rt * 16 + GQ + 8]
                hacc[mt][nt].v *= np.stack([d0, d0, d1, d1], 1)
                hacc[mt][nt].trace.append(("decay", -1))
        for ks in range(C // 8):
            bs = [b_frags(Us, cw, ks, nt) for nt in range(2)]
            for mt in range(MT):
                a = a_frag_ws(Kf, C, wi * MT + mt, ks)
                for nt in range(2):
                    hacc[mt][nt].mma(a, *bs[nt], "k", ks)
        for mt in range(MT):
            for nt in range(2):
                rt = wi * MT + mt
                for e in range(4):
                    out[rt * 16 + GQ + (e >> 1) * 8, cw + nt * 8 + 2 * T4 + (e & 1)] = hacc[mt][nt].v[:, e]
                traces[(rt, cw // 8 + nt)] = hacc[mt][nt].trace
    return out, traces


def emu_o(KP, KS, Qf, Af, hs, Us, mutate=None):
    """o [64 x 32] and the traces {(rt, ct): (q~ h chain, A~ U chain)}."""
    o = np.full((C, 32), np.nan)
    traces = {}
    if not KS:
        for wi in range(4):
            a0 = [Acc() for _ in range(4)]
            a1 = [Acc() for _ in range(4)]
            for ks in range(KP // 8):
                for nt in range(4):
                    a0[nt].mma(a_frag_ws(Qf, KP, wi, ks), *b_frags(hs, 0, ks, nt), "q", ks)
            for ks in range(C // 8):
                if ks < 2 * wi + 2:
                    for nt in range(4):
                        a1[nt].mma(a_frag_ws(Af, C, wi, ks), *b_frags(Us, 0, ks, nt), "a", ks)
            for nt in range(4):
                s = a0[nt].v + a1[nt].v
                for e in range(4):
                    o[wi * 16 + GQ + (e >> 1) * 8, nt * 8 + 2 * T4 + (e & 1)] = s[:, e]
                traces[(wi, nt)] = (a0[nt].trace, a1[nt].trace)
        return o, traces
    xs = np.full((2, 8 * 32, 4), np.nan)
    for wr in range(2):
        # ch = 1: A~ U chain into the scratch
        acc1 = [[Acc() for _ in range(4)] for _ in range(2)]
        for ks in range(C // 8):
            if ks < 4 * wr + 4:
                bs = [b_frags(Us, 0, ks, nt) for nt in range(4)]
                for mt in range(2):
                    rt = 2 * wr + mt
                    if ks < 2 * rt + 2:
                        for nt in range(4):
                            acc1[mt][nt].mma(a_frag_ws(Af, C, rt, ks), *bs[nt], "a", ks)
        for mt in range(2):
            for nt in range(4):
                slot = (mt * 4 + nt) if mutate != "xs_slot" else (nt * 2 + mt)
                xs[wr, slot * 32: slot * 32 + 32] = acc1[mt][nt].v
        # ch = 0: q~ h chain, adds the scratch, stores o
        acc0 = [[Acc() for _ in range(4)] for _ in range(2)]
        for ks in range(KP // 8):
            bs = [b_frags(hs, 0, ks, nt) for nt in range(4)]
            for mt in range(2):
                for nt in range(4):
                    acc0[mt][nt].mma(a_frag_ws(Qf, KP, 2 * wr + mt, ks), *bs[nt], "q", ks)
        for mt in range(2):
            for nt in range(4):
                y = xs[wr, (mt * 4 + nt) * 32: (mt * 4 + nt) * 32 + 32]
                s = acc0[mt][nt].v + y
                rt = 2 * wr + mt
                for e in range(4):
                    o[rt * 16 + GQ + (e >> 1) * 8, nt * 8 + 2 * T4 + (e & 1)] = s[:, e]
                traces[(rt, nt)] = (acc0[mt][nt].trace, acc1[mt][nt].trace)
    return o, traces


def problem(KP, seed):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((C, KP))
    Q = rng.standard_normal((C, KP))
    Kt = rng.standard_normal((KP, C))
    A = np.tril(rng.standard_normal((C, C)))
    H = rng.standard_normal((KP, 32))
    u0 = rng.standard_normal((C, 32))
    dec = rng.uniform(0.1, 1.0, KP)
    hs = np.full(KP * LDH, np.nan)
    for r in range(KP):
        hs[r * LDH: r * LDH + 32] = H[r]
    return W, Q, Kt, A, H, u0, dec, hs


@pytest.mark.parametrize("KS", [False, True])
@pytest.mark.parametrize("KP", [64, 128])
def test_scan6_chunk_step(KP, KS):
    W, Q, Kt, A, H, u0, dec, hs = problem(KP, 1 + KP + KS)
    Us, ut = emu_u(KP, KS, to_frag(W, KP), hs, u0)
    U = np.stack([Us[r * LDH: r * LDH + 32] for r in range(C)])
    np.testing.assert_allclose(U, u0 - W @ H, rtol=1e-12, atol=1e-10)
    for (rt, ct), (c0, c1) in ut.items():  # scan5's U chains: even / odd k-steps in order
        assert [k for _, k in c0] == list(range(0, KP // 8, 2)) and [k for _, k in c1] == list(range(1, KP // 8, 2))
    assert len(ut) == 16
    Hn, ht = emu_h(KP, to_frag(Kt, C), dec, H, Us)
    np.testing.assert_allclose(Hn, dec[:, None] * H + Kt @ U, rtol=1e-12, atol=1e-10)
    for tr in ht.values():
        assert tr == [("decay", -1)] + [("k", ks) for ks in range(8)]
    assert len(ht) == (KP // 16) * 4
    o, ot = emu_o(KP, KS, to_frag(Q, KP), to_frag(A, C), hs, Us)
    np.testing.assert_allclose(o, Q @ H + A @ U, rtol=1e-12, atol=1e-10)
    for (rt, ct), (c0, c1) in ot.items():
        assert [k for _, k in c0] == list(range(KP // 8)) and [k for _, k in c1] == list(range(2 * rt + 2))
    assert len(ot) == 16


@pytest.mark.parametrize("mutate", ["u_row_tile", "xs_slot"])
def test_emulator_sees_index_mutations(mutate):
    KP = 128
    W, Q, Kt, A, H, u0, dec, hs = problem(KP, 5)
    Us, _ = emu_u(KP, True, to_frag(W, KP), hs, u0, mutate=mutate)
    U = np.stack([Us[r * LDH: r * LDH + 32] for r in range(C)])
    o, _ = emu_o(KP, True, to_frag(Q, KP), to_frag(A, C), hs, Us, mutate=mutate)
    ok_u = np.allclose(U, u0 - W @ H, rtol=1e-12, atol=1e-10)
    ok_o = np.allclose(o, Q @ H + A @ U, rtol=1e-12, atol=1e-10)
    assert not (ok_u and ok_o)


def test_smem_budget():
    """Scan6Smem: scan5's 187 KB (+ 8 KB scratch for KS) within the 227 KB a block may have; the scratch 16-byte
    aligned after the mbarriers."""
    KP = 128
    region = C * KP * 4 + C * KP * 2 + KP * 4
    s5 = 2 * region + 4 * 3 * (KP * LDH + C * LDH) + 8 * 8
    xs_off = (s5 + 127) // 128 * 128
    assert s5 <= 227 * 1024 and xs_off + 2 * 8 * 32 * 16 <= 227 * 1024
    assert xs_off % 16 == 0


# ---- the handoff of scan6<KP, true> (KDA_CUDA_CHUNK_SCAN=9): mbarriers full / empty as scan5 (tests/
# test_cuda_scan5_emu.py), plus the warp pairs' named barriers (bar.arrive by the producer, bar.sync by the
# consumer), with agents moving chunk tags in random interleavings ----

class MBar:
    def __init__(self, expected):
        self.expected, self.pending, self.phase = expected, expected, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase += 1
            self.pending = self.expected

    def done(self, parity):
        return (self.phase & 1) != parity


class NamedBarrier:
    """bar.sync / bar.arrive with `count` warps: a generation completes when count warps arrived (arrive: without
    waiting; sync: waits for the generation it joined to complete)."""

    def __init__(self, count):
        self.count, self.arrived, self.gen = count, 0, 0

    def _join(self):
        gen = self.gen
        self.arrived += 1
        if self.arrived == self.count:
            self.arrived, self.gen = 0, self.gen + 1
        return gen

    def arrive(self):
        self._join()

    def sync(self):
        gen = self._join()
        yield lambda: self.gen != gen


def run_ks(nch, NB=3, seed=0, mutate=None):
    """One interleaving of scan6<KP, true>'s chunk loop: recurrence warps fin0, fin1 (kh = 0: final U rows of pair
    wr), part0, part1 (kh = 1), hup0, hup1 (warps 4..7: h update only); output warps q0, q1 (ch = 0) and a0, a1
    (ch = 1). Returns None or the first failed check."""
    rng = random.Random(seed)
    recs = ["fin0", "fin1", "part0", "part1", "hup0", "hup1"]
    hs = [{r: None for r in recs} for _ in range(NB)]  # chunk whose h_c each recurrence warp's part holds
    us = [[None, None] for _ in range(NB)]  # U_c row halves: ("p", c) partial chain, ("f", c) final
    xs = [None, None]  # the output pairs' scratch
    full = [MBar(len(recs)) for _ in range(NB)]
    empty = [MBar(4) for _ in range(NB)]
    rec_bar = NamedBarrier(len(recs))
    upair = [NamedBarrier(2) for _ in range(2)]
    ofull = [NamedBarrier(2) for _ in range(2)]
    oempty = [NamedBarrier(2) for _ in range(2)]
    errors = []

    def check(cond, msg):
        if not cond:
            errors.append(msg)

    def rec(name):
        role, wr = name[:-1], int(name[-1])
        hs[0][name] = 0
        yield from rec_bar.sync()
        for ci in range(nch):
            b = ci % NB
            if role in ("part", "hup"):  # their part of h_c is complete (rec_bar): arrive at the top
                full[b].arrive()
                yield None
            if role in ("fin", "part"):
                for r in recs:  # w h reads every part of h_c
                    check(hs[b][r] == ci, f"{name} chunk {ci}: h part {r} holds {hs[b][r]}")
                    yield None
                if role == "part":
                    us[b][wr] = ("p", ci)
                    yield None
                    upair[wr].arrive()
                else:
                    if mutate != "no_pair_sync":
                        yield from upair[wr].sync()
                    check(us[b][wr] == ("p", ci), f"{name} chunk {ci}: partial U holds {us[b][wr]}")
                    yield None
                    us[b][wr] = ("f", ci)
                    yield None
                    full[b].arrive()
                    yield None
            yield from rec_bar.sync()
            for h in range(2):  # the h update reads all of U_c
                check(us[b][h] == ("f", ci), f"{name} chunk {ci}: U half {h} holds {us[b][h]}")
                yield None
            if ci + 1 < nch:
                nb = (ci + 1) % NB
                if ci + 1 >= NB:
                    yield lambda nb=nb, par=((ci + 1 - NB) // NB) & 1: empty[nb].done(par)
                hs[nb][name] = ci + 1
                yield None
            yield from rec_bar.sync()

    def out(name):
        ch, wr = int(name[0] == "a"), int(name[-1])
        for ci in range(nch):
            b = ci % NB
            yield lambda b=b, ci=ci: full[b].done((ci // NB) & 1)
            if ch == 0:
                for r in recs:
                    check(hs[b][r] == ci, f"{name} chunk {ci}: h part {r} holds {hs[b][r]}")
                    yield None
            else:
                for h in range(wr + 1):  # A~ U of rows 32 wr ..: U rows 0 .. 32 wr + 31
                    check(us[b][h] == ("f", ci), f"{name} chunk {ci}: U half {h} holds {us[b][h]}")
                    yield None
            empty[b].arrive()
            yield None
            if ch == 1:
                if ci > 0 and mutate != "no_scratch_wait":
                    yield from oempty[wr].sync()
                xs[wr] = ci
                yield None
                ofull[wr].arrive()
            else:
                yield from ofull[wr].sync()
                check(xs[wr] == ci, f"{name} chunk {ci}: scratch holds {xs[wr]}")
                yield None
                oempty[wr].arrive()
        if ch == 1 and nch > 0 and mutate != "no_scratch_wait":
            yield from oempty[wr].sync()

    agents = {n: rec(n) for n in recs}
    agents.update({n: out(n) for n in ("q0", "q1", "a0", "a1")})
    waits = {name: None for name in agents}
    speed = {name: rng.choice([0.02, 0.2, 1.0, 5.0]) for name in agents}
    while agents:
        ready = [name for name in agents if waits[name] is None or waits[name]()]
        if not ready:
            return f"deadlock: {sorted(agents)} wait"
        name = rng.choices(ready, weights=[speed[n] for n in ready])[0]
        try:
            waits[name] = next(agents[name])
        except StopIteration:
            del agents[name]
        if errors:
            return errors[0]
    for nb in ofull + oempty + upair:  # every named-barrier generation completed (none left half-arrived)
        if nb.arrived:
            return "a named barrier was left with pending arrivals"
    return None


@pytest.mark.parametrize("nch", list(range(12)))
def test_scan6_ks_handoff(nch):
    for seed in range(30):
        err = run_ks(nch, seed=seed)
        assert err is None, f"nch={nch} seed={seed}: {err}"


@pytest.mark.parametrize("mutate", ["no_pair_sync", "no_scratch_wait"])
def test_scan6_ks_handoff_checks_can_fail(mutate):
    fails = [run_ks(10, seed=s, mutate=mutate) for s in range(200)]
    assert any(f is not None for f in fails)
