//! The AVX2 quantized dot: eight output features per register, read from packed records.
//!
//! Design (after llama.cpp's repacked AVX2 GEMV/GEMM, written independently): a record of
//! eight rows is decoded once into an L1 scratch of *group-vectors* (32 unsigned codes: four
//! consecutive elements of each of the eight rows), then every input row of the call reads
//! it: per group-vector, the row's four matching activation codes are broadcast, `maddubs`
//! multiplies and adds pairs (unsigned weight code x signed activation, never saturating:
//! see the bounds below), a few products are summed in i16, and `madd` with the sub-block
//! scale (or with ones) pairs them into i32 lane `l` = output `8 g + l`. Offsets (Q4_0's 8,
//! Q6_K's 32, ...) and K-quant mins come from the activation block sums. So each weight byte
//! is loaded from memory once per call whatever the number of rows, rows are taken four at a
//! time to share each loaded group-vector, and no horizontal sum is ever needed.
//!
//! The i32 sums equal the portable path's exactly (integers), and the float epilogue runs the
//! same f32 operations in the same order ([`super::dot_portable`]), so results are
//! bit-identical. i16 bounds (`|qa| <= 127`): 4-bit codes 8 products of `2 * 15 * 127`
//! (30480), 5-bit 4 of `2 * 31 * 127` (31496), 6-bit 2 of `2 * 63 * 127` (32004), 3-bit 4 of
//! `2 * 7 * 127`; Q8_0 uses `|w| x sign(qa, w)`, at most `2 * 128 * 127` (32512) per pair.

use super::activation::QuantizedRows;
use super::blocks::{self, Epilogue};
use super::linear::OutMatrix;
use super::packed::{RecordLayout, GROUP_ROWS};
use super::{BlockFormat, PackedWeight};
use std::arch::x86_64::*;
use std::ops::Range;

/// One decoded chunk of a group: a K-quant super-block, or up to 8 legacy blocks (4 for Q8_0).
#[repr(C)]
struct Scratch {
    /// Group-vectors of unsigned codes (Q8_0: |w| in 0..32, w in 32..64).
    codes: [__m256i; 64],
    /// K-quants: per sub-block, lane `l` = `(sc_j[l], sc_j[l])` as i16.
    scale_pairs: [__m256i; 16],
    /// K-quants: lane `l` = `(x_{2i}[l], x_{2i+1}[l])`, x = mins (KMin) or scales (KSym).
    off_pairs: [__m256i; 8],
    /// Per block of the chunk: the eight rows' `d` and `m`/`dmin`.
    d: [__m256; 8],
    d2: [__m256; 8],
}

/// Row `r`'s activation blocks from block `b` on.
#[derive(Clone, Copy)]
struct Act {
    qa: *const i8,
    d: *const f32,
    sum: *const f32,
    bsum: *const i16,
    bsum16: *const i16,
    bsum32: *const i16,
}

impl Act {
    /// Row `r` from block `b` (bounds checked once here; the kernels stay inside the row).
    fn at(act: &QuantizedRows, r: usize, b: usize) -> Act {
        let nb = act.blocks();
        let i = r * nb + b;
        let n = act.cols / nb;
        let k = !act.bsum16.is_empty();
        Act {
            qa: act.qs[i * n..].as_ptr(),
            d: act.d[i..].as_ptr(),
            sum: act.sum[i..].as_ptr(),
            bsum: act.bsum[i..].as_ptr(),
            bsum16: if k {
                act.bsum16[i * 16..].as_ptr()
            } else {
                std::ptr::null()
            },
            bsum32: if k {
                act.bsum32[i * 8..].as_ptr()
            } else {
                std::ptr::null()
            },
        }
    }
}

