//! Weights on the device: dense BF16 matrices, NVFP4 (ModelOpt layout) and block-scaled FP8
//! quantized ones, GGUF block formats repacked for the CPU kernels ([`PackedLinear`]); and
//! [`Linear`], which runs any of them through the backend's one `linear` op (its
//! [`LinearWeight`] descriptor says which format the kernel reads).
//!
//! Invariants:
//! - A weight's pointers were allocated on the backend it is used with, and its `shape` is
//!   the shape of the data behind them (outermost first, as in PyTorch).
//! - Weights do not free themselves (a [`DevicePtr`] has no `Drop`); whoever loaded them
//!   owns the pointers, usually through a [`DeviceAllocations`] that frees them all at once.

use crate::backend::quant::BlockFormat;
use crate::backend::{
    BackendError, DevicePtr, Dtype, ElementwiseArgs, ElementwiseOp, GpuBackend, GpuBackendExt,
    LinearArgs, LinearWeight,
};
use half::bf16;
use std::sync::{Arc, Mutex};

/// A set of device allocations freed together: on [`DeviceAllocations::free_all`] or on drop.
///
/// Loaders push every pointer they allocate here, so a load that fails half-way frees what it
/// had already uploaded, and a model that is dropped leaves the ledger at zero.
pub struct DeviceAllocations {
    gpu: Arc<dyn GpuBackend>,
    ptrs: Mutex<Vec<DevicePtr>>,
}

impl DeviceAllocations {
    /// An empty set on `gpu`.
    pub fn new(gpu: Arc<dyn GpuBackend>) -> Self {
        DeviceAllocations {
            gpu,
            ptrs: Mutex::new(Vec::new()),
        }
    }

    /// The backend the allocations live on.
    pub fn gpu(&self) -> &Arc<dyn GpuBackend> {
        &self.gpu
    }

    /// Takes ownership of `ptr` (freed with the set).
    pub fn adopt(&self, ptr: DevicePtr) {
        self.ptrs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(ptr);
    }

    /// Allocates `nbytes` zeroed bytes owned by the set.
    pub fn alloc(&self, nbytes: usize, tag: &str) -> Result<DevicePtr, BackendError> {
        let ptr = self.gpu.alloc(nbytes.max(1), tag)?;
        self.adopt(ptr);
        Ok(ptr)
    }

    /// Uploads `data` into a new buffer owned by the set.
    pub fn upload<T: bytemuck::Pod>(
        &self,
        data: &[T],
        tag: &str,
    ) -> Result<DevicePtr, BackendError> {
        let ptr = self.gpu.upload(data, tag)?;
        self.adopt(ptr);
        Ok(ptr)
    }

    /// Frees `ptr` now and stops owning it; an error if the set does not own it.
    pub fn free(&self, ptr: DevicePtr) -> Result<(), BackendError> {
        let mut ptrs = self.ptrs.lock().unwrap_or_else(|e| e.into_inner());
        let Some(i) = ptrs.iter().position(|&p| p == ptr) else {
            return Err(BackendError::InvalidArgument {
                op: "DeviceAllocations::free",
                message: format!("{ptr:?} is not owned by this set"),
            });
        };
        ptrs.swap_remove(i);
        drop(ptrs);
        self.gpu.free(ptr)
    }

