"""CPU emulation of what is new in the backward's state_fwd4_kernel (kernels_src/cuda/delta_chunk_bwd_state_fwd4.cuh)
against state_fwd3 (whose arithmetic, fragment layouts and accumulators tests/test_cuda_state_fwd3_emu.py checks):
 - the per-row bulk copies of warp 0 into the padded shared rows: every tile row lands once at its padded place,
   16-byte aligned addresses and sizes, the armed transaction bytes equal to the bytes copied, all inside the
   buffer, the shared-memory layout inside the device's 227 KB;
 - the ldmatrix.x4 loads of w's tf32 A fragments: lane by lane the words state_fwd3 read with four scalar loads,
   each 8-row matrix phase free of bank conflicts;
 - the mbarrier / buffer schedule over a sequence's chunks: every copy goes into a buffer whose previous contents
   no warp reads any more (a __syncthreads between the last read and the issue), every wait's parity names the
   phase of the chunk it waits for, and every read sees the chunk it wants.
Runs without a GPU; tests/test_cuda_chunk_bwd_state4.py checks the CUDA code itself.
"""
import re
from pathlib import Path

import numpy as np
import pytest

CH, KP, VS = 64, 128, 32
LDW, LDE, LDH = KP + 4, KP + 8, VS + 8
ROW = KP * 4  # bytes per global tile row
LANES = np.arange(32)
GQ, T4 = LANES >> 2, LANES & 3
SRC = Path(__file__).resolve().parents[1] / "kernels_src" / "cuda"

# StateFwd3Smem / StateFwd4Smem (floats, then bytes)
W_OFF = 0
E_OFF = W_OFF + 2 * CH * LDW
GL_OFF = E_OFF + 2 * CH * LDE
H_OFF = GL_OFF + 2 * KP
U_OFF = H_OFF + KP * LDH
BAR_OFF = (U_OFF + CH * LDH) * 4
SMEM = BAR_OFF + 4 * 8
W_TX, E_TX = CH * ROW, CH * ROW + KP * 4


def test_constants_match_the_headers():
    f3 = (SRC / "delta_chunk_bwd_state_fwd3.cuh").read_text()
    f4 = (SRC / "delta_chunk_bwd_state_fwd4.cuh").read_text()
    assert "constexpr int kSf3LdW = KP + 4;" in f3 and "constexpr int kSf3LdE = KP + 8;" in f3
    assert "constexpr int kSf3LdH = VS + 8;" in f3
    assert re.search(r"bar_off = StateFwd3Smem::bytes;", f4)
    assert "lrow = 16 * wi + (lane & 7) + 8 * (lm & 1), lcol = 4 * (lm >> 1);" in f4
    assert "sf4_ldmatrix_x4(wb + 32 * ks, r);" in f4
    assert SMEM <= 227 * 1024 and BAR_OFF % 16 == 0


def issue_rows(buf_byte_off, ld):
    """warp 0's bulk copies of one tile: (lane, shared byte address, global byte offset, bytes)."""
    out = []
    for lane in range(32):
        for h in range(2):
            t = lane + 32 * h
            out.append((lane, buf_byte_off + t * ld * 4, t * KP * 4, ROW))
    return out


