//! The portable quantized dot: the definition every other path reproduces bit for bit.
//!
//! Output `(r, o)` starts at `acc = 0.0` and takes one step per block `b`, in block order,
//! where `fma(a, b, c)` is `a * b + c` rounded once (IEEE fused multiply-add) and every other
//! operation is one IEEE f32 operation:
//! - legacy formats: `isum = sum_e q[e] * qa[e]` (exact i32), then
//!   `acc = fma(d * da, f32(isum), acc)`, and for Affine formats also `acc = fma(m, sa, acc)`
//!   (`da`, `sa = da * f32(sum qa)` from the row's Q8 block);
//! - K-quants: `isum = sum_j sc[j] * sum_{e in j} q[e] * qa[e]` (exact i32), then
//!   `acc = fma(d * da, f32(isum), acc)`, and for KMin formats also
//!   `acc = fma(-(dmin * da), f32(imin), acc)` with `imin = sum_j m[j] * bsum_j` (exact i32).
//!
//! Integer sums are exact whatever their order, so any path that forms the same integers
//! and then runs these float operations in this order gets the same bits. Nothing here
//! depends on the other rows of the call. (Without hardware FMA `f32::mul_add` is a slow
//! software routine; every CPU the AVX2 path runs on has FMA.)

use super::activation::QuantizedRows;
use super::blocks::{spec, Epilogue, IntBlock, Spec};
use super::linear::OutMatrix;
use super::PackedView;
use std::ops::Range;

/// `sum a[i] * b[i]` in exact i32 arithmetic.
#[inline(always)]
fn idot(a: &[i8], b: &[i8]) -> i32 {
    a.iter().zip(b).map(|(&x, &y)| x as i32 * y as i32).sum()
}

/// Adds block `blk`'s contribution to row `r`'s sum `acc` (block `b` of the row).
#[inline]
pub(crate) fn accumulate(
    spec: &Spec,
    blk: &IntBlock,
    act: &QuantizedRows,
    r: usize,
    b: usize,
    acc: f32,
) -> f32 {
    let i = r * act.blocks() + b;
    let n = act.cols / act.blocks();
    let qa = &act.qs[i * n..(i + 1) * n];
    let da = act.d[i];
    match spec.epilogue {
        Epilogue::Sym | Epilogue::Affine => {
            let acc = (blk.d * da).mul_add(idot(&blk.q[..n], qa) as f32, acc);
            if spec.epilogue == Epilogue::Affine {
                blk.d2.mul_add(act.sum[i], acc)
            } else {
                acc
            }
        }
        Epilogue::KMin | Epilogue::KSym => {
            let isum: i32 = blk.q[..n]
                .chunks_exact(spec.sub_len)
                .zip(qa.chunks_exact(spec.sub_len))
                .zip(&blk.sc)
                .map(|((w, a), &sc)| sc as i32 * idot(w, a))
                .sum();
            let acc = (blk.d * da).mul_add(isum as f32, acc);
            if spec.epilogue == Epilogue::KSym {
                return acc;
            }
            let bsums = if spec.sub_len == 16 {
                &act.bsum16[i * 16..(i + 1) * 16]
            } else {
                &act.bsum32[i * 8..(i + 1) * 8]
            };
            let imin: i32 = bsums
                .iter()
                .zip(&blk.m)
                .map(|(&s, &m)| s as i32 * m as i32)
                .sum();
            (-(blk.d2 * da)).mul_add(imin as f32, acc)
        }
    }
}

/// Output features `outputs` of every row of `act`, written to `out` (no bias).
pub(crate) fn quant_outputs(
    w: &PackedView<'_>,
    act: &QuantizedRows,
    outputs: Range<usize>,
    out: OutMatrix,
) {
    let spec = spec(w.format()).expect("a quantized format");
    let mut acc = vec![0f32; act.rows];
    for o in outputs {
        acc.fill(0.0);
        for b in 0..w.blocks() {
            let blk = w.int_block(o, b);
            for (r, a) in acc.iter_mut().enumerate() {
                *a = accumulate(&spec, &blk, act, r, b, *a);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            // SAFETY: `out` covers `act.rows` rows of every output feature, and this task owns
            // feature `o` (tasks cover disjoint feature ranges).
            unsafe { *out.at(r, o) = *a };
        }
    }
}
