//! Float weights (F32, F16, BF16) times f32 input rows: the dot every path computes the same way.
//!
//! Output `(r, o)` is one fixed sequence of f32 operations that depends only on
//! `in_features`: 16 running sums (element `i` goes to sum `i % 16`, `acc = fma(w, x, acc)`,
//! a fused multiply-add rounded once), added as a fixed tree, then the leftover elements in
//! order, each also by a fused multiply-add. The AVX2 path keeps the 16 sums in two
//! registers and widens F16 with F16C and BF16 with a shift (both exact), so it matches the
//! portable path bit for bit; each chunk of a weight row is loaded once for up to four input
//! rows.

use super::linear::OutMatrix;
use super::{BlockFormat, PackedView};
use half::f16;
use std::ops::Range;

const LANES: usize = 16;
/// Bytes of f32 input rows a long call keeps in L1 at a time.
#[cfg(target_arch = "x86_64")]
const X_BLOCK_BYTES: usize = 24 << 10;

/// Element `i` of a float weight row, widened exactly.
#[inline(always)]
fn widen(format: BlockFormat, row: &[u8], i: usize) -> f32 {
    match format {
        BlockFormat::F32 => {
            f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]])
        }
        BlockFormat::F16 => f16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32(),
        _ => f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16),
    }
}

/// The sum of the 16 running sums, as a tree.
#[inline(always)]
fn reduce(acc: &[f32; LANES]) -> f32 {
    let h: [f32; 8] = std::array::from_fn(|l| acc[l] + acc[l + 8]);
    let q: [f32; 4] = std::array::from_fn(|l| h[l] + h[l + 4]);
    (q[0] + q[2]) + (q[1] + q[3])
}

/// The dot of a widened weight row with one input row.
#[inline]
fn dot(w: &[f32], x: &[f32]) -> f32 {
    let full = w.len() / LANES * LANES;
    let mut acc = [0f32; LANES];
    for (wc, xc) in w[..full]
        .chunks_exact(LANES)
        .zip(x[..full].chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[l] = wc[l].mul_add(xc[l], acc[l]);
        }
    }
    let mut s = reduce(&acc);
    for (w, x) in w[full..].iter().zip(&x[full..]) {
        s = w.mul_add(*x, s);
    }
    s
}

/// Output features `outputs` of all `rows` rows of `x`, into `out` (no bias).
pub(crate) fn float_outputs(
    w: &PackedView<'_>,
    x: &[f32],
    rows: usize,
    outputs: Range<usize>,
    out: OutMatrix,
) {
    let n = w.in_features();
    let row_bytes = n * w.format().block_bytes();
    let mut wide = vec![0f32; n];
    for o in outputs {
        let row = &w.bytes()[o * row_bytes..][..row_bytes];
        for (i, v) in wide.iter_mut().enumerate() {
            *v = widen(w.format(), row, i);
        }
        for r in 0..rows {
            // SAFETY: this task owns feature `o` of every row.
            unsafe { *out.at(r, o) = dot(&wide, &x[r * n..(r + 1) * n]) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::float_outputs_avx2;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Eight weights from `p`, widened.
    #[inline(always)]
    unsafe fn load8(format: BlockFormat, p: *const u8) -> __m256 {
        match format {
            BlockFormat::F32 => _mm256_loadu_ps(p.cast()),
            BlockFormat::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p.cast()),
            ))),
        }
    }

    #[inline(always)]
    unsafe fn tile<const R: usize>(format: BlockFormat, wrow: &[u8], x: [&[f32]; R]) -> [f32; R] {
        let n = x[0].len();
        let full = n / LANES * LANES;
        let es = format.block_bytes();
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let mut c = 0;
        while c < full {
            // SAFETY: c + 16 <= n elements of the weight row and of every input row.
            unsafe {
                let w0 = load8(format, wrow.as_ptr().add(c * es));
                let w1 = load8(format, wrow.as_ptr().add((c + 8) * es));
                for r in 0..R {
                    let x0 = _mm256_loadu_ps(x[r].as_ptr().add(c));
                    let x1 = _mm256_loadu_ps(x[r].as_ptr().add(c + 8));
                    acc[r][0] = _mm256_fmadd_ps(w0, x0, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(w1, x1, acc[r][1]);
                }
            }
            c += LANES;
        }
        // Loops, not closures: intrinsics in a closure lack the caller's target features.
        let mut lanes = [[0f32; LANES]; R];
        for r in 0..R {
            // SAFETY: 16 floats, two stores of 8.
            unsafe {
                _mm256_storeu_ps(lanes[r].as_mut_ptr(), acc[r][0]);
                _mm256_storeu_ps(lanes[r].as_mut_ptr().add(8), acc[r][1]);
            }
        }
        let mut sums = [0f32; R];
        for r in 0..R {
            let mut s = reduce(&lanes[r]);
            for (i, xi) in x[r].iter().enumerate().skip(full) {
                s = widen(format, wrow, i).mul_add(*xi, s);
            }
            sums[r] = s;
        }
        sums
    }

    /// [`float_outputs`] with AVX2, FMA and F16C.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn float_outputs_avx2(
        w: &PackedView<'_>,
        x: &[f32],
        rows: usize,
        outputs: Range<usize>,
        out: OutMatrix,
    ) {
        let n = w.in_features();
        let format = w.format();
        let row_bytes = n * format.block_bytes();
        let xr = |r: usize| &x[r * n..(r + 1) * n];
        // Long inputs go a block of rows at a time, the block small enough to stay in L1
        // while the task's weight rows pass (each row then serves the whole block).
        let block = (X_BLOCK_BYTES / (4 * n.max(1))).max(1).next_multiple_of(4);
        for r0 in (0..rows).step_by(block) {
            let r1 = rows.min(r0 + block);
            for o in outputs.clone() {
                let wrow = &w.bytes()[o * row_bytes..][..row_bytes];
                let mut r = r0;
                // SAFETY (each tile): AVX2, FMA and F16C are enabled here; this task owns
                // feature `o`.
                unsafe {
                    while r + 4 <= r1 {
                        let v = tile::<4>(format, wrow, [xr(r), xr(r + 1), xr(r + 2), xr(r + 3)]);
                        (0..4).for_each(|i| *out.at(r + i, o) = v[i]);
                        r += 4;
                    }
                    match r1 - r {
                        3 => {
                            let v = tile::<3>(format, wrow, [xr(r), xr(r + 1), xr(r + 2)]);
                            (0..3).for_each(|i| *out.at(r + i, o) = v[i]);
                        }
                        2 => {
                            let v = tile::<2>(format, wrow, [xr(r), xr(r + 1)]);
                            (0..2).for_each(|i| *out.at(r + i, o) = v[i]);
                        }
                        1 => *out.at(r, o) = tile::<1>(format, wrow, [xr(r)])[0],
                        _ => {}
                    }
                }
            }
        }
    }
}