@pytest.mark.parametrize("which", ["w", "e"])
@pytest.mark.parametrize("buf", [0, 1])
def test_bulk_copies_cover_the_padded_rows(which, buf):
    ld = LDW if which == "w" else LDE
    base = 4 * ((W_OFF if which == "w" else E_OFF) + buf * CH * ld)
    copies = issue_rows(base, ld)
    if which == "e":
        copies.append((0, 4 * (GL_OFF + buf * KP), None, KP * 4))
    assert sum(c[3] for c in copies) == (W_TX if which == "w" else E_TX)
    spans = sorted((c[1], c[1] + c[3]) for c in copies)
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0  # no overlap
    for _, dst, _, nbytes in copies:
        assert dst % 16 == 0 and nbytes % 16 == 0
        assert dst >= 0 and dst + nbytes <= BAR_OFF
    # every global row once, each at its padded row: shared float index of tile element (t, k) is t * ld + k
    rows = sorted(c[2] // ROW for c in copies if c[2] is not None)
    assert rows == list(range(CH))
    for _, dst, src, _ in copies:
        if src is not None:
            assert dst - base == (src // ROW) * ld * 4
    # the tile and Gam_last stay inside their own region
    lo, hi = 4 * (W_OFF if which == "w" else E_OFF), 4 * (E_OFF if which == "w" else GL_OFF)
    for _, dst, src, nbytes in copies:
        if src is not None:
            assert lo <= dst and dst + nbytes <= hi


def test_ldmatrix_gives_state_fwd3_fragments():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((CH, KP))
    sm = np.full(CH * LDW, np.nan)  # one w buffer, floats
    for t in range(CH):
        sm[t * LDW:t * LDW + KP] = w[t]
    for wi in range(4):
        lm = LANES >> 3
        lrow = 16 * wi + (LANES & 7) + 8 * (lm & 1)
        lcol = 4 * (lm >> 1)
        for ks in range(KP // 8):
            addr = (lrow * LDW + lcol) * 4 + 32 * ks  # byte address each lane hands to ldmatrix
            assert (addr % 16 == 0).all()
            r = np.zeros((32, 4))
            for m in range(4):
                rows = addr[8 * m:8 * m + 8]  # matrix m: its 8 row addresses (16 bytes = 4 floats each)
                # one phase per matrix: 8 rows x 4 banks, all 32 banks distinct
                banks = np.concatenate([(a // 4 + np.arange(4)) % 32 for a in rows])
                assert len(set(banks.tolist())) == 32
                # thread i receives word i % 4 of row i / 4
                r[:, m] = sm[rows[LANES >> 2] // 4 + (LANES & 3)]
            # state_fwd3: a0 = w(16 wi + gq, 8 ks + t4), a1 = (+8 rows), a2 = (+4 columns), a3 = (+8, +4)
            ref = np.stack([w[16 * wi + GQ, 8 * ks + T4], w[16 * wi + GQ + 8, 8 * ks + T4],
                            w[16 * wi + GQ, 8 * ks + T4 + 4], w[16 * wi + GQ + 8, 8 * ks + T4 + 4]], 1)
            assert np.array_equal(r, ref)


@pytest.mark.parametrize("nc", [0, 1, 2, 3, 4, 7])
def test_mbarrier_schedule(nc):
    """The kernel's order of events, with a copy landing at any time between its issue and the wait for it."""
    content = {("w", 0): None, ("w", 1): None, ("e", 0): None, ("e", 1): None}  # chunk a buffer holds (or gets)
    arms = {k: 0 for k in content}  # phases armed on each buffer's mbarrier
    last_read = {k: -1 for k in content}  # the barrier epoch of the last read of the buffer's contents
    epoch = 0  # number of __syncthreads passed

    def issue(kind, c):
        key = (kind, c & 1)
        assert c < nc
        # the previous contents were last read before a barrier that has already been passed
        assert last_read[key] < epoch, (kind, c)
        # the previous phase was waited for (its copy complete) before this one is armed
        assert content[key] is None or content[key] == c - 2
        content[key] = c
        arms[key] += 1

    def wait_and_read(kind, c):
        key = (kind, c & 1)
        parity = (c >> 1) & 1
        # the phase armed for chunk c is number c >> 1; it is the latest one armed, and the parity names it
        assert arms[key] == (c >> 1) + 1 and ((arms[key] - 1) & 1) == parity
        assert content[key] == c
        last_read[key] = epoch

    # prologue: barrier (mbarriers initialised), then warp 0 issues w(0), K Eend(0), w(1), K Eend(1)
    epoch += 1
    for c in range(min(nc, 2)):
        issue("w", c)
        issue("e", c)
    for c in range(nc):
        wait_and_read("w", c)  # mbar_wait w(c) (every thread), then __syncthreads
        epoch += 1
        if c >= 1 and c + 1 < nc:
            issue("e", c + 1)
        wait_and_read("w", c)  # the U product reads w(c)
        last_read[("w", c & 1)] = epoch
        wait_and_read("e", c)  # mbar_wait K Eend(c), then __syncthreads
        epoch += 1
        if c + 2 < nc:
            issue("w", c + 2)
        wait_and_read("e", c)  # the state update reads K Eend(c), Gam_last(c)
    # every issued copy was waited for before the kernel ends
    for kind in ("w", "e"):
        assert sum(arms[(kind, b)] for b in range(2)) == nc


# ---- state_bwd4_kernel (delta_chunk_bwd_state_bwd4.cuh): Sb3Smem's layout (floats), then three mbarriers
LDKE, LDT, LDA, LDB = KP + 4, KP + 8, CH + 8, VS + 8
SB_KEND = 0
SB_W = SB_KEND + 2 * CH * LDKE
SB_QG = SB_W + 2 * CH * LDT
SB_AQK = SB_QG + CH * LDT
SB_GL = SB_AQK + CH * LDA
SB_DS = SB_GL + KP
SB_OU = SB_DS + KP * LDB
SB_BAR = (SB_OU + CH * LDB) * 4
G1_TX, G2_TX = 2 * CH * KP * 4, (CH * CH + CH * KP + KP) * 4


def test_state_bwd4_constants_match_the_header():
    f3 = (SRC / "delta_chunk_bwd_state_bwd3.cuh").read_text()
    f4 = (SRC / "delta_chunk_bwd_state_bwd4.cuh").read_text()
    for line in ("kSb3LdKe = KP + 4;", "kSb3LdT = KP + 8;", "kSb3LdA = CH + 8;", "kSb3LdB = VS + 8;"):
        assert line in f3
    assert "bar_off = kStateBwd3Smem;" in f4 and "bytes = bar_off + 3 * sizeof(uint64_t);" in f4
    assert "lrow = 16 * wi + (lane & 7) + 8 * (lm & 1), lcol = 4 * (lm >> 1);" in f4
    assert "sb4_ldmatrix_x4(ke + 32 * ks, r);" in f4
    assert SB_BAR + 24 <= 227 * 1024 and SB_BAR % 16 == 0


@pytest.mark.parametrize("group", ["g1_0", "g1_1", "g2"])
def test_state_bwd4_bulk_copies(group):
    copies = []  # (shared byte address, bytes, region lo, region hi, (tile, row) or None)
    for lane in range(32):
        for h in range(2):
            t = lane + 32 * h
            if group.startswith("g1"):
                b = int(group[-1])
                copies.append((4 * (SB_KEND + b * CH * LDKE + t * LDKE), KP * 4, 4 * SB_KEND, 4 * SB_W, ("ke", t)))
                copies.append((4 * (SB_W + b * CH * LDT + t * LDT), KP * 4, 4 * SB_W, 4 * SB_QG, ("w", t)))
            else:
                copies.append((4 * (SB_AQK + t * LDA), CH * 4, 4 * SB_AQK, 4 * SB_GL, ("aqk", t)))
                copies.append((4 * (SB_QG + t * LDT), KP * 4, 4 * SB_QG, 4 * SB_AQK, ("qg", t)))
    if group == "g2":
        copies.append((4 * SB_GL, KP * 4, 4 * SB_GL, 4 * SB_DS, None))
    assert sum(c[1] for c in copies) == (G1_TX if group.startswith("g1") else G2_TX)
    spans = sorted((c[0], c[0] + c[1]) for c in copies)
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0
    for dst, nbytes, lo, hi, _ in copies:
        assert dst % 16 == 0 and nbytes % 16 == 0 and lo <= dst and dst + nbytes <= hi
    tags = [c[4] for c in copies if c[4] is not None]
    assert len(set(tags)) == len(tags) == 128


def test_state_bwd4_ldmatrix_gives_kend_fragments():
    # state_bwd3: av = {ke[u0][k0], ke[u0 + 8][k0], ke[u0][k0 + 4], ke[u0 + 8][k0 + 4]}, u0 = 16 wi + gq, k0 = 8 ks + t4
    rng = np.random.default_rng(1)
    ke = rng.standard_normal((CH, KP))
    sm = np.full(CH * LDKE, np.nan)
    for t in range(CH):
        sm[t * LDKE:t * LDKE + KP] = ke[t]
    lm = LANES >> 3
    for wi in range(4):
        lrow = 16 * wi + (LANES & 7) + 8 * (lm & 1)
        addr0 = (lrow * LDKE + 4 * (lm >> 1)) * 4
        for ks in range(KP // 8):
            addr = addr0 + 32 * ks
            assert (addr % 16 == 0).all()
            r = np.zeros((32, 4))
            for m in range(4):
                rows = addr[8 * m:8 * m + 8]
                banks = np.concatenate([(a // 4 + np.arange(4)) % 32 for a in rows])
                assert len(set(banks.tolist())) == 32
                r[:, m] = sm[rows[LANES >> 2] // 4 + (LANES & 3)]
            u0, k0 = 16 * wi + GQ, 8 * ks + T4
            ref = np.stack([ke[u0, k0], ke[u0 + 8, k0], ke[u0, k0 + 4], ke[u0 + 8, k0 + 4]], 1)
            assert np.array_equal(r, ref)


@pytest.mark.parametrize("nc", [0, 1, 2, 3, 4, 7])
def test_state_bwd4_mbarrier_schedule(nc):
    """state_bwd4's order of events over the steps s = 0 .. nc - 1 (chunk c = nc - 1 - s)."""
    content = {"g1_0": None, "g1_1": None, "g2": None}
    arms = {k: 0 for k in content}
    last_read = {k: -1 for k in content}
    epoch = 0

    def issue(key, c):
        assert 0 <= c < nc and last_read[key] < epoch, (key, c)
        content[key] = c
        arms[key] += 1

    def wait(key, use, c):
        assert arms[key] == use + 1 and ((arms[key] - 1) & 1) == (use & 1) and content[key] == c

    def read(key, c):
        assert content[key] == c
        last_read[key] = epoch

    epoch += 1  # __syncthreads after the mbarrier init
    if nc > 0:
        issue("g1_0", nc - 1)
        issue("g2", nc - 1)
        if nc > 1:
            issue("g1_1", nc - 2)
    for s in range(nc):
        c, b = nc - 1 - s, f"g1_{s & 1}"
        wait(b, s >> 1, c)  # mbar_wait_parity(bar0 + 8 b, (s >> 1) & 1)
        wait("g2", s, c)  # mbar_wait_parity(bar0 + 16, s & 1)
        epoch += 1
        read("g2", c)  # products with dO: A_qk, Q Gam, Gam_last
        epoch += 1
        if c > 0:
            issue("g2", c - 1)
        read(b, c)  # dU += (K Eend) dS1
        epoch += 1
        read(b, c)  # dS0 -= w^T dU
        epoch += 1
        if c > 1:
            issue(b, c - 2)
    assert arms["g1_0"] + arms["g1_1"] == nc and arms["g2"] == nc
