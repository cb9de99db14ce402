//! The small per-row ops of a CPU forward: RMSNorm, the element-wise binary ops (add, SiLU
//! and sigmoid gating) and RoPE, written to be cheap at one decode row and to use the whole
//! pool on a prefill chunk.
//!
//! Their definitions (all arithmetic in f32, each result rounded to BF16 to nearest even):
//! - RMSNorm: `ss` is the sum of `x[i]^2` kept in [`LANES`] lanes (lane `i % LANES`, each in
//!   order) summed pairwise at the end; `out[i] = (x[i] * (1 / sqrt(ss / dim + eps))) * w[i]`;
//! - `sigmoid(g) = n / (1 + e)` with `e = exp(-|g|)` (by the attention's
//!   [`exp_nonpositive`], whose argument is never positive here) and `n = 1` for `g >= 0`,
//!   `n = e` otherwise, which never overflows; SiLU-mul is `(g * sigmoid(g)) * u`, sigmoid-mul
//!   `v * sigmoid(g)`, add `a + b`;
//! - RoPE: `(x_i cos - x_j sin, x_j cos + x_i sin)` with `(sin, cos)` of `position * inv_freq`
//!   from the standard library, kept per position by the backend (see `rope_angles`).
//!
//! Invariants:
//! - An element's arithmetic depends only on its own row's inputs, never on how the rows are
//!   batched or split into pool tasks, so a row's result is bitwise the same in any batch.
//! - The AVX2 and AVX-512 paths are the same source compiled with those features enabled
//!   (plain loops over fixed blocks that the compiler vectorises: lane-wise operations, no
//!   fused multiply-add, no reassociation), so they match the portable path bit for bit.
//! - Nothing is allocated per call; a call is split over the pool only when it has a couple of
//!   microseconds of work per task to give, which pays for a dispatch many times over.
//! - An output that is also an input (`out == x` for RMSNorm, `out == a` or `b` for the
//!   binary ops, RoPE in place) is read a block at a time into scratch before the block is
//!   written, so aliasing changes nothing.

use super::attention::math::{exp_nonpositive, to_f32, widen};
use super::rope_angles::{angle, RopeAngles, RopeCache};
use super::shared_out::SharedOut;
use crate::backend::kernels::{ElementwiseOp, RopeStyle};
use crate::backend::quant::bf16_round::narrow;
use crate::backend::quant::{KernelPool, QuantError};
use crate::backend::simd_builds::{dispatch, simd_builds};
use half::bf16;

/// Elements widened to f32 scratch at a time (eight AVX2 vectors).
const BLOCK: usize = 64;
/// Lanes of RMSNorm's sum of squares (two AVX2 vectors).
pub(super) const LANES: usize = 16;
/// Least elements for one pool task, by op: 1.5 to 4 microseconds of work each (measured with
/// `cargo bench --bench cpu_small_ops`: about 0.25 ns an element for add, 0.3 for RMSNorm
/// and for RoPE, 0.7 for the gated ops on one core), against a dispatch round trip under a
/// microsecond (`cargo bench --bench kernel_pool`).
const ADD_TASK: usize = 16384;
const NORM_TASK: usize = 8192;
const GATE_TASK: usize = 2048;
const ROPE_TASK: usize = 8192;
/// The largest of them, for tests that need every op's call split into several tasks.
#[cfg(test)]
pub(super) const LARGEST_TASK: usize = ADD_TASK;

/// An input of an op: its own rows, or the output's (the op runs in place).
#[derive(Clone, Copy)]
pub(super) enum Input<'a> {
    Apart(&'a [bf16]),
    Out,
}

impl<'a> Input<'a> {
    /// The same input from element `first` on.
    fn skip(self, first: usize) -> Input<'a> {
        match self {
            Input::Apart(x) => Input::Apart(&x[first..]),
            Input::Out => Input::Out,
        }
    }

    /// Elements `start..start + n`, from the output's current contents when in place.
    #[inline(always)]
    fn at<'b>(&'b self, out: &'b [bf16], start: usize, n: usize) -> &'b [bf16] {
        match self {
            Input::Apart(x) => &x[start..start + n],
            Input::Out => &out[start..start + n],
        }
    }
}

/// Runs `f(out_part, first_unit, units)` over `units` units of `unit_len` elements of `out`,
/// on the calling thread alone or split into pool tasks of at least `task_elements`.
fn split_units(
    pool: &KernelPool,
    out: &mut [bf16],
    (units, unit_len): (usize, usize),
    task_elements: usize,
    f: &(dyn Fn(&mut [bf16], usize, usize) + Sync),
) -> Result<(), QuantError> {
    let tasks = (units * unit_len / task_elements).clamp(1, units.max(1));
    if tasks == 1 {
        f(out, 0, units);
        return Ok(());
    }
    let per = units.div_ceil(tasks);
    let shared = SharedOut::new(out);
    pool.run(units.div_ceil(per), &|t| {
        let (first, end) = (t * per, ((t + 1) * per).min(units));
        // SAFETY: task `t` alone takes units `first..end`.
        let part = unsafe { shared.slice(first * unit_len, (end - first) * unit_len) };
        f(part, first, end - first);
    })
}

