//! The MTP module's weights and where the three checkpoint layouts keep them.
//!
//! | layout | prefix | embedding norm, hidden norm, projection, final norm |
//! | --- | --- | --- |
//! | DeepSeek-V3 / GLM-4.5+ | `model.layers.{num_hidden_layers}.` | `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` |
//! | MiMo | `model.mtp_layers.{i}.` | `token_layernorm`, `hidden_layernorm`, `input_proj`, `final_layernorm` |
//! | Qwen3-Next | `mtp.` | `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc`, `norm` |
//! | EAGLE-3 | (none) | `layers.0.input_layernorm`, `layers.0.hidden_norm`, `fc`, `norm` |
//!
//! EAGLE-3 is drafted only by [`Eagle3Head`](crate::speculative::Eagle3Head), which loads it
//! (the original checkpoints name the layer `midlayer.` rather than `layers.0.`): its
//! projection (`fc`, `[hidden, n * target hidden]`) fuses the captured target layers and is
//! applied to the target's rows only, and its layer's q/k/v read `[enorm(embed) |
//! hnorm(fused)]` (`2 * hidden` columns) with `fused` as the residual.
//!
//! The decoder layer is the model layer's one decoder layer ([`LayerWeights`]), at the
//! prefix itself (DeepSeek, MiMo) or at `mtp.layers.0.` (Qwen3-Next), with Hugging Face's
//! part names. Which options it has is read from the checkpoint: q/k/v biases and q/k norms
//! when their tensors are there, a routed MoE MLP when it has a router (`mlp.gate.weight`),
//! gated attention and zero-centred norms from the layout, and DeepSeek-V3's multi-head
//! latent attention when the config gives its sizes (loaded as a target layer's is). Invariants of a loaded
//! [`MtpWeights`]: every projection has the shape the config implies (`eh_proj` `[hidden, 2 *
//! hidden]`; `q_proj` twice as tall under gated attention); Qwen3-Next's zero-centred norms
//! are stored as `1 + w`, so every norm here is a plain RMSNorm weight.

pub(crate) use crate::model::layers::load_norm;
use crate::model::layers::{
    load_linear, ExpertShard, LayerNames, LayerOptions, LayerWeights, MoeScoring,
};
use crate::model::tensors::TensorSource;
use crate::model::{DenseWeight, DeviceAllocations, Linear, ModelConfig, ModelError};

/// Which family's MTP module this is; decides names, concatenation order and attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MtpLayout {
    /// DeepSeek-V3 and GLM-4.5+: `model.layers.{num_hidden_layers}.*`, embedding first.
    DeepseekV3,
    /// MiMo: `model.mtp_layers.{i}.*`, hidden first, Qwen2 attention (q/k/v bias).
    Mimo,
    /// Qwen3-Next / 3.5: `mtp.*`, embedding first, gated attention, q/k norm, zero-centred norms.
    Qwen3Next,
    /// EAGLE-3: `fc` over the captured target layers, attention over the concatenation
    /// (embedding first); loaded and drafted by
    /// [`Eagle3Head`](crate::speculative::Eagle3Head) only.
    Eagle3,
}

