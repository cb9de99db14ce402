//! The MTP module's weights and where the three checkpoint layouts keep them.
//!
//! | layout | prefix | embedding norm, hidden norm, projection, final norm |
//! | --- | --- | --- |
//! | DeepSeek-V3 / GLM-4.5+ | `model.layers.{num_hidden_layers}.` | `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` |
//! | MiMo | `model.mtp_layers.{i}.` | `token_layernorm`, `hidden_layernorm`, `input_proj`, `final_layernorm` |
//! | Qwen3-Next | `mtp.` | `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc`, `norm` |
//!
//! A layer whose MLP has a router (`mlp.gate.weight`) is a routed MoE (see `moe`), its
//! shared expert(s) at `mlp.shared_experts.*` (DeepSeek/GLM) or `mlp.shared_expert.*`
//! (Qwen3-Next). The decoder layer sits at the prefix itself (DeepSeek, MiMo) or at `mtp.layers.0.`
//! (Qwen3-Next), with Hugging Face's part names. Invariants of a loaded [`MtpWeights`]:
//! every projection has the shape the config implies (`eh_proj` `[hidden, 2 * hidden]`;
//! `q_proj` twice as tall under gated attention); Qwen3-Next's zero-centred norms are stored
//! as `1 + w`, so every norm here is a plain RMSNorm weight.

use super::moe::{MoeScoring, MtpMoe};
use crate::model::layers::{load_dense, load_linear};
use crate::model::tensors::TensorSource;
use crate::model::{DenseWeight, DeviceAllocations, Linear, ModelConfig, ModelError};
use half::bf16;

/// Which family's MTP module this is; decides names, concatenation order and attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MtpLayout {
    /// DeepSeek-V3 and GLM-4.5+: `model.layers.{num_hidden_layers}.*`, embedding first.
    DeepseekV3,
    /// MiMo: `model.mtp_layers.{i}.*`, hidden first, Qwen2 attention (q/k/v bias).
    Mimo,
    /// Qwen3-Next / 3.5: `mtp.*`, embedding first, gated attention, q/k norm, zero-centred norms.
    Qwen3Next,
}

impl MtpLayout {
    /// Short name, used in binding kinds and messages.
    pub fn name(self) -> &'static str {
        match self {
            MtpLayout::DeepseekV3 => "deepseek_v3",
            MtpLayout::Mimo => "mimo",
            MtpLayout::Qwen3Next => "qwen3_next",
        }
    }

    /// Parses [`MtpLayout::name`].
    pub fn parse(name: &str) -> Option<Self> {
        [Self::DeepseekV3, Self::Mimo, Self::Qwen3Next]
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
        }
    }
}

/// The decoder layer inside the MTP module (dense SwiGLU MLP).
#[derive(Clone, Debug, PartialEq)]
pub struct MtpLayerWeights {
    pub attn_norm: DenseWeight,
    /// `[heads * head_dim, hidden]`, or `[2 * heads * head_dim, hidden]` with gated attention
    /// (per head: `head_dim` query rows, then `head_dim` gate rows).
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_bias: Option<DenseWeight>,
    pub k_bias: Option<DenseWeight>,
    pub v_bias: Option<DenseWeight>,
    /// Per-head RMSNorm of q and k (`[head_dim]`), when the family has it.
    pub q_norm: Option<DenseWeight>,
    pub k_norm: Option<DenseWeight>,
    pub ffn_norm: DenseWeight,
    /// The dense MLP, or the shared expert(s) when `moe` is set.
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    /// The routed experts, for GLM/DeepSeek-V3 and Qwen3-Next MoE layers.
    pub moe: Option<MtpMoe>,
}

/// Every weight of one MTP module except the embedding and the LM head, which it shares
/// with the target (see [`MtpHead::new`](super::MtpHead::new)).
#[derive(Clone, Debug, PartialEq)]
pub struct MtpWeights {
    pub layout: MtpLayout,
    /// RMSNorm of the token embedding (`enorm`).
    pub enorm: DenseWeight,
    /// RMSNorm of the target hidden (`hnorm`).
    pub hnorm: DenseWeight,
    /// `[hidden, 2 * hidden]`, applied to the concatenation.
    pub eh_proj: Linear,
    pub layer: MtpLayerWeights,
    /// The module's final RMSNorm (`shared_head.norm` / `final_layernorm` / `norm`).
    pub final_norm: DenseWeight,
}