/// Four activation codes broadcast to every lane.
#[inline(always)]
unsafe fn bcast4(p: *const i8) -> __m256i {
    _mm256_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// Decodes the code planes of `rec` into `codes[0..layout.vectors]`.
#[inline(always)]
unsafe fn decode_codes(rec: *const u8, layout: &RecordLayout, codes: &mut [__m256i]) {
    for p in 0..layout.n_planes {
        let (at, w, dest) = layout.planes[p];
        let slots = 8 / w as usize;
        let per_slot = layout.vectors / slots;
        let mask = _mm256_set1_epi8(((1u16 << w) - 1) as u8 as i8);
        let up = _mm_cvtsi32_si128(dest as i32);
        for c in 0..per_slot {
            let v = _mm256_loadu_si256(rec.add(at + 32 * c).cast());
            for s in 0..slots {
                let x = _mm256_srl_epi16(v, _mm_cvtsi32_si128((s as u32 * w) as i32));
                let x = _mm256_sll_epi16(_mm256_and_si256(x, mask), up);
                let g = s * per_slot + c;
                codes[g] = if p == 0 {
                    x
                } else {
                    _mm256_or_si256(codes[g], x)
                };
            }
        }
    }
}

/// The eight f16 at `p` as f32.
#[inline(always)]
unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
}

/// Output features of groups `groups`, every row of `act`, into `out` (no bias).
///
/// # Safety
/// The CPU must support AVX2 and F16C; `act` must hold the blocks `w` reads
/// (Q8 for legacy formats, Q8K for K-quants) of `w.in_features()` columns.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn quant_groups(
    w: &PackedWeight,
    act: &QuantizedRows,
    groups: Range<usize>,
    out: OutMatrix,
) {
    use BlockFormat as F;
    // SAFETY (all calls below): forwarded from this function's contract.
    unsafe {
        match w.format() {
            F::Q4_0 => legacy::<8, false, false>(w, act, groups, out, 8),
            F::Q4_1 => legacy::<8, false, true>(w, act, groups, out, 0),
            F::Q5_0 => legacy::<4, false, false>(w, act, groups, out, 16),
            F::Q5_1 => legacy::<4, false, true>(w, act, groups, out, 0),
            F::Q8_0 => legacy::<1, true, false>(w, act, groups, out, 0),
            F::Q2_K => k_quant::<4, 4, true, 0>(w, act, groups, out),
            F::Q3_K => k_quant::<4, 4, false, 2>(w, act, groups, out),
            F::Q4_K => k_quant::<8, 8, true, 0>(w, act, groups, out),
            F::Q5_K => k_quant::<8, 4, true, 0>(w, act, groups, out),
            F::Q6_K => k_quant::<4, 2, false, 5>(w, act, groups, out),
            F::F32 | F::F16 | F::BF16 => unreachable!("float formats use the float dot"),
        }
    }
}

/// Zeroes the accumulators of group `g` (its eight outputs in every row).
#[inline(always)]
unsafe fn zero_group(out: OutMatrix, rows: usize, g: usize) {
    for r in 0..rows {
        // SAFETY: the caller's task owns these eight outputs of every row.
        unsafe { _mm256_storeu_ps(out.at(r, g * GROUP_ROWS), _mm256_setzero_ps()) };
    }
}

