//! A block of key rows widened from BF16 into the transposed f32 layout of the score pass,
//! `[head_dim, KEYS]`, with AVX2 8x8 transposes or AVX-512 16x16 ones. The scalar path
//! stores one element at a time, and that scatter was most of a decode row's attention once
//! its loads were prefetched; the 8x8 transposes were still two fifths of it (context 160),
//! all shuffles, and the 16x16 one takes five eighths of their shuffles an element.
//! Widening is exact, so every path writes the same bits.

use super::KEYS;
use crate::backend::quant::{Avx2Token, Avx512Token};
use half::bf16;
use std::arch::x86_64::*;

/// Writes `keys[d * KEYS + j] = rows[j][d]` widened to f32, for every `d < head_dim`, with
/// AVX2, which the proof says this CPU runs. Every row holds `head_dim` elements, `head_dim`
/// is a multiple of 8 and `keys` holds `head_dim * KEYS` elements (checked by slicing, so a
/// wrong length panics rather than reads or writes out of bounds).
#[inline(always)]
pub(super) fn keys_avx2(_: Avx2Token, rows: &[&[bf16]; KEYS], keys: &mut [f32]) {
    // SAFETY: the proof says this CPU runs AVX2.
    unsafe { keys_avx2_build(rows, keys) }
}

/// [`keys_avx2`]'s body, compiled with AVX2.
#[target_feature(enable = "avx2")]
unsafe fn keys_avx2_build(rows: &[&[bf16]; KEYS], keys: &mut [f32]) {
    let hd = keys.len() / KEYS;
    for group in 0..KEYS / 8 {
        let rows = &rows[group * 8..group * 8 + 8];
        for d0 in (0..hd).step_by(8) {
            let mut v = [_mm256_setzero_ps(); 8];
            for (v, row) in v.iter_mut().zip(rows) {
                let src = &row[d0..d0 + 8];
                let half = _mm_loadu_si128(src.as_ptr().cast());
                // BF16 is the high half of an f32's bits.
                *v = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(half)));
            }
            let t = transpose8(v);
            for (k, t) in t.into_iter().enumerate() {
                let dst = &mut keys[(d0 + k) * KEYS + group * 8..][..8];
                _mm256_storeu_ps(dst.as_mut_ptr(), t);
            }
        }
    }
}

/// The 8x8 transpose: lane `r` of output `k` is lane `k` of input `r`.
#[target_feature(enable = "avx2")]
unsafe fn transpose8(v: [__m256; 8]) -> [__m256; 8] {
    let t0 = _mm256_unpacklo_ps(v[0], v[1]);
    let t1 = _mm256_unpackhi_ps(v[0], v[1]);
    let t2 = _mm256_unpacklo_ps(v[2], v[3]);
    let t3 = _mm256_unpackhi_ps(v[2], v[3]);
    let t4 = _mm256_unpacklo_ps(v[4], v[5]);
    let t5 = _mm256_unpackhi_ps(v[4], v[5]);
    let t6 = _mm256_unpacklo_ps(v[6], v[7]);
    let t7 = _mm256_unpackhi_ps(v[6], v[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(s0, s4),
        _mm256_permute2f128_ps::<0x20>(s1, s5),
        _mm256_permute2f128_ps::<0x20>(s2, s6),
        _mm256_permute2f128_ps::<0x20>(s3, s7),
        _mm256_permute2f128_ps::<0x31>(s0, s4),
        _mm256_permute2f128_ps::<0x31>(s1, s5),
        _mm256_permute2f128_ps::<0x31>(s2, s6),
        _mm256_permute2f128_ps::<0x31>(s3, s7),
    ]
}

/// [`keys_avx2`] with 16x16 transposes of 512-bit registers, which the proof says this CPU
/// runs. Every row holds `head_dim` elements, `head_dim` is a multiple of 16 and `keys` holds
/// `head_dim * KEYS` elements (checked by slicing).
#[inline(always)]
pub(super) fn keys_avx512(_: Avx512Token, rows: &[&[bf16]; KEYS], keys: &mut [f32]) {
    // SAFETY: the proof says this CPU runs AVX-512 F and AVX2.
    unsafe { keys_avx512_build(rows, keys) }
}

/// [`keys_avx512`]'s body, compiled with AVX-512 F.
#[target_feature(enable = "avx2,avx512f")]
unsafe fn keys_avx512_build(rows: &[&[bf16]; KEYS], keys: &mut [f32]) {
    const { assert!(KEYS == 16) };
    let hd = keys.len() / KEYS;
    for d0 in (0..hd).step_by(16) {
        let v: [__m512; 16] = std::array::from_fn(|j| {
            let src = &rows[j][d0..d0 + 16];
            // SAFETY: sixteen elements.
            let half = unsafe { _mm256_loadu_si256(src.as_ptr().cast()) };
            // BF16 is the high half of an f32's bits.
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(half)))
        });
        for (k, t) in transpose16(v).into_iter().enumerate() {
            let dst = &mut keys[(d0 + k) * KEYS..][..KEYS];
            // SAFETY: sixteen floats.
            unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), t) };
        }
    }
}