/// Sum of squares in [`LANES`] lanes, summed pairwise.
#[inline(always)]
fn sum_squares(row: &[bf16]) -> f32 {
    // Whole arrays, so that the lanes stay in vector registers.
    let add = |lanes: &mut [f32; LANES], c: &[bf16; LANES]| {
        for (l, &x) in lanes.iter_mut().zip(c) {
            let v = to_f32(x);
            *l += v * v;
        }
    };
    let mut lanes = [0f32; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        add(&mut lanes, c.try_into().expect("a whole chunk"));
    }
    let mut rest = [bf16::ZERO; LANES];
    rest[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
    add(&mut lanes, &rest);
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    lanes[0]
}

#[inline(always)]
fn rms_norm_part(out: &mut [bf16], x: Input, w: &[bf16], dim: usize, eps: f32) {
    let (mut v, mut g) = ([0f32; BLOCK], [0f32; BLOCK]);
    for r in 0..out.len() / dim.max(1) {
        let base = r * dim;
        let inv = 1.0 / (sum_squares(x.at(out, base, dim)) / dim as f32 + eps).sqrt();
        for start in (0..dim).step_by(BLOCK) {
            let n = BLOCK.min(dim - start);
            widen(x.at(out, base + start, n), &mut v[..n]);
            widen(&w[start..start + n], &mut g[..n]);
            for (v, &g) in v.iter_mut().zip(&g) {
                *v = *v * inv * g;
            }
            narrow(&v[..n], &mut out[base + start..base + start + n]);
        }
    }
}

simd_builds!(rms_norm_part => rms_norm_part_avx2, rms_norm_part_avx512(
    out: &mut [bf16],
    x: Input,
    w: &[bf16],
    dim: usize,
    eps: f32,
));

/// RMSNorm of each `dim`-element row of `out`'s shape (see the module doc).
pub(super) fn rms_norm(
    pool: &KernelPool,
    out: &mut [bf16],
    x: Input,
    w: &[bf16],
    dim: usize,
    eps: f32,
) -> Result<(), QuantError> {
    let rows = out.len() / dim.max(1);
    split_units(pool, out, (rows, dim), NORM_TASK, &|part, first, _| {
        let x = x.skip(first * dim);
        dispatch!(
            pool.level(),
            rms_norm_part,
            rms_norm_part_avx2,
            rms_norm_part_avx512(part, x, w, dim, eps)
        )
    })
}

/// `1 / (1 + exp(-g))`, written so that `exp`'s argument is never positive.
#[inline(always)]
fn sigmoid(g: f32) -> f32 {
    let e = exp_nonpositive(-g.abs());
    let n = if g >= 0.0 { 1.0 } else { e };
    n / (1.0 + e)
}

#[inline(always)]
fn binary_part(op: ElementwiseOp, out: &mut [bf16], a: Input, b: Input) {
    let (mut x, mut y) = ([0f32; BLOCK], [0f32; BLOCK]);
    for start in (0..out.len()).step_by(BLOCK) {
        let n = BLOCK.min(out.len() - start);
        widen(a.at(out, start, n), &mut x[..n]);
        widen(b.at(out, start, n), &mut y[..n]);
        // Whole blocks, so that each loop vectorises; lanes past `n` are never written out.
        match op {
            ElementwiseOp::Add => x.iter_mut().zip(&y).for_each(|(x, &y)| *x += y),
            ElementwiseOp::SiluMul => x
                .iter_mut()
                .zip(&y)
                .for_each(|(g, &u)| *g = *g * sigmoid(*g) * u),
            ElementwiseOp::SigmoidMul => x
                .iter_mut()
                .zip(&y)
                .for_each(|(g, &v)| *g = v * sigmoid(*g)),
        }
        narrow(&x[..n], &mut out[start..start + n]);
    }
}

simd_builds!(binary_part => binary_part_avx2, binary_part_avx512(
    op: ElementwiseOp,
    out: &mut [bf16],
    a: Input,
    b: Input,
));

/// `out = op(a, b)` element by element (see the module doc).
pub(super) fn binary(
    pool: &KernelPool,
    op: ElementwiseOp,
    out: &mut [bf16],
    a: Input,
    b: Input,
) -> Result<(), QuantError> {
    let len = out.len();
    let task = match op {
        ElementwiseOp::Add => ADD_TASK,
        ElementwiseOp::SiluMul | ElementwiseOp::SigmoidMul => GATE_TASK,
    };
    split_units(pool, out, (len, 1), task, &|part, first, _| {
        let (a, b) = (a.skip(first), b.skip(first));
        dispatch!(
            pool.level(),
            binary_part,
            binary_part_avx2,
            binary_part_avx512(op, part, a, b)
        )
    })
}

/// The shape of a RoPE call.
#[derive(Clone, Copy)]
pub(super) struct RopeShape {
    pub heads: usize,
    pub head_dim: usize,
    pub style: RopeStyle,
}

/// One RoPE pair `(a, b)` turned by the angle whose cosine and sine are `cos`, `sin`.
#[inline(always)]
fn rotate(a: f32, b: f32, cos: f32, sin: f32) -> (f32, f32) {
    (a * cos - b * sin, b * cos + a * sin)
}

#[inline(always)]
fn rope_part(
    x: &mut [bf16],
    positions: &[u32],
    inv_freq: &[f32],
    angles: &RopeAngles,
    shape: RopeShape,
) {
    let (heads, hd, half) = (shape.heads, shape.head_dim, inv_freq.len());
    let (mut sin, mut cos) = ([0f32; BLOCK], [0f32; BLOCK]);
    // The two halves of a block of pairs (`Half`), or the pairs side by side (`Interleaved`):
    // either way contiguous runs of the head, so the widening, the rotation over whole
    // blocks and the rounding each vectorise.
    let (mut xi, mut xj) = ([0f32; BLOCK], [0f32; BLOCK]);
    let mut pairs = [0f32; 2 * BLOCK];
    for (r, &p) in positions.iter().enumerate() {
        let table = angles.at(p);
        for start in (0..half).step_by(BLOCK) {
            let n = BLOCK.min(half - start);
            // A row's angles are the same for every head: read (or computed) once per row.
            match table {
                Some((s, c)) => {
                    sin[..n].copy_from_slice(&s[start..start + n]);
                    cos[..n].copy_from_slice(&c[start..start + n]);
                }
                None => {
                    for (k, &f) in inv_freq[start..start + n].iter().enumerate() {
                        (sin[k], cos[k]) = angle(p, f);
                    }
                }
            }
            for h in 0..heads {
                let head = &mut x[(r * heads + h) * hd..(r * heads + h + 1) * hd];
                match shape.style {
                    RopeStyle::Half => {
                        let (lo, hi) = (start..start + n, start + half..start + half + n);
                        widen(&head[lo.clone()], &mut xi[..n]);
                        widen(&head[hi.clone()], &mut xj[..n]);
                        for k in 0..BLOCK {
                            (xi[k], xj[k]) = rotate(xi[k], xj[k], cos[k], sin[k]);
                        }
                        narrow(&xi[..n], &mut head[lo]);
                        narrow(&xj[..n], &mut head[hi]);
                    }
                    RopeStyle::Interleaved => {
                        let span = 2 * start..2 * (start + n);
                        widen(&head[span.clone()], &mut pairs[..2 * n]);
                        for k in 0..BLOCK {
                            let (a, b) = (pairs[2 * k], pairs[2 * k + 1]);
                            (pairs[2 * k], pairs[2 * k + 1]) = rotate(a, b, cos[k], sin[k]);
                        }
                        narrow(&pairs[..2 * n], &mut head[span]);
                    }
                }
            }
        }
    }
}

simd_builds!(rope_part => rope_part_avx2, rope_part_avx512(
    x: &mut [bf16],
    positions: &[u32],
    inv_freq: &[f32],
    angles: &RopeAngles,
    shape: RopeShape,
));

/// Rotates the leading `2 * inv_freq.len()` elements of every head of `x` (`[positions.len(),
/// heads, head_dim]`) in place (see the module doc), the angles read from `cache`'s table.
pub(super) fn rope(
    pool: &KernelPool,
    cache: &RopeCache,
    x: &mut [bf16],
    positions: &[u32],
    inv_freq: &[f32],
    shape: RopeShape,
) -> Result<(), QuantError> {
    let row_len = shape.heads * shape.head_dim;
    let units = (positions.len(), row_len);
    let angles = cache.table(inv_freq, positions.iter().copied().max().unwrap_or(0));
    let angles = &*angles;
    split_units(pool, x, units, ROPE_TASK, &|part, first, rows| {
        let pos = &positions[first..first + rows];
        dispatch!(
            pool.level(),
            rope_part,
            rope_part_avx2,
            rope_part_avx512(part, pos, inv_freq, angles, shape)
        )
    })
}

#[cfg(test)]
#[path = "elementwise_tests.rs"]
mod tests;
