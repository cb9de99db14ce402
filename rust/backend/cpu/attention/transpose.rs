//! A block of key rows widened from BF16 into the transposed f32 layout of the score pass,
//! `[head_dim, KEYS]`, with AVX2 8x8 transposes. The scalar path stores one element at a
//! time, and that scatter was most of a decode row's attention once its loads were
//! prefetched. Widening is exact, so both paths write the same bits.

use super::KEYS;
use half::bf16;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Writes `keys[d * KEYS + j] = rows[j][d]` widened to f32, for every `d < head_dim`.
///
/// # Safety
/// The CPU must support AVX2. Every row holds `head_dim` elements, `head_dim` is a multiple
/// of 8 and `keys` holds `head_dim * KEYS` elements (checked by slicing, so a wrong length
/// panics rather than writes out of bounds).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn keys_avx2(rows: &[&[bf16]; KEYS], keys: &mut [f32]) {
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
#[cfg(target_arch = "x86_64")]
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

/// The portable build has no transposes: the caller's scalar path runs.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn keys_avx2(_rows: &[&[bf16]; KEYS], _keys: &mut [f32]) {
    unreachable!("AVX2 is only reported on x86-64")
}
