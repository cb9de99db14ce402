//! Projections that read the same input rows (q, k and v; an MLP's gate and up) as one
//! `grouped_linear`: the backend may quantize the input once and spread every projection's
//! output features over its threads in one job (the CPU does), instead of once per
//! projection.
//!
//! Invariant: each output is bitwise what [`Linear::forward`] of that projection alone
//! writes; where grouping could change that (an NVFP4 projection whose bias is added after
//! rounding) or the projections do not share an input width, they run one by one.

use crate::backend::{BackendError, MAX_LINEAR_PARTS};
use crate::backend::{DevicePtr, Dtype, GpuBackend, GroupedLinearArgs, LinearPart};
use crate::model::{DenseWeight, Linear};

/// One projection of a group: `out = x @ weight^T (+ bias)`.
pub struct Projection<'a> {
    /// The weight, `[out_features, in_features]`.
    pub weight: &'a Linear,
    /// Its bias, `[out_features]`, if it has one.
    pub bias: Option<&'a DenseWeight>,
    /// BF16 `[rows, out_features]`.
    pub out: DevicePtr,
}

/// Every projection of `parts` (at most [`MAX_LINEAR_PARTS`]) over the BF16 input `x`
/// `[rows, in_features]`, into BF16 outputs.
pub fn project_bf16(
    gpu: &dyn GpuBackend,
    x: DevicePtr,
    rows: usize,
    stream: u64,
    parts: &[Projection<'_>],
) -> Result<(), BackendError> {
    let in_features = parts.first().map_or(0, |p| p.weight.dims().1);
    let groupable = parts.len() <= MAX_LINEAR_PARTS
        && parts.iter().all(|p| {
            p.weight.dims().1 == in_features
                && !(matches!(p.weight, Linear::Nvfp4(_)) && p.bias.is_some())
        });
    if !groupable || parts.len() < 2 {
        return parts.iter().try_for_each(|p| {
            p.weight
                .forward(gpu, p.out, Dtype::Bf16, x, p.bias, rows, stream)
        });
    }
    let mut group = [None; MAX_LINEAR_PARTS];
    for (slot, p) in group.iter_mut().zip(parts) {
        *slot = Some(LinearPart {
            out: p.out,
            weight: p.weight.descriptor(),
            bias: p.bias.map(|b| b.ptr),
            out_features: p.weight.dims().0,
        });
    }
    gpu.grouped_linear(GroupedLinearArgs {
        x,
        parts: group,
        out_dtype: Dtype::Bf16,
        rows,
        in_features,
        stream,
    })
}
