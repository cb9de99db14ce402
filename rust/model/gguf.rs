//! GGUF files: the header, the metadata key/values, the tensor infos and the aligned data,
//! memory-mapped; and the `ModelConfig` a Llama-family, GQA mixture-of-experts (`qwen3moe`,
//! `glm4moe`) or DeepSeek-V3 (`deepseek2`, latent attention) GGUF describes, whose stacked
//! expert tensors it serves one expert at a time.
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
//! A GGUF file is untrusted input: the header is read by [`super::gguf_reader`], which checks
//! every count and length before allocating and bounds the memory the header takes.
//!
//! Invariants: every tensor's byte range is checked (aligned, computed without overflow,
//! inside the file) at open, so a cut-short file is an error naming the first tensor that
//! does not fit, and a tensor of a known type holds exactly the bytes its shape needs; keys
//! and tensor names are unique; shapes are reported outermost first (GGUF stores dims
//! innermost first).

use super::config::{MlaConfig, ModelFamily, MoeConfig, RopeScaling, YarnParams};
use super::file_bytes::FileBytes;
use super::gguf_reader::{Reader, MIN_KV_BYTES, MIN_TENSOR_INFO_BYTES};
use super::tensors::{RawTensor, TensorSource, TensorType};
use super::{ModelConfig, ModelError};
use crate::backend::quant::BlockFormat;
use std::collections::HashMap;
use std::mem::size_of;
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
            Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| {
                self.meta_err(key, &format!("is {v:?}, not a non-negative integer"))
            }),
        }
    }

    fn meta_f32(&self, key: &str) -> Result<Option<f32>, ModelError> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| self.meta_err(key, &format!("is {v:?}, not a number"))),
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
            "qwen3moe" => ModelFamily::Qwen3Moe,
            "glm4moe" => ModelFamily::Glm4Moe,
            "deepseek2" => ModelFamily::DeepseekV3,
            other => {
                return Err(self
                    .meta_err(
                        "general.architecture",
                        &format!(
                            "is {other:?}; supported: llama, qwen2, qwen3, qwen3moe, glm4moe, deepseek2"
                        ),
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
        let mla = self.mla_config(&arch)?;
        // Under MLA the converter writes one KV head (the latent); the attention reads no
        // head count or width of its own, so they are set as a Hugging Face config has them:
        // every head, and the rotated width that RoPE's frequencies are computed over.
        let kv_heads = match mla {
            Some(_) => heads,
            None => self
                .meta_usize(&key("attention.head_count_kv"))?
                .unwrap_or(heads),
        };
        let head_dim = match &mla {
            Some(m) => m.qk_rope_head_dim,
            None => self
                .meta_usize(&key("attention.key_length"))?
                .unwrap_or(hidden_size / heads.max(1)),
        };
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
                .or_else(|| {
                    let embedding = self.tensors.get("token_embd.weight")?;
                    embedding.shape.first().copied()
                })
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
                yarn: self.yarn_params(&arch)?,
            }),
        };
        let eos = match self.meta_usize("tokenizer.ggml.eos_token_id")? {
            None => None,
            Some(e) => Some(u32::try_from(e).map_err(|_| {
                self.meta_err(
                    "tokenizer.ggml.eos_token_id",
                    &format!("is {e}, not a u32 token id"),
                )
            })?),
        };
        // glm4moe counts its MTP (nextn) layers in block_count; the main model has the rest.
        let nextn = self.meta_usize(&key("nextn_predict_layers"))?.unwrap_or(0);
        let num_hidden_layers = need("block_count")?.checked_sub(nextn).ok_or_else(|| {
            self.meta_err(&key("nextn_predict_layers"), "is more than block_count")
        })?;
        let moe = self.moe_config(&arch, num_hidden_layers)?;
        let config = ModelConfig {
            family,
            hidden_size,
            intermediate_size: need("feed_forward_length")?,
            num_hidden_layers,
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
            num_nextn_predict_layers: nextn,
            moe,
            mla,
            eos_token_ids: eos.map(|e| vec![e]).unwrap_or_default(),
        };
        config.validate()?;
        Ok(config)
    }

    /// The latent attention sizes of a `deepseek2` file (`None` for the other
    /// architectures), from either form the module docs describe.
    fn mla_config(&self, arch: &str) -> Result<Option<MlaConfig>, ModelError> {
        if arch != "deepseek2" {
            return Ok(None);
        }
        let key = |k: &str| format!("{arch}.{k}");
        let need = |k: &str| -> Result<usize, ModelError> {
            self.meta_usize(&key(k))?
                .ok_or_else(|| self.meta_err(&key(k), "is missing"))
        };
        let rope = need("rope.dimension_count")?;
        // The split form states the per-head sizes under `_mla`; the first form in the plain
        // keys.
        let (k_key, v_key) = match self.meta_usize(&key("attention.key_length_mla"))? {
            Some(_) => ("attention.key_length_mla", "attention.value_length_mla"),
            None => ("attention.key_length", "attention.value_length"),
        };
        let qk_head_dim = need(k_key)?;
        let qk_nope_head_dim = qk_head_dim.checked_sub(rope).ok_or_else(|| {
            self.meta_err(
                &key(k_key),
                &format!("is {qk_head_dim}, less than rope.dimension_count {rope}"),
            )
        })?;
        Ok(Some(MlaConfig {
            q_lora_rank: self.meta_usize(&key("attention.q_lora_rank"))?,
            kv_lora_rank: need("attention.kv_lora_rank")?,
            qk_nope_head_dim,
            qk_rope_head_dim: rope,
            v_head_dim: need(v_key)?,
            rope_interleave: true,
        }))
    }

    /// YaRN's parameters: `yarn_log_multiplier` is `0.1 * mscale_all_dim` (DeepSeek-V3's
    /// converter), whose `mscale` equals its `mscale_all_dim`; the betas where the file
    /// states them.
    fn yarn_params(&self, arch: &str) -> Result<YarnParams, ModelError> {
        let key = |k: &str| format!("{arch}.{k}");
        let all_dim = self
            .meta_f32(&key("rope.scaling.yarn_log_multiplier"))?
            .map(|m| m / 0.1);
        Ok(YarnParams {
            beta_fast: self.meta_f32(&key("rope.scaling.yarn_beta_fast"))?,
            beta_slow: self.meta_f32(&key("rope.scaling.yarn_beta_slow"))?,
            mscale: all_dim,
            mscale_all_dim: all_dim,
            attention_factor: None,
        })
    }

    /// The MoE sizes of a `qwen3moe` / `glm4moe` / `deepseek2` file (`None` for the dense
    /// architectures): llama.cpp's `expert_*` keys, `leading_dense_block_count` for GLM's
    /// and DeepSeek's dense first layers, and for Qwen3-MoE every layer without a router
    /// (`ffn_gate_inp`) dense.
    fn moe_config(&self, arch: &str, layers: usize) -> Result<Option<MoeConfig>, ModelError> {
        if !matches!(arch, "qwen3moe" | "glm4moe" | "deepseek2") {
            return Ok(None);
        }
        let key = |k: &str| format!("{arch}.{k}");
        let need = |k: &str| -> Result<usize, ModelError> {
            self.meta_usize(&key(k))?
                .ok_or_else(|| self.meta_err(&key(k), "is missing"))
        };
        // GLM-4.5 and DeepSeek-V3 route alike: sigmoid scores, leading dense layers.
        let glm = matches!(arch, "glm4moe" | "deepseek2");
        let first_k_dense_replace = match glm {
            true => self
                .meta_usize(&key("leading_dense_block_count"))?
                .unwrap_or(0),
            false => 0,
        };
        let mlp_only_layers = match glm {
            true => Vec::new(),
            false => (0..layers)
                .filter(|i| {
                    !self
                        .tensors
                        .contains_key(&format!("blk.{i}.ffn_gate_inp.weight"))
                })
                .collect(),
        };
        // llama.cpp's qwen3moe always renormalises the chosen weights; its deepseek2 does
        // where the file says so (DeepSeek-V3's converter writes the key only when true).
        let norm_topk_prob = match self.metadata.get(&key("expert_weights_norm")) {
            Some(GgufValue::Bool(b)) => *b,
            Some(v) => {
                return Err(self.meta_err(
                    &key("expert_weights_norm"),
                    &format!("is {v:?}, not a bool"),
                ))
            }
            None => arch != "deepseek2",
        };
        if glm {
            // llama.cpp's gating function 2 is sigmoid, GLM's and DeepSeek-V3's scoring; 1
            // (softmax) is not. A deepseek2 file without the key is a DeepSeek-V2 one, which
            // llama.cpp routes with softmax.
            let default = if arch == "deepseek2" { 1 } else { 2 };
            let gating = self
                .meta_usize(&key("expert_gating_func"))?
                .unwrap_or(default);
            if gating != 2 {
                return Err(self.meta_err(
                    &key("expert_gating_func"),
                    &format!(
                        "is {gating} (or absent); {arch} is read with sigmoid scores (2) only, as \
                         GLM-4.5 and DeepSeek-V3 route"
                    ),
                ));
            }
        }
        Ok(Some(MoeConfig {
            num_experts: need("expert_count")?,
            experts_per_token: need("expert_used_count")?,
            expert_intermediate_size: need("expert_feed_forward_length")?,
            num_shared_experts: self.meta_usize(&key("expert_shared_count"))?.unwrap_or(0),
            norm_topk_prob,
            routed_scaling_factor: self.meta_f32(&key("expert_weights_scale"))?.unwrap_or(1.0),
            n_group: self.meta_usize(&key("expert_group_count"))?.unwrap_or(1),
            topk_group: self
                .meta_usize(&key("expert_group_used_count"))?
                .unwrap_or(1),
            first_k_dense_replace,
            decoder_sparse_step: 1,
            mlp_only_layers,
        }))
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
