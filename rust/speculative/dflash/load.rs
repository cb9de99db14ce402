//! Reading a DFlash checkpoint's tensors (z-lab's layout): `fc.weight` `[hidden, n *
//! hidden]`, `hidden_norm.weight`, `norm.weight` and the draft layers `layers.{i}.*` (Qwen3
//! layers: q/k RMSNorm when the checkpoint has them, biases when it has them). The embedding
//! and the LM head are the target's and are not read here.
//!
//! Invariant: every shape is checked against the config before its tensor is uploaded, and a
//! missing or misshapen tensor is an error naming the file and the tensor; what was uploaded
//! lives in the given allocations, so a failed load frees it with them.

use super::config::DFlashConfig;
use crate::model::layers::{load_linear, load_norm, LayerNames, LayerOptions, LayerWeights};
use crate::model::tensors::TensorSource;
use crate::model::{DenseWeight, DeviceAllocations, Linear};

/// The weights of a DFlash head.
pub(crate) struct DFlashWeights {
    /// `[hidden, n * hidden]`: fuses the captured layers of one context row.
    pub fc: Linear,
    /// `[hidden]`: the RMSNorm of the fused context row.
    pub hidden_norm: DenseWeight,
    /// The draft layers, first to last.
    pub layers: Vec<LayerWeights>,
    /// `[hidden]`: the RMSNorm before the target's LM head.
    pub norm: DenseWeight,
}

impl DFlashWeights {
    /// Bytes of the draft's own weights one block forward reads.
    pub fn nbytes(&self) -> usize {
        self.layers.iter().map(|l| l.nbytes()).sum::<usize>()
            + self.hidden_norm.nbytes()
            + self.norm.nbytes()
    }
}

/// Loads every weight of the head for `taps` captured target layers.
pub(crate) fn load_weights(
    allocs: &DeviceAllocations,
    src: &dyn TensorSource,
    cfg: &DFlashConfig,
    taps: usize,
) -> crate::Result<DFlashWeights> {
    let config = &cfg.layer;
    let h = config.hidden_size;
    let has = |name: &str| -> crate::Result<bool> { Ok(src.tensor(name)?.is_some()) };
    // Every layer is read as layer 0 is stored: a later layer without the q/k norms or the
    // biases the first one has is a missing tensor.
    let options = LayerOptions {
        attention_bias: has("layers.0.self_attn.q_proj.bias")?,
        qk_norm: has("layers.0.self_attn.q_norm.weight")?
            || has("layers.0.self_attn.k_norm.weight")?,
        gated_attention: false,
        zero_centered_norms: false,
        experts: None,
        mlp_width: None,
        expert_shard: None,
    };
    let fc = load_linear(allocs, src, "fc", h, taps * h)?;
    let hidden_norm = load_norm(allocs, src, "hidden_norm.weight", h, false)?;
    let layers = (0..config.num_hidden_layers)
        .map(|i| {
            let names = LayerNames::hugging_face(format!("layers.{i}."));
            LayerWeights::load(allocs, src, config, &names, &options)
        })
        .collect::<crate::Result<Vec<_>>>()?;
    let norm = load_norm(allocs, src, "norm.weight", h, false)?;
    Ok(DFlashWeights {
        fc,
        hidden_norm,
        layers,
        norm,
    })
}
