//! The format-neutral view of a checkpoint: named tensors with a type, a shape (outermost
//! first) and their bytes in a memory map, plus conversion of every supported type to BF16.
//!
//! Both loaders (safetensors directories and GGUF files) implement [`TensorSource`], so the
//! model builder never sees a file format. GGUF's block-quantized types
//! ([`TensorType::Block`]) are kept as they are for backends with block kernels, and
//! dequantized exactly as ggml defines them (by [`crate::backend::quant::dequantize_bf16`])
//! for the others, rounded to BF16 once.

use super::ModelError;
use crate::backend::quant::{self, BlockFormat};
use half::{bf16, f16};
use rayon::prelude::*;

/// The element type of a stored tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TensorType {
    /// IEEE f32.
    F32,
    /// IEEE f16.
    F16,
    /// bfloat16.
    Bf16,
    /// Raw bytes (NVFP4 codes).
    U8,
    /// FP8 E4M3 (NVFP4 block scales).
    F8E4M3,
    /// A GGUF block-quantized format (Q4_0 .. Q8_0, Q2_K .. Q6_K), rows of blocks as ggml
    /// lays them out. Never a float format (those are the variants above).
    Block(BlockFormat),
    /// Anything else, by the format's own name.
    Other(String),
}

/// The types [`RawTensor::to_bf16`] reads.
pub const BF16_CONVERTIBLE: &str =
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K";

impl TensorType {
    /// Bytes taken by `n` elements, or `None` for a type without a fixed size, a block
    /// type whose block does not divide `n`, or a size that overflows `usize` (`n` comes
    /// from a file's header).
    pub fn nbytes(&self, n: usize) -> Option<usize> {
        match self {
            TensorType::F32 => n.checked_mul(4),
            TensorType::F16 | TensorType::Bf16 => n.checked_mul(2),
            TensorType::U8 | TensorType::F8E4M3 => Some(n),
            TensorType::Block(f) => f.row_bytes(n).ok(),
            TensorType::Other(_) => None,
        }
    }

    /// The type of a tensor stored in `format` (float formats map to their own variants).
    pub fn from_format(format: BlockFormat) -> Self {
        match format {
            BlockFormat::F32 => TensorType::F32,
            BlockFormat::F16 => TensorType::F16,
            BlockFormat::BF16 => TensorType::Bf16,
            f => TensorType::Block(f),
        }
    }

    /// The block format of a GGUF block type, `None` for every other type.
    pub fn block_format(&self) -> Option<BlockFormat> {
        match self {
            TensorType::Block(f) => Some(*f),
            _ => None,
        }
    }

    /// The name used in messages.
    pub fn name(&self) -> String {
        match self {
            TensorType::Other(s) => s.clone(),
            TensorType::Block(f) => f.name().to_uppercase(),
            t => format!("{t:?}").to_uppercase(),
        }
    }
}

/// One tensor as stored: its type, shape (outermost first) and bytes. The loaders guarantee
/// that a tensor of a type with a fixed size holds exactly `dtype.nbytes(numel())` bytes.
#[derive(Clone, Debug)]
pub struct RawTensor<'a> {
    /// Element type.
    pub dtype: TensorType,
    /// Shape, outermost first (GGUF's innermost-first dims are already reversed).
    pub shape: Vec<usize>,
    /// The stored bytes.
    pub data: &'a [u8],
}

impl RawTensor<'_> {
    /// Number of elements (saturating: a shape whose product overflows has no size, and
    /// [`TensorType::nbytes`] refuses it).
    pub fn numel(&self) -> usize {
        self.shape.iter().fold(1usize, |n, &d| n.saturating_mul(d))
    }

    /// The values as BF16 (f32/f16 rounded to nearest even; GGUF blocks dequantized in f32
    /// first). `name` and `path` are only for the error.
    pub fn to_bf16(&self, name: &str, path: &str) -> Result<Vec<bf16>, ModelError> {
        let n = self.numel();
        let unsupported = || ModelError::UnsupportedType {
            path: path.to_string(),
            tensor: name.to_string(),
            dtype: self.dtype.name(),
            supported: BF16_CONVERTIBLE,
        };
        let need = self.dtype.nbytes(n).ok_or_else(unsupported)?;
        if self.data.len() < need {
            return Err(ModelError::Truncated {
                path: path.to_string(),
                tensor: name.to_string(),
                start: 0,
                end: need,
                file_len: self.data.len(),
            });
        }
        let d = &self.data[..need];
        let mut out = vec![bf16::ZERO; n];
        // Elements are independent, so big tensors convert in parallel chunks of whole blocks.
        const CHUNK: usize = 32 * 1024;
        match self.dtype {
            TensorType::F32 => out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
                for (i, v) in o.iter_mut().enumerate() {
                    let j = (c * CHUNK + i) * 4;
                    *v = bf16::from_f32(f32::from_le_bytes([d[j], d[j + 1], d[j + 2], d[j + 3]]));
                }
            }),
            TensorType::F16 => out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
                for (i, v) in o.iter_mut().enumerate() {
                    let j = (c * CHUNK + i) * 2;
                    *v = bf16::from_f32(f16::from_le_bytes([d[j], d[j + 1]]).to_f32());
                }
            }),
            TensorType::Bf16 => out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
                for (i, v) in o.iter_mut().enumerate() {
                    let j = (c * CHUNK + i) * 2;
                    *v = bf16::from_le_bytes([d[j], d[j + 1]]);
                }
            }),
            TensorType::Block(format) => {
                // Whole rows of blocks per chunk, converted in parallel (load time only).
                let block = format.block_len();
                let chunk = CHUNK.div_ceil(block) * block;
                let bytes = format.row_bytes(chunk).map_err(|_| unsupported())?;
                let failed = out
                    .par_chunks_mut(chunk)
                    .zip(d.par_chunks(bytes))
                    .map(|(o, b)| quant::dequantize_bf16(format, b, o))
                    .find_any(Result::is_err);
                if failed.is_some() {
                    return Err(unsupported());
                }
            }
            _ => return Err(unsupported()),
        }
        Ok(out)
    }
}