/// Runs `tile::<R>` over the rows four at a time (R = 4, then the 1..3 left over).
macro_rules! row_tiles {
    ($rows:expr, |$r0:ident, $R:ident| $body:expr) => {{
        let rows = $rows;
        let mut $r0 = 0;
        while $r0 + 4 <= rows {
            const $R: usize = 4;
            $body;
            $r0 += 4;
        }
        match rows - $r0 {
            3 => {
                const $R: usize = 3;
                $body
            }
            2 => {
                const $R: usize = 2;
                $body
            }
            1 => {
                const $R: usize = 1;
                $body
            }
            _ => {}
        }
    }};
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn legacy<const TERMS: usize, const Q8: bool, const AFFINE: bool>(
    w: &PackedWeight,
    act: &QuantizedRows,
    groups: Range<usize>,
    out: OutMatrix,
    offset: i32,
) {
    let layout = RecordLayout::of(w.format());
    let chunk = if Q8 { 4 } else { 8 };
    let nb = w.blocks();
    // SAFETY: all-zero bytes are valid SIMD values.
    let mut s: Scratch = unsafe { std::mem::zeroed() };
    for g in groups {
        unsafe { zero_group(out, act.rows, g) };
        for b0 in (0..nb).step_by(chunk) {
            let nbk = chunk.min(nb - b0);
            for k in 0..nbk {
                let rec = w.record(g, b0 + k).as_ptr();
                // SAFETY: `rec` is a whole record of this format, which `layout` describes.
                unsafe {
                    s.d[k] = f16x8(rec);
                    if let Some(at) = layout.d2 {
                        s.d2[k] = f16x8(rec.add(at));
                    }
                    if Q8 {
                        for v in 0..8 {
                            let raw =
                                _mm256_loadu_si256(rec.add(layout.planes[0].0 + 32 * v).cast());
                            s.codes[8 * k + v] = _mm256_abs_epi8(raw);
                            s.codes[32 + 8 * k + v] = raw;
                        }
                    } else {
                        decode_codes(rec, &layout, &mut s.codes[8 * k..8 * k + 8]);
                    }
                }
            }
            row_tiles!(act.rows, |r0, R| {
                let rows: [Act; R] = std::array::from_fn(|i| Act::at(act, r0 + i, b0));
                let acc: [*mut f32; R] = std::array::from_fn(|i| out.at(r0 + i, g * GROUP_ROWS));
                // SAFETY: the rows hold `nbk` blocks from `b0`; the task owns these outputs.
                unsafe { legacy_tile::<R, TERMS, Q8, AFFINE>(&s, nbk, offset, &rows, acc) }
            });
        }
    }
}

#[inline(always)]
unsafe fn legacy_tile<const R: usize, const TERMS: usize, const Q8: bool, const AFFINE: bool>(
    s: &Scratch,
    nbk: usize,
    offset: i32,
    rows: &[Act; R],
    acc: [*mut f32; R],
) {
    let ones = _mm256_set1_epi16(1);
    let mut accv: [__m256; R] = std::array::from_fn(|r| _mm256_loadu_ps(acc[r]));
    for b in 0..nbk {
        let mut isum = [_mm256_setzero_si256(); R];
        if Q8 {
            for v in 0..8 {
                let (wabs, wsig) = (s.codes[8 * b + v], s.codes[32 + 8 * b + v]);
                for r in 0..R {
                    let a = _mm256_sign_epi8(bcast4(rows[r].qa.add(32 * b + 4 * v)), wsig);
                    let p = _mm256_maddubs_epi16(wabs, a);
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, ones));
                }
            }
        } else {
            for h in 0..8 / TERMS {
                let mut p16 = [_mm256_setzero_si256(); R];
                for v in h * TERMS..(h + 1) * TERMS {
                    let wv = s.codes[8 * b + v];
                    for r in 0..R {
                        let a = bcast4(rows[r].qa.add(32 * b + 4 * v));
                        p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(wv, a));
                    }
                }
                for r in 0..R {
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p16[r], ones));
                }
            }
            if offset != 0 {
                for r in 0..R {
                    let o = _mm256_set1_epi32(offset * *rows[r].bsum.add(b) as i32);
                    isum[r] = _mm256_sub_epi32(isum[r], o);
                }
            }
        }
        for r in 0..R {
            let scale = _mm256_mul_ps(s.d[b], _mm256_set1_ps(*rows[r].d.add(b)));
            let mut t = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(isum[r]));
            if AFFINE {
                t = _mm256_add_ps(
                    t,
                    _mm256_mul_ps(s.d2[b], _mm256_set1_ps(*rows[r].sum.add(b))),
                );
            }
            accv[r] = _mm256_add_ps(accv[r], t);
        }
    }
    for r in 0..R {
        _mm256_storeu_ps(acc[r], accv[r]);
    }
}

