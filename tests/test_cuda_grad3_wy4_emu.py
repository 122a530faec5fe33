"""CPU emulation of grad3_wy4's data movement (kernels_src/cuda/delta_chunk_bwd_grad3_wy2.cuh, grad3_wy4_kernel;
KDA_CUDA_CHUNK_BWD_WY=4) against grad3_wy2's: the part of its bit-identity claim that a GPU run covers only through
the gradients. The arithmetic (MMAs, splits, FMA chains) is grad3_wy2's statement for statement, so what can go wrong
is where a value is put and read. Emulated per thread (8 warps x 32 lanes, m16n8k8 fragment maps) with labels
instead of numbers:
  - T^T's A fragments: warp w fills fragment f = w, w + 8, w + 16 (f < 20) from T^T at (row tile fm, k-step ks),
    f = fm (7 - fm) + ks, each word once, inside tt + ms; T^T dX in grad3_wy4 (warp w: column tile w of every row
    tile) covers grad3_wy2's (row tile, column tile, k-step) products once each and reads, per product, the T^T
    words grad3_wy2's thread loads;
  - dR_s written raw by grad3_wy4's owners and read back for dbeta in grad3_wy2's thread mapping: each thread finds
    the accumulator element its grad3_wy2 counterpart held (so its FMA chain sees the same values in the same order);
  - dL += dR X^T: the tile table (Wy4Smem::band / col0, read from the source) covers grad3_wy2's non-skipped
    (row tile, column tile) pairs once each; the dL words the epilogue reads back are, per thread and position,
    those grad3_wy2's thread held in its registers (and the skipped tiles read none).
No GPU needed. Deliberate mapping errors (fragment index, dR column, tile table) must fail the checks: tested too.
"""
import re
from pathlib import Path

import numpy as np
import pytest

CH, LDA = 64, 68
TT, MS, BETA = 0, 64 * LDA, 64 * LDA + 3 * 256  # offsets relative to tt (Wy2Smem: ms = tt + CH LdA, beta = ms + 768)


def _frag_index(fm, ks):
    return fm * (7 - fm) + ks


def _fill_tfrag():
    """tfs words -> label (row, col of T^T, 'hi'/'lo') as grad3_wy4's fill writes them."""
    words = {}
    for warp in range(8):
        for q in range(3):
            f = warp + 8 * q
            if f >= 20:
                continue
            fm = 0 if f < 8 else (1 if f < 14 else (2 if f < 18 else 3))
            ks = f - fm * (7 - fm)
            for lane in range(32):
                gq, t4 = lane >> 2, lane & 3
                k0 = 8 * ks + t4
                src = [(16 * fm + gq, k0), (16 * fm + gq + 8, k0), (16 * fm + gq, k0 + 4), (16 * fm + gq + 8, k0 + 4)]
                for e in range(4):
                    for part, off in (("hi", 0), ("lo", 128)):
                        w = 256 * f + off + 4 * lane + e
                        assert w not in words, f"tfs word {w} written twice"
                        words[w] = (src[e], part)
    return words


# grad3_wy4's dL tile table (Wy4Smem::band / col0): warp w -> (row tile, first column tile, tiles)
BAND = [2, 2, 3, 3, 0, 1, 1, 3]
COL0 = [0, 3, 0, 3, 0, 0, 2, 6]


def _decode_table():
    """Wy4Smem::band / col0 read from the kernel source, decoded as grad3_wy4 does."""
    src = (Path(__file__).parent.parent / "kernels_src/cuda/delta_chunk_bwd_grad3_wy2.cuh").read_text()
    consts = {}
    for name in ("band", "col0"):
        m = re.search(r"static constexpr unsigned " + name + r" = ([0-9u<| ]+);", src)
        assert m, f"Wy4Smem::{name} not found in delta_chunk_bwd_grad3_wy2.cuh"
        consts[name] = eval(m.group(1).replace("u", ""))  # only digits, <<, |
    band, col0 = consts["band"], consts["col0"]
    return [((band >> (2 * w)) & 3, (col0 >> (4 * w)) & 15, 3 if w < 4 else 2) for w in range(8)]