/// A checkpoint: named tensors, read without copying until converted.
pub trait TensorSource: Send + Sync {
    /// The file or folder, for messages.
    fn path(&self) -> &str;
    /// Every tensor name.
    fn names(&self) -> Vec<String>;
    /// The tensor called `name`, or `None`.
    fn tensor(&self, name: &str) -> Result<Option<RawTensor<'_>>, ModelError>;

    /// The tensor called `name`; a missing one is an error naming it.
    fn require(&self, name: &str) -> Result<RawTensor<'_>, ModelError> {
        self.tensor(name)?.ok_or_else(|| ModelError::MissingTensor {
            path: self.path().to_string(),
            tensor: name.to_string(),
        })
    }

    /// The tensor `name` as BF16, checked against `expected` (outermost first).
    fn read_bf16(&self, name: &str, expected: &[usize]) -> Result<Vec<bf16>, ModelError> {
        let t = self.require(name)?;
        if t.shape != expected {
            return Err(ModelError::ShapeMismatch {
                path: self.path().to_string(),
                tensor: name.to_string(),
                expected: expected.to_vec(),
                found: t.shape.clone(),
            });
        }
        t.to_bf16(name, self.path())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16b(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn ggml_blocks_dequantize_to_their_definitions() {
        // Q4_1: element j is the low nibble of byte j, element j+16 the high nibble.
        let mut q41 = Vec::new();
        q41.extend(f16b(0.5));
        q41.extend(f16b(-1.0));
        q41.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let t = RawTensor {
            dtype: TensorType::Block(BlockFormat::Q4_1),
            shape: vec![32],
            data: &q41,
        };
        let v: Vec<f32> = t
            .to_bf16("t", "p")
            .unwrap()
            .iter()
            .map(|x| x.to_f32())
            .collect();
        for j in 0..16 {
            assert_eq!(v[j], j as f32 * 0.5 - 1.0);
            assert_eq!(v[j + 16], (15 - j) as f32 * 0.5 - 1.0);
        }
        let mut q40 = Vec::new();
        q40.extend(f16b(2.0));
        q40.extend((0..16u8).map(|j| j | (3 << 4)));
        let t = RawTensor {
            dtype: TensorType::Block(BlockFormat::Q4_0),
            shape: vec![32],
            data: &q40,
        };
        let v: Vec<f32> = t
            .to_bf16("t", "p")
            .unwrap()
            .iter()
            .map(|x| x.to_f32())
            .collect();
        assert_eq!(v[0], -16.0);
        assert_eq!(v[15], 14.0);
        assert_eq!(v[16], -10.0);
        let mut q80 = Vec::new();
        q80.extend(f16b(0.25));
        q80.extend((0..32i8).map(|j| (j - 16) as u8));
        let t = RawTensor {
            dtype: TensorType::Block(BlockFormat::Q8_0),
            shape: vec![32],
            data: &q80,
        };
        let v: Vec<f32> = t
            .to_bf16("t", "p")
            .unwrap()
            .iter()
            .map(|x| x.to_f32())
            .collect();
        assert_eq!(v[0], -4.0);
        assert_eq!(v[31], 3.75);
    }

    #[test]
    fn short_data_and_odd_types_are_errors_naming_the_tensor() {
        let t = RawTensor {
            dtype: TensorType::F32,
            shape: vec![4],
            data: &[0u8; 12],
        };
        let e = t.to_bf16("blk.0.w", "f.gguf").unwrap_err();
        assert!(matches!(e, ModelError::Truncated { .. }));
        assert!(e.to_string().contains("blk.0.w"), "{e}");
        let t = RawTensor {
            dtype: TensorType::Other("ggml type 99".into()),
            shape: vec![4],
            data: &[],
        };
        let e = t.to_bf16("x", "f.gguf").unwrap_err();
        assert!(
            e.to_string().contains("ggml type 99") && e.to_string().contains("\"x\""),
            "{e}"
        );
        let t = RawTensor {
            dtype: TensorType::Block(BlockFormat::Q4_1),
            shape: vec![33],
            data: &[0u8; 40],
        };
        assert!(matches!(
            t.to_bf16("x", "p"),
            Err(ModelError::UnsupportedType { .. })
        ));
    }
}
