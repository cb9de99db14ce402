//! `MtpQuantization`: how the head stores its projections, its names and the default per
//! backend.
//!
//! Invariant: [`MtpQuantization::parse`] accepts exactly the names [`MtpQuantization::name`]
//! gives (any case) and, for block formats, only those a quantizer exists for.

use super::bad;
use crate::backend::quant::{quantize_to_vec, BlockFormat};
use crate::backend::GpuBackend;
use crate::model::layers::keeps_block_formats;

/// How the head's projections (`eh_proj`, attention, MLP and routed experts; never the MoE
/// router) are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MtpQuantization {
    /// As given (BF16, or NVFP4 where the checkpoint already was).
    Bf16,
    /// Dense projections stored as FP8 E4M3 (one byte an element, W8A16) with one
    /// power-of-two scale per tensor, in the `linear` op's block-scaled layout; projections
    /// already FP8 in the checkpoint keep their own bytes and block scales.
    Fp8,
    /// Dense projections quantized to NVFP4 (ModelOpt layout) at construction.
    Nvfp4,
    /// Dense projections quantized at construction to a GGUF block format (`Q8_0`, say) by
    /// the same quantizer `load_model(weights=...)` uses, and run by the block-format
    /// kernels the target's quantized projections run on. Only a backend with those kernels
    /// (the CPU backend) keeps the blocks; any other keeps the projections as given, as a
    /// target loaded from a GGUF file does. Float formats (`F32`, `F16`, `BF16`) keep them too.
    Block(BlockFormat),
}

impl MtpQuantization {
    /// The option's name: `"bf16"`, `"fp8"`, `"nvfp4"` or a block format's (`"q8_0"`).
    pub fn name(self) -> &'static str {
        match self {
            MtpQuantization::Bf16 => "bf16",
            MtpQuantization::Fp8 => "fp8",
            MtpQuantization::Nvfp4 => "nvfp4",
            MtpQuantization::Block(f) => f.name(),
        }
    }

    /// Parses [`MtpQuantization::name`]'s spellings (any case); anything else is an error
    /// listing them.
    pub fn parse(name: &str) -> crate::Result<Self> {
        let lower = name.trim().to_ascii_lowercase();
        Ok(match lower.as_str() {
            "bf16" => MtpQuantization::Bf16,
            "fp8" => MtpQuantization::Fp8,
            "nvfp4" => MtpQuantization::Nvfp4,
            _ => match lower.parse::<BlockFormat>() {
                // Q2_K and Q3_K have no quantizer: only formats one can quantize to.
                Ok(f) if f.is_quantized() && quantize_to_vec(f, &vec![0.0; f.block_len()]).is_ok() => {
                    MtpQuantization::Block(f)
                }
                _ => {
                    return Err(bad(
                        "MtpHead::new",
                        format!(
                        "quant {name:?} is not one of bf16, fp8, nvfp4, or a GGUF block format to quantize to ({})",
                        BlockFormat::ALL
                            .iter()
                            .filter(|f| f.is_quantized() && quantize_to_vec(**f, &vec![0.0; f.block_len()]).is_ok())
                            .map(|f| f.name())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )))
                }
            },
        })
    }

    /// The projections' storage a draft step reads by default on `gpu`: Q8_0 where the
    /// backend runs block formats (a one-row draft step is bound by the bytes it reads, and
    /// Q8_0 reads 34 bytes per 32 weights against BF16's 64, on the kernels the target's own
    /// Q8_0 embedding uses), the projections as given elsewhere.
    pub fn default_for(gpu: &dyn GpuBackend) -> Self {
        if keeps_block_formats(gpu) {
            MtpQuantization::Block(BlockFormat::Q8_0)
        } else {
            MtpQuantization::Bf16
        }
    }
}
