//! The AVX2 kernel of the K-quants (256-element super-blocks: Q2_K .. Q6_K).
//!
//! Each record is decoded once into the L1 scratch (codes, the eight rows' sub-block scales
//! and mins), then every row of the tile reads it. A sub-block's products are summed by
//! AVX2's `maddubs` in i16 and scaled by `madd` with the sub-block scales ([`run`]), or,
//! where the CPU has VNNI, summed by `vpdpbusd` in i32 and scaled by one 32-bit multiply
//! ([`run_vnni`]; [`super::legacy::EVEX_VNNI`] for the odd last group of the 512-bit build,
//! [`super::kquant_zmm`]). Both form the same integers (the module bounds in `avx2/mod.rs`
//! keep every partial sum exact), so the f32 epilogue, and every output bit, is the same on
//! each. The decode fills only the scale form its build reads.

use super::legacy::{dpbusd256, MADDUBS};
use super::*;

dot_builds!();

/// The body of both builds (and of the 512-bit build's odd last group), inlined into each;
/// `DOT` says how sub-block sums are formed.
#[inline(always)]
pub(super) unsafe fn run_with<F: Fmt, const DOT: u8>(
    w: &PackedView<'_>,
    act: &QuantizedRows,
    groups: Range<usize>,
    out: OutMatrix,
) {
    let format = w.format();
    let layout = RecordLayout::of(format);
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
        for b in 0..nb {
            let rec = &records[b * record_bytes..][..record_bytes];
            // SAFETY: `rec` is a whole record of this format, which `layout` describes.
            unsafe {
                prefetch_ahead(rec.as_ptr(), record_bytes);
                decode::<F, DOT>(s, format, rec, &layout)
            };
            row_tiles!(tile.len(), |r0, R| {
                let rows: [Act; R] =
                    std::array::from_fn(|i| acts[tile.start + r0 + i].at_block(b, 256));
                let acc: [*mut f32; R] = std::array::from_fn(|i| accs.at(r0 + i));
                // SAFETY: the rows hold super-block `b`; `acc` are this tile's sums.
                unsafe { tile_rows::<F, R, DOT>(s, &rows, acc) }
            });
        }
        // SAFETY: the task owns group `g`'s outputs of every row.
        unsafe { accs.store(out, tile, g) };
    }
    ws.give_back();
}

/// Decodes one record: codes, the eight rows' scales, and their sub-block scales (as the i16
/// pairs `madd` takes, or, for the VNNI builds, as i32 multipliers) and mins.
#[inline(always)]
unsafe fn decode<F: Fmt, const DOT: u8>(
    s: &mut Scratch,
    format: BlockFormat,
    rec: &[u8],
    layout: &RecordLayout,
) {
    s.d[0] = f16x8(rec.as_ptr());
    if let Some(at) = layout.d2 {
        s.d2[0] = f16x8(rec.as_ptr().add(at));
    }
    decode_codes::<F>(rec.as_ptr(), layout, 64, s.codes.as_mut_ptr());
    let subs = 64 / F::GPS;
    let scales = rec[layout.scales..][..GROUP_ROWS * layout.scale_bytes].as_ptr();
    // Lane l of each: row l's scale (or min) of sub-block j, as i16.
    let mut sc = [_mm_setzero_si128(); 16];
    let mut m = [_mm_setzero_si128(); 16];
    for (j, (sc, m)) in sc.iter_mut().zip(&mut m).enumerate().take(subs) {
        (*sc, *m) = sub_scale_lanes(format, scales, j);
    }
    if DOT == MADDUBS {
        for (v, &x) in s.scale_pairs.iter_mut().zip(&sc).take(subs) {
            *v = pairs(x, x);
        }
    } else {
        for (v, &x) in s.scale_words.iter_mut().zip(&sc).take(subs) {
            *v = _mm256_cvtepi16_epi32(x);
        }
    }
    let off = if F::MIN { &m } else { &sc };
    for (v, x) in s
        .off_pairs
        .iter_mut()
        .zip(off.chunks_exact(2))
        .take(subs / 2)
    {
        *v = pairs(x[0], x[1]);
    }
}

