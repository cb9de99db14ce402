//! Input rows quantized once per linear to 8-bit blocks, the form the integer dots read.
//!
//! - [`ActKind::Q8`] (legacy weight formats): 32-element blocks, `d = amax / 127`, codes
//!   `round_ties_even(x / d)`; per block also `bsum = sum(q)` and `sum = d * bsum` (ggml's
//!   Q8_0 and Q8_1 in one).
//! - [`ActKind::Q8K`] (K-quant weights): 256-element blocks with the same rule, plus the sums
//!   of each 16 and each 32 codes (ggml's Q8_K `bsums`).
//!
//! Invariants: a row's codes depend only on that row (never on the batch); `|q| <= 127`, so
//! AVX2's `maddubs` never saturates on any weight code; a block holding a NaN or an infinity
//! gets `d = NaN`, so the outputs it feeds are NaN rather than silently finite.

use super::block_pairs::BlockPairs;
use super::{KernelPool, QuantError, SupportedIsa};
use half::bf16;

/// Input elements per quantization task (see [`QuantizedRows::fill`]).
const TASK_ELEMENTS: usize = 4096;

/// Which 8-bit blocks a weight format's dot reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActKind {
    Q8,
    Q8K,
}

impl ActKind {
    pub(crate) fn block_len(self) -> usize {
        match self {
            ActKind::Q8 => 32,
            ActKind::Q8K => 256,
        }
    }
}

/// An input element: f32 or BF16 (widened exactly).
pub trait InputElem: Copy + Send + Sync {
    /// The value as an f32 (exact for both element types).
    fn to_f32(self) -> f32;
    /// The slice itself when it already is f32.
    fn as_f32(x: &[Self]) -> Option<&[f32]> {
        let _ = x;
        None
    }
}

impl InputElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    fn as_f32(x: &[f32]) -> Option<&[f32]> {
        Some(x)
    }
}

impl InputElem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// `rows` input rows of `cols` elements as 8-bit blocks (buffers reused between calls).
#[derive(Debug, Default)]
pub(crate) struct QuantizedRows {
    pub rows: usize,
    pub cols: usize,
    pub kind: Option<ActKind>,
    /// Codes, `[rows, cols]`.
    pub qs: Vec<i8>,
    /// Per block: scale, `d * sum(q)`, `sum(q)`.
    pub d: Vec<f32>,
    pub sum: Vec<f32>,
    pub bsum: Vec<i32>,
    /// Q8K: per block, the sums of each 16 and each 32 codes.
    pub bsum16: Vec<i16>,
    pub bsum32: Vec<i16>,
    /// The codes as AMX activation tiles, when a call runs on them ([`Self::fill_pairs`]);
    /// emptied by every [`Self::fill`], so it never describes another call's rows.
    pub pairs: BlockPairs,
}

impl QuantizedRows {
    /// Blocks per row.
    pub(crate) fn blocks(&self) -> usize {
        self.cols / self.kind.map_or(1, ActKind::block_len)
    }

    /// Lays the Q8 codes out as AMX activation tiles ([`BlockPairs`]).
    pub(crate) fn fill_pairs(&mut self) {
        debug_assert_eq!(self.kind, Some(ActKind::Q8));
        self.pairs.fill(&self.qs, self.rows, self.cols);
    }

    /// Whether [`Self::fill_pairs`] laid out this call's rows.
    pub(crate) fn has_pairs(&self) -> bool {
        self.rows > 0 && self.pairs.rows() == self.rows
    }

