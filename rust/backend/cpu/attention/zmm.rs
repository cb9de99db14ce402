//! The AVX-512 build of the attention's three hot loops, written in intrinsics: the scores
//! of a key block, the softmax weights of a query, and the weighted values.
//!
//! Each runs, lane by lane, the same operations in the same order as its plain loop in
//! [`super::math`] (products fused where those fuse them, apart where they are apart), so
//! its results are those loops' bit for bit; the tests below hold each to that. They exist
//! because the compiler, given the plain loops, keeps too few running sums in registers
//! (scores and weighted values) or leaves the exponentials and their reductions half as
//! wide as the registers (softmax).
//!
//! Every function here runs AVX-512 F instructions, and so takes the proof that this CPU has
//! them ([`Avx512Token`]); the attention's AVX-512 build is the only caller, and inlines them.
//! Each checks the lengths its unchecked accesses rely on once, at its entry.

use super::math::{EXP_FLOOR, EXP_LN2_HI, EXP_LN2_LO, EXP_MAGIC, EXP_POLY, LANES, VALUE_CHUNK};
use super::KEYS;
use crate::backend::quant::Avx512Token;
use std::arch::x86_64::*;

/// [`super::math::score_block`] in AVX-512 registers, one a query: the same operations lane
/// by lane, so the same scores. Written out because the compiler keeps no more than four
/// queries' sums of the plain loop in registers, and four chains of multiply-adds, each
/// waiting on the one before, fill half of the two vector units (`cargo bench --bench
/// cpu_attention`: eight queries of the plain loop ran 3x slower than four).
///
/// Panics if a query is shorter than the keys' head size (`keys.len() / KEYS`).
#[inline(always)]
pub(super) fn score_block<const Q: usize>(
    _: Avx512Token,
    qs: [&[f32]; Q],
    keys: &[f32],
    scale: f32,
) -> [[f32; KEYS]; Q] {
    const { assert!(KEYS == 16) };
    let hd = keys.len() / KEYS;
    // Once a key block, outside its loops; the unchecked reads below rest on it.
    assert!(
        qs.iter().all(|q| q.len() >= hd),
        "a query shorter than the head size"
    );
    // SAFETY: the proof says this CPU runs AVX-512 F. For every `d < hd`, the key load reads
    // `keys[d * KEYS..][..16]`, and `d * KEYS + 16 <= hd * KEYS <= keys.len()`; the query
    // read is `q[d]`, and `d < hd <= q.len()` (asserted above). Each store fills one `o` of
    // 16 lanes.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); Q];
        for d in 0..hd {
            let k = _mm512_loadu_ps(keys.as_ptr().add(d * KEYS));
            for (a, q) in acc.iter_mut().zip(&qs) {
                let x = _mm512_set1_ps(*q.get_unchecked(d));
                *a = _mm512_fmadd_ps(x, k, *a);
            }
        }
        let scale = _mm512_set1_ps(scale);
        let mut out = [[0f32; KEYS]; Q];
        for (o, &a) in out.iter_mut().zip(&acc) {
            _mm512_storeu_ps(o.as_mut_ptr(), _mm512_mul_ps(a, scale));
        }
        out
    }
}

