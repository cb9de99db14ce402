//! The CPU `linear` and `grouped_linear` once their arguments are checked: a linear is a
//! group of one part.
//!
//! A group whose weights are all GGUF block formats runs as one [`quant::linear_group`]: the
//! input quantized once, one pool job over every part's output features, each task adding
//! the bias and rounding to BF16 the outputs it computed. Any other group runs part by part
//! on the float kernels of `linear.rs`. Either way a part's result is bitwise that of its own
//! `linear`, and nothing on the block-format path allocates once the scratch has grown.

use super::fp8::Fp8Rows;
use super::linear::{linear_rows, Bf16Rows, Nvfp4Rows, RowsScratch};
use super::HostView;
use crate::backend::kernels::{GroupedLinearArgs, LinearPart, LinearWeight, MAX_LINEAR_PARTS};
use crate::backend::quant::{self, Bias, GroupPart, KernelPool, LinearOut, PackedView, QuantError};
use crate::backend::{BackendError, Dtype};
use half::bf16;
use std::cell::RefCell;

/// The calling thread's widened input and bias and its float-kernel results, reused between
/// calls of the float formats.
#[derive(Default)]
struct FloatScratch {
    xs: Vec<f32>,
    bias: Vec<f32>,
    rows: RowsScratch,
}

thread_local! {
    static FLOAT_SCRATCH: RefCell<FloatScratch> = RefCell::default();
}

fn quant_err(op: &'static str) -> impl Fn(QuantError) -> BackendError {
    move |source| BackendError::Quant { op, source }
}

/// Runs checked `linear` (`op`) or `grouped_linear` arguments.
pub(super) fn run(
    pool: &KernelPool,
    op: &'static str,
    a: &GroupedLinearArgs<HostView>,
) -> Result<(), BackendError> {
    let err = quant_err(op);
    if !a.present().all(|p| packed_view(a, p).is_some()) {
        // Part by part; a packed part is a group of its own.
        return a.present().try_for_each(|p| match packed_view(a, p) {
            Some(w) => {
                let w = w.map_err(&err)?;
                let x = unsafe { a.x.typed::<bf16>() };
                quant::linear_group(pool, x, a.rows, &mut [group_part(a, p, &w)]).map_err(&err)
            }
            None => run_float(pool, op, a, p),
        });
    }
    let mut views: [Option<PackedView<'_>>; MAX_LINEAR_PARTS] = Default::default();
    for (v, p) in views.iter_mut().zip(a.present()) {
        *v = packed_view(a, p).transpose().map_err(&err)?;
    }
    match a.present().count() {
        1 => run_packed::<1>(pool, a, &views),
        2 => run_packed::<2>(pool, a, &views),
        _ => run_packed::<3>(pool, a, &views),
    }
    .map_err(err)
}

/// The kernels' view of a packed part's weight (`None`: not a block format).
fn packed_view<'a>(
    a: &GroupedLinearArgs<HostView>,
    p: &'a LinearPart<HostView>,
) -> Option<Result<PackedView<'a>, QuantError>> {
    let LinearWeight::Packed { blocks, format, .. } = &p.weight else {
        return None;
    };
    // SAFETY: a validated range, only read.
    let bytes = unsafe { blocks.bytes() };
    Some(PackedView::from_packed(
        *format,
        p.out_features,
        a.in_features,
        bytes,
    ))
}

/// A packed part as the quantized kernels take it.
fn group_part<'a>(
    a: &GroupedLinearArgs<HostView>,
    p: &'a LinearPart<HostView>,
    weight: &'a PackedView<'a>,
) -> GroupPart<'a> {
    // SAFETY (every view): validated ranges; each output is apart from every input and from
    // the other outputs, and only outputs are written.
    GroupPart {
        weight,
        bias: p
            .bias
            .as_ref()
            .map(|b| Bias::Bf16(unsafe { b.typed::<bf16>() })),
        out: match a.out_dtype {
            Dtype::F32 => LinearOut::F32(unsafe { p.out.typed_mut::<f32>() }),
            _ => LinearOut::Bf16(unsafe { p.out.typed_mut::<bf16>() }),
        },
    }
}

