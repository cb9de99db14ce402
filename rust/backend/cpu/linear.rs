//! The CPU `linear`: `out[r, o] = dot(x[r, :], weight[o, :]) (+ bias[o])`, the hot op of a
//! CPU forward, written to run at memory bandwidth.
//!
//! Invariants:
//! - Each output element is computed by one fixed sequence of f32 operations that depends
//!   only on `in_features`: 16 running sums (element `i` goes to sum `i % 16`), added up as a
//!   fixed tree, then the tail, then the bias. How many rows are in the call, which other rows are
//!   present, the thread split and the instruction set do not change a single bit (Rust never
//!   fuses a multiply and an add on its own), so row `r` of a k-row verify forward equals the
//!   1-row decode of the same input exactly.
//! - Each weight row is read from memory once per call and then serves every input row from
//!   L1, so a verify forward of a few rows costs far less than that many 1-row forwards.

use super::formats::{e2m1_to_f32, fp8_e4m3_to_f32};
use super::shared_out::SharedOut;
use crate::backend::quant::{Avx2Token, KernelPool, QuantError};
use std::cell::RefCell;

/// Independent running sums per dot product (two AVX2 registers of f32).
const LANES: usize = 16;
/// Output features per parallel task: big enough to amortise the task, small enough to
/// split the small projections of a 135M model across cores.
const FEATURES_PER_TASK: usize = 32;
/// Input rows per tile of a long (prefill) call: 16 rows of 576-1536 f32 fit in L1/L2.
const ROW_TILE: usize = 16;
/// How many weight rows ahead a multi-row call prefetches.
#[cfg(target_arch = "x86_64")]
const PREFETCH_ROWS: usize = 4;

/// A weight element the kernel widens to f32 inside the dot.
pub(super) trait WeightElem: bytemuck::Pod + Send + Sync {
    fn widen(self) -> f32;
}

impl WeightElem for u16 {
    /// BF16 bits to f32: the upper half of an f32 (NaN payloads are kept, not quietened).
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
}

impl WeightElem for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

/// The sum of the 16 running sums as a tree (halves added lane-wise, four times): short
/// dependency chains, and the same order whatever the register width.
#[inline(always)]
fn reduce(acc: &[f32; LANES]) -> f32 {
    let mut h = [0f32; 8];
    for l in 0..8 {
        h[l] = acc[l] + acc[l + 8];
    }
    let mut q = [0f32; 4];
    for l in 0..4 {
        q[l] = h[l] + h[l + 4];
    }
    (q[0] + q[2]) + (q[1] + q[3])
}

/// `dot(w, x)` with [`LANES`] running sums (element `i` goes to sum `i % LANES`), the sums
/// added by [`reduce`], then the tail elements: the one definition every output element uses.
#[inline(always)]
fn dot<W: WeightElem>(w: &[W], x: &[f32]) -> f32 {
    let full = w.len() / LANES * LANES;
    // Whole chunks as fixed-size arrays: the lane loop needs no bounds checks.
    let wb: &[[W; LANES]] = bytemuck::cast_slice(&w[..full]);
    let xb: &[[f32; LANES]] = bytemuck::cast_slice(&x[..full]);
    let mut acc = [0f32; LANES];
    for (wa, xa) in wb.iter().zip(xb) {
        for l in 0..LANES {
            acc[l] += wa[l].widen() * xa[l];
        }
    }
    let mut s = reduce(&acc);
    for (w, x) in w[full..].iter().zip(&x[full..]) {
        s += w.widen() * x;
    }
    s
}