    /// Live allocations owned by the set.
    pub fn len(&self) -> usize {
        self.ptrs.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether the set owns nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Frees everything; the first error is returned after trying every pointer. Calling it
    /// again frees nothing.
    pub fn free_all(&self) -> Result<(), BackendError> {
        let ptrs = std::mem::take(&mut *self.ptrs.lock().unwrap_or_else(|e| e.into_inner()));
        let mut first = None;
        for p in ptrs.into_iter().rev() {
            if let Err(e) = self.gpu.free(p) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for DeviceAllocations {
    fn drop(&mut self) {
        // Errors here mean a pointer was freed behind our back; the ledger reports it.
        let _ = self.free_all();
    }
}

/// A dense BF16 tensor on the device.
#[derive(Clone, Debug, PartialEq)]
pub struct DenseWeight {
    /// BF16 data, row-major.
    pub ptr: DevicePtr,
    /// Shape, outermost first (`[out_features, in_features]` for a projection).
    pub shape: Vec<usize>,
}

impl DenseWeight {
    /// Uploads BF16 values of `shape` into `allocs`.
    pub fn upload(
        allocs: &DeviceAllocations,
        name: &str,
        shape: &[usize],
        data: &[bf16],
    ) -> Result<Self, BackendError> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(BackendError::InvalidArgument {
                op: "DenseWeight::upload",
                message: format!(
                    "{name}: shape {shape:?} holds {n} values, got {}",
                    data.len()
                ),
            });
        }
        Ok(DenseWeight {
            ptr: allocs.upload(data, name)?,
            shape: shape.to_vec(),
        })
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of device memory the weight occupies.
    pub fn nbytes(&self) -> usize {
        self.numel() * Dtype::Bf16.size()
    }
}

/// An NVFP4 weight in NVIDIA ModelOpt's layout (W4A16 here: activations stay BF16).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedWeight {
    /// u8 `[out_features, in_features / 2]`: two E2M1 codes a byte, low nibble = even column.
    pub weight: DevicePtr,
    /// FP8 E4M3 `[out_features, in_features / 16]`, one scale per 16 columns.
    pub weight_scale: DevicePtr,
    /// The tensor-wide scale every element is multiplied by.
    pub weight_scale_2: f32,
    /// The activation scale of the checkpoint, kept for W4A4 kernels (unused by W4A16).
    pub input_scale: Option<f32>,
    /// Rows of the logical matrix.
    pub out_features: usize,
    /// Columns of the logical matrix (a multiple of 16).
    pub in_features: usize,
}

impl QuantizedWeight {
    /// Bytes of device memory the weight occupies.
    pub fn nbytes(&self) -> usize {
        self.out_features * self.in_features / 2 + self.out_features * self.in_features / 16
    }
}

/// An FP8 E4M3 weight with a scale per 128 x 128 block (DeepSeek-V3's FP8 layout; see
/// [`LinearWeight::Fp8`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Weight {
    /// One E4M3 byte per element, `[out_features, in_features]`.
    pub weight: DevicePtr,
    /// f32 `[ceil(out_features / 128), ceil(in_features / 128)]` (`weight_scale_inv`).
    pub block_scales: DevicePtr,
    /// Rows of the logical matrix.
    pub out_features: usize,
    /// Columns of the logical matrix.
    pub in_features: usize,
}

impl Fp8Weight {
    /// Bytes of device memory the weight occupies.
    pub fn nbytes(&self) -> usize {
        let blocks = self.out_features.div_ceil(crate::backend::FP8_BLOCK)
            * self.in_features.div_ceil(crate::backend::FP8_BLOCK);
        self.out_features * self.in_features + blocks * Dtype::F32.size()
    }
}

/// A weight in a GGUF block format, repacked for the CPU kernels
/// ([`crate::backend::quant::PackedWeight`]): exactly as many bytes as the file's blocks.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedLinear {
    /// The packed bytes.
    pub blocks: DevicePtr,
    /// The GGUF block format of the rows.
    pub format: BlockFormat,
    /// Rows of the logical matrix.
    pub out_features: usize,
    /// Columns of the logical matrix.
    pub in_features: usize,
}

impl PackedLinear {
    /// Bytes of device memory the weight occupies (the file's bytes for it).
    pub fn nbytes(&self) -> usize {
        self.format
            .matrix_bytes(self.out_features, self.in_features)
            .unwrap_or(usize::MAX)
    }
}

/// A projection weight of any kind, plus its optional bias.
#[derive(Clone, Debug, PartialEq)]
pub enum Linear {
    /// BF16 `[out, in]`.
    Dense(DenseWeight),
    /// NVFP4 `[out, in]`.
    Nvfp4(QuantizedWeight),
    /// FP8 E4M3 `[out, in]` with block scales.
    Fp8(Fp8Weight),
    /// A GGUF block format `[out, in]`, repacked (CPU backends only).
    Packed(PackedLinear),
}

