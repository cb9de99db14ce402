//! GGUF files: the header, the metadata key/values, the tensor infos and the aligned data,
//! memory-mapped; and the `ModelConfig` a Llama-family GGUF describes.
//!
//! Written here rather than taken from a crate: the format is small (a few hundred lines of
//! spec), and the crates that read it either belong to a whole inference framework or stop
//! at parsing, while this crate needs the parse, exact errors naming the tensor, and the
//! block dequantization in [`super::tensors`] on top of one memory map.
//!
//! Invariants: every tensor's byte range is checked against the file length at open, so a
//! cut-short file is an error naming the first tensor that does not fit; shapes are
//! reported outermost first (GGUF stores dims innermost first).

use super::config::{ModelFamily, RopeScaling};
use super::tensors::{RawTensor, TensorSource, TensorType};
use super::{ModelConfig, ModelError};
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

const MAGIC: &[u8; 4] = b"GGUF";

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// Any unsigned integer type.
    UInt(u64),
    /// Any signed integer type.
    Int(i64),
    /// f32 or f64.
    Float(f64),
    /// bool.
    Bool(bool),
    /// UTF-8 string (invalid bytes replaced).
    Str(String),
    /// An array of values.
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// As an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::UInt(v) => Some(v),
            GgufValue::Int(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    /// As a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::Float(v) => Some(v),
            GgufValue::UInt(v) => Some(v as f64),
            GgufValue::Int(v) => Some(v as f64),
            _ => None,
        }
    }

    /// As a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// As an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(v) => Some(v),
            _ => None,
        }
    }
}

