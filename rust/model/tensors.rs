//! The format-neutral view of a checkpoint: named tensors with a type, a shape (outermost
//! first) and their bytes in a memory map, plus conversion of every supported type to BF16.
//!
//! Both loaders (safetensors directories and GGUF files) implement [`TensorSource`], so the
//! model builder never sees a file format. GGUF's block-quantized types are dequantized here
//! exactly as ggml defines them (block layouts below), then rounded to BF16 once.

use super::ModelError;
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
    /// GGUF Q8_0: blocks of 32 values, f16 scale + 32 i8.
    Q8_0,
    /// GGUF Q4_0: blocks of 32 values, f16 scale + 16 bytes of 4-bit codes (offset 8).
    Q4_0,
    /// GGUF Q4_1: blocks of 32 values, f16 scale, f16 minimum + 16 bytes of 4-bit codes.
    Q4_1,
    /// Anything else, by the format's own name.
    Other(String),
}

/// The types [`RawTensor::to_bf16`] reads.
pub const BF16_CONVERTIBLE: &str = "F32, F16, BF16, Q8_0, Q4_0, Q4_1";

impl TensorType {
    /// Bytes taken by `n` elements, or `None` for a type without a fixed size, a block
    /// type whose block does not divide `n`, or a size that overflows `usize` (`n` comes
    /// from a file's header).
    pub fn nbytes(&self, n: usize) -> Option<usize> {
        let blocks = |bytes: usize| (n % 32 == 0).then(|| (n / 32).checked_mul(bytes))?;
        match self {
            TensorType::F32 => n.checked_mul(4),
            TensorType::F16 | TensorType::Bf16 => n.checked_mul(2),
            TensorType::U8 | TensorType::F8E4M3 => Some(n),
            TensorType::Q8_0 => blocks(34),
            TensorType::Q4_0 => blocks(18),
            TensorType::Q4_1 => blocks(20),
            TensorType::Other(_) => None,
        }
    }

    /// The name used in messages.
    pub fn name(&self) -> String {
        match self {
            TensorType::Other(s) => s.clone(),
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
            TensorType::Q8_0 | TensorType::Q4_0 | TensorType::Q4_1 => {
                let kind = self.dtype.clone();
                let block_bytes = kind.nbytes(32).unwrap_or(0);
                out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
                    let mut vals = [0f32; 32];
                    for (b, ob) in o.chunks_mut(32).enumerate() {
                        let start = (c * CHUNK / 32 + b) * block_bytes;
                        dequant_block(&kind, &d[start..start + block_bytes], &mut vals);
                        for (v, x) in ob.iter_mut().zip(vals) {
                            *v = bf16::from_f32(x);
                        }
                    }
                })
            }
            _ => return Err(unsupported()),
        }
        Ok(out)
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes one 32-value ggml block.
fn dequant_block(kind: &TensorType, block: &[u8], out: &mut [f32; 32]) {
    match kind {
        TensorType::Q8_0 => {
            let d = f16_at(block, 0);
            for (j, o) in out.iter_mut().enumerate() {
                *o = block[2 + j] as i8 as f32 * d;
            }
        }
        TensorType::Q4_0 => {
            let d = f16_at(block, 0);
            for j in 0..16 {
                let q = block[2 + j];
                out[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
                out[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
            }
        }
        TensorType::Q4_1 => {
            let (d, m) = (f16_at(block, 0), f16_at(block, 2));
            for j in 0..16 {
                let q = block[4 + j];
                out[j] = (q & 0x0f) as f32 * d + m;
                out[j + 16] = (q >> 4) as f32 * d + m;
            }
        }
        _ => out.fill(0.0),
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
            dtype: TensorType::Q4_1,
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
            dtype: TensorType::Q4_0,
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
            dtype: TensorType::Q8_0,
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
            dtype: TensorType::Other("Q6_K".into()),
            shape: vec![4],
            data: &[],
        };
        let e = t.to_bf16("x", "f.gguf").unwrap_err();
        assert!(
            e.to_string().contains("Q6_K") && e.to_string().contains("\"x\""),
            "{e}"
        );
        let t = RawTensor {
            dtype: TensorType::Q4_1,
            shape: vec![33],
            data: &[0u8; 40],
        };
        assert!(matches!(
            t.to_bf16("x", "p"),
            Err(ModelError::UnsupportedType { .. })
        ));
    }
}
