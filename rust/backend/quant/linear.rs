//! The linear op on packed weights: `out[r, o] = sum_i W[o, i] * x[r, i] (+ bias[o])`, for
//! one weight ([`linear`]) or several over the same input rows ([`linear_group`]: a layer's
//! q, k and v projections, an MLP's gate and up).
//!
//! One call quantizes each input row once per kind of 8-bit block its weights read, splits
//! the output features of all its weights into contiguous tiles (eight-row groups) claimed
//! by the pool's threads in one job, and runs the AVX2 or portable kernel on each tile for
//! all rows at once; the task that computed a tile also adds its bias and rounds it to BF16
//! where the output is BF16, so a call allocates nothing once its thread's scratch has grown. Every output element is
//! computed by one fixed sequence of operations that depends only on its own input row and
//! weight row, so a row's result is bit-identical whatever the batch, the tiling, the thread
//! count or the instruction set.

use super::activation::{ActKind, InputElem, QuantizedRows};
use super::bf16_round::narrow;
use super::block_pairs::AMX_MIN_ROWS;
use super::format::checked_mul;
use super::packed::GROUP_ROWS;
use super::{
    dot_portable, float_dot, Isa, KernelPool, PackedView, PackedWeight, QuantError, SupportedIsa,
};
use crate::backend::simd_builds::{dispatch, simd_builds};
use half::bf16;
use std::cell::RefCell;
use std::ops::Range;

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

/// Parts one pool job covers; a longer group runs as several jobs over one quantized input.
const PARTS_PER_JOB: usize = 4;

thread_local! {
    /// The calling thread's quantized input rows (one per block kind), widened input and f32
    /// results of BF16 outputs, reused between calls.
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

#[derive(Default)]
struct Scratch {
    q8: QuantizedRows,
    q8k: QuantizedRows,
    wide: Vec<f32>,
    results: Vec<f32>,
}

/// A bias vector, `[out_features]`, in f32 or BF16 (widened exactly before the add).
#[derive(Clone, Copy, Debug)]
pub enum Bias<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// BF16 values.
    Bf16(&'a [bf16]),
}

impl Bias<'_> {
    fn len(&self) -> usize {
        match self {
            Bias::F32(b) => b.len(),
            Bias::Bf16(b) => b.len(),
        }
    }

    /// Elements `range` of the bias.
    fn part(self, range: Range<usize>) -> Self {
        match self {
            Bias::F32(b) => Bias::F32(&b[range]),
            Bias::Bf16(b) => Bias::Bf16(&b[range]),
        }
    }

    #[inline(always)]
    fn at(&self, o: usize) -> f32 {
        match self {
            Bias::F32(b) => b[o],
            Bias::Bf16(b) => b[o].to_f32(),
        }
    }
}

/// Where one weight's `[rows, out_features]` results go: f32 as computed, or BF16 rounded
/// to nearest even from the f32 result (bias included).
#[derive(Debug)]
pub enum LinearOut<'a> {
    /// f32 outputs.
    F32(&'a mut [f32]),
    /// BF16 outputs.
    Bf16(&'a mut [bf16]),
}

impl LinearOut<'_> {
    fn len(&self) -> usize {
        match self {
            LinearOut::F32(o) => o.len(),
            LinearOut::Bf16(o) => o.len(),
        }
    }
}

/// One weight of a [`linear_group`], its bias and its output.
#[derive(Debug)]
pub struct GroupPart<'a> {
    /// The weight `[out_features, in_features]`.
    pub weight: &'a PackedView<'a>,
    /// `[out_features]`, added to the f32 result.
    pub bias: Option<Bias<'a>>,
    /// `[rows, out_features]`.
    pub out: LinearOut<'a>,
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
    let w = w.view();
    let mut parts = [GroupPart {
        weight: &w,
        bias: bias.map(Bias::F32),
        out: LinearOut::F32(out),
    }];
    linear_group(pool, x, rows, &mut parts)
}

