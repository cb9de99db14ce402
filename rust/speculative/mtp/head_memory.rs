//! The device memory `MtpHead::new` allocates while it builds a head ([`Owned`], all freed
//! if the build fails part-way), and the projections it re-stores there in the format the
//! head was asked for ([`requantize`]).
//!
//! Invariant: every pointer `Owned` hands out is in its list until the build hands the list
//! to the head, so a failed build leaves the ledger as it found it.

use super::fp8::quantize_fp8;
use super::nvfp4::quantize_nvfp4;
use super::quantization::MtpQuantization;
use crate::backend::quant::{BlockFormat, PackedWeight};
use crate::backend::{DevicePtr, Dtype, GpuBackend, GpuBackendExt};
use crate::model::layers::keeps_block_formats;
use crate::model::{Fp8Weight, Linear, PackedLinear, QuantizedWeight};

/// Allocations made during `new`, freed if `new` fails part-way.
pub(super) struct Owned<'g> {
    pub(super) gpu: &'g dyn GpuBackend,
    pub(super) ptrs: Vec<DevicePtr>,
}

impl Owned<'_> {
    pub(super) fn alloc(
        &mut self,
        dtype: Dtype,
        len: usize,
        tag: &str,
    ) -> crate::Result<DevicePtr> {
        let p = self.gpu.alloc_zeros(dtype, len.max(1), tag)?;
        self.ptrs.push(p);
        Ok(p)
    }

    pub(super) fn upload<T: bytemuck::Pod>(
        &mut self,
        data: &[T],
        tag: &str,
    ) -> crate::Result<DevicePtr> {
        let p = self.gpu.upload(data, tag)?;
        self.ptrs.push(p);
        Ok(p)
    }

    pub(super) fn free_all(&mut self) {
        for p in self.ptrs.drain(..).rev() {
            // Ours and live: freeing cannot fail except on a backend bug the ledger reports.
            let _ = self.gpu.free(p);
        }
    }
}

/// Re-stores one dense projection as `quant` asks (NVFP4 or FP8 copies owned by the head).
pub(super) fn requantize(
    owned: &mut Owned<'_>,
    lin: &mut Linear,
    quant: MtpQuantization,
) -> crate::Result<()> {
    let Linear::Dense(w) = lin else {
        return Ok(());
    };
    let (out_f, in_f) = (w.shape[0], w.shape[1]);
    // As `load_model(weights=...)` does, a row that is not a whole number of blocks stays
    // as it is (a K-quant of a 576-wide projection, say).
    let keeps_blocks = |f: BlockFormat| keeps_block_formats(owned.gpu) && in_f % f.block_len() == 0;
    match quant {
        MtpQuantization::Bf16 => return Ok(()),
        MtpQuantization::Block(f) if !keeps_blocks(f) => return Ok(()),
        _ => {}
    }
    let values = owned.gpu.download_bf16(w.ptr, out_f * in_f)?;
    match quant {
        MtpQuantization::Block(format) => {
            let packed = PackedWeight::from_f32(format, out_f, in_f, &values).map_err(|e| {
                super::bad(
                    "MtpHead::new",
                    format!("quantizing a [{out_f}, {in_f}] projection to {format}: {e}"),
                )
            })?;
            *lin = Linear::Packed(PackedLinear {
                blocks: owned.upload(packed.bytes(), &format!("mtp:{format} weight"))?,
                format,
                out_features: out_f,
                in_features: in_f,
            });
        }
        MtpQuantization::Nvfp4 => {
            let q = quantize_nvfp4(&values, out_f, in_f)?;
            let weight = owned.upload(&q.codes, "mtp:nvfp4 weight")?;
            let weight_scale = owned.upload(&q.scales, "mtp:nvfp4 weight_scale")?;
            *lin = Linear::Nvfp4(QuantizedWeight {
                weight,
                weight_scale,
                weight_scale_2: q.global_scale,
                input_scale: None,
                out_features: out_f,
                in_features: in_f,
            });
        }
        MtpQuantization::Fp8 => {
            let q = quantize_fp8(&values, out_f, in_f)?;
            *lin = Linear::Fp8(Fp8Weight {
                weight: owned.upload(&q.codes, "mtp:fp8 weight")?,
                block_scales: owned.upload(&q.block_scales, "mtp:fp8 block_scales")?,
                out_features: out_f,
                in_features: in_f,
            });
        }
        MtpQuantization::Bf16 => {}
    }
    Ok(())
}
