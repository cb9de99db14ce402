//! The arithmetic of the CPU paged attention (see the parent module for the definition each
//! function implements): plain loops over fixed lanes that the compiler vectorises, the same
//! operations in the same order whatever instruction set they are compiled for.

use super::KEYS;
use half::bf16;

/// Output elements whose weighted sums are kept in registers (four AVX2 vectors).
const VALUE_CHUNK: usize = 32;
/// Lanes of the softmax total.
const LANES: usize = 8;

/// BF16 to f32 exactly (the high half of the f32's bits), written so that it vectorises.
#[inline(always)]
pub(in crate::backend::cpu) fn to_f32(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

#[inline(always)]
pub(in crate::backend::cpu) fn widen(src: &[bf16], dst: &mut [f32]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = to_f32(x);
    }
}

/// The scores of `Q` queries against one block of transposed keys: lane `j` of query `i` is
/// `(sum over d, in order, of q_i[d] * k_j[d]) * scale`, the same whatever `Q` is.
#[inline(always)]
pub(super) fn score_block<const Q: usize>(
    qs: [&[f32]; Q],
    keys: &[f32],
    scale: f32,
) -> [[f32; KEYS]; Q] {
    let mut acc = [[0f32; KEYS]; Q];
    for (d, k) in keys.chunks_exact(KEYS).enumerate() {
        for (a, q) in acc.iter_mut().zip(&qs) {
            let x = q[d];
            for (a, &k) in a.iter_mut().zip(k) {
                *a += x * k;
            }
        }
    }
    for a in acc.iter_mut() {
        for v in a.iter_mut() {
            *v *= scale;
        }
    }
    acc
}

/// Replaces each score by `exp(score - max)` and returns their total (eight lanes by
/// position, summed pairwise).
#[inline(always)]
pub(super) fn softmax_weights(row: &mut [f32]) -> f32 {
    let mut top = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (t, &x) in top.iter_mut().zip(c) {
            *t = t.max(x);
        }
    }
    for (t, &x) in top.iter_mut().zip(chunks.remainder()) {
        *t = t.max(x);
    }
    let max = top.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut lanes = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (l, x) in lanes.iter_mut().zip(c.iter_mut()) {
            *x = exp_nonpositive(*x - max);
            *l += *x;
        }
    }
    for (l, x) in lanes.iter_mut().zip(chunks.into_remainder()) {
        *x = exp_nonpositive(*x - max);
        *l += *x;
    }
    ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
}

/// `acc[d] += w_j * values[j][d]` for each `j` in order; [`VALUE_CHUNK`] elements at a time,
/// so that their sums stay in registers across the keys.
#[inline(always)]
pub(super) fn add_weighted(acc: &mut [f32], weights: &[f32], values: &[f32]) {
    let hd = acc.len();
    let mut chunks = acc.chunks_exact_mut(VALUE_CHUNK);
    for (c, chunk) in (&mut chunks).enumerate() {
        let mut sums = [0f32; VALUE_CHUNK];
        sums.copy_from_slice(chunk);
        for (j, &w) in weights.iter().enumerate() {
            let at = j * hd + c * VALUE_CHUNK;
            for (a, &v) in sums.iter_mut().zip(&values[at..at + VALUE_CHUNK]) {
                *a += w * v;
            }
        }
        chunk.copy_from_slice(&sums);
    }
    let rest = chunks.into_remainder();
    let first = hd - rest.len();
    for (j, &w) in weights.iter().enumerate() {
        for (a, &v) in rest.iter_mut().zip(&values[j * hd + first..(j + 1) * hd]) {
            *a += w * v;
        }
    }
}

/// `exp(x)` for `x <= 0` (a score minus its row's maximum), within 2 ulp; below -87 the
/// result is clamped to `exp(-87)`, far under any total it joins. Written out (Cephes' `expf`
/// polynomial, Cody-Waite reduction) rather than calling `f32::exp` so that it vectorises
/// and gives the same bits on every platform and instruction set.
#[inline(always)]
pub(in crate::backend::cpu) fn exp_nonpositive(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Written as a comparison so that a NaN passes through.
    let x = if x < -87.0 { -87.0 } else { x };
    let t = x * std::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    let k = t.to_bits() as i32 - MAGIC.to_bits() as i32;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    y * f32::from_bits(((k + 127) << 23) as u32)
}
