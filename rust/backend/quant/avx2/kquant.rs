//! The AVX2 kernel of the K-quants (256-element super-blocks: Q2_K .. Q6_K).

use super::*;
use crate::backend::quant::blocks;

/// Output features of groups `groups`, every row of `act` (Q8K blocks), into `out`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` is of format `F`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run<F: Fmt>(
    w: &PackedWeight,
    act: &QuantizedRows,
    groups: Range<usize>,
    out: OutMatrix,
) {
    let format = w.format();
    let layout = RecordLayout::of(format);
    let nb = w.blocks();
    let mut s = Scratch::new();
    let mut accs = Accumulators::new(act.rows);
    let acts = Act::rows(act);
    for (tile, g) in tiles(act.rows, groups) {
        accs.zero();
        let records = w.group_records(g);
        let record_bytes = records.len() / nb;
        for b in 0..nb {
            let rec = &records[b * record_bytes..][..record_bytes];
            // SAFETY: `rec` is a whole record of this format, which `layout` describes.
            unsafe { decode::<F>(&mut s, format, rec, &layout) };
            row_tiles!(tile.len(), |r0, R| {
                let rows: [Act; R] =
                    std::array::from_fn(|i| acts[tile.start + r0 + i].at_block(b, 256));
                let acc: [*mut f32; R] = std::array::from_fn(|i| accs.at(r0 + i));
                // SAFETY: the rows hold super-block `b`; `acc` are this tile's sums.
                unsafe { tile_rows::<F, R>(&s, &rows, acc) }
            });
        }
        // SAFETY: the task owns group `g`'s outputs of every row.
        unsafe { accs.store(out, tile, g) };
    }
}

/// Decodes one record: codes, the eight rows' scales, and their sub-block scales and mins as
/// the i16 pairs `madd` takes.
#[inline(always)]
unsafe fn decode<F: Fmt>(s: &mut Scratch, format: BlockFormat, rec: &[u8], layout: &RecordLayout) {
    s.d[0] = f16x8(rec.as_ptr());
    if let Some(at) = layout.d2 {
        s.d2[0] = f16x8(rec.as_ptr().add(at));
    }
    decode_codes::<F>(rec.as_ptr(), layout, 64, s.codes.as_mut_ptr());
    let subs = 64 / F::GPS;
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
            let (x, y) = if F::MIN {
                (m[2 * i] as i16, m[2 * i + 1] as i16)
            } else {
                (sc[2 * i] as i16, sc[2 * i + 1] as i16)
            };
            off_pairs[i][2 * l] = x;
            off_pairs[i][2 * l + 1] = y;
        }
    }
    for (v, pairs) in s.scale_pairs.iter_mut().zip(&sc_pairs).take(subs) {
        *v = _mm256_loadu_si256(pairs.as_ptr().cast());
    }
    for (v, pairs) in s.off_pairs.iter_mut().zip(&off_pairs).take(subs / 2) {
        *v = _mm256_loadu_si256(pairs.as_ptr().cast());
    }
}

/// `R` rows times the decoded super-block, added to the sums at `acc`.
#[inline(always)]
unsafe fn tile_rows<F: Fmt, const R: usize>(s: &Scratch, rows: &[Act; R], acc: [*mut f32; R]) {
    let subs = 64 / F::GPS;
    let codes = s.codes.as_ptr();
    let mut isum = [_mm256_setzero_si256(); R];
    for j in 0..subs {
        for h in 0..F::GPS / F::TERMS {
            let mut p16 = [_mm256_setzero_si256(); R];
            for v in j * F::GPS + h * F::TERMS..j * F::GPS + (h + 1) * F::TERMS {
                let wv = *codes.add(v);
                for r in 0..R {
                    let a = bcast4(rows[r].qa.add(4 * v));
                    p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(wv, a));
                }
            }
            let scale = *s.scale_pairs.as_ptr().add(j);
            for r in 0..R {
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p16[r], scale));
            }
        }
    }
    let shift = _mm_cvtsi32_si128(F::SHIFT);
    for r in 0..R {
        // Pairs of block sums, low i16 first: 16-element sums for 16-element sub-blocks.
        let sums = if F::GPS == 4 {
            rows[r].bsum16
        } else {
            rows[r].bsum32
        };
        let mut corr = _mm256_setzero_si256();
        for i in 0..subs / 2 {
            let pair = _mm256_set1_epi32(sums.add(2 * i).cast::<i32>().read_unaligned());
            corr = _mm256_add_epi32(corr, _mm256_madd_epi16(*s.off_pairs.as_ptr().add(i), pair));
        }
        let da = _mm256_set1_ps(*rows[r].d);
        let isum = if F::MIN {
            isum[r]
        } else {
            _mm256_sub_epi32(isum[r], _mm256_sll_epi32(corr, shift))
        };
        let mut a = _mm256_loadu_ps(acc[r]);
        a = _mm256_fmadd_ps(_mm256_mul_ps(s.d[0], da), _mm256_cvtepi32_ps(isum), a);
        if F::MIN {
            // fnmadd: -(dmin * da) * imin + a, rounded once, as the portable `mul_add`.
            a = _mm256_fnmadd_ps(_mm256_mul_ps(s.d2[0], da), _mm256_cvtepi32_ps(corr), a);
        }
        _mm256_storeu_ps(acc[r], a);
    }
}
