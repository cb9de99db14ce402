//! How a DFlash head's projections are stored: as the checkpoint holds them, or re-stored at
//! load in a GGUF block format (`Q8_0`, say) by the quantizer `load_model(weights=...)` uses,
//! and then run by the block-format kernels the target's quantized projections run on.
//!
//! Invariant: only a backend with those kernels (the CPU backend) gets blocks, and only a
//! projection whose rows are whole blocks; everything else stays as loaded. A re-stored
//! projection's BF16 copy is freed at once, so the head holds one copy of each.

use super::load::DFlashWeights;
use crate::backend::quant::{BlockFormat, PackedWeight};
use crate::backend::GpuBackendExt;
use crate::model::layers::keeps_block_formats;
use crate::model::{DeviceAllocations, Linear, PackedLinear};
use crate::speculative::ProposerError;

/// Re-stores every dense projection of `weights` (`fc` and the layers') in `format`.
pub(crate) fn store_in(
    allocs: &DeviceAllocations,
    weights: &mut DFlashWeights,
    format: BlockFormat,
) -> crate::Result<()> {
    let gpu = allocs.gpu().clone();
    if !keeps_block_formats(gpu.as_ref()) || !format.is_quantized() {
        return Ok(());
    }
    let mut all: Vec<&mut Linear> = vec![&mut weights.fc];
    for layer in weights.layers.iter_mut() {
        all.extend(layer.projections_mut());
    }
    for lin in all {
        let Linear::Dense(w) = lin else {
            continue;
        };
        let (out_f, in_f) = (w.shape[0], w.shape[1]);
        if !in_f.is_multiple_of(format.block_len()) {
            continue;
        }
        let values = gpu.download_bf16(w.ptr, out_f * in_f)?;
        let packed = PackedWeight::from_f32(format, out_f, in_f, &values).map_err(|e| {
            ProposerError::InvalidArgument {
                method: "DFlashHead::from_checkpoint",
                message: format!("quantizing a [{out_f}, {in_f}] projection to {format}: {e}"),
            }
        })?;
        let blocks = allocs.upload(packed.bytes(), &format!("dflash:{format} weight"))?;
        allocs.free(w.ptr)?;
        *lin = Linear::Packed(PackedLinear {
            blocks,
            format,
            out_features: out_f,
            in_features: in_f,
        });
    }
    Ok(())
}
