//! The shape checks `MtpHead::new` makes on the weights it is given, and reading the first
//! rows of a projection in place (the reduced draft vocabulary's LM head).
//!
//! Invariant: a [`first_rows`] view shares the projection's device memory and never owns
//! any; a shape error names the tensor, the shape found and the shape expected.

use super::bad;
use super::weights::{MtpLayout, MtpWeights};
use crate::backend::quant::GROUP_ROWS;
use crate::model::layers::LayerShape;
use crate::model::{DenseWeight, Fp8Weight, Linear, ModelConfig, PackedLinear, QuantizedWeight};

fn invalid(message: String) -> crate::Error {
    bad("MtpHead::new", message)
}

pub(crate) fn check_weights(
    w: &MtpWeights,
    embed: &Linear,
    final_norm: &DenseWeight,
    config: &ModelConfig,
) -> crate::Result<()> {
    let h = config.hidden_size;
    let found = w.eh_proj.dims();
    // EAGLE-3's fc reads the captured layers (any positive width); its layer attends over
    // the `2 * hidden` concatenation. An MTP projection reads the concatenation itself.
    let (want, attn_in) = match w.layout {
        MtpLayout::Eagle3 => ((h, found.1.max(1)), 2 * h),
        _ => ((h, 2 * h), h),
    };
    if found != want {
        return Err(invalid(format!(
            "eh_proj is [{}, {}], expected [{}, {}] for hidden_size {h}",
            found.0, found.1, want.0, want.1
        )));
    }
    w.layer
        .check_with_attention_input(&LayerShape::of(config), attn_in)
        .map_err(invalid)?;
    let vectors = [
        ("enorm", &w.enorm),
        ("hnorm", &w.hnorm),
        ("final_norm", &w.final_norm),
        ("target_final_norm", final_norm),
    ];
    for (name, wt) in vectors {
        if wt.shape != [h] {
            return Err(invalid(format!(
                "{name} has shape {:?}, expected [{h}]",
                wt.shape
            )));
        }
    }
    if embed.dims() != (config.vocab_size, h) {
        let (rows, cols) = embed.dims();
        return Err(invalid(format!(
            "embed_tokens has shape [{rows}, {cols}], expected [{}, {h}]",
            config.vocab_size
        )));
    }
    if !h.is_multiple_of(16) {
        return Err(invalid(format!(
            "hidden_size {h} must be a multiple of 16 for the NVFP4 LM head"
        )));
    }
    Ok(())
}

/// The first `n` rows of a row-major `[out, in]` projection, read in place: every storage
/// keeps a row's data (and its block scales) contiguous and in row order, so a prefix of
/// each buffer is the smaller matrix. A block format repacked for the CPU kernels keeps
/// rows in groups of [`GROUP_ROWS`] (group after group), so its prefix is a matrix only at a
/// group boundary: any other `n` is an error.
pub(crate) fn first_rows(lin: &Linear, n: usize) -> crate::Result<Linear> {
    if let Linear::Packed(q) = lin {
        if q.format.is_quantized() && !n.is_multiple_of(GROUP_ROWS) && n != q.out_features {
            return Err(invalid(format!(
                "a draft vocabulary of {n} rows of the {} LM head: the head reads its first rows in place, which needs a multiple of {GROUP_ROWS}",
                q.format
            )));
        }
    }
    Ok(match lin {
        Linear::Dense(w) => {
            let mut shape = w.shape.clone();
            shape[0] = n;
            Linear::Dense(DenseWeight { ptr: w.ptr, shape })
        }
        Linear::Nvfp4(q) => Linear::Nvfp4(QuantizedWeight {
            out_features: n,
            ..q.clone()
        }),
        Linear::Fp8(q) => Linear::Fp8(Fp8Weight {
            out_features: n,
            ..q.clone()
        }),
        Linear::Packed(q) => Linear::Packed(PackedLinear {
            out_features: n,
            ..q.clone()
        }),
    })
}