/// [`dot`] of `R` (up to four) input rows with one widened weight row, each weight chunk
/// loaded into registers once for all of them: lane `l` of row `r` does exactly `dot`'s `acc[l] += w[l] *
/// x[l]` (a multiply, then an add; no fused multiply-add), and the lanes are summed by
/// the same [`reduce`], so the results are bitwise those of `dot`. Written with intrinsics because
/// LLVM's vectoriser turns the portable form into a vectorisation across rows.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dots_avx2<const R: usize>(w: &[f32], x: [&[f32]; R]) -> [f32; R] {
    use std::arch::x86_64::{__m256, _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps};
    use std::arch::x86_64::{_mm256_setzero_ps, _mm256_storeu_ps};
    let n = w.len();
    let full = n / LANES * LANES;
    assert!(x.iter().all(|r| r.len() == n), "rows of unequal length");
    let mut acc: [[__m256; 2]; R] = [[_mm256_setzero_ps(); 2]; R];
    let mut c = 0;
    while c < full {
        // SAFETY: c + 16 <= full <= n, the length of `w` and of every row (asserted).
        unsafe {
            let w0 = _mm256_loadu_ps(w.as_ptr().add(c));
            let w1 = _mm256_loadu_ps(w.as_ptr().add(c + 8));
            for (r, xr) in x.iter().enumerate() {
                let x0 = _mm256_loadu_ps(xr.as_ptr().add(c));
                let x1 = _mm256_loadu_ps(xr.as_ptr().add(c + 8));
                acc[r][0] = _mm256_add_ps(acc[r][0], _mm256_mul_ps(w0, x0));
                acc[r][1] = _mm256_add_ps(acc[r][1], _mm256_mul_ps(w1, x1));
            }
        }
        c += LANES;
    }
    let mut out = [0f32; R];
    for (r, (o, xr)) in out.iter_mut().zip(&x).enumerate() {
        let mut lanes = [0f32; LANES];
        // SAFETY: `lanes` holds 16 f32, two stores of 8.
        unsafe {
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r][0]);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[r][1]);
        }
        let mut s = reduce(&lanes);
        for (w, x) in w[full..].iter().zip(&xr[full..]) {
            s += w * x;
        }
        *o = s;
    }
    out
}

/// Where the kernel gets weight row `o` (`in_features` elements): borrowed from the weight
/// tensor, or decoded into the task's scratch `buf`.
pub(super) trait WeightRows: Sync {
    type Elem: WeightElem;
    fn row<'a>(&'a self, o: usize, buf: &'a mut Vec<f32>) -> &'a [Self::Elem];
    /// Asks the CPU to start loading row `o` (if it exists) into cache; a hint only. Only
    /// the AVX2 build asks, and may use its instructions, which the proof says this CPU runs.
    #[cfg(target_arch = "x86_64")]
    fn prefetch(&self, _proof: Avx2Token, _o: usize) {}
}

