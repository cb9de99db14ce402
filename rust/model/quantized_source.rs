//! [`QuantizedSource`]: a float checkpoint seen through a GGUF block format chosen at load
//! (`load_model(path, weights="q8_0")`), so the rest of loading treats it exactly like a GGUF
//! file of that format.
//!
//! Which tensors are quantized: every 2-D F32/F16/BF16 `*.weight` whose rows are a whole
//! number of the format's blocks (projections, the embedding, an LM head). Norms and biases
//! (1-D) stay as they are, and so does a matrix whose rows do not divide into blocks (a K-quant
//! of a 576-wide model, say), as llama.cpp's quantizer also keeps such tensors in another type.
//!
//! Invariants: a quantized tensor's bytes are ggml's quantizer's output for the tensor's values
//! (through `backend::quant::quantize`); every other tensor is the inner source's, untouched.

use super::tensors::{RawTensor, TensorSource, TensorType};
use super::ModelError;
use crate::backend::quant::{quantize_to_vec, BlockFormat};
use half::{bf16, f16};
use rayon::prelude::*;
use std::collections::HashMap;

/// A tensor source whose float matrices were quantized to one block format when it was made.
pub struct QuantizedSource<'a> {
    inner: &'a dyn TensorSource,
    format: BlockFormat,
    quantized: HashMap<String, (Vec<usize>, Vec<u8>)>,
}

/// The block format a `weights=` name asks for; an unknown name is an error listing the known.
pub fn parse_weights_format(name: &str) -> Result<BlockFormat, ModelError> {
    name.trim()
        .to_ascii_lowercase()
        .parse::<BlockFormat>()
        .map_err(|e| ModelError::invalid("load_model", e.to_string()))
}

fn quantizable(t: &RawTensor<'_>, name: &str, format: BlockFormat) -> bool {
    matches!(
        t.dtype,
        TensorType::F32 | TensorType::F16 | TensorType::Bf16
    ) && name.ends_with(".weight")
        && t.shape.len() == 2
        && t.shape[1].is_multiple_of(format.block_len())
}

/// The values of an F32/F16/BF16 tensor, exactly (a loader guarantees the byte count).
fn float_values(t: &RawTensor<'_>) -> Vec<f32> {
    let two = |c: &[u8]| [c[0], c[1]];
    match t.dtype {
        TensorType::F32 => t
            .data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        TensorType::F16 => t
            .data
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes(two(c)).to_f32())
            .collect(),
        _ => t
            .data
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes(two(c)).to_f32())
            .collect(),
    }
}

impl<'a> QuantizedSource<'a> {
    /// Quantizes every eligible tensor of `inner` to `format` (see the module doc).
    /// A format the quantizers do not produce (Q2_K, Q3_K) is an error before any work.
    pub fn new(inner: &'a dyn TensorSource, format: BlockFormat) -> Result<Self, ModelError> {
        let refuse = |e: crate::backend::quant::QuantError| {
            ModelError::invalid("load_model", format!("weights={format}: {e}"))
        };
        quantize_to_vec(format, &vec![0.0; format.block_len()]).map_err(refuse)?;
        let mut todo = Vec::new();
        for name in inner.names() {
            if let Some(t) = inner.tensor(&name)? {
                if quantizable(&t, &name, format) {
                    todo.push((name, t.shape.clone()));
                }
            }
        }
        let quantized = todo
            .into_par_iter()
            .map(|(name, shape)| {
                let values = float_values(&inner.require(&name)?);
                let bytes = quantize_to_vec(format, &values).map_err(refuse)?;
                Ok((name, (shape, bytes)))
            })
            .collect::<Result<HashMap<_, _>, ModelError>>()?;
        Ok(QuantizedSource {
            inner,
            format,
            quantized,
        })
    }

    /// The format the eligible tensors were quantized to.
    pub fn format(&self) -> BlockFormat {
        self.format
    }

    /// How many tensors were quantized.
    pub fn quantized_count(&self) -> usize {
        self.quantized.len()
    }
}

impl TensorSource for QuantizedSource<'_> {
    fn path(&self) -> &str {
        self.inner.path()
    }

    fn names(&self) -> Vec<String> {
        self.inner.names()
    }

    fn tensor(&self, name: &str) -> Result<Option<RawTensor<'_>>, ModelError> {
        match self.quantized.get(name) {
            Some((shape, bytes)) => Ok(Some(RawTensor {
                dtype: TensorType::from_format(self.format),
                shape: shape.clone(),
                data: bytes,
            })),
            None => self.inner.tensor(name),
        }
    }
}
