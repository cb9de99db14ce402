//! The Llama-family decoder's weights: the embedding, the decoder layers, the final norm
//! and the LM head, loaded with every shape the config implies checked.
//!
//! Invariants: a loaded [`DecoderWeights`] has every tensor the config implies, with the
//! shape it implies (`[out, in]` projections); every device buffer it points to is owned
//! by the [`DeviceAllocations`] it was loaded into.

use super::layers::{load_dense, load_linear, LayerOptions, LayerWeights};
pub use super::layers::{NameScheme, Part};
use super::tensors::TensorSource;
use super::weights::{DenseWeight, DeviceAllocations, Linear};
use super::{ModelConfig, ModelError};

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
    /// Loads and checks every tensor `config` implies.
    pub fn load(
        allocs: &DeviceAllocations,
        src: &dyn TensorSource,
        config: &ModelConfig,
        scheme: NameScheme,
    ) -> crate::Result<Self> {
        let h = config.hidden_size;
        let (embed_name, norm_name, head_name) = scheme.globals();
        let embed_base = embed_name.trim_end_matches(".weight");
        let embed = load_linear(allocs, src, embed_base, config.vocab_size, h)?;
        let options = LayerOptions {
            attention_bias: config.attention_bias,
            qk_norm: config.qk_norm,
            gated_attention: false,
            zero_centered_norms: false,
            experts: None,
            mlp_width: Some(config.intermediate_size),
        };
        let layers = (0..config.num_hidden_layers)
            .map(|i| LayerWeights::load(allocs, src, config, &scheme.layer(i), &options))
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

    /// Bytes of weights one decode step reads (every layer, the final norm and the head;
    /// the embedding only for the rows looked up, so it is not counted unless tied).
    pub fn bytes_per_token(&self) -> usize {
        let layers: usize = self.layers.iter().map(LayerWeights::nbytes).sum();
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