def _check_tfrag(words, frag_index=_frag_index):
    assert all(0 <= w < BETA for w in words), "T^T fragments outside tt + ms"
    # T^T dX: grad3_wy2's warp (mi, nh) computes tiles (mi, 4 nh + nt) at k-steps ks >= 2 mi; grad3_wy4's warp w
    # the tiles (mt, w) at ks with mt <= ks / 2, reading fragment frag_index(mt, ks)
    wy2 = {(mi, 4 * nh + nt, ks) for mi in range(4) for nh in range(2) for nt in range(4) for ks in range(8)
           if ks >= 2 * mi}
    wy4 = [(mt, w, ks) for w in range(8) for ks in range(8) for mt in range(ks // 2 + 1)]
    assert len(wy4) == len(set(wy4)) and set(wy4) == wy2
    for mt, w, ks in wy4:
        for lane in range(32):
            gq, t4 = lane >> 2, lane & 3
            tr0, k0 = 16 * mt + gq, 8 * ks + t4
            want = [(tr0, k0), (tr0 + 8, k0), (tr0, k0 + 4), (tr0 + 8, k0 + 4)]  # grad3_wy2's av in row tile mt
            base = 256 * frag_index(mt, ks) + 4 * lane
            for e in range(4):
                assert words.get(base + e) == (want[e], "hi"), (w, mt, ks, lane, e)
                assert words.get(base + 128 + e) == (want[e], "lo"), (w, mt, ks, lane, e)


def _check_dr_readback(col=lambda w: 8 * w):
    """dR_s written raw by grad3_wy4's T^T dX owner (warp w: columns col(w) .., every row tile), read back for
    dbeta by grad3_wy2's thread mapping: each read must find the accumulator element grad3_wy2's thread held."""
    dr = {}
    for w in range(8):
        for lane in range(32):
            gq, t4 = lane >> 2, lane & 3
            for mt in range(4):
                for h in range(2):
                    for e in range(2):
                        pos = (16 * mt + gq + 8 * h, col(w) + 2 * t4 + e)
                        assert pos not in dr
                        dr[pos] = ((mt, w), lane, 2 * h + e)
    for warp in range(8):
        mi, nh = warp & 3, warp >> 2
        for lane in range(32):
            gq, t4 = lane >> 2, lane & 3
            for nt in range(4):
                for h in range(2):
                    for e in range(2):
                        pos = (16 * mi + gq + 8 * h, 32 * nh + 8 * nt + 2 * t4 + e)
                        assert dr[pos] == ((mi, 4 * nh + nt), lane, 2 * h + e), (warp, lane, nt, h, e)


def _wy4_tiles(table=None):
    """(mi, J) -> (warp, i): dL tile (rows 16 mi.., columns 8 J..) accumulated by warp in dl[i] (grad3_wy4)."""
    tiles = {}
    for warp, (pb, pj, pn) in enumerate(table or _decode_table()):
        for i in range(pn):
            assert (pb, pj + i) not in tiles, f"tile {(pb, pj + i)} accumulated twice"
            tiles[(pb, pj + i)] = (warp, i)
    return tiles


def _check_dl(tiles, table=None):
    table = table or _decode_table()
    wy2 = {(mi, 4 * nh + nt) for mi in range(4) for nh in range(2) for nt in range(4)
           if not 32 * nh + 8 * nt > 16 * mi + 15}
    assert set(tiles) == wy2, f"tile sets differ: {sorted(set(tiles) ^ wy2)}"
    # the shared dL array: word (t, j) <- (tile, lane, accumulator element) as grad3_wy4 stores it
    dls = {}
    for (mi, J), (warp, i) in tiles.items():
        pb, pj, _ = table[warp]
        for lane in range(32):
            gq, t4 = lane >> 2, lane & 3
            j = 8 * (pj + i) + 2 * t4
            for h in range(2):
                t = 16 * pb + gq + 8 * h
                for e in range(2):
                    w = (t, j + e)
                    assert w not in dls
                    dls[w] = ((mi, J), lane, 2 * h + e)
    assert all(t < CH and j < CH for t, j in dls)
    # grad3_wy2's epilogue thread (mi, nh, lane) at (nt, h, e) held dl[nt][2h + e] of its tile (mi, 4 nh + nt);
    # grad3_wy4's same thread reads dls at (t, j + e) where the tile was computed
    for warp in range(8):
        mi, nh = warp & 3, warp >> 2
        for lane in range(32):
            gq, t4 = lane >> 2, lane & 3
            for nt in range(4):
                J = 4 * nh + nt
                done = J <= 2 * mi + 1
                assert done == ((mi, J) in wy2)
                if not done:
                    continue
                j = 32 * nh + 8 * nt + 2 * t4
                for h in range(2):
                    t = 16 * mi + gq + 8 * h
                    for e in range(2):
                        assert dls[(t, j + e)] == ((mi, J), lane, 2 * h + e), (warp, lane, nt, h, e)


def test_tfrag_maps_match_grad3_wy2():
    _check_tfrag(_fill_tfrag())
    assert len(_fill_tfrag()) == 20 * 256 == BETA - TT  # fills tt + ms exactly


def test_dr_readback_matches_grad3_wy2():
    _check_dr_readback()


def test_dl_tiles_match_grad3_wy2():
    assert _decode_table() == list(zip(BAND, COL0, [3, 3, 3, 3, 2, 2, 2, 2]))
    tiles = _wy4_tiles()
    _check_dl(tiles)
    # three tiles for warps 0-3, two for 4-7 (grad3_wy2: 2, 4, 4, 4, 0, 0, 2, 4 for warps 0..7)
    per_warp = np.bincount([w for w, _ in tiles.values()], minlength=8)
    assert per_warp.tolist() == [3, 3, 3, 3, 2, 2, 2, 2]


def test_emulation_catches_mapping_errors():
    # a wrong fragment index, a wrong dR column, a wrong dL tile table must be caught
    with pytest.raises(AssertionError):
        _check_tfrag(_fill_tfrag(), frag_index=lambda fm, ks: fm * (8 - fm) + ks)
    with pytest.raises(AssertionError):
        _check_dr_readback(col=lambda w: 8 * (w ^ 4))
    bad = list(zip(BAND, COL0, [3, 3, 3, 3, 2, 2, 2, 2]))
    bad[7] = (3, 5, 2)  # overlaps warp 3's tiles, leaves (3, 7) out
    with pytest.raises(AssertionError):
        _check_dl(_wy4_tiles(bad), bad)
