//! The K-quants' dot on AVX-512 VNNI: two eight-row groups side by side in one 512-bit
//! register, as [`super::zmm`] does for the legacy formats.
//!
//! Group `g`'s eight rows fill the low half of each register and group `g + 1`'s the high
//! half (their records follow each other in memory). A super-block's group-vectors are
//! decoded in registers as they are used, never through the L1 scratch of the 256-bit build
//! ([`super::kquant`]), and each meets a tile of up to [`TILE`] rows: per sub-block,
//! `vpdpbusd` sums the codes times the row's activation codes in i32 (broadcast by the
//! instruction itself, as in [`super::zmm`]), one 32-bit multiply scales the sum by the
//! sub-block scale, and the mins (or the code offset) come off through the activation block
//! sums after the last sub-block.
//!
//! Invariants: the i32 sums are the same integers as the 256-bit build's (each partial sum is
//! exact: see the bounds in `avx2/mod.rs`), and each output lane runs the same f32
//! operations in the same order, so results are bit-identical to the portable path. A
//! task's odd last group goes to the 256-bit build.

use super::kquant::{pairs, sub_scale_lanes};
use super::legacy::EVEX_VNNI;
use super::zmm::{dpbusd_broadcast, f16x16, pair_tiles, plane_vector_of};
use super::*;

/// The most rows one tile holds in registers: per row its f32 sums, its i32 sums and its
/// sub-block's dot (24 of the 32 registers at eight rows, with the codes, the scales and the
/// offsets beside them).
const TILE: usize = 8;

/// Output features of groups `groups`, every row of `act` (Q8K blocks), into `out`.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512 F/BW/VL and AVX-512 VNNI; `w` is of
/// format `F` (a K-quant).
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
        TILE,
        [1, 2, 3, 4, 5, 6, 7, 8],
        pair,
        super::kquant::run_with::<F, EVEX_VNNI>
    )
}

/// Groups `g` and `g + 1` for rows `first..first + R` (`rows`, from their first super-block),
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
    let format = w.format();
    let nb = w.blocks();
    let (lo, hi) = (w.group_records(g), w.group_records(g + 1));
    let record_bytes = F::RECORD_BYTES;
    // Once a pair of groups: every record pointer below rests on it.
    assert!(
        lo.len() == record_bytes * nb && hi.len() == lo.len(),
        "a group's records are not {nb} of {record_bytes} bytes"
    );
    let subs = 64 / F::GPS;
    let mut accv = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let rec = [lo.as_ptr(), hi.as_ptr()].map(|p| p.add(b * record_bytes));
        prefetch_ahead(rec[0], record_bytes);
        prefetch_ahead(rec[1], record_bytes);
        let act: [Act; R] = std::array::from_fn(|r| rows[r].at_block(b, 256));
        let scales = rec.map(|p| p.add(layout.scales));
        // Per sub-block of both groups: its scale (as i32) and its offset (the min, or the
        // scale where the code offset comes off), kept as i16 for the pairs `madd` takes.
        let mut off = [[_mm_setzero_si128(); 2]; 16];
        let mut isum = [_mm512_setzero_si512(); R];
        for (j, off) in off.iter_mut().enumerate().take(subs) {
            let (sc_lo, m_lo) = sub_scale_lanes(format, scales[0], j);
            let (sc_hi, m_hi) = sub_scale_lanes(format, scales[1], j);
            *off = if F::MIN { [m_lo, m_hi] } else { [sc_lo, sc_hi] };
            let scale = _mm512_cvtepi16_epi32(_mm256_set_m128i(sc_hi, sc_lo));
            let mut dot = [_mm512_setzero_si512(); R];
            for v in j * F::GPS..(j + 1) * F::GPS {
                let x = plane_vector_of(&rec, layout.planes[0].0, F::W1, 0, 64, v);
                let codes = if F::W2 == 0 {
                    x
                } else {
                    let y = plane_vector_of(&rec, layout.planes[1].0, F::W2, F::D2, 64, v);
                    _mm512_or_si512(x, y)
                };
                for r in 0..R {
                    dot[r] = dpbusd_broadcast::<0>(dot[r], codes, act[r].qa.add(4 * v));
                }
            }
            for r in 0..R {
                isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(dot[r], scale));
            }
        }
        // Lane `l` = `(x_{2i}[l], x_{2i+1}[l])`, x the offsets: what `madd` pairs with two
        // block sums, as the 256-bit build's `off_pairs`.
        let off_pairs: [__m512i; 8] = std::array::from_fn(|i| {
            if 2 * i + 1 >= subs {
                return _mm512_setzero_si512();
            }
            let low = pairs(off[2 * i][0], off[2 * i + 1][0]);
            let high = pairs(off[2 * i][1], off[2 * i + 1][1]);
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high)
        });
        let d = f16x16(rec[0], rec[1]);
        let d2 = match layout.d2 {
            Some(at) => f16x16(rec[0].add(at), rec[1].add(at)),
            None => _mm512_setzero_ps(),
        };
        let shift = _mm_cvtsi32_si128(F::SHIFT);
        for r in 0..R {
            // Pairs of block sums, low i16 first: 16-element sums for 16-element sub-blocks.
            let sums = if F::GPS == 4 {
                act[r].bsum16
            } else {
                act[r].bsum32
            };
            let mut corr = _mm512_setzero_si512();
            for (i, &pair) in off_pairs.iter().enumerate().take(subs / 2) {
                let s = _mm512_set1_epi32(sums.add(2 * i).cast::<i32>().read_unaligned());
                corr = _mm512_add_epi32(corr, _mm512_madd_epi16(pair, s));
            }
            let da = _mm512_set1_ps(*act[r].d);
            let isum = if F::MIN {
                isum[r]
            } else {
                _mm512_sub_epi32(isum[r], _mm512_sll_epi32(corr, shift))
            };
            accv[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(isum), accv[r]);
            if F::MIN {
                // fnmadd: -(dmin * da) * imin + a, rounded once, as the portable `mul_add`.
                accv[r] =
                    _mm512_fnmadd_ps(_mm512_mul_ps(d2, da), _mm512_cvtepi32_ps(corr), accv[r]);
            }
        }
    }
    for (r, &sum) in accv.iter().enumerate() {
        // SAFETY: the caller owns these sixteen outputs of row `first + r`.
        _mm512_storeu_ps(out.at(first + r, g * GROUP_ROWS), sum);
    }
}
