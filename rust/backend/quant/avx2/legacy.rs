//! The AVX2 kernel of the legacy formats (32-element blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).
//!
//! Three ways to feed the same dot ([`block_rows`]): calls of up to [`register_rows`] rows (a
//! decode step, a short verify) decode each record's group-vectors in registers and use them at
//! once, so a record is loaded once and never stored; calls of up to [`GROUPWISE_DIRECT_ROWS`]
//! rows do the same one group at a time, in tiles of up to [`register_rows`] rows that meet the
//! group's records while they are in L1; longer calls decode a chunk of records into the L1
//! scratch once and take the rows four at a time past it. All form the same i32 sums and run
//! the same f32 operations in the same order. Each is compiled twice: for AVX2 ([`run`],
//! `maddubs`) and for AVX2 with AVX-VNNI ([`run_vnni`], `vpdpbusd`), the same integers by two
//! instruction sequences (AVX2's i16 steps never saturate, and `vpdpbusd` adds exactly). With
//! VNNI, Q8_0's signed codes go in as `w + 128` (unsigned) with `128 * sum(qa)` taken off after,
//! which drops AVX2's per-row `sign`.

use super::*;

/// Calls of more than [`register_rows`] and at most this many rows (a verify of a few
/// drafts) take one group at a time and decode its records in registers once per tile of up
/// to [`register_rows`] rows: the group's records stay in L1 between its tiles, so memory is
/// read once and nothing goes through the scratch. Measured by `cargo bench --bench
/// model_decode` (quiet, two runs each against the scratch path): 5 rows 1.91-1.97x a
/// one-row step against 2.06-2.16x, 6 rows 2.08-2.13x against 2.34-2.44x, 9 rows
/// 3.03-3.15x against 3.22-3.41x.
const GROUPWISE_DIRECT_ROWS: usize = 9;

/// Rows that meet each group-vector while it is in a register, as a whole call (calls of up
/// to this many rows) or as one tile of the group-at-a-time path: the scratch would only add
/// a store and a load per group-vector. Past three rows of 4- and 5-bit codes the registers
/// run short (`--kernel`, one 1536x576 Q4_1 call of 4 rows: 58-64 us in registers, against
/// 47-49 us as 3 + 1 or 2 + 2, on AVX2 and VNNI alike); Q8_0's dot holds fewer values per
/// row and gains to four (4 rows 108 us against 142 as 3 + 1 with VNNI, 195 against 241 on
/// AVX2).
const fn register_rows<F: Fmt>() -> usize {
    if F::Q8 {
        4
    } else {
        3
    }
}

dot_builds!();

/// How a kernel build forms its i32 sums: AVX2's `maddubs`/`madd`, or `vpdpbusd` on 256-bit
/// registers in its VEX encoding (AVX-VNNI) or its EVEX one (AVX-512 VNNI with VL). The two
/// encodings are separate CPU features: Zen 4 has only the EVEX one, Alder Lake only the VEX
/// one, so the 512-bit kernels, which hand their odd last group to this one, use EVEX.
pub(super) const MADDUBS: u8 = 0;
/// See [`MADDUBS`].
pub(super) const VEX_VNNI: u8 = 1;
/// See [`MADDUBS`].
pub(super) const EVEX_VNNI: u8 = 2;

/// `acc + dpbusd(w, a)` in the encoding `DOT` names (the same integers either way). Only the
/// branch of the caller's build is compiled into it, so it needs only that build's features.
#[inline(always)]
pub(super) unsafe fn dpbusd256<const DOT: u8>(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
    // SAFETY: the caller's build has the features of the encoding it names.
    unsafe {
        if DOT == EVEX_VNNI {
            _mm256_dpbusd_epi32(acc, w, a)
        } else {
            _mm256_dpbusd_avx_epi32(acc, w, a)
        }
    }
}