/// Every part's `out = x @ weight^T (+ bias)` over the same input rows (`x`: `[rows,
/// in_features]`, f32 or BF16; every weight has `in_features` columns): the input is
/// quantized once per kind of 8-bit block the weights read and the parts' output features
/// are spread over the pool in one job. Each part's result is bit-identical to its own
/// [`linear`] (then rounded to BF16 for a BF16 output).
pub fn linear_group<T: InputElem>(
    pool: &KernelPool,
    x: &[T],
    rows: usize,
    parts: &mut [GroupPart<'_>],
) -> Result<(), QuantError> {
    let Some(first) = parts.first() else {
        return Ok(());
    };
    let inf = first.weight.in_features();
    check_len(
        "input rows",
        checked_mul("input", rows, inf)?,
        x.len(),
        "elements",
    )?;
    for p in parts.iter() {
        let outf = p.weight.out_features();
        check_len(
            "in_features of a grouped weight",
            inf,
            p.weight.in_features(),
            "columns",
        )?;
        check_len(
            "output rows",
            checked_mul("output", rows, outf)?,
            p.out.len(),
            "elements",
        )?;
        if let Some(b) = &p.bias {
            check_len("bias", outf, b.len(), "elements")?;
        }
    }
    if rows == 0 {
        return Ok(());
    }
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut s) => run(pool, x, rows, parts, &mut s),
        // Re-entered from inside a call on this thread: fresh buffers.
        Err(_) => run(pool, x, rows, parts, &mut Scratch::default()),
    })
}

/// Where one part's tasks write, and what their epilogue does.
struct PartJob<'a> {
    w: &'a PackedView<'a>,
    act: Option<&'a QuantizedRows>,
    /// The f32 results (the output itself, or the scratch behind a BF16 output).
    results: OutMatrix,
    bias: Option<Bias<'a>>,
    /// The BF16 output the results are rounded into.
    bf16_out: Option<Bf16Matrix>,
    /// The first of this part's units among the job's, and how many it has.
    first_unit: usize,
    units: usize,
}

/// A BF16 output matrix `[rows, stride]`, each task writing its own columns.
#[derive(Clone, Copy)]
struct Bf16Matrix {
    ptr: *mut bf16,
    stride: usize,
}

// SAFETY: as for `OutMatrix`: tasks write disjoint columns, and the call that made it holds
// the `&mut [bf16]` until every task is done.
unsafe impl Send for Bf16Matrix {}
unsafe impl Sync for Bf16Matrix {}

