//! GGUF files: the header, the metadata key/values, the tensor infos and the aligned data,
//! memory-mapped; and the `ModelConfig` a Llama-family, GQA mixture-of-experts (`qwen3moe`,
//! `glm4moe`) or DeepSeek-V3 (`deepseek2`, latent attention) GGUF describes (read in
//! `model_config`), whose stacked expert tensors it serves one expert at a time.
//!
//! `deepseek2` files come in two forms, both read: the first conversions keep `attn_kv_b`
//! whole and give the per-head sizes in `attention.key_length` (`qk_nope + qk_rope`) and
//! `value_length`; later ones split it into `attn_k_b` (per head `[kv_lora_rank,
//! qk_nope]`, transposed) and `attn_v_b`, set `key_length` / `value_length` to the latent's
//! widths and move the per-head sizes to `key_length_mla` / `value_length_mla`. Neither
//! permutes the query or key rows: RoPE pairs adjacent elements, as DeepSeek's own code does.
//!
//! Written here rather than taken from a crate: the format is small (a few hundred lines of
//! spec), and the crates that read it either belong to a whole inference framework or stop
//! at parsing, while this crate needs the parse, exact errors naming the tensor, and the
//! block dequantization in [`super::tensors`] on top of one memory map.
//!
//! A GGUF file is untrusted input: the header is read by `gguf_reader`, which checks
//! every count and length before allocating and bounds the memory the header takes.
//!
//! Invariants: every tensor's byte range is checked (aligned, computed without overflow,
//! inside the file) at open, so a cut-short file is an error naming the first tensor that
//! does not fit, and a tensor of a known type holds exactly the bytes its shape needs; keys
//! and tensor names are unique; shapes are reported outermost first (GGUF stores dims
//! innermost first).

use super::file_bytes::FileBytes;
use super::gguf_reader::{Reader, MIN_KV_BYTES, MIN_TENSOR_INFO_BYTES};
use super::tensors::{RawTensor, TensorSource, TensorType};
use super::ModelError;
use crate::backend::quant::BlockFormat;
use std::collections::HashMap;
use std::mem::size_of;
use std::path::Path;

mod model_config;

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

/// A parsed GGUF file; its bytes are memory-mapped (or owned, see [`GgufFile::from_bytes`]).
pub struct GgufFile {
    path: String,
    bytes: FileBytes,
    /// Metadata key/values.
    pub metadata: HashMap<String, GgufValue>,
    tensors: HashMap<String, TensorEntry>,
    order: Vec<String>,
}

/// The tensor dims GGUF allows (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;
/// The largest `general.alignment` accepted (GGUF writers use 32).
const MAX_ALIGNMENT: u64 = 1 << 30;
/// Memory one tensor info takes beyond its name and dims (the map entry, the order list).
const TENSOR_INFO_MEMORY: usize = size_of::<TensorEntry>() + 2 * size_of::<String>() + 16;

/// One tensor info as read, before its byte range is placed.
struct TensorInfo {
    name: String,
    shape: Vec<usize>,
    numel: usize,
    dtype: TensorType,
    offset: u64,
}

fn ggml_type(t: u32) -> TensorType {
    match BlockFormat::from_ggml_type(t) {
        Ok(format) => TensorType::from_format(format),
        Err(_) => TensorType::Other(format!("ggml type {t}")),
    }
}

/// Reads one tensor info: its name, dims (innermost first in the file), type and offset.
fn read_tensor_info(r: &mut Reader<'_>) -> Result<TensorInfo, ModelError> {
    let name = r.name("a tensor name")?;
    let n_dims = r.u32(&format!("the dims count of tensor {name:?}"))?;
    if n_dims > MAX_DIMS {
        return Err(r.out_of_range(
            format!("the dims count of tensor {name:?}"),
            n_dims,
            format!("GGUF tensors have at most {MAX_DIMS} dims"),
        ));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        dims.push(r.u64(&format!("a dim of tensor {name:?}"))?);
    }
    r.charge(TENSOR_INFO_MEMORY + 2 * name.len() + dims.len() * 8, &name)?;
    let numel = dims
        .iter()
        .try_fold(1usize, |n, &d| usize::try_from(d).ok()?.checked_mul(n))
        .ok_or_else(|| {
            r.out_of_range(
                format!("the shape of tensor {name:?}"),
                format!("{dims:?} (innermost first)"),
                "its element count overflows 64 bits",
            )
        })?;
    let dtype = ggml_type(r.u32(&format!("the type of tensor {name:?}"))?);
    let offset = r.u64(&format!("the data offset of tensor {name:?}"))?;
    // The product fitting usize means every dim does too.
    let shape = dims.iter().rev().map(|&d| d as usize).collect();
    Ok(TensorInfo {
        name,
        shape,
        numel,
        dtype,
        offset,
    })
}

/// The byte range of a tensor's data, checked: aligned, without overflow, inside the file.
fn place_tensor(
    r: &Reader<'_>,
    info: &TensorInfo,
    data_start: usize,
    align: u64,
    file_len: usize,
) -> Result<(usize, usize), ModelError> {
    let name = &info.name;
    if !info.offset.is_multiple_of(align) {
        return Err(r.out_of_range(
            format!("the data offset of tensor {name:?}"),
            info.offset,
            format!("offsets are multiples of the alignment, {align}"),
        ));
    }
    // A type without a known size is accepted here and refused on conversion.
    let nbytes = match (&info.dtype, info.dtype.nbytes(info.numel)) {
        (_, Some(n)) => n,
        (TensorType::Other(_), None) => 0,
        (t, None) => {
            return Err(r.out_of_range(
                format!("the shape of tensor {name:?}"),
                format!("{:?}", info.shape),
                format!(
                    "{} elements of type {} are not a whole number of blocks, or overflow",
                    info.numel,
                    t.name()
                ),
            ))
        }
    };
    let start = usize::try_from(info.offset)
        .ok()
        .and_then(|o| data_start.checked_add(o));
    let end = start.and_then(|s| s.checked_add(nbytes));
    match (start, end) {
        (Some(start), Some(end)) if end <= file_len => Ok((start, end)),
        _ => Err(ModelError::Truncated {
            path: r.path().to_string(),
            tensor: name.clone(),
            start: start.unwrap_or(usize::MAX),
            end: end.unwrap_or(usize::MAX),
            file_len,
        }),
    }
}

