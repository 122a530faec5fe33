"""CPU emulation of the operand hand-off of state_fwd3s_kernel (KDA_CUDA_CHUNK_BWD_STATE_FWD=11,
kernels_src/cuda/delta_chunk_bwd_state_fwd3.cuh): two column groups of one block walk the chunks, each with its own
two barriers per chunk step, and share double-buffered w and K Eend (+ Gam_last) tiles. Readers wait for chunk c's
tile with try_wait.parity((c >> 1) & 1) on its mbarrier (fw[c & 1] / fe[c & 1], completed once every piece of the
tile has landed: cp.async + cp.async.mbarrier.arrive.noinc by the 256 issuing threads) before the barrier in front
of their first read. A group releases w(c) past its second barrier of chunk c and K Eend(c) past its first barrier
of chunk c + 1 (a shared counter per tile kind and buffer); the second group to release sets its flag and its
threads issue chunk c + 2 into the buffer after their next barrier. Random interleavings of the two groups and the
pieces' landings check that every read of a tile sees the chunk it wants from its first to its last read (no piece
lands in a buffer in use, none is missing), that no wait passes on a stale phase, and that nothing deadlocks. The
arithmetic of each group is =7's (tests/test_cuda_state_fwd3_emu.py's narrow instance: fragments, bank conflicts).
Deliberately broken hand-offs (w released before its reads, K Eend released one barrier early, the parity of c
instead of c >> 1, no wait for K Eend) must fail.
"""
import random

import pytest


class MBar:
    """mbarrier with arrival count 1: phase k completes when its arrival is in and its tx count is back to 0."""

    def __init__(self):
        self.k, self.arrived, self.tx = 0, False, 0

    def _check(self):
        if self.arrived and self.tx == 0:
            self.k, self.arrived = self.k + 1, False

    def arrive_expect_tx(self, n):
        assert not self.arrived, "a second arrival in one phase"
        self.tx += n
        self.arrived = True
        self._check()

    def complete_tx(self, n):
        self.tx -= n
        self._check()

    def try_wait_parity(self, par):
        return (self.k & 1) != par  # PTX: true once the phase of parity `par` (the current or an older one) is done


def emulate(nc, seed, bug=None, rows=4):
    rng = random.Random(seed)
    bars = {"w": [MBar(), MBar()], "e": [MBar(), MBar()]}
    tag = {(k, b): [None] * rows for k in ("w", "e") for b in (0, 1)}
    cnt = {(k, b): 0 for k in ("w", "e") for b in (0, 1)}
    flag = {(g, k): -1 for g in (0, 1) for k in ("w", "e")}
    inflight = []  # (tile kind, buffer, row, chunk)

    def issue(kind, c):
        b = c & 1
        bars[kind][b].arrive_expect_tx(rows)  # (the 256 noinc arrivals: complete once every piece has landed)
        for r in range(rows):
            inflight.append((kind, b, r, c))

    def release(g, kind, cr):
        if cr + 2 >= nc:
            return
        old = cnt[(kind, cr & 1)]
        cnt[(kind, cr & 1)] += 1
        if old & 1:
            flag[(g, kind)] = cr + 2

    def par(c):
        return (c & 1) if bug == "parity" else (c >> 1) & 1

    def reads(kind, c):
        got = tag[(kind, c & 1)]
        assert all(t == c for t in got), f"group reads {kind}({c}) but the buffer holds {got}"

    def group(g):
        """A generator: yields while blocked and between steps."""
        for c in range(nc):
            while not bars["w"][c & 1].try_wait_parity(par(c)):
                yield
            yield  # first barrier
            if flag[(g, "w")] == c + 1:
                issue("w", c + 1)
            if c > 0:
                release(g, "e", c - 1)
            if bug == "w_early":
                release(g, "w", c)
            reads("w", c)  # U: first and last reads of w(c)
            yield
            reads("w", c)
            if bug == "e_early":
                release(g, "e", c)
            if bug != "no_e_wait":
                while not bars["e"][c & 1].try_wait_parity(par(c)):
                    yield
            yield  # second barrier
            if flag[(g, "e")] == c + 1:
                issue("e", c + 1)
            if bug != "w_early":
                release(g, "w", c)
            reads("e", c)  # the state update: K Eend(c), Gam_last(c)
            yield
            reads("e", c)
            yield

    for c in range(min(nc, 2)):  # group 0 issues chunks 0 and 1
        issue("w", c)
        issue("e", c)
    gens = [group(0), group(1)]
    done = [False, False]
    steps = 0
    while not all(done):
        steps += 1
        assert steps < 100000, "no progress"
        actors = [("g", i) for i in range(2) if not done[i]] + [("c", i) for i in range(len(inflight))]
        kind, i = rng.choice(actors)
        if kind == "c":
            tile, b, r, c = inflight.pop(i)
            tag[(tile, b)][r] = c
            bars[tile][b].complete_tx(1)
        else:
            try:
                next(gens[i])
            except StopIteration:
                done[i] = True
    assert not inflight, "copies issued past the last chunk"
    return True


@pytest.mark.parametrize("nc", [0, 1, 2, 3, 4, 7, 12])
def test_state_fwd11_handoff(nc):
    for seed in range(200):
        emulate(nc, seed)


@pytest.mark.parametrize("bug", ["w_early", "e_early", "parity", "no_e_wait"])
def test_state_fwd11_handoff_emulation_catches_bugs(bug):
    failed = 0
    for seed in range(200):
        try:
            emulate(7, seed, bug)
        except AssertionError:
            failed += 1
    assert failed > 0, f"the emulation did not catch the {bug} hand-off"