impl Linear {
    /// `(out_features, in_features)`.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            Linear::Dense(w) => (w.shape[0], w.shape[1]),
            Linear::Nvfp4(w) => (w.out_features, w.in_features),
            Linear::Fp8(w) => (w.out_features, w.in_features),
            Linear::Packed(w) => (w.out_features, w.in_features),
        }
    }

    /// Bytes of device memory the weight occupies (read once per forward).
    pub fn nbytes(&self) -> usize {
        match self {
            Linear::Dense(w) => w.nbytes(),
            Linear::Nvfp4(w) => w.nbytes(),
            Linear::Fp8(w) => w.nbytes(),
            Linear::Packed(w) => w.nbytes(),
        }
    }

    /// The name of the stored format (`"bf16"`, `"nvfp4"`, `"q4_1"`, ...).
    pub fn format_name(&self) -> &'static str {
        self.descriptor().format()
    }

    /// The kernel's descriptor of this weight.
    pub fn descriptor(&self) -> LinearWeight {
        match self {
            Linear::Dense(w) => LinearWeight::Bf16 { weight: w.ptr },
            Linear::Nvfp4(w) => LinearWeight::Nvfp4 {
                codes: w.weight,
                block_scales: w.weight_scale,
                global_scale: w.weight_scale_2,
            },
            Linear::Fp8(w) => LinearWeight::Fp8 {
                weight: w.weight,
                block_scales: w.block_scales,
            },
            Linear::Packed(w) => LinearWeight::Packed {
                blocks: w.blocks,
                format: w.format,
                out_features: w.out_features,
                in_features: w.in_features,
            },
        }
    }

    /// `out = x @ W^T (+ bias)` for `rows` rows; `out` of `out_dtype`.
    ///
    /// An NVFP4 projection's bias is added to the BF16-rounded product, one row at a time,
    /// rather than inside the kernel: that is the rounding the recorded outputs of the MTP
    /// heads (and their numpy reference) were made with, so it stays until they are
    /// deliberately re-recorded.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        gpu: &dyn GpuBackend,
        out: DevicePtr,
        out_dtype: Dtype,
        x: DevicePtr,
        bias: Option<&DenseWeight>,
        rows: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        let (out_features, in_features) = self.dims();
        let post_bias = match (self, bias) {
            (Linear::Nvfp4(_), Some(b)) if out_dtype == Dtype::Bf16 => Some(b),
            (Linear::Nvfp4(_), Some(_)) => {
                return Err(BackendError::InvalidArgument {
                    op: "Linear::forward",
                    message: "an NVFP4 projection with a bias needs a bf16 output".into(),
                })
            }
            _ => None,
        };
        gpu.linear(LinearArgs {
            out,
            out_dtype,
            x,
            weight: self.descriptor(),
            bias: if post_bias.is_some() {
                None
            } else {
                bias.map(|b| b.ptr)
            },
            rows,
            in_features,
            out_features,
            stream,
        })?;
        if let Some(b) = post_bias {
            for r in 0..rows {
                let row = out.offset(r * out_features * Dtype::Bf16.size());
                gpu.elementwise(ElementwiseArgs {
                    op: ElementwiseOp::Add,
                    out: row,
                    a: row,
                    b: b.ptr,
                    n: out_features,
                    stream,
                })?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;

    #[test]
    fn allocations_are_freed_on_drop_and_free_all_is_idempotent() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        {
            let allocs = DeviceAllocations::new(gpu.clone());
            let w = DenseWeight::upload(&allocs, "w", &[2, 3], &[bf16::ONE; 6]).unwrap();
            assert_eq!(w.nbytes(), 12);
            assert!(DenseWeight::upload(&allocs, "bad", &[2, 2], &[bf16::ONE; 3]).is_err());
            assert_eq!(gpu.ledger().live_count(), 1);
        }
        assert_eq!(gpu.ledger().live_count(), 0);
        let allocs = DeviceAllocations::new(gpu.clone());
        allocs.alloc(8, "x").unwrap();
        allocs.free_all().unwrap();
        allocs.free_all().unwrap();
        assert_eq!(gpu.ledger().live_count(), 0);
    }

    #[test]
    fn nvfp4_linear_matches_dense_of_dequantized_weight() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let allocs = DeviceAllocations::new(gpu.clone());
        let (out_f, in_f) = (3, 16);
        let codes: Vec<u8> = (0..out_f * in_f / 2)
            .map(|i| (i * 37 % 256) as u8)
            .collect();
        let scales = vec![0x38u8; out_f]; // 1.0 in E4M3
        let dense: Vec<bf16> = (0..out_f * in_f)
            .map(|i| {
                let byte = codes[i / 2];
                let code = if i % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                bf16::from_f32(crate::backend::e2m1_to_f32(code) * 0.5)
            })
            .collect();
        let q = Linear::Nvfp4(QuantizedWeight {
            weight: allocs.upload(&codes, "codes").unwrap(),
            weight_scale: allocs.upload(&scales, "scales").unwrap(),
            weight_scale_2: 0.5,
            input_scale: None,
            out_features: out_f,
            in_features: in_f,
        });
        let d =
            Linear::Dense(DenseWeight::upload(&allocs, "dense", &[out_f, in_f], &dense).unwrap());
        let x: Vec<f32> = (0..2 * in_f).map(|i| (i as f32 - 8.0) / 4.0).collect();
        let x = gpu.upload_bf16(&x, "x").unwrap();
        allocs.adopt(x);
        let bias = DenseWeight::upload(&allocs, "b", &[out_f], &[bf16::from_f32(1.0); 3]).unwrap();
        let o1 = allocs.alloc(2 * out_f * 2, "o1").unwrap();
        let o2 = allocs.alloc(2 * out_f * 2, "o2").unwrap();
        q.forward(gpu.as_ref(), o1, Dtype::Bf16, x, Some(&bias), 2, 0)
            .unwrap();
        d.forward(gpu.as_ref(), o2, Dtype::Bf16, x, Some(&bias), 2, 0)
            .unwrap();
        // The NVFP4 path rounds to BF16 before adding the bias: equal up to one BF16 step.
        let (a, b) = (
            gpu.download_bf16(o1, 2 * out_f).unwrap(),
            gpu.download_bf16(o2, 2 * out_f).unwrap(),
        );
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= y.abs() / 128.0 + 1e-6, "{a:?} vs {b:?}");
        }
        assert_eq!(q.dims(), (3, 16));
        drop(allocs);
        assert_eq!(gpu.ledger().live_count(), 0);
    }
}