/// K-quants: `GPS` group-vectors per sub-block (4: 16 elements, 8: 32), `TERMS` products summed
/// in i16, `MIN` for formats with mins, else the code offset is `2^SHIFT`.
#[target_feature(enable = "avx2,f16c")]
unsafe fn k_quant<const GPS: usize, const TERMS: usize, const MIN: bool, const SHIFT: i32>(
    w: &PackedWeight,
    act: &QuantizedRows,
    groups: Range<usize>,
    out: OutMatrix,
) {
    let format = w.format();
    let layout = RecordLayout::of(format);
    let subs = 64 / GPS;
    // SAFETY: all-zero bytes are valid SIMD values.
    let mut s: Scratch = unsafe { std::mem::zeroed() };
    for g in groups {
        unsafe { zero_group(out, act.rows, g) };
        for b in 0..w.blocks() {
            let rec = w.record(g, b);
            // SAFETY: `rec` is a whole record of this format, which `layout` describes.
            unsafe {
                s.d[0] = f16x8(rec.as_ptr());
                if let Some(at) = layout.d2 {
                    s.d2[0] = f16x8(rec.as_ptr().add(at));
                }
                decode_codes(rec.as_ptr(), &layout, &mut s.codes);
            }
            let mut sc_pairs = [[0i16; 16]; 16];
            let mut off_pairs = [[0i16; 16]; 8];
            let (mut sc, mut m) = ([0i8; 16], [0u8; 16]);
            for l in 0..GROUP_ROWS {
                let raw = &rec[layout.scales + l * layout.scale_bytes..][..layout.scale_bytes];
                blocks::sub_scales(format, raw, &mut sc, &mut m);
                for j in 0..subs {
                    sc_pairs[j][2 * l] = sc[j] as i16;
                    sc_pairs[j][2 * l + 1] = sc[j] as i16;
                }
                for i in 0..subs / 2 {
                    let (x, y) = if MIN {
                        (m[2 * i] as i16, m[2 * i + 1] as i16)
                    } else {
                        (sc[2 * i] as i16, sc[2 * i + 1] as i16)
                    };
                    off_pairs[i][2 * l] = x;
                    off_pairs[i][2 * l + 1] = y;
                }
            }
            // SAFETY: each array is 32 bytes, one unaligned load each.
            unsafe {
                for j in 0..subs {
                    s.scale_pairs[j] = _mm256_loadu_si256(sc_pairs[j].as_ptr().cast());
                }
                for i in 0..subs / 2 {
                    s.off_pairs[i] = _mm256_loadu_si256(off_pairs[i].as_ptr().cast());
                }
            }
            row_tiles!(act.rows, |r0, R| {
                let rows: [Act; R] = std::array::from_fn(|i| Act::at(act, r0 + i, b));
                let acc: [*mut f32; R] = std::array::from_fn(|i| out.at(r0 + i, g * GROUP_ROWS));
                // SAFETY: the rows hold super-block `b`; the task owns these outputs.
                unsafe { k_tile::<R, GPS, TERMS, MIN, SHIFT>(&s, &rows, acc) }
            });
        }
    }
    debug_assert!(matches!(
        blocks::spec(format).map(|s| s.epilogue),
        Some(Epilogue::KMin | Epilogue::KSym)
    ));
}

#[inline(always)]
unsafe fn k_tile<
    const R: usize,
    const GPS: usize,
    const TERMS: usize,
    const MIN: bool,
    const SHIFT: i32,
>(
    s: &Scratch,
    rows: &[Act; R],
    acc: [*mut f32; R],
) {
    let subs = 64 / GPS;
    let mut isum = [_mm256_setzero_si256(); R];
    for j in 0..subs {
        for h in 0..GPS / TERMS {
            let mut p16 = [_mm256_setzero_si256(); R];
            for v in j * GPS + h * TERMS..j * GPS + (h + 1) * TERMS {
                let wv = s.codes[v];
                for r in 0..R {
                    let a = bcast4(rows[r].qa.add(4 * v));
                    p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(wv, a));
                }
            }
            for r in 0..R {
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p16[r], s.scale_pairs[j]));
            }
        }
    }
    for r in 0..R {
        // Pairs of block sums, low i16 first: 16-element sums for 16-element sub-blocks.
        let sums = if GPS == 4 {
            rows[r].bsum16
        } else {
            rows[r].bsum32
        };
        let mut corr = _mm256_setzero_si256();
        for i in 0..subs / 2 {
            let pair = _mm256_set1_epi32(sums.add(2 * i).cast::<i32>().read_unaligned());
            corr = _mm256_add_epi32(corr, _mm256_madd_epi16(s.off_pairs[i], pair));
        }
        let da = _mm256_set1_ps(*rows[r].d);
        let t = if MIN {
            let t = _mm256_mul_ps(_mm256_mul_ps(s.d[0], da), _mm256_cvtepi32_ps(isum[r]));
            _mm256_sub_ps(
                t,
                _mm256_mul_ps(_mm256_mul_ps(s.d2[0], da), _mm256_cvtepi32_ps(corr)),
            )
        } else {
            let isum = _mm256_sub_epi32(isum[r], _mm256_slli_epi32::<SHIFT>(corr));
            _mm256_mul_ps(_mm256_mul_ps(s.d[0], da), _mm256_cvtepi32_ps(isum))
        };
        _mm256_storeu_ps(acc[r], _mm256_add_ps(_mm256_loadu_ps(acc[r]), t));
    }
}