    /// Quantizes `x` (`[rows, cols]`, `cols` a multiple of the kind's block length) with
    /// the SIMD of `isa` (every level gives the same codes and scales),
    /// inputs of several thousand elements spread over `pool`.
    pub(crate) fn fill(
        &mut self,
        kind: ActKind,
        x: &[f32],
        (rows, cols): (usize, usize),
        isa: SupportedIsa,
        pool: &KernelPool,
    ) -> Result<(), QuantError> {
        let n = kind.block_len();
        assert!(cols % n == 0 && x.len() == rows * cols, "input shape");
        self.pairs.clear();
        let blocks = rows * cols / n;
        self.rows = rows;
        self.cols = cols;
        self.kind = Some(kind);
        self.qs.resize(rows * cols, 0);
        self.d.resize(blocks, 0.0);
        self.sum.resize(blocks, 0.0);
        self.bsum.resize(blocks, 0);
        let k = kind == ActKind::Q8K;
        self.bsum16.resize(if k { blocks * 16 } else { 0 }, 0);
        self.bsum32.resize(if k { blocks * 8 } else { 0 }, 0);
        let out = Blocks {
            qs: self.qs.as_mut_ptr(),
            d: self.d.as_mut_ptr(),
            sum: self.sum.as_mut_ptr(),
            bsum: self.bsum.as_mut_ptr(),
            bsum16: self.bsum16.as_mut_ptr(),
            bsum32: self.bsum32.as_mut_ptr(),
        };
        // A task of 4K elements takes about a microsecond with AVX-512, a few times the
        // pool's hand-off; the quantization is serial work every linear waits on (a 9-row
        // verify's down projection: 14K elements, a fifth of the call on one thread).
        let tasks = (rows * cols / TASK_ELEMENTS).clamp(1, blocks.max(1));
        pool.run(tasks, &|t| {
            let range = t * blocks / tasks..(t + 1) * blocks / tasks;
            // SAFETY: the tasks cover disjoint block ranges of buffers sized above, which
            // `self` keeps alive and unborrowed until `run` returns.
            unsafe { out.quantize(x, n, k, isa, range) };
        })
    }
}

/// The output buffers of [`QuantizedRows::fill`], written block-range by block-range.
struct Blocks {
    qs: *mut i8,
    d: *mut f32,
    sum: *mut f32,
    bsum: *mut i32,
    bsum16: *mut i16,
    bsum32: *mut i16,
}

// SAFETY: tasks write disjoint block ranges through it (see `fill`).
unsafe impl Sync for Blocks {}

impl Blocks {
    /// Quantizes blocks `range` (of `n` elements; `k`: also the 16- and 32-element sums).
    ///
    /// # Safety
    /// The buffers hold every block of `range`, and no one else touches those blocks.
    unsafe fn quantize(
        &self,
        x: &[f32],
        n: usize,
        k: bool,
        isa: SupportedIsa,
        range: std::ops::Range<usize>,
    ) {
        for b in range {
            let xb = &x[b * n..(b + 1) * n];
            // SAFETY: block `b` is this task's (the function's contract).
            let qb = unsafe { std::slice::from_raw_parts_mut(self.qs.add(b * n), n) };
            #[cfg(target_arch = "x86_64")]
            // SAFETY: each build runs only with the proof that this CPU has its features.
            let (d, total) = match (isa.avx512(), isa.avx2()) {
                (Some(_proof), _) => unsafe { avx512::quantize_block(xb, qb) },
                (None, Some(_proof)) => {
                    let d = unsafe { avx2::quantize_block(xb, qb) };
                    (d, code_sum(qb))
                }
                _ => (quantize_block(xb, qb), code_sum(qb)),
            };
            #[cfg(not(target_arch = "x86_64"))]
            let (d, total) = {
                let _ = isa;
                (quantize_block(xb, qb), code_sum(qb))
            };
            // SAFETY: as above.
            unsafe {
                *self.d.add(b) = d;
                *self.bsum.add(b) = total;
                *self.sum.add(b) = d * total as f32;
                if k {
                    for (j, q) in qb.chunks(16).enumerate() {
                        *self.bsum16.add(b * 16 + j) = q.iter().map(|&v| v as i16).sum();
                    }
                    for (j, q) in qb.chunks(32).enumerate() {
                        *self.bsum32.add(b * 8 + j) = q.iter().map(|&v| v as i16).sum();
                    }
                }
            }
        }
    }
}

/// The sum of a block's codes.
#[inline]
fn code_sum(q: &[i8]) -> i32 {
    q.iter().map(|&q| q as i32).sum()
}