/// One task: features `first..first + col.len() / rows`, written feature-major into `col`
/// (`col[j * rows + r]` is row `r` of feature `first + j`).
#[inline(always)]
fn task<S: WeightRows>(
    src: &S,
    bufs: &mut (Vec<f32>, Vec<f32>),
    xs: &[f32],
    rows: usize,
    first: usize,
    col: &mut [f32],
    avx2: Option<Avx2Token>,
) {
    let in_features = xs.len() / rows;
    #[cfg(not(target_arch = "x86_64"))]
    let _ = avx2;
    let x = |r: usize| &xs[r * in_features..(r + 1) * in_features];
    let (buf, wide) = bufs;
    // Long inputs (prefill) are taken a tile of rows at a time, so that the tile stays in
    // L1/L2 while the task's weight rows (also cache-resident after the first tile) pass.
    for t0 in (0..rows).step_by(ROW_TILE) {
        let t1 = rows.min(t0 + ROW_TILE);
        for (j, outs) in col.chunks_mut(rows).enumerate() {
            let w = src.row(first + j, buf);
            #[cfg(target_arch = "x86_64")]
            if let Some(proof) = avx2 {
                // The hardware prefetcher alone leaves the core waiting on memory between
                // rows (each row is a short stream of its own, and each task a new region).
                src.prefetch(proof, first + j + PREFETCH_ROWS);
            }
            if rows == 1 {
                // Decode: memory-bound, so the weights are widened inside the dot.
                outs[0] = dot(w, x(0));
                continue;
            }
            // Several rows: the row is read from memory once and widened once into L1, where
            // it serves every row of the tile; with AVX2, up to four rows at a time share
            // each loaded chunk.
            wide.resize(w.len(), 0.0);
            for (d, s) in wide.iter_mut().zip(w) {
                *d = s.widen();
            }
            let mut r = t0;
            #[cfg(target_arch = "x86_64")]
            if avx2.is_some() {
                while r + 4 <= t1 {
                    // SAFETY: the proof says this CPU runs AVX2.
                    let v = unsafe { dots_avx2(wide, [x(r), x(r + 1), x(r + 2), x(r + 3)]) };
                    outs[r..r + 4].copy_from_slice(&v);
                    r += 4;
                }
                let tail = &mut outs[r..t1];
                // SAFETY: as above.
                match tail.len() {
                    3 => tail
                        .copy_from_slice(&unsafe { dots_avx2(wide, [x(r), x(r + 1), x(r + 2)]) }),
                    2 => tail.copy_from_slice(&unsafe { dots_avx2(wide, [x(r), x(r + 1)]) }),
                    1 => tail[0] = unsafe { dots_avx2(wide, [x(r)]) }[0],
                    _ => {}
                }
                continue;
            }
            for (o, r) in outs[r..t1].iter_mut().zip(r..) {
                *o = dot(wide, x(r));
            }
        }
    }
}

/// [`task`] compiled for AVX2, which the proof says this CPU runs. Same source, so the same
/// operations in the same order: the wider registers change only how many lanes run at once.
#[cfg(target_arch = "x86_64")]
fn task_avx2<S: WeightRows>(
    proof: Avx2Token,
    src: &S,
    bufs: &mut (Vec<f32>, Vec<f32>),
    xs: &[f32],
    rows: usize,
    first: usize,
    col: &mut [f32],
) {
    #[target_feature(enable = "avx2")]
    unsafe fn build<S: WeightRows>(
        proof: Avx2Token,
        src: &S,
        bufs: &mut (Vec<f32>, Vec<f32>),
        xs: &[f32],
        rows: usize,
        first: usize,
        col: &mut [f32],
    ) {
        task(src, bufs, xs, rows, first, col, Some(proof))
    }
    // SAFETY: the proof says this CPU runs AVX2.
    unsafe { build(proof, src, bufs, xs, rows, first, col) }
}

thread_local! {
    /// Each pool thread's decode and widening scratch, reused between calls.
    static BUFS: RefCell<(Vec<f32>, Vec<f32>)> = RefCell::default();
}

/// The calling thread's buffers of [`linear_rows`], reused between calls.
#[derive(Default)]
pub(super) struct RowsScratch {
    /// Results feature-major, as the tasks write them.
    by_feature: Vec<f32>,
    /// Results row-major (a call of several rows).
    by_row: Vec<f32>,
}

