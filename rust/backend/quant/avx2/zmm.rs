//! The legacy formats' dot on AVX-512 VNNI: two eight-row groups side by side in one 512-bit
//! register.
//!
//! The same dot as [`super::legacy`]'s VNNI build, twice as wide: a 512-bit group-vector is
//! group `g`'s four elements of its eight rows in the low half and group `g + 1`'s in the
//! high half (their records follow each other in memory), so one broadcast of a row's four
//! activation codes and one `vpdpbusd` serve sixteen outputs. AVX-512's 32 registers hold a
//! tile of up to [`ZMM_TILE`] rows, so a verify's rows meet each decoded group-vector in
//! registers and the records are decoded once per tile, not once per three rows. Rows go in
//! chunks of [`ROW_TILE`], so a chunk's activations stay in cache while every pair passes.
//!
//! Invariants: the i32 sums are the same integers as every other path's, and each output
//! lane runs the same f32 operations in the same order as [`super::super::dot_portable`], so
//! results are bit-identical to the portable path whatever the instruction set. A task's odd
//! last group goes to the 256-bit VNNI build.

use super::legacy;
use super::*;

/// The most rows one tile holds in registers: per row its f32 sums and its i32 sums (one
/// chain from seven rows on, two below), with the activation codes read by the multiplies
/// themselves ([`dpbusd_broadcast`]), so ten rows fit the 32 registers (`--kernel`, Q4_1
/// 1536x576 at 9 rows: 46 us in one tile, 56 as 5 + 4; the Q8_0 head 124 against 135).
const ZMM_TILE: usize = 10;

/// Output features of groups `groups`, every row of `act` (Q8 blocks), into `out`.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512 F/BW/VL and AVX-512 VNNI; `w` is
/// of format `F`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn run<F: Fmt>(
    w: &PackedView<'_>,
    act: &QuantizedRows,
    groups: Range<usize>,
    out: OutMatrix,
) {
    // The odd group's 256-bit build runs on this function's features.
    pair_tiles!(
        (w, act, groups, out),
        ZMM_TILE,
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        pair,
        legacy::run_with::<F, { legacy::EVEX_VNNI }>
    )
}

/// The 512-bit kernels' loop over a task's outputs: for every chunk of [`ROW_TILE`] rows and
/// every pair of groups (`g`, `g + 1`) of `groups`, `$pair::<F, R>(w, &layout, &rows, r0, g,
/// out)` over tiles of at most `$tile` rows, as even as they can be (the bracketed list the
/// tile lengths `$pair` is instantiated for, as [`even_tiles`] takes it); a range's odd last
/// group goes to `$odd` (a 256-bit build's body). Written once for the legacy formats' kernel and the K-quants' ([`super::kquant_zmm`]).
macro_rules! pair_tiles {
    (
        ($w:expr, $act:expr, $groups:expr, $out:expr),
        $tile:expr,
        [$($n:literal),+],
        $pair:ident,
        $odd:expr
    ) => {{
        let (w, act, groups, out): (&PackedView<'_>, &QuantizedRows, Range<usize>, OutMatrix) =
            ($w, $act, $groups, $out);
        let pairs_end = groups.start + groups.len() / 2 * 2;
        let layout = RecordLayout::of(w.format());
        let ws = Workspace::take(act);
        let acts = &ws.acts;
        for c0 in (0..act.rows).step_by(ROW_TILE) {
            let chunk = c0..act.rows.min(c0 + ROW_TILE);
            for g in (groups.start..pairs_end).step_by(2) {
                even_tiles!(chunk.clone(), $tile, [$($n),+], |r0, R| {
                    let rows: [Act; R] = std::array::from_fn(|i| acts[r0 + i]);
                    // SAFETY: the rows hold every block of the weight's rows; the task owns
                    // groups `g` and `g + 1`'s outputs of every row.
                    unsafe { $pair::<F, R>(w, &layout, &rows, r0, g, out) }
                });
            }
        }
        ws.give_back();
        if pairs_end < groups.end {
            // SAFETY: as above, for the last group.
            unsafe { $odd(w, act, pairs_end..groups.end, out) };
        }
    }};
}
pub(super) use pair_tiles;

/// Groups `g` and `g + 1` for rows `first..first + R` (`rows`, from their first block),
/// decoded in registers, written to their sixteen outputs.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn pair<F: Fmt, const R: usize>(
    w: &PackedView<'_>,
    layout: &RecordLayout,
    rows: &[Act; R],
    first: usize,
    g: usize,
    out: OutMatrix,
) {
    let nb = w.blocks();
    let lo = w.group_records(g);
    let hi = w.group_records(g + 1);
    let record_bytes = F::RECORD_BYTES;
    // Once a pair of groups: every record pointer below rests on it.
    assert!(
        lo.len() == record_bytes * nb && hi.len() == lo.len(),
        "a group's records are not {nb} of {record_bytes} bytes"
    );
    let flip = _mm512_set1_epi8(i8::MIN);
    let mut accv = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let rec = [lo.as_ptr(), hi.as_ptr()].map(|p| p.add(b * record_bytes));
        prefetch_ahead(rec[0], record_bytes);
        prefetch_ahead(rec[1], record_bytes);
        // Below seven rows, two chains of `vpdpbusd` per row (even and odd group-vectors),
        // added after: one chain of eight leaves each row waiting on the instruction's
        // latency (`--kernel`, Q4_1 1536x576 at 5 rows: 36 us against 40). From seven rows
        // on there are chains enough, and the registers go to a longer tile.
        let chains = if R >= 7 { 1 } else { 2 };
        let mut isum = [[_mm512_setzero_si512(); R]; 2];
        let block: [*const i8; R] = std::array::from_fn(|r| rows[r].qa.add(32 * b));
        // Group-vector `$v` of both records, then its product with every row's four codes.
        macro_rules! vector {
            ($v:literal) => {{
                let codes = if F::Q8 {
                    // `w ^ 0x80` is `w + 128` as an unsigned byte; `128 * sum(qa)` comes off below.
                    let at = layout.planes[0].0 + 32 * $v;
                    _mm512_xor_si512(halves(rec[0].add(at), rec[1].add(at)), flip)
                } else {
                    let x = plane_vector(&rec, layout.planes[0].0, F::W1, 0, $v);
                    if F::W2 == 0 {
                        x
                    } else {
                        let y = plane_vector(&rec, layout.planes[1].0, F::W2, F::D2, $v);
                        _mm512_or_si512(x, y)
                    }
                };
                for r in 0..R {
                    let acc = &mut isum[$v % chains][r];
                    *acc = dpbusd_broadcast::<{ 4 * $v }>(*acc, codes, block[r]);
                }
            }};
        }
        vector!(0);
        vector!(1);
        vector!(2);
        vector!(3);
        vector!(4);
        vector!(5);
        vector!(6);
        vector!(7);
        let mut isum: [__m512i; R] =
            std::array::from_fn(|r| _mm512_add_epi32(isum[0][r], isum[1][r]));
        // Q8_0's bias of 128 and the code offsets of Q4_0 and Q5_0 (`2^OFFSET`).
        let shift = if F::Q8 { 7 } else { F::OFFSET };
        if shift != 0 {
            for r in 0..R {
                let o = _mm512_set1_epi32(*rows[r].bsum.add(b) << shift);
                isum[r] = _mm512_sub_epi32(isum[r], o);
            }
        }
        let d = f16x16(rec[0], rec[1]);
        let d2 = match layout.d2 {
            Some(at) => f16x16(rec[0].add(at), rec[1].add(at)),
            None => _mm512_setzero_ps(),
        };
        for r in 0..R {
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(*rows[r].d.add(b)));
            accv[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum[r]), accv[r]);
            if F::AFFINE {
                accv[r] = _mm512_fmadd_ps(d2, _mm512_set1_ps(*rows[r].sum.add(b)), accv[r]);
            }
        }
    }
    for (r, &sum) in accv.iter().enumerate() {
        // SAFETY: the caller owns these sixteen outputs of row `first + r`.
        _mm512_storeu_ps(out.at(first + r, g * GROUP_ROWS), sum);
    }
}