struct TensorEntry {
    dtype: TensorType,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A memory-mapped GGUF file.
pub struct GgufFile {
    path: String,
    map: Mmap,
    /// Metadata key/values.
    pub metadata: HashMap<String, GgufValue>,
    tensors: HashMap<String, TensorEntry>,
    order: Vec<String>,
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
    path: &'a str,
}

impl<'a> Cursor<'a> {
    fn err(&self, message: String) -> ModelError {
        ModelError::Format {
            path: self.path.to_string(),
            format: "GGUF",
            message,
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], ModelError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len());
        let Some(end) = end else {
            return Err(self.err(format!(
                "the file ends at byte {} while reading {what} ({n} bytes at {})",
                self.b.len(),
                self.pos
            )));
        };
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u32(&mut self, what: &str) -> Result<u32, ModelError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, ModelError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn string(&mut self, what: &str) -> Result<String, ModelError> {
        let n = self.u64(what)? as usize;
        Ok(String::from_utf8_lossy(self.take(n, what)?).into_owned())
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<GgufValue, ModelError> {
        let what = format!("the value of {key:?}");
        let mut fixed = |n: usize| -> Result<u64, ModelError> {
            let b = self.take(n, &what)?;
            let mut a = [0u8; 8];
            a[..n].copy_from_slice(b);
            Ok(u64::from_le_bytes(a))
        };
        Ok(match ty {
            0 => GgufValue::UInt(fixed(1)?),
            1 => GgufValue::Int(fixed(1)? as u8 as i8 as i64),
            2 => GgufValue::UInt(fixed(2)?),
            3 => GgufValue::Int(fixed(2)? as u16 as i16 as i64),
            4 => GgufValue::UInt(fixed(4)?),
            5 => GgufValue::Int(fixed(4)? as u32 as i32 as i64),
            6 => GgufValue::Float(f32::from_bits(fixed(4)? as u32) as f64),
            7 => GgufValue::Bool(fixed(1)? != 0),
            8 => GgufValue::Str(self.string(&what)?),
            9 if depth < 4 => {
                let inner = self.u32(&what)?;
                let n = self.u64(&what)? as usize;
                // Every element takes at least one byte: a count larger than the rest of
                // the file is corruption, not a reason to reserve gigabytes.
                if n > self.b.len() - self.pos {
                    return Err(self.err(format!(
                        "{key:?}: array of {n} elements is longer than the file"
                    )));
                }
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(inner, key, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::UInt(fixed(8)?),
            11 => GgufValue::Int(fixed(8)? as i64),
            12 => GgufValue::Float(f64::from_bits(fixed(8)?)),
            other => return Err(self.err(format!("{key:?} has unknown value type {other}"))),
        })
    }
}

fn ggml_type(t: u32) -> TensorType {
    match t {
        0 => TensorType::F32,
        1 => TensorType::F16,
        2 => TensorType::Q4_0,
        3 => TensorType::Q4_1,
        8 => TensorType::Q8_0,
        30 => TensorType::Bf16,
        other => TensorType::Other(match other {
            6 => "Q5_0".into(),
            7 => "Q5_1".into(),
            10 => "Q2_K".into(),
            11 => "Q3_K".into(),
            12 => "Q4_K".into(),
            13 => "Q5_K".into(),
            14 => "Q6_K".into(),
            n => format!("ggml type {n}"),
        }),
    }
}

impl GgufFile {
    /// Maps and parses a GGUF file (versions 2 and 3).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let p = path.as_ref();
        let path = p.display().to_string();
        let io = |e: std::io::Error| ModelError::Io {
            path: path.clone(),
            message: e.to_string(),
        };
        let file = File::open(p).map_err(io)?;
        // SAFETY: read-only map; modifying the file while loading is unsupported, as with
        // every mmap-based loader.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let mut c = Cursor {
            b: &map,
            pos: 0,
            path: &path,
        };
        if c.take(4, "the magic")? != MAGIC {
            return Err(c.err("it does not start with the GGUF magic".into()));
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(c.err(format!("version {version} is not supported (2 or 3)")));
        }
        let n_tensors = c.u64("the tensor count")? as usize;
        let n_kv = c.u64("the metadata count")? as usize;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string("a metadata key")?;
            let ty = c.u32("a metadata type")?;
            let v = c.value(ty, &key, 0)?;
            metadata.insert(key, v);
        }
        let mut infos = Vec::new();
        for _ in 0..n_tensors {
            let name = c.string("a tensor name")?;
            let n_dims = c.u32("tensor dims")? as usize;
            if n_dims > 8 {
                return Err(c.err(format!("tensor {name:?} has {n_dims} dims")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.u64("a tensor dim")? as usize);
            }
            let ty = ggml_type(c.u32("a tensor type")?);
            let offset = c.u64("a tensor offset")? as usize;
            dims.reverse();
            infos.push((name, dims, ty, offset));
        }
        let align = metadata
            .get("general.alignment")
            .and_then(GgufValue::as_u64)
            .unwrap_or(32)
            .max(1) as usize;
        let data_start = c.pos.div_ceil(align) * align;
        let mut tensors = HashMap::new();
        let mut order = Vec::new();
        for (name, shape, dtype, offset) in infos {
            let numel: usize = shape.iter().product();
            // A type without a known size is accepted here and refused on conversion.
            let nbytes = dtype.nbytes(numel).unwrap_or(0);
            let start = data_start.saturating_add(offset);
            let end = start.saturating_add(nbytes);
            if end > map.len() {
                return Err(ModelError::Truncated {
                    path,
                    tensor: name,
                    start,
                    end,
                    file_len: map.len(),
                });
            }
            order.push(name.clone());
            tensors.insert(
                name,
                TensorEntry {
                    dtype,
                    shape,
                    start,
                    end,
                },
            );
        }
        Ok(GgufFile {
            path,
            map,
            metadata,
            tensors,
            order,
        })
    }

    /// `general.architecture` (`"llama"`, `"qwen2"`, ...).
    pub fn architecture(&self) -> Option<&str> {
        self.metadata
            .get("general.architecture")
            .and_then(GgufValue::as_str)
    }

    fn meta_err(&self, key: &str, message: &str) -> ModelError {
        ModelError::Format {
            path: self.path.clone(),
            format: "GGUF",
            message: format!("metadata {key:?} {message}"),
        }
    }

    fn meta_usize(&self, key: &str) -> Result<Option<usize>, ModelError> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| self.meta_err(key, "is not a non-negative integer")),
        }
    }

    fn meta_f32(&self, key: &str) -> Result<Option<f32>, ModelError> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| self.meta_err(key, "is not a number")),
        }
    }

    /// The `ModelConfig` the `{arch}.*` metadata describes (llama, qwen2, qwen3).
    pub fn model_config(&self) -> crate::Result<ModelConfig> {
        let arch = self
            .architecture()
            .ok_or_else(|| self.meta_err("general.architecture", "is missing"))?
            .to_string();
        let family = match arch.as_str() {
            "llama" => ModelFamily::Llama,
            "qwen2" => ModelFamily::Qwen2,
            "qwen3" => ModelFamily::Qwen3,
            other => {
                return Err(self
                    .meta_err(
                        "general.architecture",
                        &format!("is {other:?}; supported: llama, qwen2, qwen3"),
                    )
                    .into())
            }
        };
        let key = |k: &str| format!("{arch}.{k}");
        let need = |k: &str| -> Result<usize, ModelError> {
            self.meta_usize(&key(k))?
                .ok_or_else(|| self.meta_err(&key(k), "is missing"))
        };
        let hidden_size = need("embedding_length")?;
        let heads = need("attention.head_count")?;
        let kv_heads = self
            .meta_usize(&key("attention.head_count_kv"))?
            .unwrap_or(heads);
        let head_dim = self
            .meta_usize(&key("attention.key_length"))?
            .unwrap_or(hidden_size / heads.max(1));
        let rotary = self
            .meta_usize(&key("rope.dimension_count"))?
            .unwrap_or(head_dim);
        let vocab_size = match self.meta_usize(&key("vocab_size"))? {
            Some(v) => v,
            None => self
                .metadata
                .get("tokenizer.ggml.tokens")
                .and_then(GgufValue::as_array)
                .map(|a| a.len())
                .or_else(|| self.tensors.get("token_embd.weight").map(|t| t.shape[0]))
                .ok_or_else(|| self.meta_err(&key("vocab_size"), "is missing"))?,
        };
        let rope_scaling = match self
            .metadata
            .get(&key("rope.scaling.type"))
            .and_then(GgufValue::as_str)
        {
            None | Some("none") => None,
            Some(kind) => Some(RopeScaling {
                kind: kind.to_string(),
                factor: self.meta_f32(&key("rope.scaling.factor"))?.unwrap_or(1.0),
                low_freq_factor: None,
                high_freq_factor: None,
                original_max_position_embeddings: self
                    .meta_usize(&key("rope.scaling.original_context_length"))?,
            }),
        };
        let eos = self.meta_usize("tokenizer.ggml.eos_token_id")?;
        let config = ModelConfig {
            family,
            hidden_size,
            intermediate_size: need("feed_forward_length")?,
            num_hidden_layers: need("block_count")?,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: self
                .meta_f32(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-6),
            rope_theta: self.meta_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0),
            rope_scaling,
            partial_rotary_factor: rotary as f32 / head_dim.max(1) as f32,
            max_position_embeddings: self.meta_usize(&key("context_length"))?.unwrap_or(4096),
            tie_word_embeddings: !self.tensors.contains_key("output.weight"),
            attention_bias: self.tensors.contains_key("blk.0.attn_q.bias"),
            qk_norm: self.tensors.contains_key("blk.0.attn_q_norm.weight"),
            num_nextn_predict_layers: 0,
            moe: None,
            eos_token_ids: eos.map(|e| vec![e as u32]).unwrap_or_default(),
        };
        config.validate()?;
        Ok(config)
    }
}

impl TensorSource for GgufFile {
    fn path(&self) -> &str {
        &self.path
    }

    fn names(&self) -> Vec<String> {
        self.order.clone()
    }

    fn tensor(&self, name: &str) -> Result<Option<RawTensor<'_>>, ModelError> {
        Ok(self.tensors.get(name).map(|t| RawTensor {
            dtype: t.dtype.clone(),
            shape: t.shape.clone(),
            data: &self.map[t.start..t.end],
        }))
    }
}
