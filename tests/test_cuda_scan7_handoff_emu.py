"""CPU emulation of the handoff of h_c / U_c in the scan delta_chunk_scan7_kernel<KP, UHL> (KDA_CUDA_CHUNK_SCAN=11, the
default since session 12, and 10; kernels_src/cuda/delta_chunk_scan7.cuh) between its recurrence warps and its
output warps through NB rotating buffers and the mbarriers full[NB] / empty[NB], and its shared-memory layout
Scan7Smem. (Written in session 9 for scan5, whose handoff scan6 and then scan7 kept; with scan6's arrivals since
session 12, which scan7 has too; retargeted from scan6, test_cuda_scan6_handoff_emu.py, when scan6 was retired in
session 12. scan7's h_pre -- the decay and the k~^T fragments, before the U step -- touches registers only, no
shared buffer, so it does not enter here.)

The products themselves are emulated by tests/test_cuda_scan7_emu.py; here the agents move chunk tags instead of
numbers. Recurrence and output warps (each arrives once, lane 0 after __syncwarp) are modelled as a few agents each
(every recurrence agent owns its part of each h buffer; the first n_u of them -- scan7's warps 0..3 -- also own
the parts of U), run in random interleavings (each agent with a random speed): the recurrence agents meet at the
named barrier twice per chunk; a U writer arrives on full[b] after writing its part of U_c, the others at the top of
the chunk step (their part of h_c was written before the barrier that ended the previous step); each waits on
empty[b] (the kernel's parity formula) before writing h_{c+1} into buffer (c + 1) % NB; the output agents wait on
full[c % NB] (parity (c / NB) & 1), read every part of h_c and U_c, then arrive on empty. mbarriers complete a
phase when all their expected arrivals came; try_wait.parity(P) succeeds when the phase of parity P has completed.
Checks: every read sees the chunk it expects (no buffer is overwritten before its readers are done, none is read
before it is written), no deadlock, for 0..13 chunks and NB 2, 3, 4; and the same emulation with the empty wait
dropped, its parity off by one, or a U writer arriving before its part of U_c is written fails (the checks can
fail). (A non-U agent arriving early is harmless: full completes only with the U writers' arrivals, which follow
the barrier that every h part precedes.) Runs without a GPU; the CUDA code itself is tested by tests/test_cuda_scan7.py.
"""
import random

import pytest

C = 64
BULK = 16


class MBar:
    """An mbarrier: `expected` arrivals complete a phase."""

    def __init__(self, expected):
        self.expected, self.pending, self.phase = expected, expected, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase += 1
            self.pending = self.expected

    def done(self, parity):  # mbarrier.try_wait.parity
        return (self.phase & 1) != parity


class NamedBarrier:
    def __init__(self, count):
        self.count, self.arrived, self.gen = count, 0, 0

    def sync(self):
        gen = self.gen
        self.arrived += 1
        if self.arrived == self.count:
            self.arrived, self.gen = 0, self.gen + 1
        yield lambda: self.gen != gen


