//! The Llama-family decoder's weights: the embedding, the decoder layers (dense, or routed
//! experts where a MoE config says a layer is sparse; grouped-query or, where the config
//! has MLA sizes, multi-head latent attention), the final norm and the LM head,
//! loaded with every shape the config implies checked.
//!
//! Invariants: a loaded [`DecoderWeights`] has every tensor the config implies, with the
//! shape it implies (`[out, in]` projections); every device buffer it points to is owned
//! by the [`DeviceAllocations`] it was loaded into.

use super::layers::{
    load_dense, load_linear, ExpertShard, LayerOptions, LayerWeights, MoeMlp, MoeScoring,
};
pub use super::layers::{NameScheme, Part};
use super::tensors::TensorSource;
use super::weights::{DenseWeight, DeviceAllocations, Linear};
use super::{ModelConfig, ModelError, ModelFamily};

/// Every weight of a decoder-only Llama-family model.
pub struct DecoderWeights {
    /// `[vocab, hidden]` in the checkpoint's format (a GGUF block format stays one on the CPU
    /// backend); a tied LM head reads the same weight.
    pub embed: Linear,
    /// The decoder layers, first to last.
    pub layers: Vec<LayerWeights>,
    /// `[hidden]`: the RMSNorm before the LM head.
    pub final_norm: DenseWeight,
    /// `None` when tied to the embedding.
    pub lm_head: Option<Linear>,
}

impl DecoderWeights {
    /// Loads and checks every tensor `config` implies; with an `expert_shard`, only this
    /// rank's routed experts of each MoE layer.
    pub fn load(
        allocs: &DeviceAllocations,
        src: &dyn TensorSource,
        config: &ModelConfig,
        scheme: NameScheme,
        expert_shard: Option<&ExpertShard>,
    ) -> crate::Result<Self> {
        refuse_unsupported(src, config)?;
        let h = config.hidden_size;
        let (embed_name, norm_name, head_name) = scheme.globals();
        let embed_base = embed_name.trim_end_matches(".weight");
        let embed = load_linear(allocs, src, embed_base, config.vocab_size, h)?;
        let dense = LayerOptions {
            attention_bias: config.attention_bias,
            qk_norm: config.qk_norm,
            gated_attention: false,
            zero_centered_norms: false,
            experts: None,
            mlp_width: Some(config.intermediate_size),
            expert_shard: None,
        };
        let options = |layer: usize| match &config.moe {
            Some(m) if m.is_sparse(layer) => LayerOptions {
                experts: Some(moe_scoring(config)),
                // The shared experts are one SwiGLU of `n_shared_experts` experts' width;
                // without them the width is never read.
                mlp_width: (m.num_shared_experts > 0)
                    .then(|| m.expert_intermediate_size * m.num_shared_experts),
                expert_shard: expert_shard.cloned(),
                ..dense.clone()
            },
            _ => dense.clone(),
        };
        let layers = (0..config.num_hidden_layers)
            .map(|i| LayerWeights::load(allocs, src, config, &scheme.layer(i), &options(i)))
            .collect::<crate::Result<Vec<_>>>()?;
        let final_norm = load_dense(allocs, src, norm_name, &[h])?;
        let has_head = src.tensor(head_name)?.is_some();
        let lm_head =
            if has_head && !(config.tie_word_embeddings && scheme == NameScheme::HuggingFace) {
                let base = head_name.trim_end_matches(".weight");
                Some(load_linear(allocs, src, base, config.vocab_size, h)?)
            } else if config.tie_word_embeddings || scheme == NameScheme::Gguf {
                None
            } else {
                return Err(ModelError::MissingTensor {
                    path: src.path().to_string(),
                    tensor: head_name.to_string(),
                }
                .into());
            };
        Ok(DecoderWeights {
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }

    /// Bytes of weights one decode step reads (every layer with the router and `top_k`
    /// routed experts of a MoE layer, the final norm and the head; the embedding only for
    /// the rows looked up, so it is not counted unless tied).
    pub fn bytes_per_token(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.nbytes() + l.moe().map_or(0, MoeMlp::nbytes_per_row))
            .sum();
        self.final_norm.nbytes()
            + layers
            + self
                .lm_head
                .as_ref()
                .map_or(self.embed.nbytes(), Linear::nbytes)
    }

    /// The LM head: its own weight, or the embedding when tied.
    pub fn head(&self) -> &Linear {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// How a MoE family's router scores experts: sigmoid with group-limited top-k for
/// DeepSeek-V3 and GLM-4.5, softmax for the Qwen families.
fn moe_scoring(config: &ModelConfig) -> MoeScoring {
    match config.family {
        ModelFamily::DeepseekV3 | ModelFamily::Glm4Moe => MoeScoring::Sigmoid,
        _ => MoeScoring::Softmax,
    }
}

/// Refuses, naming the missing part, the families whose attention this decoder does not run;
/// their MoE MLPs would load.
fn refuse_unsupported(src: &dyn TensorSource, config: &ModelConfig) -> crate::Result<()> {
    let missing = match config.family {
        ModelFamily::DeepseekV3 if config.mla.is_none() => {
            "DeepSeek-V3 attention is multi-head latent attention (MLA), whose sizes the \
             config must give (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)"
        }
        ModelFamily::Qwen3Next => {
            "Qwen3-Next's linear-attention (Gated DeltaNet) and gated-attention layers are not \
             supported in target models"
        }
        _ => return Ok(()),
    };
    Err(ModelError::Format {
        path: src.path().to_string(),
        format: "target checkpoint",
        message: format!("model_type {}: {missing}", config.family.model_type()),
    }
    .into())
}