/// The body of [`run`] and [`run_vnni`] (and of the 512-bit kernels' odd last group), inlined
/// into each so every intrinsic is compiled with its caller's features; `DOT` is one of
/// [`MADDUBS`], [`VEX_VNNI`] and [`EVEX_VNNI`].
#[inline(always)]
pub(super) unsafe fn run_with<F: Fmt, const DOT: u8>(
    w: &PackedView<'_>,
    act: &QuantizedRows,
    groups: Range<usize>,
    out: OutMatrix,
) {
    let layout = RecordLayout::of(w.format());
    // Q8_0 keeps two vectors per group (|w| and w), so half as many blocks fit.
    let chunk = if F::Q8 { 4 } else { 8 };
    let nb = w.blocks();
    let mut ws = Workspace::take(act);
    let Workspace {
        scratch: s,
        accs,
        acts,
    } = &mut *ws;
    if act.rows <= register_rows::<F>() {
        row_tiles!(act.rows, |r0, R| {
            let rows: [Act; R] = std::array::from_fn(|i| acts[r0 + i]);
            // SAFETY: the rows hold every block of the weight's rows; the task owns these
            // groups' outputs of every row.
            unsafe { direct::<F, R, DOT>(w, &layout, &rows, r0, groups.clone(), out) }
        });
        return ws.give_back();
    }
    if act.rows <= GROUPWISE_DIRECT_ROWS {
        for g in groups.clone() {
            even_tiles!(0..act.rows, register_rows::<F>(), [1, 2, 3, 4], |r0, R| {
                let rows: [Act; R] = std::array::from_fn(|i| acts[r0 + i]);
                // SAFETY: as above, for group `g` alone.
                unsafe { direct::<F, R, DOT>(w, &layout, &rows, r0, g..g + 1, out) }
            });
        }
        return ws.give_back();
    }
    for (tile, g) in tiles(act.rows, groups) {
        accs.zero();
        let records = w.group_records(g);
        let record_bytes = records.len() / nb;
        for b0 in (0..nb).step_by(chunk) {
            let nbk = chunk.min(nb - b0);
            for k in 0..nbk {
                let rec = records[(b0 + k) * record_bytes..][..record_bytes].as_ptr();
                // SAFETY: `rec` is a whole record of this format, which `layout` describes.
                unsafe {
                    prefetch_ahead(rec, record_bytes);
                    decode::<F>(s, k, rec, &layout)
                };
            }
            row_tiles!(tile.len(), |r0, R| {
                let rows: [Act; R] =
                    std::array::from_fn(|i| acts[tile.start + r0 + i].at_block(b0, 32));
                let acc: [*mut f32; R] = std::array::from_fn(|i| accs.at(r0 + i));
                // SAFETY: the rows hold `nbk` blocks from `b0`; `acc` are this tile's sums.
                unsafe {
                    let mut accv = [_mm256_setzero_ps(); R];
                    for r in 0..R {
                        accv[r] = _mm256_loadu_ps(acc[r]);
                    }
                    for b in 0..nbk {
                        block_rows::<F, Scratch, R, DOT>(s, b, &rows, &mut accv);
                    }
                    for r in 0..R {
                        _mm256_storeu_ps(acc[r], accv[r]);
                    }
                }
            });
        }
        // SAFETY: the task owns group `g`'s outputs of every row.
        unsafe { accs.store(out, tile, g) };
    }
    ws.give_back();
}

/// Groups `groups` for rows `first..first + R` (`rows`, from their first block), decoded in
/// registers, written to their outputs. One row takes two groups side by side: the f32 sums
/// of an output form one chain of dependent fused multiply-adds, and two groups' chains
/// overlap where one would leave the core waiting.
#[inline(always)]
unsafe fn direct<F: Fmt, const R: usize, const DOT: u8>(
    w: &PackedView<'_>,
    layout: &RecordLayout,
    rows: &[Act; R],
    first: usize,
    groups: Range<usize>,
    out: OutMatrix,
) {
    let mut g = groups.start;
    if R == 1 {
        while g + 2 <= groups.end {
            direct_groups::<F, R, 2, DOT>(w, layout, rows, first, g, out);
            g += 2;
        }
    }
    while g < groups.end {
        direct_groups::<F, R, 1, DOT>(w, layout, rows, first, g, out);
        g += 1;
    }
}