/// [`super::math::softmax_weights`] sixteen lanes at a time: the maximum (the same value
/// whatever the order: `vmaxps` with the running maximum second skips a NaN score as
/// `f32::max` does), the exponentials ([`exp16`]), and the total kept in the same eight
/// lanes, each adding its elements in order (the low then the high half of every sixteen).
/// A row's last elements are a masked register, not a scalar loop (a verify's rows are
/// rarely a multiple of sixteen long, and eight scalar exponentials cost as much as the
/// rest of a 160-score row). Twice as fast as the plain loops on 152-160 scores.
#[inline(always)]
pub(super) fn softmax_weights(_: Avx512Token, row: &mut [f32]) -> f32 {
    const { assert!(LANES == 8) };
    let len = row.len();
    let p = row.as_mut_ptr();
    // Sixteen elements from `c` (fewer at the end: the rest of the lanes masked off).
    let mask = |c: usize| ((1u32 << (len - c).min(16)) - 1) as __mmask16;
    // SAFETY: the proof says this CPU runs AVX-512 F. Every load and store is at `p + c`
    // for a `c < len` (so the address is inside `row`), masked to the `len - c` elements
    // left from there. Masked-off lanes add +0.0 to the total, which leaves a lane's sum (of
    // weights, never negative) as it was.
    unsafe {
        let lowest = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut top = lowest;
        for c in (0..len).step_by(16) {
            top = _mm512_max_ps(_mm512_mask_loadu_ps(lowest, mask(c), p.add(c)), top);
        }
        let m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        let mut lanes = _mm256_setzero_ps();
        for c in (0..len).step_by(16) {
            let k = mask(c);
            let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p.add(c)), m));
            _mm512_mask_storeu_ps(p.add(c), k, e);
            let e = _mm512_maskz_mov_ps(k, e);
            lanes = _mm256_add_ps(lanes, _mm512_castps512_ps256(e));
            let high = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(e));
            lanes = _mm256_add_ps(lanes, _mm256_castpd_ps(high));
        }
        let mut l = [0f32; LANES];
        _mm256_storeu_ps(l.as_mut_ptr(), lanes);
        ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
    }
}

/// [`super::math::exp_nonpositive`] of sixteen lanes: the same operations, none fused.
///
/// # Safety
/// The CPU must support AVX-512 F.
#[inline(always)]
unsafe fn exp16(x: __m512) -> __m512 {
    let floor = _mm512_set1_ps(EXP_FLOOR);
    // `x < floor` is false for a NaN, which passes through as in the scalar build.
    let x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, floor), x, floor);
    let magic = _mm512_set1_ps(EXP_MAGIC);
    let t = _mm512_add_ps(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        magic,
    );
    let n = _mm512_sub_ps(t, magic);
    let k = _mm512_sub_epi32(
        _mm512_castps_si512(t),
        _mm512_set1_epi32(EXP_MAGIC.to_bits() as i32),
    );
    let r = _mm512_sub_ps(
        _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(EXP_LN2_HI))),
        _mm512_mul_ps(n, _mm512_set1_ps(EXP_LN2_LO)),
    );
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
    }
    let y = _mm512_add_ps(
        _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r),
        _mm512_set1_ps(1.0),
    );
    let two_k = _mm512_slli_epi32::<23>(_mm512_add_epi32(k, _mm512_set1_epi32(127)));
    _mm512_mul_ps(y, _mm512_castsi512_ps(two_k))
}