/// The 16x16 transpose: lane `r` of output `k` is lane `k` of input `r`.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    // Within each 128-bit lane: pairs of rows interleaved, then four rows' columns.
    let t: [__m512; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    // `u[4 g + j]`: in 128-bit lane `l`, column `4 l + j` of rows `4 g .. 4 g + 4`.
    let u: [__m512; 16] = std::array::from_fn(|i| {
        let (g, j) = (i / 4, i % 4);
        let (a, b) = (t[4 * g + j / 2], t[4 * g + 2 + j / 2]);
        if j % 2 == 0 {
            _mm512_shuffle_ps::<0x44>(a, b)
        } else {
            _mm512_shuffle_ps::<0xEE>(a, b)
        }
    });
    // Then the 128-bit lanes: column `4 l + j` gathered from the four row groups.
    let mut out = [_mm512_setzero_ps(); 16];
    for j in 0..4 {
        let even = (
            _mm512_shuffle_f32x4::<0x88>(u[j], u[4 + j]),
            _mm512_shuffle_f32x4::<0x88>(u[8 + j], u[12 + j]),
        );
        let odd = (
            _mm512_shuffle_f32x4::<0xDD>(u[j], u[4 + j]),
            _mm512_shuffle_f32x4::<0xDD>(u[8 + j], u[12 + j]),
        );
        out[j] = _mm512_shuffle_f32x4::<0x88>(even.0, even.1);
        out[8 + j] = _mm512_shuffle_f32x4::<0xDD>(even.0, even.1);
        out[4 + j] = _mm512_shuffle_f32x4::<0x88>(odd.0, odd.1);
        out[12 + j] = _mm512_shuffle_f32x4::<0xDD>(odd.0, odd.1);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::quant::{Isa, SupportedIsa};

    /// Both transposes write `keys[d * KEYS + j] = rows[j][d]`, widened, for every element.
    #[test]
    fn transposes_put_every_element_in_its_place() {
        for hd in [16, 64, 128] {
            // Every element its own BF16 value (consecutive bit patterns from 1.0, all finite
            // and normal), so any misplaced lane fails: integers such as `1000 j + d` would
            // round together in BF16's eight bits of precision.
            let data: Vec<Vec<bf16>> = (0..KEYS)
                .map(|j| {
                    (0..hd)
                        .map(|d| bf16::from_bits(0x3f80 + (j * hd + d) as u16))
                        .collect()
                })
                .collect();
            let rows: [&[bf16]; KEYS] = std::array::from_fn(|j| &data[j][..]);
            let want: Vec<f32> = (0..hd * KEYS)
                .map(|i| data[i % KEYS][i / KEYS].to_f32())
                .collect();
            let mut got = vec![0f32; hd * KEYS];
            let level = SupportedIsa::at_most(Isa::Amx);
            if let Some(proof) = level.avx2() {
                keys_avx2(proof, &rows, &mut got);
                assert_eq!(got, want, "AVX2, head size {hd}");
            }
            if let Some(proof) = level.avx512() {
                got.fill(0.0);
                keys_avx512(proof, &rows, &mut got);
                assert_eq!(got, want, "AVX-512, head size {hd}");
            }
        }
    }
}