/// One block: codes into `q`, the scale returned.
#[inline]
fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let mut amax = 0f32;
    let mut finite = true;
    for &v in x {
        amax = amax.max(v.abs());
        finite &= v.is_finite();
    }
    if !finite {
        q.fill(0);
        return f32::NAN;
    }
    let d = amax / 127.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    for (q, v) in q.iter_mut().zip(x) {
        // |v * id| <= 127 * (1 + 3 * 2^-24), which rounds to at most 127.
        *q = (v * id).round_ties_even() as i8;
    }
    d
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// [`super::quantize_block`] eight lanes at a time: the same maximum (exact), the same
    /// `x * id` products, and rounding to nearest even, so the same codes and scale.
    ///
    /// # Safety
    /// The CPU must support AVX2; `x.len() == q.len()` is a multiple of 32.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
        assert!(x.len() == q.len() && x.len().is_multiple_of(32));
        let sign = _mm256_set1_ps(-0.0);
        let inf = _mm256_set1_ps(f32::INFINITY);
        let (mut amax, mut bad) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for c in x.chunks_exact(8) {
            // SAFETY: eight floats.
            let a = _mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(c.as_ptr()) });
            amax = _mm256_max_ps(amax, a);
            // Not below infinity: an infinity or a NaN.
            bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_NLT_UQ>(a, inf));
        }
        if _mm256_movemask_ps(bad) != 0 {
            q.fill(0);
            return f32::NAN;
        }
        let mut lanes = [0f32; 8];
        // SAFETY: eight floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), amax) };
        let amax = lanes.iter().fold(0f32, |m, &v| m.max(v));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d == 0.0 { 0.0 } else { 1.0 / d });
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (xc, qc) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)) {
            // SAFETY: four times eight floats of the 32.
            let (c0, c1, c2, c3) = unsafe {
                let p = xc.as_ptr();
                (
                    codes8(p, id),
                    codes8(p.add(8), id),
                    codes8(p.add(16), id),
                    codes8(p.add(24), id),
                )
            };
            let ab = _mm256_packs_epi32(c0, c1);
            let cd = _mm256_packs_epi32(c2, c3);
            let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order);
            // SAFETY: 32 bytes.
            unsafe { _mm256_storeu_si256(qc.as_mut_ptr().cast(), bytes) };
        }
        d
    }

    /// `round_ties_even(x * id)` of the eight floats at `p`, as i32.
    #[inline(always)]
    unsafe fn codes8(p: *const f32, id: __m256) -> __m256i {
        let v = _mm256_mul_ps(_mm256_loadu_ps(p), id);
        _mm256_cvtps_epi32(_mm256_round_ps::<
            { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
        >(v))
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// [`super::quantize_block`] sixteen lanes at a time, with the codes' sum: the same
    /// maximum (exact in any order), the same `x * id` products and rounding to nearest even,
    /// so the same codes and scale. Written for the latency of one block (its reductions are
    /// single instructions where the AVX2 build folds eight lanes in scalar code), because
    /// blocks are quantized one after another on the thread every task of a linear waits for.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and BW; `x.len() == q.len()` is a multiple of 32.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
        assert!(x.len() == q.len() && x.len().is_multiple_of(32));
        let inf = _mm512_set1_ps(f32::INFINITY);
        let (mut amax, mut bad) = (_mm512_setzero_ps(), 0);
        for c in x.chunks_exact(16) {
            // SAFETY: sixteen floats.
            let a = _mm512_abs_ps(unsafe { _mm512_loadu_ps(c.as_ptr()) });
            amax = _mm512_max_ps(amax, a);
            // Not below infinity: an infinity or a NaN.
            bad |= _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(a, inf);
        }
        if bad != 0 {
            q.fill(0);
            return (f32::NAN, 0);
        }
        let d = _mm512_reduce_max_ps(amax) / 127.0;
        let id = _mm512_set1_ps(if d == 0.0 { 0.0 } else { 1.0 / d });
        let mut total = _mm512_setzero_si512();
        for (xc, qc) in x.chunks_exact(16).zip(q.chunks_exact_mut(16)) {
            // SAFETY: sixteen floats in, sixteen bytes out.
            unsafe {
                let v = _mm512_mul_ps(_mm512_loadu_ps(xc.as_ptr()), id);
                let c = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    v,
                );
                total = _mm512_add_epi32(total, c);
                // |c| <= 127, so the narrowing keeps every code.
                _mm_storeu_si128(qc.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(c));
            }
        }
        (d, _mm512_reduce_add_epi32(total))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::quant::Isa;

    #[test]
    fn codes_round_to_nearest_and_scale_is_amax_over_127() {
        let x: Vec<f32> = (0..32).map(|i| (i as f32 - 15.5) * 0.25).collect();
        let mut a = QuantizedRows::default();
        a.fill(
            ActKind::Q8,
            &x,
            (1, 32),
            SupportedIsa::PORTABLE,
            &KernelPool::new(1),
        )
        .unwrap();
        let d = 3.875f32 / 127.0;
        assert_eq!(a.d[0], d);
        for (q, v) in a.qs.iter().zip(&x) {
            assert!((*q as f32 * d - v).abs() <= d / 2.0 * 1.0001, "{q} vs {v}");
        }
        assert_eq!(a.qs[0], -127);
        assert_eq!(a.qs[31], 127);
        assert_eq!(a.bsum[0], a.qs.iter().map(|&q| q as i32).sum::<i32>());
    }

    /// Every instruction set this CPU runs quantizes to the portable path's codes, scales
    /// and sums, on blocks that hold round-half ties, zeros, subnormals, huge values and
    /// non-finite elements, whatever the task split (rows of 1 to 300 blocks).
    #[test]
    fn every_instruction_set_gives_the_portable_blocks() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        for (rows, cols) in [(1, 32), (3, 576), (9, 1536), (2, 9600), (1, 256 * 3)] {
            let mut x: Vec<f32> = (0..rows * cols)
                .map(|_| rng.random_range(-4.0f32..4.0) * 2f32.powi(rng.random_range(-20..20)))
                .collect();
            // Block 1 of each row: ties, k + 1/2 times the scale that its maximum, 127, sets.
            for r in 0..rows {
                let b = &mut x[r * cols..][32.min(cols - 32)..][..32];
                for (i, v) in b.iter_mut().enumerate() {
                    *v = if i == 0 {
                        127.0
                    } else {
                        (i as f32 - 16.0) + 0.5
                    };
                }
            }
            x[0] = 1e38;
            if cols >= 256 {
                x[64..96].fill(0.0);
                x[96..128]
                    .iter_mut()
                    .for_each(|v| *v = f32::from_bits(1) * 3.0);
                x[130] = f32::NAN;
                x[200] = f32::NEG_INFINITY;
            }
            for kind in [ActKind::Q8, ActKind::Q8K] {
                if cols % kind.block_len() != 0 {
                    continue;
                }
                let mut want = QuantizedRows::default();
                want.fill(
                    kind,
                    &x,
                    (rows, cols),
                    SupportedIsa::PORTABLE,
                    &KernelPool::new(1),
                )
                .unwrap();
                for isa in Isa::available() {
                    let pool = KernelPool::with_options(2, isa, KernelPool::DEFAULT_SPIN);
                    let mut got = QuantizedRows::default();
                    got.fill(kind, &x, (rows, cols), pool.level(), &pool)
                        .unwrap();
                    let what = format!("{kind:?} {rows}x{cols} on {}", isa.name());
                    assert_eq!(got.qs, want.qs, "codes, {what}");
                    assert_eq!(got.bsum, want.bsum, "code sums, {what}");
                    assert_eq!(got.bsum16, want.bsum16, "16-code sums, {what}");
                    assert_eq!(got.bsum32, want.bsum32, "32-code sums, {what}");
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got.d), bits(&want.d), "scales, {what}");
                    assert_eq!(bits(&got.sum), bits(&want.sum), "scaled sums, {what}");
                }
            }
        }
    }

    #[test]
    fn non_finite_blocks_get_a_nan_scale() {
        let mut x = vec![1.0f32; 512];
        x[300] = f32::NAN;
        x[5] = f32::INFINITY;
        let mut a = QuantizedRows::default();
        a.fill(
            ActKind::Q8K,
            &x,
            (1, 512),
            SupportedIsa::PORTABLE,
            &KernelPool::new(1),
        )
        .unwrap();
        assert!(a.d[0].is_nan() && a.d[1].is_nan());
        a.fill(
            ActKind::Q8,
            &x,
            (1, 512),
            SupportedIsa::PORTABLE,
            &KernelPool::new(1),
        )
        .unwrap();
        assert!(a.d[0].is_nan() && a.d[9].is_nan());
        assert_eq!(a.d[1], 1.0 / 127.0);
    }

    #[test]
    fn k_sums_cover_their_codes() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let mut a = QuantizedRows::default();
        a.fill(
            ActKind::Q8K,
            &x,
            (2, 256),
            SupportedIsa::PORTABLE,
            &KernelPool::new(1),
        )
        .unwrap();
        for b in 0..2 {
            for j in 0..16 {
                let s: i32 = a.qs[b * 256 + j * 16..b * 256 + j * 16 + 16]
                    .iter()
                    .map(|&q| q as i32)
                    .sum();
                assert_eq!(a.bsum16[b * 16 + j] as i32, s);
            }
            for j in 0..8 {
                let pair = a.bsum16[b * 16 + 2 * j] + a.bsum16[b * 16 + 2 * j + 1];
                assert_eq!(a.bsum32[b * 8 + j], pair);
            }
        }
    }
}