impl MtpLayout {
    /// Short name, used in binding kinds and messages.
    pub fn name(self) -> &'static str {
        match self {
            MtpLayout::DeepseekV3 => "deepseek_v3",
            MtpLayout::Mimo => "mimo",
            MtpLayout::Qwen3Next => "qwen3_next",
            MtpLayout::Eagle3 => "eagle3",
        }
    }

    /// Parses [`MtpLayout::name`].
    pub fn parse(name: &str) -> Option<Self> {
        [Self::DeepseekV3, Self::Mimo, Self::Qwen3Next, Self::Eagle3]
            .into_iter()
            .find(|l| l.name() == name)
    }

    /// Whether the embedding comes first in the concatenation fed to the projection.
    pub fn embedding_first(self) -> bool {
        !matches!(self, MtpLayout::Mimo)
    }

    /// Whether attention has a sigmoid output gate (q_proj holds query and gate per head).
    pub fn gated_attention(self) -> bool {
        matches!(self, MtpLayout::Qwen3Next)
    }

    /// Whether the checkpoint's RMSNorm weights are stored as `w` for a scale of `1 + w`.
    pub fn zero_centered_norms(self) -> bool {
        matches!(self, MtpLayout::Qwen3Next)
    }

    /// `(module prefix, decoder-layer prefix)` for module `index`.
    pub fn prefixes(self, config: &ModelConfig, index: usize) -> (String, String) {
        match self {
            MtpLayout::DeepseekV3 => {
                let p = format!("model.layers.{}.", config.num_hidden_layers + index);
                (p.clone(), p)
            }
            MtpLayout::Mimo => {
                let p = format!("model.mtp_layers.{index}.");
                (p.clone(), p)
            }
            MtpLayout::Qwen3Next => ("mtp.".into(), format!("mtp.layers.{index}.")),
            MtpLayout::Eagle3 => (String::new(), format!("layers.{index}.")),
        }
    }

    /// `(embedding norm, hidden norm, projection, final norm)` names, without `.weight`.
    pub fn part_names(self) -> [&'static str; 4] {
        match self {
            MtpLayout::DeepseekV3 => ["enorm", "hnorm", "eh_proj", "shared_head.norm"],
            MtpLayout::Mimo => [
                "token_layernorm",
                "hidden_layernorm",
                "input_proj",
                "final_layernorm",
            ],
            MtpLayout::Qwen3Next => ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"],
            MtpLayout::Eagle3 => [
                "layers.0.input_layernorm",
                "layers.0.hidden_norm",
                "fc",
                "norm",
            ],
        }
    }
}

/// Every weight of one MTP module except the embedding and the LM head, which it shares
/// with the target (see [`MtpHead::new`](super::MtpHead::new)).
#[derive(Clone, Debug, PartialEq)]
pub struct MtpWeights {
    /// Which family's MTP module this is (tensor names, concatenation order, attention).
    pub layout: MtpLayout,
    /// RMSNorm of the token embedding (`enorm`; EAGLE-3's `input_layernorm`).
    pub enorm: DenseWeight,
    /// RMSNorm of the target hidden (`hnorm`; EAGLE-3's `hidden_norm`, of the fused hidden).
    pub hnorm: DenseWeight,
    /// `[hidden, 2 * hidden]`, applied to the concatenation (EAGLE-3: `fc`, `[hidden, n *
    /// target hidden]`, applied to the captured target layers).
    pub eh_proj: Linear,
    /// The module's decoder layer (attention and MLP), the same kind as a target layer's.
    pub layer: LayerWeights,
    /// The module's final RMSNorm (`shared_head.norm` / `final_layernorm` / `norm`).
    pub final_norm: DenseWeight,
}

impl MtpWeights {
    /// Every projection that is not a routed expert, with its slot name, in forward order.
    pub fn projections(&self) -> Vec<(String, &Linear)> {
        let mut all = vec![("eh_proj".to_string(), &self.eh_proj)];
        for (name, w) in self.layer.projections() {
            all.push((format!("layer.{name}"), w));
        }
        all
    }

    /// Every projection, routed experts included, to re-store.
    pub(crate) fn projections_mut(&mut self) -> Vec<&mut Linear> {
        let mut all = vec![&mut self.eh_proj];
        all.extend(self.layer.projections_mut());
        all
    }

    /// Bytes of weights one draft step reads (projections and norms; not the embedding row,
    /// the LM head, which the head counts itself, or the routed experts).
    pub fn nbytes(&self) -> usize {
        // EAGLE-3's `enorm` is its layer's own `input_layernorm`, which the layer counts.
        let enorm = match self.layout {
            MtpLayout::Eagle3 => 0,
            _ => self.enorm.nbytes(),
        };
        let norms = [&self.hnorm, &self.final_norm];
        self.eh_proj.nbytes()
            + enorm
            + norms.iter().map(|w| w.nbytes()).sum::<usize>()
            + self.layer.nbytes()
    }