fn run<T: InputElem>(
    pool: &KernelPool,
    x: &[T],
    rows: usize,
    parts: &mut [GroupPart<'_>],
    s: &mut Scratch,
) -> Result<(), QuantError> {
    let isa = pool.level();
    let Scratch {
        q8,
        q8k,
        wide,
        results,
    } = s;
    let x: &[f32] = match T::as_f32(x) {
        Some(x) => x,
        None => {
            wide.clear();
            wide.extend(x.iter().map(|v| v.to_f32()));
            wide
        }
    };
    let inf = parts[0].weight.in_features();
    let needs = |kind: ActKind| {
        inf > 0
            && parts
                .iter()
                .any(|p| p.weight.out_features() > 0 && act_kind(p.weight) == Some(kind))
    };
    for (kind, act) in [(ActKind::Q8, &mut *q8), (ActKind::Q8K, &mut *q8k)] {
        if needs(kind) {
            act.fill(kind, x, (rows, inf), isa, pool)?;
        }
    }
    if isa.isa() == Isa::Amx && rows >= AMX_MIN_ROWS && needs(ActKind::Q8) {
        q8.fill_pairs();
    }
    // The f32 results of BF16 outputs, one region per part, sized before any pointer into
    // it is taken.
    let staged: usize = parts
        .iter()
        .filter(|p| matches!(p.out, LinearOut::Bf16(_)))
        .map(|p| rows * p.weight.out_features())
        .sum();
    results.resize(staged, 0.0);
    let (q8, q8k) = (&*q8, &*q8k);
    let mut staged_at = 0;
    let mut jobs: [Option<PartJob<'_>>; PARTS_PER_JOB] = Default::default();
    for chunk in parts.chunks_mut(PARTS_PER_JOB) {
        let mut units = 0;
        for (slot, p) in jobs.iter_mut().zip(chunk.iter_mut()) {
            let outf = p.weight.out_features();
            let (results, bf16_out) = match &mut p.out {
                LinearOut::F32(out) => (out.as_mut_ptr(), None),
                LinearOut::Bf16(out) => {
                    let region = &mut results[staged_at..staged_at + rows * outf];
                    staged_at += rows * outf;
                    let out = Bf16Matrix {
                        ptr: out.as_mut_ptr(),
                        stride: outf,
                    };
                    (region.as_mut_ptr(), Some(out))
                }
            };
            let part_units = unit_count(p.weight);
            *slot = Some(PartJob {
                w: p.weight,
                act: match act_kind(p.weight) {
                    Some(ActKind::Q8) => Some(q8),
                    Some(ActKind::Q8K) => Some(q8k),
                    None => None,
                },
                results: OutMatrix {
                    ptr: results,
                    stride: outf,
                },
                bias: p.bias,
                bf16_out,
                first_unit: units,
                units: part_units,
            });
            units += part_units;
        }
        let jobs = &jobs[..chunk.len()];
        split(pool, units, &|range| {
            for job in jobs.iter().flatten() {
                let own = job.first_unit..job.first_unit + job.units;
                let (lo, hi) = (range.start.max(own.start), range.end.min(own.end));
                if lo < hi {
                    job.run(lo - own.start..hi - own.start, x, rows, isa);
                }
            }
        })?;
    }
    Ok(())
}

/// The 8-bit blocks `w`'s dot reads (`None`: a float format, read against the f32 input).
fn act_kind(w: &PackedView<'_>) -> Option<ActKind> {
    match (w.format().is_quantized(), w.format().is_k_quant()) {
        (false, _) => None,
        (true, true) => Some(ActKind::Q8K),
        (true, false) => Some(ActKind::Q8),
    }
}

/// Work units of a weight: eight-row groups, plus one for the rows past the last full group
/// of a quantized weight (run by the portable kernel).
fn unit_count(w: &PackedView<'_>) -> usize {
    if w.in_features() == 0 {
        return w.out_features().div_ceil(GROUP_ROWS);
    }
    match act_kind(w) {
        None => w.out_features().div_ceil(GROUP_ROWS),
        Some(_) => w.groups() + (w.out_features() > w.groups() * GROUP_ROWS) as usize,
    }
}

impl PartJob<'_> {
    /// Units `units` of this part: the dots, then the bias and the BF16 rounding of the
    /// same output features.
    fn run(&self, units: Range<usize>, x: &[f32], rows: usize, isa: SupportedIsa) {
        let (w, outm) = (self.w, self.results);
        let outf = w.out_features();
        let features = units.start * GROUP_ROWS..(units.end * GROUP_ROWS).min(outf);
        if w.in_features() == 0 {
            // Empty dot products: the output is the bias alone.
            for r in 0..rows {
                for o in features.clone() {
                    // SAFETY: this task owns these features of every row.
                    unsafe { *outm.at(r, o) = self.bias.map_or(0.0, |b| b.at(o)) };
                }
            }
            return self.epilogue(rows, features, false, isa);
        }
        match self.act {
            None => {
                #[cfg(target_arch = "x86_64")]
                if let Some(_proof) = isa.avx2() {
                    // SAFETY: the proof says this CPU has AVX2, FMA and F16C.
                    unsafe { float_dot::float_outputs_avx2(w, x, rows, features.clone(), outm) };
                } else {
                    float_dot::float_outputs(w, x, rows, features.clone(), outm);
                }
                #[cfg(not(target_arch = "x86_64"))]
                float_dot::float_outputs(w, x, rows, features.clone(), outm);
            }
            Some(act) => quant_units(w, act, units, outm, isa),
        }
        self.epilogue(rows, features, true, isa);
    }

    /// Adds the bias to output features `features` of every row and rounds them into the
    /// BF16 output: the same f32 add, then round to nearest even, as a single linear.
    fn epilogue(&self, rows: usize, features: Range<usize>, add_bias: bool, isa: SupportedIsa) {
        let bias = self
            .bias
            .filter(|_| add_bias)
            .map(|b| b.part(features.clone()));
        if bias.is_none() && self.bf16_out.is_none() {
            return;
        }
        let n = features.len();
        for r in 0..rows {
            // SAFETY: this task owns these features of every row, in the results and in the
            // BF16 output, so these slices overlap nothing another task touches.
            let (results, out) = unsafe {
                (
                    std::slice::from_raw_parts_mut(self.results.at(r, features.start), n),
                    self.bf16_out.map(|o| {
                        std::slice::from_raw_parts_mut(o.ptr.add(r * o.stride + features.start), n)
                    }),
                )
            };
            dispatch!(
                isa,
                finish_row,
                finish_row_avx2,
                finish_row_avx512(results, bias, out)
            );
        }
    }
}

/// One row's epilogue: `results += bias`, then `out = round_bf16(results)`. Written as whole
/// slices so that the compiler vectorises it, compiled again with AVX2 and with AVX-512
/// enabled (the same source, so the same bits): one f32 add and one rounding per element.
#[inline(always)]
fn finish_row(results: &mut [f32], bias: Option<Bias<'_>>, out: Option<&mut [bf16]>) {
    match bias {
        Some(Bias::F32(b)) => results.iter_mut().zip(b).for_each(|(v, &b)| *v += b),
        Some(Bias::Bf16(b)) => results
            .iter_mut()
            .zip(b)
            .for_each(|(v, &b)| *v += b.to_f32()),
        None => {}
    }
    if let Some(out) = out {
        narrow(results, out);
    }
}

simd_builds!(finish_row => finish_row_avx2, finish_row_avx512(
    results: &mut [f32],
    bias: Option<Bias<'_>>,
    out: Option<&mut [bf16]>,
));

/// Units `units` of a quantized weight: full groups on the instruction set's kernel, the
/// rows past the last full group (the last unit) on the portable one.
fn quant_units(
    w: &PackedView<'_>,
    act: &QuantizedRows,
    units: Range<usize>,
    outm: OutMatrix,
    isa: SupportedIsa,
) {
    let groups = w.groups();
    let full = units.start..units.end.min(groups);
    if units.end > groups {
        dot_portable::quant_outputs(w, act, groups * GROUP_ROWS..w.out_features(), outm);
    }
    if full.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa.avx2().is_some() {
        // SAFETY: `isa` includes AVX2, and a `SupportedIsa` is a level this CPU runs; `act`
        // holds the blocks of the kind this format reads.
        return unsafe { super::avx2::quant_groups(w, act, full, outm, isa) };
    }
    let _ = isa;
    let outputs = full.start * GROUP_ROWS..full.end * GROUP_ROWS;
    dot_portable::quant_outputs(w, act, outputs, outm);
}

/// Runs `task` over `0..units` split into one contiguous range per participant of the pool.
/// Inner boundaries fall on even units: the 512-bit kernel takes groups in pairs and sends a
/// range's odd last group to the 256-bit one, which costs about twice as much an output.
///
/// Finer tasks were meant to even the threads out, but every task restarts its weight stream
/// and claims from the counter both threads hammer, and a participant that runs late is
/// already covered by the pool (a worker that has not joined when the caller finishes its
/// range leaves the rest to the caller). Against four tasks a thread (`model_decode`, 2
/// threads, three interleaved runs each): decode 4.16-4.66 -> 3.71-4.00 ms a token, 8
/// sequences 828-933 -> 962-981 tokens/s, a 9-row verify 8.50-8.73 -> 7.97-8.27 ms, prefill
/// 1480-1501 -> 1593-1619 tokens/s.
fn split(
    pool: &KernelPool,
    units: usize,
    task: &(dyn Fn(Range<usize>) + Sync),
) -> Result<(), QuantError> {
    let tasks = units.min(pool.threads()).max(1);
    let bound = |t: usize| {
        if t == tasks {
            units
        } else {
            (t * units / tasks) & !1
        }
    };
    pool.run(tasks, &|t| task(bound(t)..bound(t + 1)))
}
