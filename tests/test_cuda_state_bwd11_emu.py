"""CPU index-level checks of state_bwd3f_kernel (KDA_CUDA_CHUNK_BWD_STATE_BWD=11 / 12,
kernels_src/cuda/delta_chunk_bwd_state_bwd3.cuh) against state_bwd3_kernel<PC, false> (=4): the claims behind
"bit for bit =4's outputs", transcribed from both kernels' index expressions:
  1. every mma fragment element that =12 loads (base pointer + offsets, decoded with the padded row strides) is the
     tile element (row, column) that =4 loads for the same (warp, lane, k step, tile), in each of the four products
     (dU's own buffer through its XOR swizzle); =11 the same but for the products with Q Gam and w, whose A rows
     are its permuted dS rows (fragment rows g, g + 8 of m tile mt = dS rows 32 wi + 2 g + 16 mt + 0 / 1, a
     bijection; its 8-byte reads conflict-free);
  2. the in-place rounding pass: each element of each tile's 16-byte pieces is rounded exactly once, by the thread
     whose cp.async wrote it (so its own wait makes the data visible to it), and A_qk's zeroed elements are exactly
     those =4 masks (row < column);
  3. the dU buffer: the swizzle is a bijection of the 64 x 32 tile, and the warp's float2 writes and 4-byte reads
     are free of bank conflicts;
  4. the cp.async groups: at each wait the groups the following reads need are complete (group accounting of the
     kernel's commit / wait sequence), and each buffer is rewritten only after a barrier that follows its last read;
  5. tf32 bits: sb3_tf32f (x + 2^12 in the bit pattern where |x| < inf) has the top 19 bits of cvt.rna.tf32.f32
     (round to nearest, ties away from zero), the bits the mma reads; zero and masked zero agree.
Each check is run once with a deliberate mutation that must make it fail. Needs no GPU.
"""
import numpy as np
import pytest

CH, KP, VS = 64, 128, 32
LdKe, LdT, LdA, LdB = KP + 4, KP + 8, CH + 8, VS + 8


def lanes():
    for warp in range(8):
        wi, wc = warp & 3, warp >> 2
        for lane in range(32):
            yield wi, wc, lane >> 2, lane & 3


def R4(wi, gq, mt, h):  # =4 (and =12): the dS row of accumulator row g + 8 h of m tile mt
    return 32 * wi + gq + 16 * mt + 8 * h


def R11(wi, gq, mt, h, bug=None):  # =11 (ROWP): drow in the kernel
    return 32 * wi + 2 * gq + 16 * mt + (h if bug != "rowp_rows" else 8 * h)


