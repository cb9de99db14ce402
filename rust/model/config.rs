//! `ModelConfig`: the sizes and switches of a target model, read from a Hugging Face
//! `config.json` (in `config_json`), built by hand, or from GGUF metadata by the loaders.
//!
//! A configuration comes from an untrusted file, so [`ModelConfig::validate`] (in
//! `config_limits`) bounds every size; `config.json` itself is read only up to
//! [`MAX_CONFIG_BYTES`].

use thiserror::Error;

/// What is wrong with a model configuration.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {message}")]
    Io {
        /// The file's path as given.
        path: String,
        /// The operating system's reason.
        message: String,
    },
    /// The text is not JSON, or not a JSON object.
    #[error("{path} is not a JSON object: {message}")]
    Json {
        /// The file's path as given.
        path: String,
        /// The parser's reason.
        message: String,
    },
    /// A required key is absent.
    #[error("config is missing required key {key:?} (model_type {model_type:?})")]
    MissingKey {
        /// The absent key.
        key: String,
        /// The config's `model_type`, which decides the required keys.
        model_type: String,
    },
    /// A key has the wrong type or an impossible value.
    #[error("config key {key:?}: {message}")]
    BadValue {
        /// The key with the bad value.
        key: String,
        /// What is wrong with its value.
        message: String,
    },
    /// A `model_type` this crate does not know.
    #[error("unknown model_type {0:?}; known: llama, qwen2, qwen3, qwen3_moe, qwen3_next, mimo, deepseek_v3, glm4_moe")]
    UnknownModelType(String),
    /// The file is larger than any configuration.
    #[error("{path} is {size} bytes; a configuration file is at most {limit} bytes")]
    TooLarge {
        /// The file's path as given.
        path: String,
        /// The file's size in bytes.
        size: u64,
        /// The largest size read, in bytes ([`MAX_CONFIG_BYTES`]).
        limit: u64,
    },
    /// An error about the contents of the file at `path`.
    #[error("{path}: {source}")]
    InFile {
        /// The file's path as given.
        path: String,
        /// The error about its contents.
        source: Box<ConfigError>,
    },
}

/// The largest `config.json` read (real ones are a few kilobytes).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The model family, which decides layer details (biases, q/k norm, MTP layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelFamily {
    /// Llama, SmolLM2 and other `model_type: llama` models.
    Llama,
    /// Qwen2 / Qwen2.5: q/k/v projections carry a bias.
    Qwen2,
    /// Qwen3: per-head RMSNorm on q and k.
    Qwen3,
    /// Qwen3-MoE: Qwen3's attention, softmax-routed experts without a shared expert.
    Qwen3Moe,
    /// Qwen3-Next: gated attention, q/k norm, MTP as `mtp.*`.
    Qwen3Next,
    /// MiMo: a Qwen2-style base with `model.mtp_layers.*`.
    Mimo,
    /// DeepSeek-V3: MTP as `model.layers.{num_hidden_layers}.*`.
    DeepseekV3,
    /// GLM-4.5+ (`glm4_moe`): the DeepSeek-V3 MTP layout.
    Glm4Moe,
}

impl ModelFamily {
    /// Parses a HF `model_type`.
    pub fn from_model_type(model_type: &str) -> Result<Self, ConfigError> {
        Ok(match model_type {
            "llama" | "smollm2" => ModelFamily::Llama,
            "qwen2" => ModelFamily::Qwen2,
            "qwen3" => ModelFamily::Qwen3,
            "qwen3_moe" => ModelFamily::Qwen3Moe,
            "qwen3_next" => ModelFamily::Qwen3Next,
            "mimo" => ModelFamily::Mimo,
            "deepseek_v3" => ModelFamily::DeepseekV3,
            "glm4_moe" => ModelFamily::Glm4Moe,
            other => return Err(ConfigError::UnknownModelType(other.to_string())),
        })
    }

    /// `partial_rotary_factor` when the config leaves it out: the family's default in
    /// `transformers` (GLM-4.5 rotates half of each head, Qwen3-Next a quarter).
    pub fn default_partial_rotary_factor(self) -> f32 {
        match self {
            ModelFamily::Glm4Moe => 0.5,
            ModelFamily::Qwen3Next => 0.25,
            _ => 1.0,
        }
    }

    /// `rms_norm_eps` when the config leaves it out: the family's default in `transformers`.
    pub fn default_rms_norm_eps(self) -> f32 {
        match self {
            ModelFamily::Glm4Moe => 1e-5,
            _ => 1e-6,
        }
    }