/// [`super::math::add_weighted`] for up to eight queries, each query's sums of a
/// [`VALUE_CHUNK`] of output elements in two registers (sixteen running sums: eight queries
/// keep both vector units busy where the plain loop's four left them waiting): `acc[d] =
/// fma(w_j, v_j[d], acc[d])` for each `j` in order, the same chain for every element
/// whatever the chunk it falls in (a short last chunk is masked).
///
/// The lengths are as for the plain loop (`acc` holds `Q` rows of `hd`, `values` at least `n`
/// rows of `hd`, every weight row `n`, `n <= KEYS`); panics if `values` or a weight row is
/// shorter.
#[inline(always)]
pub(super) fn add_weighted<const Q: usize>(
    _: Avx512Token,
    acc: &mut [f32],
    weights: [&[f32]; Q],
    values: &[f32],
) {
    const { assert!(VALUE_CHUNK == 32) };
    let hd = acc.len() / Q;
    let n = weights[0].len().min(KEYS);
    assert!(weights.iter().all(|w| w.len() >= n) && values.len() >= n * hd);
    let a = acc.as_mut_ptr();
    for c in (0..hd).step_by(VALUE_CHUNK) {
        let left = hd - c;
        let mask = |half: usize| -> __mmask16 {
            let lanes = left.saturating_sub(16 * half).min(16);
            ((1u32 << lanes) - 1) as __mmask16
        };
        let (m0, m1) = (mask(0), mask(1));
        // The two halves of query `q`'s chunk. The high half of a last chunk of 16 elements
        // or fewer starts past the row, for the last query past `acc` itself: its address is
        // computed with `wrapping_add` (an `add` past the end of an allocation is undefined
        // behaviour even unread), and its mask is empty, so nothing there is read or written.
        let halves = |q: usize| (a.wrapping_add(q * hd + c), a.wrapping_add(q * hd + c + 16));
        // SAFETY (every block below): the proof says this CPU runs AVX-512 F. Each load and
        // store is masked to the `left` elements of a row from `c`: of query `q`'s row in
        // `acc` (`q < Q`, `Q * hd <= acc.len()`), of row `j < n` in `values` (`n * hd <=
        // values.len()`, asserted above).
        let mut sums = [[unsafe { _mm512_setzero_ps() }; 2]; Q];
        for (q, s) in sums.iter_mut().enumerate() {
            let (lo, hi) = halves(q);
            unsafe {
                s[0] = _mm512_maskz_loadu_ps(m0, lo);
                s[1] = _mm512_maskz_loadu_ps(m1, hi);
            }
        }
        for j in 0..n {
            let row = values.as_ptr().wrapping_add(j * hd + c);
            let (v0, v1) = unsafe {
                (
                    _mm512_maskz_loadu_ps(m0, row),
                    _mm512_maskz_loadu_ps(m1, row.wrapping_add(16)),
                )
            };
            for (s, w) in sums.iter_mut().zip(&weights) {
                // `j < n <= w.len()` (asserted above).
                unsafe {
                    let w = _mm512_set1_ps(*w.get_unchecked(j));
                    s[0] = _mm512_fmadd_ps(w, v0, s[0]);
                    s[1] = _mm512_fmadd_ps(w, v1, s[1]);
                }
            }
        }
        for (q, s) in sums.iter().enumerate() {
            let (lo, hi) = halves(q);
            unsafe {
                _mm512_mask_storeu_ps(lo, m0, s[0]);
                _mm512_mask_storeu_ps(hi, m1, s[1]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::math;
    use super::*;
    use crate::backend::const_count::with_count;
    use crate::backend::quant::{Isa, SupportedIsa};
    use rand::{Rng, SeedableRng};

    fn avx512() -> Option<Avx512Token> {
        let proof = SupportedIsa::at_most(Isa::Amx).avx512();
        if proof.is_none() {
            eprintln!("no AVX-512 here: nothing to compare");
        }
        proof
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The functions compiled as the AVX-512 attention build compiles them.
    #[target_feature(enable = "avx2,fma,avx512f")]
    fn scores<const Q: usize>(
        proof: Avx512Token,
        qs: [&[f32]; Q],
        keys: &[f32],
    ) -> [[f32; KEYS]; Q] {
        score_block::<Q>(proof, qs, keys, 0.125)
    }
    #[target_feature(enable = "avx2,fma,avx512f")]
    fn softmax(proof: Avx512Token, row: &mut [f32]) -> f32 {
        softmax_weights(proof, row)
    }
    #[target_feature(enable = "avx2,fma,avx512f")]
    fn weighted<const Q: usize>(
        proof: Avx512Token,
        acc: &mut [f32],
        w: [&[f32]; Q],
        values: &[f32],
    ) {
        add_weighted::<Q>(proof, acc, w, values)
    }

    #[test]
    fn scores_equal_the_plain_loop_bit_for_bit() {
        let Some(proof) = avx512() else { return };
        // The attention's outputs are BF16, which hides a last-bit difference in a score;
        // here the f32 scores themselves are compared, so an unfused or reordered chain fails.
        let mut r = rand::rngs::SmallRng::seed_from_u64(5);
        let sizes: &[usize] = if cfg!(miri) {
            &[1, 17]
        } else {
            &[1, 17, 64, 128]
        };
        for &hd in sizes {
            let keys: Vec<f32> = (0..hd * KEYS).map(|_| r.random_range(-3.0..3.0)).collect();
            let queries: Vec<Vec<f32>> = (0..8)
                .map(|_| (0..hd).map(|_| r.random_range(-2.0..2.0)).collect())
                .collect();
            for q in 1..=8 {
                with_count!(q, "queries", |N| {
                    let qs: [&[f32]; N] = std::array::from_fn(|i| &queries[i][..]);
                    let want = math::score_block::<N>(qs, &keys, 0.125);
                    // SAFETY: the proof says this CPU runs what the build enables.
                    let got = unsafe { scores::<N>(proof, qs, &keys) };
                    for (g, w) in got.iter().zip(&want) {
                        assert_eq!(bits(g), bits(w), "head size {hd}, {q} queries");
                    }
                });
            }
        }
    }

    #[test]
    fn softmax_weights_equal_the_plain_loops_bit_for_bit() {
        let Some(proof) = avx512() else { return };
        let mut r = rand::rngs::SmallRng::seed_from_u64(11);
        for len in (1..=70).chain([159, 160, 161, 170, 400, 513]) {
            for spread in [0.5f32, 8.0, 200.0] {
                let mut row: Vec<f32> = (0..len).map(|_| r.random_range(-spread..spread)).collect();
                if len > 20 {
                    // A masked-out key, a score far below the clamp, and a tie for the maximum.
                    row[3] = f32::NEG_INFINITY;
                    row[7] = -1e30;
                    row[len - 1] = row.iter().copied().fold(f32::MIN, f32::max);
                }
                let (mut want, mut got) = (row.clone(), row.clone());
                let total = math::softmax_weights(&mut want);
                // SAFETY: the proof says this CPU runs what the build enables.
                let got_total = unsafe { softmax(proof, &mut got) };
                assert_eq!(bits(&got), bits(&want), "weights of {len} scores");
                assert_eq!(
                    got_total.to_bits(),
                    total.to_bits(),
                    "total of {len} scores"
                );
            }
        }
    }

    #[test]
    fn weighted_values_equal_the_plain_loop_bit_for_bit() {
        let Some(proof) = avx512() else { return };
        let mut r = rand::rngs::SmallRng::seed_from_u64(13);
        // Under Miri (scripts/unsafe-check.sh), fewer shapes, still with short last chunks.
        let (sizes, counts): (&[usize], &[usize]) = if cfg!(miri) {
            (&[1, 17, 40], &[1, KEYS])
        } else {
            (&[1, 15, 16, 17, 40, 64, 96, 128], &[1, 5, KEYS])
        };
        for &hd in sizes {
            for &n in counts {
                let values: Vec<f32> = (0..n * hd).map(|_| r.random_range(-4.0..4.0)).collect();
                let weights: Vec<Vec<f32>> = (0..8)
                    .map(|_| (0..n).map(|_| r.random_range(0.0..1.0)).collect())
                    .collect();
                let start: Vec<f32> = (0..8 * hd).map(|_| r.random_range(-1.0..1.0)).collect();
                for q in (1..=8).filter(|&q| !cfg!(miri) || q % 3 == 2) {
                    with_count!(q, "queries", |N| {
                        let w: [&[f32]; N] = std::array::from_fn(|i| &weights[i][..]);
                        let mut want = start[..N * hd].to_vec();
                        math::add_weighted::<N>(&mut want, w, &values);
                        let mut got = start[..N * hd].to_vec();
                        // SAFETY: the proof says this CPU runs what the build enables.
                        unsafe { weighted::<N>(proof, &mut got, w, &values) };
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "head size {hd}, {n} keys, {q} queries"
                        );
                    });
                }
            }
        }
    }

    /// The unchecked query reads rest on a check that stays in release builds: a query
    /// shorter than the keys' head size panics instead of reading past its end.
    #[test]
    fn a_short_query_panics_in_every_build() {
        let Some(proof) = avx512() else { return };
        let keys = vec![1.0f32; 64 * KEYS];
        let (long, short) = (vec![1.0f32; 64], vec![1.0f32; 63]);
        let caught = std::panic::catch_unwind(|| {
            // SAFETY: the proof says this CPU runs what the build enables.
            unsafe { scores::<2>(proof, [&long, &short], &keys) }
        });
        let payload = caught.expect_err("a query of 63 against keys of 64 ran");
        let message = payload.downcast_ref::<&str>().copied().unwrap_or_default();
        assert_eq!(message, "a query shorter than the head size");
    }
}
