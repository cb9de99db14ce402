//! The AVX2 kernel of the legacy formats (32-element blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).

use super::*;

/// Output features of groups `groups`, every row of `act` (Q8 blocks), into `out`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` is of format `F`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run<F: Fmt>(
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
    for (tile, g) in tiles(act.rows, groups) {
        accs.zero();
        let records = w.group_records(g);
        let record_bytes = records.len() / nb;
        for b0 in (0..nb).step_by(chunk) {
            let nbk = chunk.min(nb - b0);
            for k in 0..nbk {
                let rec = records[(b0 + k) * record_bytes..][..record_bytes].as_ptr();
                // SAFETY: `rec` is a whole record of this format, which `layout` describes.
                unsafe { decode::<F>(s, k, rec, &layout) };
            }
            row_tiles!(tile.len(), |r0, R| {
                let rows: [Act; R] =
                    std::array::from_fn(|i| acts[tile.start + r0 + i].at_block(b0, 32));
                let acc: [*mut f32; R] = std::array::from_fn(|i| accs.at(r0 + i));
                // SAFETY: the rows hold `nbk` blocks from `b0`; `acc` are this tile's sums.
                unsafe { tile_rows::<F, R>(s, nbk, &rows, acc) }
            });
        }
        // SAFETY: the task owns group `g`'s outputs of every row.
        unsafe { accs.store(out, tile, g) };
    }
    ws.give_back();
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

/// `R` rows times the `nbk` decoded blocks of the scratch, added to the sums at `acc`.
#[inline(always)]
unsafe fn tile_rows<F: Fmt, const R: usize>(
    s: &Scratch,
    nbk: usize,
    rows: &[Act; R],
    acc: [*mut f32; R],
) {
    let ones = _mm256_set1_epi16(1);
    let offset = _mm_cvtsi32_si128(F::OFFSET);
    // A loop, not a closure: intrinsics in a closure lack this function's target features.
    let mut accv = [_mm256_setzero_ps(); R];
    for r in 0..R {
        accv[r] = _mm256_loadu_ps(acc[r]);
    }
    for b in 0..nbk {
        let codes = s.codes.as_ptr().add(8 * b);
        let mut isum = [_mm256_setzero_si256(); R];
        if F::Q8 {
            for v in 0..8 {
                let (wabs, wsig) = (*codes.add(v), *codes.add(32 + v));
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
                    let wv = *codes.add(v);
                    for r in 0..R {
                        let a = bcast4(rows[r].qa.add(32 * b + 4 * v));
                        p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(wv, a));
                    }
                }
                for r in 0..R {
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p16[r], ones));
                }
            }
            if F::OFFSET != 0 {
                for r in 0..R {
                    let o = _mm256_sll_epi32(_mm256_set1_epi32(*rows[r].bsum.add(b)), offset);
                    isum[r] = _mm256_sub_epi32(isum[r], o);
                }
            }
        }
        let (d, d2) = (*s.d.as_ptr().add(b), *s.d2.as_ptr().add(b));
        for r in 0..R {
            let scale = _mm256_mul_ps(d, _mm256_set1_ps(*rows[r].d.add(b)));
            accv[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum[r]), accv[r]);
            if F::AFFINE {
                accv[r] = _mm256_fmadd_ps(d2, _mm256_set1_ps(*rows[r].sum.add(b)), accv[r]);
            }
        }
    }
    for r in 0..R {
        _mm256_storeu_ps(acc[r], accv[r]);
    }
}
