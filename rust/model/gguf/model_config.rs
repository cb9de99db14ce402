//! The [`ModelConfig`] a GGUF file's `{arch}.*` metadata describes: the Llama family's sizes,
//! and for `qwen3moe` / `glm4moe` / `deepseek2` their experts and (for `deepseek2`) latent
//! attention and YaRN scaling.
//!
//! Invariants: a key of the wrong type is an error naming the key and the file; a missing
//! required key is an error naming it; every config returned has passed
//! [`ModelConfig::validate`].

use super::{GgufFile, GgufValue};
use crate::model::config::{MlaConfig, ModelFamily, MoeConfig, RopeScaling, YarnParams};
use crate::model::{ModelConfig, ModelError};

impl GgufFile {
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