/// Lane `l` = `(a[l], b[l])` as two i16 (what `madd` pairs with two block sums).
#[inline(always)]
pub(super) unsafe fn pairs(a: __m128i, b: __m128i) -> __m256i {
    _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b))
}

/// Eight adjacent bytes, widened to i16 lanes (unsigned).
#[inline(always)]
unsafe fn bytes_u16(p: *const u8) -> __m128i {
    _mm_cvtepu8_epi16(_mm_loadl_epi64(p.cast()))
}

/// `v >> n` in each i16 lane (n constant once inlined).
#[inline(always)]
unsafe fn shr16(v: __m128i, n: usize) -> __m128i {
    _mm_srl_epi16(v, _mm_cvtsi32_si128(n as i32))
}

/// Sub-block `j`'s scales and mins of the eight rows, from the record's sub-block-major
/// scale bytes (the layout [`crate::backend::quant::subscales`] documents).
#[inline(always)]
pub(super) unsafe fn sub_scale_lanes(
    format: BlockFormat,
    s: *const u8,
    j: usize,
) -> (__m128i, __m128i) {
    let low4 = _mm_set1_epi16(15);
    let low2 = _mm_set1_epi16(3);
    match format {
        BlockFormat::Q2_K => {
            let v = bytes_u16(s.add(8 * j));
            (_mm_and_si128(v, low4), shr16(v, 4))
        }
        BlockFormat::Q6_K => (
            _mm_cvtepi8_epi16(_mm_loadl_epi64(s.add(8 * j).cast())),
            _mm_setzero_si128(),
        ),
        BlockFormat::Q3_K => {
            let lo = _mm_and_si128(shr16(bytes_u16(s.add(8 * (j % 8))), 4 * (j / 8)), low4);
            let hi = _mm_and_si128(shr16(bytes_u16(s.add(64 + 8 * (j % 4))), 2 * (j / 4)), low2);
            let v = _mm_or_si128(lo, _mm_slli_epi16::<4>(hi));
            (_mm_sub_epi16(v, _mm_set1_epi16(32)), _mm_setzero_si128())
        }
        _ => {
            // Q4_K / Q5_K.
            let lo = bytes_u16(s.add(8 * j));
            let hi = shr16(bytes_u16(s.add(64 + 8 * (j % 4))), 4 * (j / 4));
            let sc = _mm_or_si128(
                _mm_and_si128(lo, low4),
                _mm_slli_epi16::<4>(_mm_and_si128(hi, low2)),
            );
            let m = _mm_or_si128(
                shr16(lo, 4),
                _mm_slli_epi16::<4>(_mm_and_si128(shr16(hi, 2), low2)),
            );
            (sc, m)
        }
    }
}

/// `R` rows times the decoded super-block, added to the sums at `acc`.
#[inline(always)]
unsafe fn tile_rows<F: Fmt, const R: usize, const DOT: u8>(
    s: &Scratch,
    rows: &[Act; R],
    acc: [*mut f32; R],
) {
    let subs = 64 / F::GPS;
    let codes = s.codes.as_ptr();
    let mut isum = [_mm256_setzero_si256(); R];
    if DOT == MADDUBS {
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
    } else {
        for j in 0..subs {
            // The sub-block's dot in i32, then times its scale: the same integer as the
            // pairs of i16 sums `madd` scales in the AVX2 build.
            let mut dot = [_mm256_setzero_si256(); R];
            for v in j * F::GPS..(j + 1) * F::GPS {
                let wv = *codes.add(v);
                for r in 0..R {
                    dot[r] = dpbusd256::<DOT>(dot[r], wv, bcast4(rows[r].qa.add(4 * v)));
                }
            }
            let scale = *s.scale_words.as_ptr().add(j);
            for r in 0..R {
                isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(dot[r], scale));
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