/// Groups `g0..g0 + G` for rows `first..first + R`, decoded in registers.
#[inline(always)]
unsafe fn direct_groups<F: Fmt, const R: usize, const G: usize, const DOT: u8>(
    w: &PackedView<'_>,
    layout: &RecordLayout,
    rows: &[Act; R],
    first: usize,
    g0: usize,
    out: OutMatrix,
) {
    let nb = w.blocks();
    let src: [Records<'_, F>; G] = std::array::from_fn(|i| {
        let records = w.group_records(g0 + i);
        Records {
            at: records.as_ptr(),
            record_bytes: records.len() / nb,
            layout,
            format: std::marker::PhantomData,
        }
    });
    let mut accv = [[_mm256_setzero_ps(); R]; G];
    for b in 0..nb {
        for i in 0..G {
            src[i].prefetch(b);
            block_rows::<F, _, R, DOT>(&src[i], b, rows, &mut accv[i]);
        }
    }
    for (i, sums) in accv.iter().enumerate() {
        for (r, &sum) in sums.iter().enumerate() {
            // SAFETY: the caller owns these groups' eight outputs of row `first + r`.
            _mm256_storeu_ps(out.at(first + r, (g0 + i) * GROUP_ROWS), sum);
        }
    }
}

/// Where [`block_rows`] finds block `b`'s decoded codes and scales.
trait Codes {
    /// Group-vector `v` of block `b` (not Q8_0).
    unsafe fn codes(&self, b: usize, v: usize) -> __m256i;
    /// Q8_0: group-vector `v` of block `b` as (|w|, w).
    unsafe fn signed(&self, b: usize, v: usize) -> (__m256i, __m256i);
    /// The eight rows' `d` and `m` (zero for formats without a min).
    unsafe fn scales(&self, b: usize) -> (__m256, __m256);
}

/// The L1 scratch: block `b` in slot `b`.
impl Codes for Scratch {
    #[inline(always)]
    unsafe fn codes(&self, b: usize, v: usize) -> __m256i {
        *self.codes.as_ptr().add(8 * b + v)
    }

    #[inline(always)]
    unsafe fn signed(&self, b: usize, v: usize) -> (__m256i, __m256i) {
        let codes = self.codes.as_ptr();
        (*codes.add(8 * b + v), *codes.add(32 + 8 * b + v))
    }

    #[inline(always)]
    unsafe fn scales(&self, b: usize) -> (__m256, __m256) {
        (*self.d.as_ptr().add(b), *self.d2.as_ptr().add(b))
    }
}

/// One group's records, decoded as they are read: block `b` is record `b`.
struct Records<'a, F> {
    at: *const u8,
    record_bytes: usize,
    layout: &'a RecordLayout,
    format: std::marker::PhantomData<F>,
}

impl<F: Fmt> Records<'_, F> {
    #[inline(always)]
    unsafe fn record(&self, b: usize) -> *const u8 {
        self.at.add(b * self.record_bytes)
    }

    #[inline(always)]
    unsafe fn prefetch(&self, b: usize) {
        prefetch_ahead(self.record(b), self.record_bytes);
    }
}

impl<F: Fmt> Codes for Records<'_, F> {
    #[inline(always)]
    unsafe fn codes(&self, b: usize, v: usize) -> __m256i {
        let rec = self.record(b);
        let x = plane_vector(rec.add(self.layout.planes[0].0), F::W1, 0, v);
        if F::W2 == 0 {
            return x;
        }
        let y = plane_vector(rec.add(self.layout.planes[1].0), F::W2, F::D2, v);
        _mm256_or_si256(x, y)
    }

    #[inline(always)]
    unsafe fn signed(&self, b: usize, v: usize) -> (__m256i, __m256i) {
        let raw = _mm256_loadu_si256(self.record(b).add(self.layout.planes[0].0 + 32 * v).cast());
        (_mm256_abs_epi8(raw), raw)
    }

    #[inline(always)]
    unsafe fn scales(&self, b: usize) -> (__m256, __m256) {
        let rec = self.record(b);
        let d2 = match self.layout.d2 {
            Some(at) => f16x8(rec.add(at)),
            None => _mm256_setzero_ps(),
        };
        (f16x8(rec), d2)
    }
}

/// Group-vector `v` (of a 32-element block's eight) of the `w`-bit plane at `p`, at bit
/// `dest` of the code: the register form of [`decode_plane`]'s store.
#[inline(always)]
unsafe fn plane_vector(p: *const u8, w: u32, dest: u32, v: usize) -> __m256i {
    let (c, by, mask) = plane_field(w, dest, 8 / (8 / w as usize), v);
    place_field(
        _mm256_loadu_si256(p.add(32 * c).cast()),
        by,
        _mm256_set1_epi8(mask),
    )
}