/// The first `N` parts (all present, all packed) as one group.
fn run_packed<const N: usize>(
    pool: &KernelPool,
    a: &GroupedLinearArgs<HostView>,
    views: &[Option<PackedView<'_>>; MAX_LINEAR_PARTS],
) -> Result<(), QuantError> {
    let mut parts: [GroupPart<'_>; N] = std::array::from_fn(|i| {
        let p = a.parts[i].as_ref().expect("present");
        group_part(
            a,
            p,
            views[i].as_ref().expect("made for every present part"),
        )
    });
    // SAFETY: a validated range, only read.
    let x = unsafe { a.x.typed::<bf16>() };
    quant::linear_group(pool, x, a.rows, &mut parts)
}

/// One part whose weight is BF16, NVFP4 or FP8, on the float kernels.
fn run_float(
    pool: &KernelPool,
    op: &'static str,
    a: &GroupedLinearArgs<HostView>,
    p: &LinearPart<HostView>,
) -> Result<(), BackendError> {
    FLOAT_SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut s) => run_float_in(pool, op, a, p, &mut s),
        // Re-entered from inside a call on this thread: fresh buffers.
        Err(_) => run_float_in(pool, op, a, p, &mut FloatScratch::default()),
    })
}

fn run_float_in(
    pool: &KernelPool,
    op: &'static str,
    a: &GroupedLinearArgs<HostView>,
    p: &LinearPart<HostView>,
    s: &mut FloatScratch,
) -> Result<(), BackendError> {
    let (rows, in_features, out_features) = (a.rows, a.in_features, p.out_features);
    let widen = |v: &[bf16], into: &mut Vec<f32>| {
        into.clear();
        into.extend(v.iter().map(|x| x.to_f32()));
    };
    // SAFETY (every view below): validated ranges; `out` is apart from every input, which are
    // only read.
    let bias = match &p.bias {
        Some(b) => {
            widen(unsafe { b.typed::<bf16>() }, &mut s.bias);
            Some(&s.bias[..])
        }
        None => None,
    };
    widen(unsafe { a.x.typed::<bf16>() }, &mut s.xs);
    let xs = &s.xs;
    let scratch = &mut s.rows;
    // Each float format is its own `WeightRows` type, so one generic call is spelled once here.
    macro_rules! run {
        ($src:expr) => {
            linear_rows(
                pool,
                &$src,
                xs,
                bias,
                rows,
                in_features,
                out_features,
                scratch,
            )
        };
    }
    let result = match &p.weight {
        LinearWeight::Bf16 { weight } => {
            let src = Bf16Rows {
                weight: unsafe { weight.typed::<u16>() },
                in_features,
            };
            run!(src)
        }
        LinearWeight::Nvfp4 {
            codes,
            block_scales,
            global_scale,
        } => {
            let src = Nvfp4Rows {
                codes: unsafe { codes.bytes() },
                scales: unsafe { block_scales.bytes() },
                global_scale: *global_scale,
                in_features,
            };
            run!(src)
        }
        LinearWeight::Fp8 {
            weight,
            block_scales,
        } => {
            let src = Fp8Rows {
                weight: unsafe { weight.bytes() },
                block_scales: unsafe { block_scales.typed::<f32>() },
                in_features,
            };
            run!(src)
        }
        LinearWeight::Packed { .. } => unreachable!("packed parts run as groups"),
    }
    .map_err(quant_err(op))?;
    match a.out_dtype {
        Dtype::F32 => unsafe { p.out.typed_mut::<f32>() }.copy_from_slice(result),
        _ => {
            let out = unsafe { p.out.typed_mut::<bf16>() };
            for (o, &v) in out.iter_mut().zip(result) {
                *o = bf16::from_f32(v);
            }
        }
    }
    Ok(())
}