    /// The HF `model_type` of this family.
    pub fn model_type(self) -> &'static str {
        match self {
            ModelFamily::Llama => "llama",
            ModelFamily::Qwen2 => "qwen2",
            ModelFamily::Qwen3 => "qwen3",
            ModelFamily::Qwen3Moe => "qwen3_moe",
            ModelFamily::Qwen3Next => "qwen3_next",
            ModelFamily::Mimo => "mimo",
            ModelFamily::DeepseekV3 => "deepseek_v3",
            ModelFamily::Glm4Moe => "glm4_moe",
        }
    }
}

/// RoPE frequency scaling (`rope_scaling` in the config).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeScaling {
    /// `rope_type` (or `type`): `"linear"`, `"llama3"`, `"yarn"`, ...
    pub kind: String,
    /// The scaling factor.
    pub factor: f32,
    /// `low_freq_factor` (llama3).
    pub low_freq_factor: Option<f32>,
    /// `high_freq_factor` (llama3).
    pub high_freq_factor: Option<f32>,
    /// `original_max_position_embeddings`.
    pub original_max_position_embeddings: Option<usize>,
    /// YaRN's keys, as the config gives them (none for the other kinds).
    pub yarn: YarnParams,
}

/// YaRN's keys of `rope_scaling`, each `None` where the config leaves it out (`transformers`'
/// defaults then apply: `beta_fast` 32, `beta_slow` 1, no `mscale`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct YarnParams {
    /// Rotations per original context above which a frequency is kept (`beta_fast`).
    pub beta_fast: Option<f32>,
    /// Rotations per original context below which a frequency is divided by the factor
    /// (`beta_slow`).
    pub beta_slow: Option<f32>,
    /// `mscale`: the numerator of the cos/sin scale.
    pub mscale: Option<f32>,
    /// `mscale_all_dim`: the denominator of the cos/sin scale, and (DeepSeek-V3) what the
    /// attention's score scale is multiplied by, squared.
    pub mscale_all_dim: Option<f32>,
    /// `attention_factor`: the cos/sin scale given outright.
    pub attention_factor: Option<f32>,
}

/// YaRN's magnitude scale for a context `factor` (`0.1 * mscale * ln(factor) + 1`, 1 for a
/// factor of at most 1), as `transformers` and DeepSeek define it.
pub fn yarn_mscale(factor: f32, mscale: f32) -> f32 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}

/// Mixture-of-experts sizes, for the families whose MLPs route.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Routed experts.
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub experts_per_token: usize,
    /// Hidden size of one expert's MLP.
    pub expert_intermediate_size: usize,
    /// Always-on shared experts.
    pub num_shared_experts: usize,
    /// Whether the top-k weights are renormalised to sum to one.
    pub norm_topk_prob: bool,
    /// Scale applied to the routed output.
    pub routed_scaling_factor: f32,
    /// Groups the routed experts are split into for group-limited routing (`n_group`; 1:
    /// none).
    pub n_group: usize,
    /// Groups kept before the top-k experts are chosen from them (`topk_group`).
    pub topk_group: usize,
    /// Leading layers whose MLP is dense (`first_k_dense_replace`, DeepSeek-V3 / GLM).
    pub first_k_dense_replace: usize,
    /// Every `decoder_sparse_step`-th layer routes (Qwen3-MoE; 1: every layer).
    pub decoder_sparse_step: usize,
    /// Layers whose MLP is dense whatever the rules above say (`mlp_only_layers`, Qwen3-MoE).
    pub mlp_only_layers: Vec<usize>,
}

impl MoeConfig {
    /// Whether layer `layer`'s MLP routes to experts (else it is a dense SwiGLU of
    /// `intermediate_size`): not one of the first `first_k_dense_replace`, not listed in
    /// `mlp_only_layers`, and `layer + 1` a multiple of `decoder_sparse_step`.
    pub fn is_sparse(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace
            && !self.mlp_only_layers.contains(&layer)
            && (layer + 1).is_multiple_of(self.decoder_sparse_step.max(1))
    }
}