/// `acc + dpbusd(codes, a)`, `a` the four activation codes at `row + OFF` broadcast to every
/// lane by the instruction itself. Written as assembly because LLVM, given the broadcasts as
/// values, hoists a block's (eight a row) to its top and spills most of them to the stack
/// (Q4_1 at five rows: 21 of 40, a store and a reload each).
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
pub(super) unsafe fn dpbusd_broadcast<const OFF: usize>(
    acc: __m512i,
    codes: __m512i,
    row: *const i8,
) -> __m512i {
    let mut acc = acc;
    // SAFETY: the caller's contract: the four bytes at `row + OFF` are readable.
    unsafe {
        std::arch::asm!(
            "vpdpbusd {acc}, {codes}, dword ptr [{row} + {off}]{{1to16}}",
            acc = inout(zmm_reg) acc,
            codes = in(zmm_reg) codes,
            row = in(reg) row,
            off = const OFF,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    acc
}

/// The 32 bytes at `lo` and the 32 at `hi` as one register, `lo` in the low half.
#[inline(always)]
pub(super) unsafe fn halves(lo: *const u8, hi: *const u8) -> __m512i {
    let low = _mm512_castsi256_si512(_mm256_loadu_si256(lo.cast()));
    _mm512_inserti64x4::<1>(low, _mm256_loadu_si256(hi.cast()))
}

/// The eight f16 at `lo` and the eight at `hi` as sixteen f32.
#[inline(always)]
pub(super) unsafe fn f16x16(lo: *const u8, hi: *const u8) -> __m512 {
    let low = _mm256_castsi128_si256(_mm_loadu_si128(lo.cast()));
    _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(
        low,
        _mm_loadu_si128(hi.cast()),
    ))
}

/// Group-vector `v` of both records' `w`-bit plane at byte `plane`, at bit `dest` of the code
/// (the 512-bit form of the 256-bit kernel's register decode), for a legacy format's record
/// of eight group-vectors.
#[inline(always)]
pub(super) unsafe fn plane_vector(
    rec: &[*const u8; 2],
    plane: usize,
    w: u32,
    dest: u32,
    v: usize,
) -> __m512i {
    plane_vector_of(rec, plane, w, dest, 8, v)
}

/// [`plane_vector`] for records of `vectors` group-vectors (a K-quant's 64).
#[inline(always)]
pub(super) unsafe fn plane_vector_of(
    rec: &[*const u8; 2],
    plane: usize,
    w: u32,
    dest: u32,
    vectors: usize,
    v: usize,
) -> __m512i {
    let (c, by, mask) = plane_field(w, dest, vectors / (8 / w as usize), v);
    let x = halves(rec[0].add(plane + 32 * c), rec[1].add(plane + 32 * c));
    let x = if by >= 0 {
        _mm512_sll_epi16(x, _mm_cvtsi32_si128(by))
    } else {
        _mm512_srl_epi16(x, _mm_cvtsi32_si128(-by))
    };
    _mm512_and_si512(x, _mm512_set1_epi8(mask))
}
