"""CPU emulation of what is new in the warp-specialized scan (KDA_CUDA_CHUNK_SCAN=7,
kernels_src/cuda/delta_chunk_scan5.cuh): the shared-memory layout Scan5Smem and the handoff of h_c / U_c between
the recurrence warps and the output warps through NB rotating buffers and the mbarriers full[NB] / empty[NB].

The recurrence's own products (ScanRec: scan4's U and h update, operand bulk copies) are emulated by
tests/test_cuda_split_emu.py and the output products (scan3's o chains) by tests/test_cuda_scan3_emu.py; here the
agents move chunk tags instead of numbers. Recurrence and output warps (each arrives once, lane 0 after __syncwarp)
are modelled as a few agents each (every agent owns its part of each buffer), run in random interleavings (each
agent with a random speed): the recurrence agents meet at the named barrier twice per chunk, arrive on full[b] after
writing their part of U_c, and wait on empty[b] (the kernel's parity formula) before writing h_{c+1} into buffer
(c + 1) % NB; the output agents wait on full[c % NB] (parity (c / NB) & 1), read every part of h_c and U_c, then
arrive on empty. mbarriers complete a phase when all their expected arrivals came; try_wait.parity(P) succeeds when
the phase of parity P has completed. Checks: every read sees the chunk it expects (no buffer is overwritten before
its readers are done, none is read before it is written), no deadlock, for 0..13 chunks and NB 2, 3, 4; and the same
emulation with the empty wait dropped or its parity off by one fails (the checks can fail). Runs without a GPU; the
CUDA code itself is tested by tests/test_cuda_chunk_fwd.py (test_chunk_fwd_scan5, test_chunk_scan5_vs_scan3*).
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


def run(nch, NB, n_rec=2, n_out=3, seed=0, mutate=None):
    """One random interleaving; returns None or the first failed check (a string)."""
    rng = random.Random(seed)
    hs = [[None] * n_rec for _ in range(NB)]  # chunk whose h_c each agent's part holds
    us = [[None] * n_rec for _ in range(NB)]
    full = [MBar(n_rec) for _ in range(NB)]
    empty = [MBar(n_out) for _ in range(NB)]
    bar = NamedBarrier(n_rec)
    errors = []

    def check(cond, msg):
        if not cond:
            errors.append(msg)

    def rec(r):
        hs[0][r] = 0
        yield from bar.sync()
        for ci in range(nch):
            b = ci % NB
            for part in range(n_rec):  # U = u0 - w h reads h_c (every part: the mma B operand spans all rows)
                check(hs[b][part] == ci, f"rec {r} chunk {ci}: h part {part} holds {hs[b][part]}")
                yield None
            us[b][r] = ci
            yield None
            full[b].arrive()
            yield None
            yield from bar.sync()
            for part in range(n_rec):  # h update reads all of U_c
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


def scan5_smem(KP, NB=3):
    """Scan5Smem<KP>: (hs_off, us_off, bar_off, bytes); Scan4Smem's operand region twice, then NB h_c / U_c tiles
    of stride LDH = 40 floats, then 2 + 2 NB mbarriers."""
    LDH = 32 + 8
    region = C * KP * 4 + C * KP * 2 + KP * 4
    hs_off = 2 * region
    us_off = hs_off + 4 * NB * KP * LDH
    bar_off = us_off + 4 * NB * C * LDH
    return hs_off, us_off, bar_off, bar_off + 8 * (2 + 2 * NB)


@pytest.mark.parametrize("KP", [64, 128])
def test_scan5_smem_layout(KP):
    hs_off, us_off, bar_off, total = scan5_smem(KP)
    assert hs_off % 128 == 0 and us_off % BULK == 0 and bar_off % 8 == 0  # bulk-copy targets, float4, mbarriers
    assert total <= 227 * 1024  # one block per SM (the static_assert in the kernel)
    if KP == 128:
        assert total == 191552


@pytest.mark.parametrize("NB", [2, 3, 4])
@pytest.mark.parametrize("nch", list(range(14)))
def test_scan5_handoff(nch, NB):
    for seed in range(40):
        err = run(nch, NB, seed=seed)
        assert err is None, f"nch={nch} NB={NB} seed={seed}: {err}"


@pytest.mark.parametrize("mutate", ["no_empty_wait", "parity_off"])
def test_scan5_handoff_checks_can_fail(mutate):
    """Without the empty wait the recurrence may overwrite h_c before the output agents read it; with the wrong
    parity it either overwrites too early or waits for a phase that never comes (deadlock)."""
    fails = [run(12, 3, seed=s, mutate=mutate) for s in range(200)]
    assert any(f is not None for f in fails)
