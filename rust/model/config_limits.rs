//! The limits of a model configuration and [`ModelConfig::validate`], which every
//! configuration passes whatever its source (`config.json`, GGUF metadata, built by hand).
//!
//! A configuration comes from an untrusted file, so every size is bounded: products of sizes
//! cannot overflow, and a file cannot make a loader reserve memory for a model its tensors
//! do not hold (a hidden size of 2^40 would otherwise ask for a terabyte of RoPE table before
//! a tensor is read).

use super::config::{ConfigError, ModelConfig};
use super::config_json::Keys;

/// How many of [`LIMITS`] (from the first) must be non-zero.
const REQUIRED_SIZES: usize = 7;

/// The largest value accepted for each size of a configuration. Real models are far below
/// them (hidden 16,384, FFN 53,248, 128 heads, 512 experts, 262,144-token vocabularies); the
/// limits keep every product of sizes far from overflowing `usize`. The first
/// `REQUIRED_SIZES` are sizes every model has, which must also be non-zero.
pub const LIMITS: [(&str, usize); 11] = [
    ("hidden_size", 1 << 20),
    ("intermediate_size", 1 << 22),
    ("num_hidden_layers", 1 << 12),
    ("num_attention_heads", 1 << 12),
    ("num_key_value_heads", 1 << 12),
    ("head_dim", 1 << 12),
    ("vocab_size", 1 << 26),
    ("max_position_embeddings", 1 << 32),
    ("num_nextn_predict_layers", 1 << 8),
    ("num_experts", 1 << 16),
    ("moe_intermediate_size", 1 << 22),
];

/// The largest multi-head latent attention size accepted (DeepSeek-V3's largest is 1,536).
const MLA_LIMIT: usize = 1 << 16;

impl ModelConfig {
    /// Checks the invariants every consumer relies on: sizes non-zero and within [`LIMITS`],
    /// heads dividing evenly, positive finite scalars.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, message: String| Err(Keys::bad(key, message));
        let moe = self.moe.as_ref();
        let sizes = [
            self.hidden_size,
            self.intermediate_size,
            self.num_hidden_layers,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
            self.vocab_size,
            self.max_position_embeddings,
            self.num_nextn_predict_layers,
            moe.map_or(0, |m| m.num_experts),
            moe.map_or(0, |m| m.expert_intermediate_size),
        ];
        for ((key, limit), v) in LIMITS.iter().zip(sizes) {
            if v > *limit {
                return bad(key, format!("is {v}, above the largest accepted ({limit})"));
            }
        }
        for (key, v) in LIMITS
            .iter()
            .map(|(k, _)| *k)
            .zip(sizes)
            .take(REQUIRED_SIZES)
        {
            if v == 0 {
                return bad(key, "must be greater than zero".into());
            }
        }
        if let Some(m) = &self.mla {
            let sizes = [
                ("q_lora_rank", m.q_lora_rank.unwrap_or(1)),
                ("kv_lora_rank", m.kv_lora_rank),
                ("qk_nope_head_dim", m.qk_nope_head_dim),
                ("qk_rope_head_dim", m.qk_rope_head_dim),
                ("v_head_dim", m.v_head_dim),
            ];
            for (key, v) in sizes {
                if v == 0 || v > MLA_LIMIT {
                    return bad(key, format!("is {v}, not in 1..={MLA_LIMIT}"));
                }
            }
            if !m.qk_rope_head_dim.is_multiple_of(2) {
                return bad(
                    "qk_rope_head_dim",
                    format!("{} is odd; RoPE rotates pairs", m.qk_rope_head_dim),
                );
            }
            // The latent row is cached as two halves (see `kv_cache_row`).
            if !m.kv_lora_rank.is_multiple_of(2) {
                return bad(
                    "kv_lora_rank",
                    format!(
                        "{} is odd; the cached latent row (kv_lora_rank + qk_rope_head_dim) must split in two halves",
                        m.kv_lora_rank
                    ),
                );
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return bad(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(
                "head_dim",
                format!("{} is odd; RoPE rotates pairs", self.head_dim),
            );
        }
        if let Some(m) = moe {
            if m.experts_per_token == 0 || m.experts_per_token > m.num_experts {
                return bad(
                    "num_experts_per_tok",
                    format!("is {}, not in 1..={}", m.experts_per_token, m.num_experts),
                );
            }
            if m.num_shared_experts > m.num_experts {
                return bad(
                    "n_shared_experts",
                    format!(
                        "is {}, more than the {} experts",
                        m.num_shared_experts, m.num_experts
                    ),
                );
            }
            if !m.routed_scaling_factor.is_finite() {
                return bad("routed_scaling_factor", "must be finite".into());
            }
            if m.n_group == 0 || !m.num_experts.is_multiple_of(m.n_group) {
                return bad(
                    "n_group",
                    format!(
                        "is {}, which does not divide the {} routed experts",
                        m.n_group, m.num_experts
                    ),
                );
            }
            if m.topk_group == 0 || m.topk_group > m.n_group {
                return bad(
                    "topk_group",
                    format!("is {}, not in 1..={} (n_group)", m.topk_group, m.n_group),
                );
            }
            let kept = m.topk_group * (m.num_experts / m.n_group);
            if kept < m.experts_per_token {
                return bad(
                    "topk_group",
                    format!(
                        "keeps {} groups of {} experts, fewer than num_experts_per_tok {}",
                        m.topk_group,
                        m.num_experts / m.n_group,
                        m.experts_per_token
                    ),
                );
            }
            if m.decoder_sparse_step == 0 {
                return bad("decoder_sparse_step", "must be greater than zero".into());
            }
        }
        let positive = [
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_theta", self.rope_theta),
            (
                "rope_scaling.factor",
                self.rope_scaling.as_ref().map_or(1.0, |r| r.factor),
            ),
        ];
        for (key, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return bad(key, format!("is {v}; it must be positive and finite"));
            }
        }
        if !(self.partial_rotary_factor > 0.0 && self.partial_rotary_factor <= 1.0) {
            return bad(
                "partial_rotary_factor",
                format!("is {}; it must be in (0, 1]", self.partial_rotary_factor),
            );
        }
        Ok(())
    }
}