    /// Loads module `index` of `layout` from `src`, checking every shape against `config`;
    /// with an `expert_shard`, only this rank's routed experts of a MoE layer.
    pub fn load(
        allocs: &DeviceAllocations,
        src: &dyn TensorSource,
        config: &ModelConfig,
        layout: MtpLayout,
        index: usize,
        expert_shard: Option<&ExpertShard>,
    ) -> crate::Result<Self> {
        if layout == MtpLayout::Eagle3 {
            return Err(ModelError::Format {
                path: src.path().to_string(),
                format: "MTP checkpoint",
                message: "EAGLE-3 weights are loaded by Eagle3Head".into(),
            }
            .into());
        }
        let (module, layer) = layout.prefixes(config, index);
        let h = config.hidden_size;
        let zc = layout.zero_centered_norms();
        let norm = |name: String| load_norm(allocs, src, &name, h, zc);
        let [en, hn, proj, fin] = layout.part_names();
        refuse_latent_without_sizes(src, config, &layer)?;
        let has = |part: &str| -> crate::Result<bool> {
            Ok(src.tensor(&format!("{layer}{part}"))?.is_some())
        };
        let options = LayerOptions {
            attention_bias: has("self_attn.q_proj.bias")?,
            qk_norm: has("self_attn.q_norm.weight")? || has("self_attn.k_norm.weight")?,
            gated_attention: layout.gated_attention(),
            zero_centered_norms: zc,
            experts: match (has("mlp.gate.weight")?, layout) {
                (false, _) | (_, MtpLayout::Mimo | MtpLayout::Eagle3) => None,
                (true, MtpLayout::DeepseekV3) => Some(MoeScoring::Sigmoid),
                (true, MtpLayout::Qwen3Next) => Some(MoeScoring::Softmax),
            },
            mlp_width: None,
            expert_shard: expert_shard.cloned(),
        };
        let names = LayerNames::hugging_face(layer);
        Ok(MtpWeights {
            layout,
            enorm: norm(format!("{module}{en}.weight"))?,
            hnorm: norm(format!("{module}{hn}.weight"))?,
            eh_proj: load_linear(allocs, src, &format!("{module}{proj}"), h, 2 * h)?,
            layer: LayerWeights::load(allocs, src, config, &names, &options)?,
            final_norm: norm(format!("{module}{fin}.weight"))?,
        })
    }
}

/// Refuses a layer with multi-head latent attention under a config that gives no MLA sizes
/// (`kv_lora_rank`, ...): the layer could not be read as the attention its tensors describe.
fn refuse_latent_without_sizes(
    src: &dyn TensorSource,
    config: &ModelConfig,
    layer: &str,
) -> crate::Result<()> {
    let name = format!("{layer}self_attn.kv_a_proj_with_mqa.weight");
    if config.mla.is_some() || src.tensor(&name)?.is_none() {
        return Ok(());
    }
    Err(ModelError::Format {
        path: src.path().to_string(),
        format: "MTP checkpoint",
        message: format!(
            "{name}: the layer has multi-head latent attention (MLA), but config.json gives \
             no kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim for it"
        ),
    }
    .into())
}

/// Finds the MTP module in `src`: the first layout whose projection tensor is present.
/// When none is, the error lists what was looked for and what the checkpoint holds.
pub fn find_layout(src: &dyn TensorSource, config: &ModelConfig) -> crate::Result<MtpLayout> {
    let mut looked = Vec::new();
    for layout in [MtpLayout::DeepseekV3, MtpLayout::Mimo, MtpLayout::Qwen3Next] {
        let (module, _) = layout.prefixes(config, 0);
        let name = format!("{module}{}.weight", layout.part_names()[2]);
        if src.tensor(&name)?.is_some() {
            return Ok(layout);
        }
        looked.push(name);
    }
    let mut groups: Vec<String> = Vec::new();
    for n in src.names() {
        let parts: Vec<&str> = n.split('.').collect();
        let g = match parts.as_slice() {
            ["model", "layers", i, ..] => format!("model.layers.{i}.*"),
            ["model", "mtp_layers", i, ..] => format!("model.mtp_layers.{i}.*"),
            [a, b, ..] => format!("{a}.{b}.*"),
            _ => n.clone(),
        };
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    let shown = if groups.len() > 12 {
        let n = groups.len();
        let mut g = groups[..6].to_vec();
        g.push(format!("... ({} more) ...", n - 12));
        g.extend_from_slice(&groups[n - 6..]);
        g
    } else {
        groups
    };
    Err(ModelError::Format {
        path: src.path().to_string(),
        format: "MTP checkpoint",
        message: format!(
            "no MTP module found: looked for {} (DeepSeek-V3/GLM, MiMo, Qwen3-Next layouts, num_hidden_layers = {}); the checkpoint holds {}",
            looked.join(", "),
            config.num_hidden_layers,
            shown.join(", ")
        ),
    }
    .into())
}