impl MtpWeights {
    /// Every projection with its slot name, in forward order.
    pub fn projections(&self) -> Vec<(&'static str, &Linear)> {
        let l = &self.layer;
        vec![
            ("eh_proj", &self.eh_proj),
            ("layer.self_attn.q_proj", &l.q),
            ("layer.self_attn.k_proj", &l.k),
            ("layer.self_attn.v_proj", &l.v),
            ("layer.self_attn.o_proj", &l.o),
            ("layer.mlp.gate_proj", &l.gate),
            ("layer.mlp.up_proj", &l.up),
            ("layer.mlp.down_proj", &l.down),
        ]
    }

    /// Mutable projections, same order as [`MtpWeights::projections`].
    pub(crate) fn projections_mut(&mut self) -> [&mut Linear; 8] {
        let l = &mut self.layer;
        [
            &mut self.eh_proj,
            &mut l.q,
            &mut l.k,
            &mut l.v,
            &mut l.o,
            &mut l.gate,
            &mut l.up,
            &mut l.down,
        ]
    }

    /// Bytes of weights one draft step reads (projections and norms; not the embedding row
    /// or the LM head, which the head counts itself).
    pub fn nbytes(&self) -> usize {
        let l = &self.layer;
        let norms = [
            &self.enorm,
            &self.hnorm,
            &self.final_norm,
            &l.attn_norm,
            &l.ffn_norm,
        ];
        let opt = [&l.q_bias, &l.k_bias, &l.v_bias, &l.q_norm, &l.k_norm];
        self.projections()
            .iter()
            .map(|(_, w)| w.nbytes())
            .sum::<usize>()
            + norms.iter().map(|w| w.nbytes()).sum::<usize>()
            + opt
                .iter()
                .filter_map(|w| w.as_ref())
                .map(|w| w.nbytes())
                .sum::<usize>()
    }

