//! The linear op on packed weights: `out[r, o] = sum_i W[o, i] * x[r, i] (+ bias[o])`.
//!
//! One call quantizes each input row once (quantized weights), splits the output features
//! into contiguous tiles (eight-row groups) claimed by the pool's threads, and runs the
//! AVX2 or portable kernel on each tile for all rows at once. Every output element is
//! computed by one fixed sequence of operations that depends only on its own input row and
//! weight row, so a row's result is bit-identical whatever the batch, the tiling, the thread
//! count or the instruction set.

use super::activation::{ActKind, InputElem, QuantizedRows};
use super::format::checked_mul;
use super::packed::GROUP_ROWS;
use super::pool::{Isa, KernelPool};
use super::{dot_portable, float_dot, PackedView, PackedWeight, QuantError};
use std::cell::RefCell;

/// Tasks per thread: enough for the threads to even out, few enough to stay cheap.
const TASKS_PER_THREAD: usize = 4;

/// The output matrix `[rows, stride]` shared by the tasks, each writing its own columns.
#[derive(Clone, Copy)]
pub(crate) struct OutMatrix {
    ptr: *mut f32,
    stride: usize,
}

// SAFETY: tasks write disjoint columns (their own output features) through it, and the call
// that made it holds the `&mut [f32]` until every task is done.
unsafe impl Send for OutMatrix {}
unsafe impl Sync for OutMatrix {}

impl OutMatrix {
    /// The address of element `(r, o)` (dereferencing it is the caller's business).
    #[inline(always)]
    pub(crate) fn at(&self, r: usize, o: usize) -> *mut f32 {
        self.ptr.wrapping_add(r * self.stride + o)
    }
}

thread_local! {
    /// The calling thread's quantized input rows and widened input, reused between calls.
    static SCRATCH: RefCell<(QuantizedRows, Vec<f32>)> = RefCell::default();
}

fn check_len(
    what: &'static str,
    expected: usize,
    got: usize,
    unit: &'static str,
) -> Result<(), QuantError> {
    if expected == got {
        Ok(())
    } else {
        Err(QuantError::Length {
            what,
            expected,
            got,
            unit,
        })
    }
}

/// `out = x @ w^T (+ bias)` for `rows` input rows (`x`: `[rows, in_features]`, f32 or BF16;
/// `out`: `[rows, out_features]`), on `pool`'s threads with its instruction set.
pub fn linear<T: InputElem, D: AsRef<[u8]>>(
    pool: &KernelPool,
    w: &PackedWeight<D>,
    x: &[T],
    rows: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), QuantError> {
    let w = &w.view();
    let (inf, outf) = (w.in_features(), w.out_features());
    check_len(
        "input rows",
        checked_mul("input", rows, inf)?,
        x.len(),
        "elements",
    )?;
    check_len(
        "output rows",
        checked_mul("output", rows, outf)?,
        out.len(),
        "elements",
    )?;
    if let Some(b) = bias {
        check_len("bias", outf, b.len(), "elements")?;
    }
    if rows == 0 || outf == 0 {
        return Ok(());
    }
    if inf == 0 {
        // Empty dot products: the output is the bias alone.
        for row in out.chunks_exact_mut(outf) {
            match bias {
                Some(b) => row.copy_from_slice(b),
                None => row.fill(0.0),
            }
        }
        return Ok(());
    }
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut s) => {
            let (act, wide) = &mut *s;
            run(pool, w, x, rows, out, act, wide)
        }
        // Re-entered from inside a call on this thread: fresh buffers.
        Err(_) => run(
            pool,
            w,
            x,
            rows,
            out,
            &mut Default::default(),
            &mut Vec::new(),
        ),
    })?;
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(outf) {
            row.iter_mut().zip(b).for_each(|(o, b)| *o += b);
        }
    }
    Ok(())
}

fn run<T: InputElem>(
    pool: &KernelPool,
    w: &PackedView<'_>,
    x: &[T],
    rows: usize,
    out: &mut [f32],
    act: &mut QuantizedRows,
    wide: &mut Vec<f32>,
) -> Result<(), QuantError> {
    let outm = OutMatrix {
        ptr: out.as_mut_ptr(),
        stride: w.out_features(),
    };
    let isa = pool.isa();
    let x: &[f32] = match T::as_f32(x) {
        Some(x) => x,
        None => {
            wide.clear();
            wide.extend(x.iter().map(|v| v.to_f32()));
            wide
        }
    };
    if !w.format().is_quantized() {
        let units = w.out_features().div_ceil(GROUP_ROWS);
        return split(pool, units, &|range| {
            let o = range.start * GROUP_ROWS..(range.end * GROUP_ROWS).min(w.out_features());
            #[cfg(target_arch = "x86_64")]
            if isa == Isa::Avx2 {
                // SAFETY: the pool only reports AVX2 when the CPU has AVX2, FMA and F16C.
                return unsafe { float_dot::float_outputs_avx2(w, x, rows, o, outm) };
            }
            float_dot::float_outputs(w, x, rows, o, outm);
        });
    }
    let kind = if w.format().is_k_quant() {
        ActKind::Q8K
    } else {
        ActKind::Q8
    };
    act.fill(kind, x, (rows, w.in_features()), isa == Isa::Avx2, pool)?;
    let act = &*act;
    let groups = w.groups();
    // The rows past the last full group are one more unit, run by the portable kernel.
    let tail = w.out_features() > groups * GROUP_ROWS;
    split(pool, groups + tail as usize, &|range| {
        let full = range.start..range.end.min(groups);
        if range.end > groups {
            dot_portable::quant_outputs(w, act, groups * GROUP_ROWS..w.out_features(), outm);
        }
        if full.is_empty() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx2 {
            // SAFETY: the pool only reports AVX2 when the CPU has AVX2, FMA and F16C; `act` holds
            // the blocks of the kind this format reads.
            return unsafe { super::avx2::quant_groups(w, act, full, outm) };
        }
        let outputs = full.start * GROUP_ROWS..full.end * GROUP_ROWS;
        dot_portable::quant_outputs(w, act, outputs, outm);
    })
}

/// Runs `task` over `0..units` split into contiguous ranges, spread over the pool.
fn split(
    pool: &KernelPool,
    units: usize,
    task: &(dyn Fn(std::ops::Range<usize>) + Sync),
) -> Result<(), QuantError> {
    let tasks = units.min(pool.threads() * TASKS_PER_THREAD).max(1);
    let tasks = if pool.threads() == 1 { 1 } else { tasks };
    pool.run(tasks, &|t| task(t * units / tasks..(t + 1) * units / tasks))
}
