//! The arithmetic of the CPU paged attention (see the parent module for the definition each
//! function implements): plain loops over fixed lanes that the compiler vectorises, the same
//! operations in the same order whatever instruction set they are compiled for. The AVX-512
//! build writes the hot three out in intrinsics ([`super::zmm`]), lane for lane the same.

use super::KEYS;
use half::bf16;

/// Output elements of one query whose weighted sums are kept in registers (four AVX2
/// vectors, two AVX-512 ones).
pub(super) const VALUE_CHUNK: usize = 32;
/// Lanes of the softmax total.
pub(super) const LANES: usize = 8;

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
/// `(sum over d, in order, of q_i[d] * k_j[d]) * scale`, each product fused into the sum (a
/// multiply-add rounds once), the same whatever `Q` is.
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
                *a = x.mul_add(k, *a);
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
    // The exponentials as a loop of their own, which the compiler vectorises at the widest
    // registers; computed inside the lane-wise total below, they went four lanes at a time
    // and took a third of a verify step's attention.
    for x in row.iter_mut() {
        *x = exp_nonpositive(*x - max);
    }
    let mut lanes = [0f32; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += x;
        }
    }
    for (l, &x) in lanes.iter_mut().zip(chunks.remainder()) {
        *l += x;
    }
    ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
}

/// `acc[d] += w_j * values[j][d]` for each `j` in order, for `Q` queries at once: query `q`'s
/// sums are `acc[q * hd ..][..hd]` and its weights `weights[q]` (all of one length), and the
/// values are `[weights.len(), hd]`. [`VALUE_CHUNK`] elements of every query at a time, so
/// their sums stay in registers across the keys and each value load serves every query: one
/// query alone leaves each sum waiting on the add before it. A query's sums are the same
/// whatever `Q` is.
#[inline(always)]
pub(super) fn add_weighted<const Q: usize>(acc: &mut [f32], weights: [&[f32]; Q], values: &[f32]) {
    let hd = acc.len() / Q;
    let n = weights[0].len().min(KEYS);
    let mut w = [[0f32; KEYS]; Q];
    for (w, src) in w.iter_mut().zip(&weights) {
        w[..n].copy_from_slice(&src[..n]);
    }
    let full = hd - hd % VALUE_CHUNK;
    for c in (0..full).step_by(VALUE_CHUNK) {
        let mut sums = [[0f32; VALUE_CHUNK]; Q];
        for (q, sum) in sums.iter_mut().enumerate() {
            sum.copy_from_slice(&acc[q * hd + c..][..VALUE_CHUNK]);
        }
        for (j, row) in values.chunks_exact(hd).take(n).enumerate() {
            let v: &[f32; VALUE_CHUNK] = row[c..c + VALUE_CHUNK].try_into().expect("a chunk");
            for q in 0..Q {
                let wq = w[q][j & (KEYS - 1)];
                for (a, &x) in sums[q].iter_mut().zip(v) {
                    *a = wq.mul_add(x, *a);
                }
            }
        }
        for (q, sum) in sums.iter().enumerate() {
            acc[q * hd + c..][..VALUE_CHUNK].copy_from_slice(sum);
        }
    }
    if full == hd {
        return;
    }
    for (q, w) in w.iter().enumerate() {
        let rest = &mut acc[q * hd + full..(q + 1) * hd];
        for (&w, row) in w[..n].iter().zip(values.chunks_exact(hd)) {
            for (a, &v) in rest.iter_mut().zip(&row[full..]) {
                *a = w.mul_add(v, *a);
            }
        }
    }
}

/// The constants of [`exp_nonpositive`], shared with its 16-lane build (`super::zmm`):
/// `1.5 * 2^23` (adding it rounds to an integer), below which `x` is clamped, `ln 2` split in
/// a high and a low part (Cody-Waite), and the polynomial's coefficients, highest first.
pub(super) const EXP_MAGIC: f32 = 12_582_912.0;
pub(super) const EXP_FLOOR: f32 = -87.0;
pub(super) const EXP_LN2_HI: f32 = 0.693_359_4;
pub(super) const EXP_LN2_LO: f32 = -2.121_944_4e-4;
pub(super) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `exp(x)` for `x <= 0` (a score minus its row's maximum), within 2 ulp; below -87 the
/// result is clamped to `exp(-87)`, far under any total it joins. Written out (Cephes' `expf`
/// polynomial, Cody-Waite reduction) rather than calling `f32::exp` so that it vectorises
/// and gives the same bits on every platform and instruction set.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    // Written as a comparison so that a NaN passes through.
    let x = if x < EXP_FLOOR { EXP_FLOOR } else { x };
    let t = x * std::f32::consts::LOG2_E + EXP_MAGIC;
    let n = t - EXP_MAGIC;
    let k = t.to_bits() as i32 - EXP_MAGIC.to_bits() as i32;
    let r = x - n * EXP_LN2_HI - n * EXP_LN2_LO;
    let p = EXP_POLY[1..].iter().fold(EXP_POLY[0], |p, &c| p * r + c);
    let y = p * r * r + r + 1.0;
    y * f32::from_bits(((k + 127) << 23) as u32)
}