def run(nch, NB, n_rec=4, n_u=2, n_out=3, seed=0, mutate=None):
    """One random interleaving; returns None or the first failed check (a string). Recurrence agents 0 .. n_u - 1
    write U (and arrive on full after it), the others arrive at the top of the chunk step."""
    rng = random.Random(seed)
    hs = [[None] * n_rec for _ in range(NB)]  # chunk whose h_c each agent's part holds
    us = [[None] * n_u for _ in range(NB)]
    full = [MBar(n_rec) for _ in range(NB)]
    empty = [MBar(n_out) for _ in range(NB)]
    bar = NamedBarrier(n_rec)
    errors = []

    def check(cond, msg):
        if not cond:
            errors.append(msg)

    def rec(r):
        ufin = r < n_u
        hs[0][r] = 0
        yield from bar.sync()
        for ci in range(nch):
            b = ci % NB
            if not ufin:
                full[b].arrive()  # its part of h_c is complete (written before the last barrier)
                yield None
            if ufin:
                for part in range(n_rec):  # U = u0 - w h reads h_c (every part: the mma B operand spans all rows)
                    check(hs[b][part] == ci, f"rec {r} chunk {ci}: h part {part} holds {hs[b][part]}")
                    yield None
                if mutate == "u_early":  # arrives before its part of U_c is written
                    full[b].arrive()
                    yield None
                us[b][r] = ci
                yield None
                if mutate != "u_early":
                    full[b].arrive()
                    yield None
            yield from bar.sync()
            for part in range(n_u):  # h update reads all of U_c
                check(us[b][part] == ci, f"rec {r} chunk {ci}: U part {part} holds {us[b][part]}")
                yield None
            if ci + 1 < nch:
                nb = (ci + 1) % NB
                if mutate == "no_empty_wait":
                    pass
                elif ci + 1 >= NB:
                    par = ((ci + 1 - NB) // NB) & 1
                    if mutate == "parity_off":
                        par ^= 1
                    yield lambda nb=nb, par=par: empty[nb].done(par)
                hs[nb][r] = ci + 1
                yield None
            yield from bar.sync()

    def out(o):
        for ci in range(nch):
            b = ci % NB
            yield lambda b=b, ci=ci: full[b].done((ci // NB) & 1)
            for part in range(n_rec):
                check(hs[b][part] == ci, f"out {o} chunk {ci}: h part {part} holds {hs[b][part]}")
                yield None
            for part in range(n_u):
                check(us[b][part] == ci, f"out {o} chunk {ci}: U part {part} holds {us[b][part]}")
                yield None
            empty[b].arrive()
            yield None

    agents = {f"rec{r}": rec(r) for r in range(n_rec)}
    agents.update({f"out{o}": out(o) for o in range(n_out)})
    waits = {name: None for name in agents}
    speed = {name: rng.choice([0.02, 0.2, 1.0, 5.0]) for name in agents}  # slow and fast agents, per run
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
    return None


def scan7_smem(KP, uhl, NB=3):
    """Scan7Smem<KP, UHL>: (region, hs_off, us_off, bar_off, bytes); the operand region (w bf16 | k~^T bf16 | decay
    fp32) twice, then NB h_c tiles and NB U_c tiles of bf16 row-pair words (LDW = 40 words per row pair; UHL: U's
    low words after its high words), then 2 + 2 NB mbarriers."""
    LDW = 32 + 8
    region = C * KP * 2 + C * KP * 2 + KP * 4
    hs_words = KP // 2 * LDW
    us_words = (2 if uhl else 1) * (C // 2 * LDW)
    hs_off = 2 * region
    us_off = hs_off + 4 * NB * hs_words
    bar_off = us_off + 4 * NB * us_words
    return region, hs_off, us_off, bar_off, bar_off + 8 * (2 + 2 * NB)


@pytest.mark.parametrize("uhl", [False, True], ids=["uhl0", "uhl1"])
@pytest.mark.parametrize("KP", [64, 128])
def test_scan7_smem_layout(KP, uhl):
    region, hs_off, us_off, bar_off, total = scan7_smem(KP, uhl)
    # bulk-copy targets (each operand buffer, and w / k~^T / decay inside it), 8-byte tile stores, mbarriers
    assert region % BULK == 0 and (C * KP * 2) % BULK == 0 and (KP * 4) % BULK == 0
    assert hs_off % BULK == 0 and us_off % BULK == 0 and bar_off % 8 == 0
    assert total <= 227 * 1024  # one block per SM (the static_assert in the kernel)
    if KP == 128:  # ~110 / 125 KB (delta_chunk_fwd_host.cuh, launch_chunk_scan7)
        assert total == (128064 if uhl else 112704)


@pytest.mark.parametrize("NB", [2, 3, 4])
@pytest.mark.parametrize("nch", list(range(14)))
def test_scan7_handoff(nch, NB):
    for seed in range(40):
        err = run(nch, NB, seed=seed)
        assert err is None, f"nch={nch} NB={NB} seed={seed}: {err}"


@pytest.mark.parametrize("mutate", ["no_empty_wait", "parity_off", "u_early"])
def test_scan7_handoff_checks_can_fail(mutate):
    """Without the empty wait the recurrence may overwrite h_c before the output agents read it; with the wrong
    parity it either overwrites too early or waits for a phase that never comes (deadlock); a U writer that arrives
    on full before writing its part of U_c lets the output agents read it too early."""
    fails = [run(12, 3, seed=s, mutate=mutate) for s in range(200)]
    assert any(f is not None for f in fails)