/// Multi-head latent attention sizes (DeepSeek-V3's `q_lora_rank`, `kv_lora_rank`,
/// `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`).
///
/// Each head's query is `qk_nope_head_dim` elements without RoPE then `qk_rope_head_dim`
/// with it; a token's keys and values are all derived from one latent row of
/// `kv_lora_rank` elements plus one `qk_rope_head_dim` RoPE key shared by every head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaConfig {
    /// Width of the query's low-rank bottleneck (`q_a_proj`); `None`: a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Width of the compressed key/value latent (`kv_a_proj_with_mqa`'s first part).
    pub kv_lora_rank: usize,
    /// Elements of each head's query and key that RoPE leaves alone.
    pub qk_nope_head_dim: usize,
    /// Elements of each head's query (and of the shared key) that RoPE rotates.
    pub qk_rope_head_dim: usize,
    /// Elements of each head's value.
    pub v_head_dim: usize,
    /// RoPE pairs adjacent elements (`rope_interleave`, true unless the config says false,
    /// as in `transformers`' DeepSeek-V3 and DeepSeek's own inference code).
    pub rope_interleave: bool,
}

impl MlaConfig {
    /// Elements of one token's cached latent: `kv_lora_rank + qk_rope_head_dim`.
    pub fn latent_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// Elements of one head's query: `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The attention's score scale before any RoPE scaling, `1 / sqrt(qk_head_dim)` (see
    /// [`ModelConfig::mla_softmax_scale`]).
    pub fn softmax_scale(&self) -> f32 {
        1.0 / (self.qk_head_dim() as f32).sqrt()
    }
}

/// The sizes and switches of a target model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The family (from `model_type`).
    pub family: ModelFamily,
    /// Model width.
    pub hidden_size: usize,
    /// Dense MLP width.
    pub intermediate_size: usize,
    /// Decoder layers of the main model (MTP layers not counted).
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE scaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// Fraction of each head that RoPE rotates (1.0 for all but a few families).
    pub partial_rotary_factor: f32,
    /// Longest context the model was trained for.
    pub max_position_embeddings: usize,
    /// Whether the LM head shares the embedding's weights.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v projections carry biases.
    pub attention_bias: bool,
    /// Whether q and k get a per-head RMSNorm (Qwen3, Qwen3-MoE, Qwen3-Next; GLM-4.5 with
    /// `use_qk_norm`).
    pub qk_norm: bool,
    /// MTP modules shipped in the checkpoint (`num_nextn_predict_layers`), 0 when none.
    pub num_nextn_predict_layers: usize,
    /// Mixture-of-experts sizes, when the MLPs route.
    pub moe: Option<MoeConfig>,
    /// Multi-head latent attention sizes, when attention is MLA (DeepSeek-V3).
    pub mla: Option<MlaConfig>,
    /// End-of-sequence token ids.
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// A small Llama-family config for tests and examples.
    pub fn tiny(vocab_size: usize) -> ModelConfig {
        ModelConfig {
            family: ModelFamily::Llama,
            hidden_size: 64,
            intermediate_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            vocab_size,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            partial_rotary_factor: 1.0,
            max_position_embeddings: 2048,
            tie_word_embeddings: true,
            attention_bias: false,
            qk_norm: false,
            num_nextn_predict_layers: 0,
            moe: None,
            mla: None,
            eos_token_ids: Vec::new(),
        }
    }

    /// Width of the query projection's output.
    pub fn q_size(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Width of the key (and of the value) projection's output.
    pub fn kv_size(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// The MLA score scale: `1 / sqrt(qk_head_dim)`, times `yarn_mscale(factor,
    /// mscale_all_dim)^2` when `rope_scaling` gives a non-zero `mscale_all_dim` (as
    /// `transformers`' DeepSeek-V3 does); `None` without MLA.
    pub fn mla_softmax_scale(&self) -> Option<f32> {
        let m = self.mla.as_ref()?;
        let mscale = match &self.rope_scaling {
            Some(rs) => match rs.yarn.mscale_all_dim {
                Some(all) if all != 0.0 => yarn_mscale(rs.factor, all),
                _ => 1.0,
            },
            None => 1.0,
        };
        Some(m.softmax_scale() * mscale * mscale)
    }

    /// `(heads, head_dim)` of a row of each of a layer's two KV caches (key and value):
    /// `(num_key_value_heads, head_dim)`, or under MLA `(1, latent_width / 2)`, the first
    /// half of each token's latent row in the key cache and the second in the value cache,
    /// so one token holds exactly one latent row and the cache ops move it whole.
    pub fn kv_cache_row(&self) -> (usize, usize) {
        match &self.mla {
            Some(m) => (1, m.latent_width() / 2),
            None => (self.num_key_value_heads, self.head_dim),
        }
    }

    /// Elements of a row of each of a layer's two KV caches (see
    /// [`ModelConfig::kv_cache_row`]).
    pub fn kv_cache_width(&self) -> usize {
        let (heads, dim) = self.kv_cache_row();
        heads * dim
    }
}