def frags4(R=R4):
    """=4: per product, (warp, lane, ks, mt/nt) -> [(tile, row, col)] of the A and B fragment elements read; with
    R, the A fragments of the products with Q Gam and w for the dS row map R (=4's own for R4)"""
    out = {}
    for wi, wc, gq, t4 in lanes():
        cw, r0, u0 = 16 * wc, 32 * wi + gq, 16 * wi + gq
        key = (wi, wc, gq, t4)
        for ks in range(CH // 8):
            if ks >= 2 * wi:
                j0 = 8 * ks + t4
                out[("A_dU_a", key, ks)] = [("aqk", j0, u0), ("aqk", j0, u0 + 8), ("aqk", j0 + 4, u0),
                                            ("aqk", j0 + 4, u0 + 8)]
                for nt in range(2):
                    out[("A_dU_b", key, ks, nt)] = [("od", j0, cw + 8 * nt + gq), ("od", j0 + 4, cw + 8 * nt + gq)]
            t0 = 8 * ks + t4
            for nt in range(2):
                out[("A_dS_b", key, ks, nt)] = [("od", t0, cw + 8 * nt + gq), ("od", t0 + 4, cw + 8 * nt + gq)]
                out[("C_b", key, ks, nt)] = [("du", t0, cw + 8 * nt + gq), ("du", t0 + 4, cw + 8 * nt + gq)]
            for mt in range(2):
                i0 = r0 + 16 * mt
                if R is R4:  # =4's literal expressions
                    out[("A_dS_a", key, ks, mt)] = [("qg", t0, i0), ("qg", t0, i0 + 8), ("qg", t0 + 4, i0),
                                                    ("qg", t0 + 4, i0 + 8)]
                    out[("C_a", key, ks, mt)] = [("w", t0, i0), ("w", t0, i0 + 8), ("w", t0 + 4, i0),
                                                 ("w", t0 + 4, i0 + 8)]
                else:  # fragment rows g, g + 8 (slots 0 / 2 and 1 / 3) hold dS rows R(mt, 0), R(mt, 1)
                    ra, rb = R(wi, gq, mt, 0), R(wi, gq, mt, 1)
                    out[("A_dS_a", key, ks, mt)] = [("qg", t0, ra), ("qg", t0, rb), ("qg", t0 + 4, ra),
                                                    ("qg", t0 + 4, rb)]
                    out[("C_a", key, ks, mt)] = [("w", t0, ra), ("w", t0, rb), ("w", t0 + 4, ra), ("w", t0 + 4, rb)]
        for ks in range(KP // 8):
            k0 = 8 * ks + t4
            out[("B_a", key, ks)] = [("ke", u0, k0), ("ke", u0 + 8, k0), ("ke", u0, k0 + 4), ("ke", u0 + 8, k0 + 4)]
            for nt in range(2):
                out[("B_b", key, ks, nt)] = [("ds", k0, cw + 8 * nt + gq), ("ds", k0 + 4, cw + 8 * nt + gq)]
    return out


def du_pos(t, c):  # =11's dU buffer: row t, column c at t * VS + (c ^ 8 (t & 3))
    return t * VS + (c ^ ((t & 3) << 3))


def frags11(rowp, bug=None):
    """=11 (rowp) / =12: the same keys, from the kernel's base pointers and immediate offsets, decoded to
    (tile, row, col)"""
    inv_du = {du_pos(t, c): (t, c) for t in range(CH) for c in range(VS)}
    dec = {"aqk": lambda o: divmod(o, LdA), "qg": lambda o: divmod(o, LdT), "w": lambda o: divmod(o, LdT),
           "ke": lambda o: divmod(o, LdKe), "od": lambda o: divmod(o, LdB), "ds": lambda o: divmod(o, LdB),
           "du": lambda o: inv_du[o]}
    out = {}
    for wi, wc, gq, t4 in lanes():
        cw, u0 = 16 * wc, 16 * wi + gq
        r0 = 32 * wi + 2 * gq if rowp else 32 * wi + gq
        duw, dur = (u0 & 3) << 3, t4 << 3
        assert duw == ((u0 + 8) & 3) << 3
        key = (wi, wc, gq, t4)
        ab, ob, qb = t4 * LdA + u0, t4 * LdB + cw + gq, t4 * LdT + r0
        ke, sb, wb, ub = u0 * LdKe + t4, t4 * LdB + cw + gq, t4 * LdT + r0, t4 * VS

        def put(name, tile, offs):
            out[name] = [(tile, *dec[tile](o)) for o in offs]
        for ks in range(CH // 8):
            if ks >= 2 * wi:
                a = ab + 8 * ks * LdA
                put(("A_dU_a", key, ks), "aqk", [a, a + 8, a + 4 * LdA, a + 4 * LdA + 8])
                for nt in range(2):
                    o = ob + 8 * ks * LdB + 8 * nt
                    put(("A_dU_b", key, ks, nt), "od", [o, o + 4 * LdB])
            for nt in range(2):
                o = ob + 8 * ks * LdB + 8 * nt
                put(("A_dS_b", key, ks, nt), "od", [o, o + 4 * LdB])
                u = ub + 8 * ks * VS + ((cw + 8 * nt + gq) ^ (dur if bug != "swizzle_read" else 0))
                put(("C_b", key, ks, nt), "du", [u, u + 4 * VS])
            for mt in range(2):  # sb3f_afrag
                for name, tile, base in (("A_dS_a", "qg", qb), ("C_a", "w", wb)):
                    a = base + 8 * ks * LdT + 16 * mt
                    if rowp:  # float2 at rows t4 and t4 + 4
                        put((name, key, ks, mt), tile, [a, a + 1, a + 4 * LdT, a + 4 * LdT + 1])
                    else:
                        put((name, key, ks, mt), tile, [a, a + 8, a + 4 * LdT, a + 4 * LdT + 8])
        for ks in range(KP // 8):
            a = ke + 8 * ks
            put(("B_a", key, ks), "ke", [a, a + 8 * LdKe, a + 4, a + 8 * LdKe + (4 if bug != "ke_offset" else 8)])
            for nt in range(2):
                o = sb + 8 * ks * LdB + 8 * nt
                put(("B_b", key, ks, nt), "ds", [o, o + 4 * LdB])
    return out


def dU_writes11(bug=None):
    """(tile row, col) -> buffer position of =11's tf32(dU) stores (float2 at col, col + 1)"""
    w = {}
    for wi, wc, gq, t4 in lanes():
        cw, u0 = 16 * wc, 16 * wi + gq
        duw = ((u0 & 3) << 3) if bug != "swizzle_write" else 0
        for nt in range(2):
            c = cw + 8 * nt + 2 * t4
            col = c ^ duw
            for r in (u0, u0 + 8):
                w[(r, c)] = r * VS + col
                w[(r, c + 1)] = r * VS + col + 1
    return w


def check_fragments(bug=None, rowp=False):
    R = (lambda *a: R11(*a, bug=bug)) if rowp else R4
    f4, f11 = frags4(R), frags11(rowp, bug)
    assert f4.keys() == f11.keys()
    for k in f4:
        assert f4[k] == f11[k], (k, f4[k], f11[k])
    # every dS row exactly once per (warp column half, n tile): the row map is a bijection of the 128 rows
    assert sorted(R(wi, gq, mt, h) for wi in range(4) for gq in range(8) for mt in range(2) for h in range(2)) \
        == list(range(KP))
    # the 8-byte A reads (ROWP) are conflict-free: half-warps, rows t4 / t4 + 4 of a k step
    if rowp:
        for wi in range(4):
            for mt in range(2):
                ld = LdT if bug != "rowp_bank" else LdT + 4
                ad = [t4 * ld + 32 * wi + 2 * gq + 16 * mt for gq, t4 in ((lane >> 2, lane & 3) for lane in range(32))]
                assert banks(ad, 8) == 1, ("rowp A read", wi, mt)
    # the dU stores put tile element (r, c) where the reads decode it from
    w = dU_writes11(bug)
    assert len(w) == CH * VS and all(w[(t, c)] == du_pos(t, c) for t in range(CH) for c in range(VS))


def check_rounding_pass(bug=None):
    """the pieces each thread cp.asyncs and the pieces it rounds: the same, every tile element exactly once"""
    for tile, rows, cols, ld in (("ke", CH, KP, LdKe), ("w", CH, KP, LdT), ("qg", CH, KP, LdT), ("aqk", CH, CH, LdA)):
        copied, rounded = {}, {}
        for tid in range(256):
            kr, kc, ar, ac = tid >> 5, 4 * (tid & 31), tid >> 4, 4 * (tid & 15)
            if tile == "aqk":
                issue = [(ar + 16 * j) * ld + ac for j in range(4)]
                rnd = [(ar + 16 * j) * ld + ac for j in range(4 if bug != "short_pass" else 3)]
            else:
                issue = [(kr + 8 * j) * ld + kc for j in range(8)]
                rnd = [(kr + 8 * j) * ld + kc for j in range(8)]
            for base in issue:
                for e in range(4):
                    assert base + e not in copied
                    copied[base + e] = tid
            for base in rnd:
                for e in range(4):
                    assert base + e not in rounded
                    rounded[base + e] = tid
        assert copied == rounded, tile  # same elements, same thread
        assert sorted(divmod(o, ld) for o in copied) == [(r, c) for r in range(rows) for c in range(cols)], tile
    # A_qk's zeros: element (row, ac + e) of the piece at row r is zeroed iff r < ac + e, =4's mask (j0 < u0 ...)
    for r in range(CH):
        for c in range(CH):
            zero11 = not (r >= c) if bug != "mask" else not (r > c)
            zero4 = r < c  # =4 reads A(t, j) = A_qk[j, t] as 0 for j < t: smem row j, column t
            assert zero11 == zero4, (r, c)


def banks(addrs_by_lane, width):
    """wavefronts a warp's shared access needs (4-byte banks; width 4 or 8 bytes: 8-byte accesses in half-warps)"""
    groups = [range(32)] if width == 4 else [range(16), range(16, 32)]
    worst = 0
    for grp in groups:
        per_bank = {}
        for lane in grp:
            for wd in range(width // 4):
                a = addrs_by_lane[lane] + wd
                per_bank.setdefault(a % 32, set()).add(a)
        worst = max(worst, max(len(s) for s in per_bank.values()))
    return worst


def check_du_banks(bug=None):
    for wi in range(4):
        for wc in range(2):
            cw = 16 * wc
            for nt in range(2):
                for h in range(2):  # writes: float2 at row u0 + 8 h
                    ad = []
                    for lane in range(32):
                        gq, t4 = lane >> 2, lane & 3
                        u0 = 16 * wi + gq
                        duw = ((u0 & 3) << 3) if bug != "swizzle_write" else 0
                        ad.append((u0 + 8 * h) * VS + ((cw + 8 * nt + 2 * t4) ^ duw))
                    assert banks(ad, 8) == 1, ("write", wi, wc, nt, h)
                for ks in range(CH // 8):  # reads
                    for half in range(2):
                        ad = []
                        for lane in range(32):
                            gq, t4 = lane >> 2, lane & 3
                            dur = (t4 << 3) if bug != "swizzle_read" else 0
                            ad.append(t4 * VS + 8 * ks * VS + 4 * half * VS + ((cw + 8 * nt + gq) ^ dur))
                        assert banks(ad, 4) == 1, ("read", wi, wc, nt, ks)
    assert sorted(du_pos(t, c) for t in range(CH) for c in range(VS)) == list(range(CH * VS))


def check_schedule(nc, bug=None):
    """Replays the loop's cp.async commits / waits and barriers for nc chunks: each read finds its data landed and
    rounded (and the rounding after the thread's wait for that group); no buffer is overwritten (cp.async issue,
    rounding, store) between its last read and the next barrier."""
    groups = []         # committed groups: list of sets of (buffer, chunk)
    pending_issue = []  # issued, not yet committed
    done = set()        # (buffer, chunk) whose group is complete
    rounded = {}        # buffer -> chunk whose data in it is rounded
    content = {}        # buffer -> chunk (last issued)
    epoch = 0
    last_read = {}      # buffer -> epoch of its last read
    written = {}        # buffer -> epoch of its last write visible to the thread that made it (store, rounding, wait)
    def issue(buf, c):
        assert last_read.get(buf, -1) < epoch, f"{buf} overwritten (chunk {c}) in the epoch of a read"
        pending_issue.append((buf, c)); content[buf] = c; rounded.pop(buf, None)
    def commit():
        groups.append(set(pending_issue)); pending_issue.clear()
    def wait(n):
        for gset in groups[:len(groups) - n]:
            for x in gset - done:
                written[x[0]] = epoch
            done.update(gset)
    def rnd(buf):
        c = content[buf]
        assert (buf, c) in done, f"rounding {buf} of chunk {c} before its group completed"
        assert last_read.get(buf, -1) < epoch
        rounded[buf] = c
        written[buf] = epoch
    def read(buf, c, need_round=True):
        assert content.get(buf) == c and (buf, c) in done, f"{buf}: chunk {c} not landed"
        if need_round:
            assert rounded.get(buf) == c, f"{buf}: chunk {c} not rounded"
        assert written.get(buf, -1) < epoch, f"{buf}: chunk {c} written in the epoch of its read (no barrier)"
        last_read[buf] = epoch
    def barrier():
        nonlocal epoch
        epoch += 1
    def store(buf, c):
        assert last_read.get(buf, -1) < epoch, f"{buf} stored in the epoch of a read"
        content[buf] = c; done.add((buf, c)); rounded[buf] = c; written[buf] = epoch

    store("ds", nc)
    if nc > 0:
        issue("ke0", nc - 1); issue("w0", nc - 1); commit()
        issue("aqk", nc - 1); issue("qg", nc - 1); issue("gl", nc - 1); commit()
        if nc > 1:
            issue("ke1", nc - 2); issue("w1", nc - 2)
        commit()
        store("od", nc - 1)
        wait(2 if bug != "prologue_wait" else 3)
        rnd("ke0"); rnd("w0")
    for s in range(nc):
        c, b = nc - 1 - s, s & 1
        wait(1)
        rnd("aqk"); rnd("qg")
        if bug == "skip_top_barrier" and s == 1:
            pass
        else:
            barrier()
        read("aqk", c); read("od", c, False); read("qg", c); read("gl", c, False)
        read(f"ke{b}", c); read("ds", c + 1)
        store("du", c)
        if bug != "early_g2":
            barrier()
        if c > 0:
            issue("aqk", c - 1); issue("qg", c - 1); issue("gl", c - 1)
        commit()
        if bug == "early_g2":
            barrier()
        read(f"w{b}", c); read("du", c)
        store("ds", c)
        if c > 0:
            wait(1 if bug != "wait_too_loose" else 2)
            rnd(f"ke{b ^ 1}"); rnd(f"w{b ^ 1}")
        barrier()
        if c > 1:
            issue(f"ke{b}", c - 2); issue(f"w{b}", c - 2)
        commit()
        if c > 0:
            store("od", c - 1)


def check_fragments_rowp(bug=None):
    check_fragments(bug, rowp=True)


CHECKS = [
    (check_fragments, ["ke_offset", "swizzle_read", "swizzle_write"]),
    (check_fragments_rowp, ["ke_offset", "swizzle_read", "rowp_rows", "rowp_bank"]),
    (check_rounding_pass, ["short_pass", "mask"]),
    (check_du_banks, ["swizzle_write", "swizzle_read"]),
]


@pytest.mark.parametrize("check,bugs", CHECKS, ids=[c.__name__ for c, _ in CHECKS])
def test_state_bwd11_index_checks(check, bugs):
    check()
    for bug in bugs:  # each deliberate mutation must be caught
        with pytest.raises((AssertionError, KeyError)):
            check(bug)


def test_state_bwd11_schedule():
    for nc in range(0, 6):
        check_schedule(nc)
    for bug in ("early_g2", "wait_too_loose", "skip_top_barrier", "prologue_wait"):
        with pytest.raises(AssertionError):
            check_schedule(5, bug)


def tf32_rna_top19(x):
    """cvt.rna.tf32.f32 by the PTX definition (round to nearest, ties away from zero, on the magnitude), top 19 bits
    (sign, exponent, 10 mantissa bits); NaN / inf unchanged"""
    u = x.view(np.uint32).astype(np.uint64)
    mag = u & 0x7fffffff
    fin = np.isfinite(x)
    rm = np.where(fin, ((mag + 0x1000) >> 13) << 13, mag)  # adding half an ulp and truncating: ties away
    out = (u & 0x80000000) | rm
    return (out >> 13).astype(np.uint64)


def sb3_tf32f_top19(x, bug=None):
    u = x.view(np.uint32).astype(np.uint64)
    fin = np.abs(x) < np.inf
    add = 0x1000 if bug != "half_ulp" else 0x0fff
    return (np.where(fin, (u + add) & 0xffffffff, u) >> 13).astype(np.uint64)


def test_tf32_bits():
    rng = np.random.default_rng(1)
    x = np.concatenate([
        (rng.standard_normal(100000) * 10.0 ** rng.integers(-30, 30, 100000)).astype(np.float32),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 1.17549435e-38],
                 np.float32),
        # exact ties: the 13 dropped bits 1000000000000
        ((rng.integers(0, 2 ** 18, 1000, dtype=np.uint64) << 13) | 0x1000 | (rng.integers(1, 250, 1000,
                                                                                         dtype=np.uint64) << 23)
         ).astype(np.uint32).view(np.float32),
    ]).astype(np.float32)
    fin = np.isfinite(x)
    a, b = tf32_rna_top19(x), sb3_tf32f_top19(x)
    # where rounding carries into the exponent up to inf (|x| near FLT_MAX), both give the inf pattern's top bits
    assert np.array_equal(a[fin], b[fin])
    assert np.array_equal(a[~fin], b[~fin])
    # a masked A_qk zero (0) and =4's tf32(0.f) (0x1000 in the register) are the same tf32 zero
    assert sb3_tf32f_top19(np.array([0.0], np.float32))[0] == 0
    # negation commutes with the rounding (=11 rounds -w as =4 does; checked anyway)
    assert np.array_equal(sb3_tf32f_top19(-x[fin]) ^ (1 << 18), sb3_tf32f_top19(x[fin]))
    assert not np.array_equal(sb3_tf32f_top19(x, "half_ulp")[fin], a[fin])