    /// Loads module `index` of `layout` from `src`, checking every shape against `config`.
    pub fn load(
        allocs: &DeviceAllocations,
        src: &dyn TensorSource,
        config: &ModelConfig,
        layout: MtpLayout,
        index: usize,
    ) -> crate::Result<Self> {
        let (module, layer) = layout.prefixes(config, index);
        let h = config.hidden_size;
        let (heads, kvh, hd) = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        );
        let zc = layout.zero_centered_norms();
        let norm = |name: String, len: usize| load_norm(allocs, src, &name, len, zc);
        let [en, hn, proj, fin] = layout.part_names();
        let l = |part: &str| format!("{layer}{part}");
        refuse_unsupported(src, &layer)?;
        let q_rows = heads * hd * if layout.gated_attention() { 2 } else { 1 };
        let bias = |part: &str, len: usize| -> crate::Result<Option<DenseWeight>> {
            let name = format!("{}.bias", l(part));
            match src.tensor(&name)? {
                Some(_) => load_dense(allocs, src, &name, &[len]).map(Some),
                None => Ok(None),
            }
        };
        let head_norm = |part: &str| -> crate::Result<Option<DenseWeight>> {
            let name = format!("{}.weight", l(part));
            match src.tensor(&name)? {
                Some(_) => load_norm(allocs, src, &name, hd, zc).map(Some),
                None => Ok(None),
            }
        };
        let moe = match layout {
            MtpLayout::DeepseekV3 => {
                MtpMoe::load(allocs, src, config, &layer, MoeScoring::Sigmoid)?
            }
            MtpLayout::Qwen3Next => MtpMoe::load(allocs, src, config, &layer, MoeScoring::Softmax)?,
            MtpLayout::Mimo => None,
        };
        // A MoE layer's gate/up/down are its shared expert(s).
        let mlp = match (&moe, layout) {
            (None, _) => "mlp",
            (Some(_), MtpLayout::Qwen3Next) => "mlp.shared_expert",
            (Some(_), _) => "mlp.shared_experts",
        };
        let ffn = match src.tensor(&format!("{}.weight", l(&format!("{mlp}.gate_proj"))))? {
            Some(t) if t.shape.len() == 2 => t.shape[0],
            _ => {
                return Err(ModelError::MissingTensor {
                    path: src.path().to_string(),
                    tensor: format!("{}.weight", l(&format!("{mlp}.gate_proj"))),
                }
                .into())
            }
        };
        let layer_weights = MtpLayerWeights {
            attn_norm: norm(format!("{}.weight", l("input_layernorm")), h)?,
            q: load_linear(allocs, src, &l("self_attn.q_proj"), q_rows, h)?,
            k: load_linear(allocs, src, &l("self_attn.k_proj"), kvh * hd, h)?,
            v: load_linear(allocs, src, &l("self_attn.v_proj"), kvh * hd, h)?,
            o: load_linear(allocs, src, &l("self_attn.o_proj"), h, heads * hd)?,
            q_bias: bias("self_attn.q_proj", q_rows)?,
            k_bias: bias("self_attn.k_proj", kvh * hd)?,
            v_bias: bias("self_attn.v_proj", kvh * hd)?,
            q_norm: head_norm("self_attn.q_norm")?,
            k_norm: head_norm("self_attn.k_norm")?,
            ffn_norm: norm(format!("{}.weight", l("post_attention_layernorm")), h)?,
            gate: load_linear(allocs, src, &l(&format!("{mlp}.gate_proj")), ffn, h)?,
            up: load_linear(allocs, src, &l(&format!("{mlp}.up_proj")), ffn, h)?,
            down: load_linear(allocs, src, &l(&format!("{mlp}.down_proj")), h, ffn)?,
            moe,
        };
        if layer_weights.q_norm.is_some() != layer_weights.k_norm.is_some() {
            return Err(ModelError::MissingTensor {
                path: src.path().to_string(),
                tensor: format!(
                    "{} (q_norm and k_norm come together)",
                    l("self_attn.k_norm")
                ),
            }
            .into());
        }
        Ok(MtpWeights {
            layout,
            enorm: norm(format!("{module}{en}.weight"), h)?,
            hnorm: norm(format!("{module}{hn}.weight"), h)?,
            eh_proj: load_linear(allocs, src, &format!("{module}{proj}"), h, 2 * h)?,
            layer: layer_weights,
            final_norm: norm(format!("{module}{fin}.weight"), h)?,
        })
    }
}

/// Loads an RMSNorm weight; zero-centred ones (`1 + w`) are stored with the 1 added.
pub(crate) fn load_norm(
    allocs: &DeviceAllocations,
    src: &dyn TensorSource,
    name: &str,
    len: usize,
    zero_centered: bool,
) -> crate::Result<DenseWeight> {
    if !zero_centered {
        return load_dense(allocs, src, name, &[len]);
    }
    let w: Vec<bf16> = src
        .read_bf16(name, &[len])?
        .into_iter()
        .map(|x| bf16::from_f32(1.0 + x.to_f32()))
        .collect();
    Ok(DenseWeight::upload(allocs, name, &[len], &w)?)
}

/// Refuses, with a message naming the tensor, the layer kinds this head does not run.
fn refuse_unsupported(src: &dyn TensorSource, layer: &str) -> crate::Result<()> {
    let unsupported = [(
        "self_attn.kv_a_proj_with_mqa.weight",
        "multi-head latent attention (DeepSeek-V3 MLA) is not supported; GQA attention is",
    )];
    for (part, why) in unsupported {
        let name = format!("{layer}{part}");
        if src.tensor(&name)?.is_some() {
            return Err(ModelError::Format {
                path: src.path().to_string(),
                format: "MTP checkpoint",
                message: format!("{name}: {why}"),
            }
            .into());
        }
    }
    Ok(())
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