/// `x @ weight^T (+ bias)` for `rows` rows, row-major `[rows, out_features]`, on `pool`'s
/// threads (the backend's one pool, so no other threads compete with them), in `scratch`.
///
/// `xs` is `[rows, in_features]`; `src` yields `out_features` rows.
#[allow(clippy::too_many_arguments)]
pub(super) fn linear_rows<'s>(
    pool: &KernelPool,
    src: &impl WeightRows,
    xs: &[f32],
    bias: Option<&[f32]>,
    rows: usize,
    in_features: usize,
    out_features: usize,
    scratch: &'s mut RowsScratch,
) -> Result<&'s [f32], QuantError> {
    let RowsScratch { by_feature, by_row } = scratch;
    by_feature.clear();
    by_feature.resize(out_features * rows, 0.0);
    if rows == 0 || out_features == 0 {
        return Ok(by_feature);
    }
    // Exactly `rows` rows, so that the tasks can derive `in_features` from the length.
    let xs = &xs[..rows * in_features];
    #[cfg(target_arch = "x86_64")]
    let avx2 = pool.level().avx2();
    let chunk = FEATURES_PER_TASK * rows;
    let shared = SharedOut::new(by_feature);
    pool.run(out_features.div_ceil(FEATURES_PER_TASK), &|t| {
        // SAFETY: task `t` is the only one writing chunk `t`.
        let col = unsafe { shared.chunk(t, chunk) };
        let first = t * FEATURES_PER_TASK;
        BUFS.with(|cell| {
            let mut fresh = Default::default();
            let mut guard = cell.try_borrow_mut();
            let bufs = match guard.as_deref_mut() {
                Ok(b) => b,
                Err(_) => &mut fresh,
            };
            #[cfg(target_arch = "x86_64")]
            if let Some(proof) = avx2 {
                return task_avx2(proof, src, bufs, xs, rows, first, col);
            }
            task(src, bufs, xs, rows, first, col, None);
        })
    })?;
    if let Some(b) = bias {
        for (v, b) in by_feature.chunks_mut(rows).zip(b) {
            v.iter_mut().for_each(|v| *v += b);
        }
    }
    if rows == 1 {
        return Ok(by_feature);
    }
    by_row.clear();
    by_row.resize(rows * out_features, 0.0);
    for (o, col) in by_feature.chunks(rows).enumerate() {
        for (r, v) in col.iter().enumerate() {
            by_row[r * out_features + o] = *v;
        }
    }
    Ok(by_row)
}

/// BF16 weights `[out_features, in_features]`, read in place as their bits.
pub(super) struct Bf16Rows<'a> {
    pub weight: &'a [u16],
    pub in_features: usize,
}

impl WeightRows for Bf16Rows<'_> {
    type Elem = u16;
    #[inline(always)]
    fn row<'a>(&'a self, o: usize, _buf: &'a mut Vec<f32>) -> &'a [u16] {
        &self.weight[o * self.in_features..(o + 1) * self.in_features]
    }

    #[cfg(target_arch = "x86_64")]
    fn prefetch(&self, _: Avx2Token, o: usize) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        if let Some(row) = self
            .weight
            .get(o * self.in_features..(o + 1) * self.in_features)
        {
            for line in row.chunks(32) {
                // SAFETY: a prefetch of an address inside the slice; it never faults.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
            }
        }
    }
}

/// NVFP4 weights (two E2M1 codes a byte, low nibble first; one FP8 E4M3 scale per 16
/// elements; a tensor-wide scale), decoded a row at a time into the task's scratch.
pub(super) struct Nvfp4Rows<'a> {
    pub codes: &'a [u8],
    pub scales: &'a [u8],
    pub global_scale: f32,
    pub in_features: usize,
}

impl WeightRows for Nvfp4Rows<'_> {
    type Elem = f32;
    fn row<'a>(&'a self, o: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
        let n = self.in_features;
        buf.resize(n, 0.0);
        let codes = &self.codes[o * n / 2..(o + 1) * n / 2];
        let scales = &self.scales[o * n / 16..(o + 1) * n / 16];
        let e2m1: [f32; 16] = std::array::from_fn(|c| e2m1_to_f32(c as u8));
        // One FP8 decode per block: the same products in the same order as
        // `e2m1 * fp8 * global_scale`, without a powi per element.
        for ((chunk, pair), &s) in buf.chunks_mut(16).zip(codes.chunks(8)).zip(scales) {
            let scale = fp8_e4m3_to_f32(s);
            for (j, d) in chunk.iter_mut().enumerate() {
                let byte = pair[j / 2];
                let code = if j % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                *d = e2m1[code as usize] * scale * self.global_scale;
            }
        }
        buf
    }
}

#[cfg(test)]
#[path = "linear_tests.rs"]
mod tests;