/// Decodes one record into slot `k` of the scratch.
#[inline(always)]
unsafe fn decode<F: Fmt>(s: &mut Scratch, k: usize, rec: *const u8, layout: &RecordLayout) {
    s.d[k] = f16x8(rec);
    if let Some(at) = layout.d2 {
        s.d2[k] = f16x8(rec.add(at));
    }
    let codes = s.codes.as_mut_ptr();
    if F::Q8 {
        for v in 0..8 {
            let raw = _mm256_loadu_si256(rec.add(layout.planes[0].0 + 32 * v).cast());
            *codes.add(8 * k + v) = _mm256_abs_epi8(raw);
            *codes.add(32 + 8 * k + v) = raw;
        }
    } else {
        decode_codes::<F>(rec, layout, 8, codes.add(8 * k));
    }
}

/// `R` rows times block `b` of `src` (the rows' block `b` is the activation block it meets),
/// added to their running sums `accv`; unless `DOT` is [`MADDUBS`], on `vpdpbusd` (see
/// [`run_vnni`]).
#[inline(always)]
unsafe fn block_rows<F: Fmt, C: Codes, const R: usize, const DOT: u8>(
    src: &C,
    b: usize,
    rows: &[Act; R],
    accv: &mut [__m256; R],
) {
    let ones = _mm256_set1_epi16(1);
    // Loops, not closures: intrinsics in a closure lack this function's target features.
    let mut isum = [_mm256_setzero_si256(); R];
    if DOT != MADDUBS && F::Q8 {
        let flip = _mm256_set1_epi8(i8::MIN);
        for v in 0..8 {
            // `w ^ 0x80` is `w + 128` as an unsigned byte.
            let biased = _mm256_xor_si256(src.signed(b, v).1, flip);
            for r in 0..R {
                let a = bcast4(rows[r].qa.add(32 * b + 4 * v));
                isum[r] = dpbusd256::<DOT>(isum[r], biased, a);
            }
        }
    } else if DOT != MADDUBS {
        for v in 0..8 {
            let wv = src.codes(b, v);
            for r in 0..R {
                let a = bcast4(rows[r].qa.add(32 * b + 4 * v));
                isum[r] = dpbusd256::<DOT>(isum[r], wv, a);
            }
        }
    } else if F::Q8 {
        for v in 0..8 {
            let (wabs, wsig) = src.signed(b, v);
            for r in 0..R {
                let a = _mm256_sign_epi8(bcast4(rows[r].qa.add(32 * b + 4 * v)), wsig);
                let p = _mm256_maddubs_epi16(wabs, a);
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, ones));
            }
        }
    } else {
        for h in 0..8 / F::TERMS {
            let mut p16 = [_mm256_setzero_si256(); R];
            for v in h * F::TERMS..(h + 1) * F::TERMS {
                let wv = src.codes(b, v);
                for r in 0..R {
                    let a = bcast4(rows[r].qa.add(32 * b + 4 * v));
                    p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(wv, a));
                }
            }
            for r in 0..R {
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p16[r], ones));
            }
        }
    }
    // The code offset `2^OFFSET` of Q4_0 and Q5_0, or the 128 added to Q8_0's codes for
    // `vpdpbusd`: that many times `sum(qa)` comes off.
    let shift = if DOT != MADDUBS && F::Q8 {
        7
    } else {
        F::OFFSET
    };
    if shift != 0 {
        let shift = _mm_cvtsi32_si128(shift);
        for r in 0..R {
            let o = _mm256_sll_epi32(_mm256_set1_epi32(*rows[r].bsum.add(b)), shift);
            isum[r] = _mm256_sub_epi32(isum[r], o);
        }
    }
    let (d, d2) = src.scales(b);
    for r in 0..R {
        let scale = _mm256_mul_ps(d, _mm256_set1_ps(*rows[r].d.add(b)));
        accv[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum[r]), accv[r]);
        if F::AFFINE {
            accv[r] = _mm256_fmadd_ps(d2, _mm256_set1_ps(*rows[r].sum.add(b)), accv[r]);
        }
    }
}