impl GgufFile {
    /// Maps and parses a GGUF file (versions 2 and 3).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let p = path.as_ref();
        Self::parse(p.display().to_string(), FileBytes::map(p)?)
    }

    /// Parses a GGUF file held in memory; `name` stands for its path in messages.
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<Self, ModelError> {
        Self::parse(name.to_string(), FileBytes::Owned(bytes))
    }

    fn parse(path: String, bytes: FileBytes) -> Result<Self, ModelError> {
        let mut r = Reader::new(&bytes, &path);
        if r.take(4, "the magic")? != MAGIC {
            return Err(r.format_err("it does not start with the GGUF magic".into()));
        }
        let version = r.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(r.out_of_range("the version", version, "versions 2 and 3 are read"));
        }
        let n_tensors = r.count("the tensor count", MIN_TENSOR_INFO_BYTES)?;
        let n_kv = r.count("the metadata count", MIN_KV_BYTES)?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = r.name("a metadata key")?;
            let ty = r.u32(&format!("the type of {key:?}"))?;
            let value = r.value(ty, &key, 0)?;
            r.charge(size_of::<(String, GgufValue)>() + 16, &key)?;
            if metadata.contains_key(&key) {
                return Err(r.format_err(format!("metadata key {key:?} appears twice")));
            }
            metadata.insert(key, value);
        }
        let mut infos = Vec::new();
        for _ in 0..n_tensors {
            infos.push(read_tensor_info(&mut r)?);
        }
        let align = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => v
                .as_u64()
                .filter(|a| a.is_power_of_two() && *a <= MAX_ALIGNMENT)
                .ok_or_else(|| {
                    r.out_of_range(
                        "metadata \"general.alignment\"",
                        format!("{v:?}"),
                        format!("a power of two up to {MAX_ALIGNMENT} is expected"),
                    )
                })?,
        };
        // align <= 2^30 and pos <= the file's length: the rounding cannot overflow.
        let data_start = r.pos.div_ceil(align as usize) * align as usize;
        let mut tensors = HashMap::new();
        let mut order = Vec::new();
        for info in infos {
            let (start, end) = place_tensor(&r, &info, data_start, align, bytes.len())?;
            if tensors.contains_key(&info.name) {
                return Err(r.format_err(format!("tensor {:?} appears twice", info.name)));
            }
            order.push(info.name.clone());
            let entry = TensorEntry {
                dtype: info.dtype,
                shape: info.shape,
                start,
                end,
            };
            tensors.insert(info.name, entry);
        }
        Ok(GgufFile {
            path,
            bytes,
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
}

impl TensorSource for GgufFile {
    fn path(&self) -> &str {
        &self.path
    }

    fn names(&self) -> Vec<String> {
        self.order.clone()
    }

    fn tensor(&self, name: &str) -> Result<Option<RawTensor<'_>>, ModelError> {
        if let Some(t) = self.tensors.get(name) {
            return Ok(Some(RawTensor {
                dtype: t.dtype.clone(),
                shape: t.shape.clone(),
                data: &self.bytes[t.start..t.end],
            }));
        }
        // llama.cpp's glm4moe names the norm before the MLP `post_attention_norm`.
        if let Some(layer) = name.strip_suffix(".ffn_norm.weight") {
            if self.architecture() == Some("glm4moe") {
                return self.tensor(&format!("{layer}.post_attention_norm.weight"));
            }
        }
        self.expert_slice(name)
    }
}

impl GgufFile {
    /// Expert `e` of a stacked expert tensor, asked for as `{base}_exps.{e}.weight`: the
    /// `e`-th outermost slice of `{base}_exps.weight` (`[experts, rows, cols]`), whose
    /// bytes are contiguous in any format since a row holds whole blocks. `None` when the
    /// name is not of that form, the stacked tensor is absent or `e` is past its experts.
    fn expert_slice(&self, name: &str) -> Result<Option<RawTensor<'_>>, ModelError> {
        let Some((base, e)) = name
            .strip_suffix(".weight")
            .and_then(|n| n.rsplit_once('.'))
            .filter(|(base, _)| base.ends_with("_exps"))
        else {
            return Ok(None);
        };
        let (Ok(e), Some(t)) = (
            e.parse::<usize>(),
            self.tensors.get(&format!("{base}.weight")),
        ) else {
            return Ok(None);
        };
        let [experts, rows, cols] = t.shape[..] else {
            return Err(ModelError::Format {
                path: self.path.clone(),
                format: "GGUF",
                message: format!(
                    "{base}.weight holds stacked experts, so it must be [experts, rows, cols]; it is {:?}",
                    t.shape
                ),
            });
        };
        if e >= experts {
            return Ok(None);
        }
        // The open checked that the whole tensor holds exactly its bytes.
        let per = (t.end - t.start) / experts;
        let start = t.start + e * per;
        Ok(Some(RawTensor {
            dtype: t.dtype.clone(),
            shape: vec![rows, cols],
            data: &self.bytes[start..start + per],
        }))
    }
}
