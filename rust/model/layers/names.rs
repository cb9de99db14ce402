//! How checkpoints name a decoder's tensors: the scheme (Hugging Face or GGUF), the parts
//! of one layer, and [`LayerNames`], the names of one layer's tensors under its prefix
//! (`model.layers.3.` in a target, `mtp.layers.0.` in a Qwen3-Next MTP module).

/// How a checkpoint names its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameScheme {
    /// Hugging Face (`model.layers.{i}.self_attn.q_proj.weight`).
    HuggingFace,
    /// llama.cpp's GGUF (`blk.{i}.attn_q.weight`).
    Gguf,
}

/// The parts of a decoder layer, named in [`NameScheme::name`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// The RMSNorm before attention (`input_layernorm` / `attn_norm`).
    AttnNorm,
    /// The query projection.
    Q,
    /// The key projection.
    K,
    /// The value projection.
    V,
    /// Attention's output projection.
    O,
    /// The per-head RMSNorm of the queries.
    QNorm,
    /// The per-head RMSNorm of the keys.
    KNorm,
    /// The RMSNorm before the MLP (`post_attention_layernorm` / `ffn_norm`).
    FfnNorm,
    /// The MLP's gate projection (the one through SiLU).
    Gate,
    /// The MLP's up projection.
    Up,
    /// The MLP's down projection, back to the residual width.
    Down,
}

impl NameScheme {
    /// The name of layer `layer`'s `part` (without `.weight` / `.bias`).
    pub fn name(self, layer: usize, part: Part) -> String {
        self.layer(layer).part(part)
    }

    /// The names of layer `layer`'s tensors.
    pub fn layer(self, layer: usize) -> LayerNames {
        let prefix = match self {
            NameScheme::HuggingFace => format!("model.layers.{layer}."),
            NameScheme::Gguf => format!("blk.{layer}."),
        };
        LayerNames {
            prefix,
            scheme: self,
        }
    }

    /// `part`'s name inside a layer, in this scheme.
    fn part(self, part: Part) -> &'static str {
        let (hf, gg) = match part {
            Part::AttnNorm => ("input_layernorm", "attn_norm"),
            Part::Q => ("self_attn.q_proj", "attn_q"),
            Part::K => ("self_attn.k_proj", "attn_k"),
            Part::V => ("self_attn.v_proj", "attn_v"),
            Part::O => ("self_attn.o_proj", "attn_output"),
            Part::QNorm => ("self_attn.q_norm", "attn_q_norm"),
            Part::KNorm => ("self_attn.k_norm", "attn_k_norm"),
            Part::FfnNorm => ("post_attention_layernorm", "ffn_norm"),
            Part::Gate => ("mlp.gate_proj", "ffn_gate"),
            Part::Up => ("mlp.up_proj", "ffn_up"),
            Part::Down => ("mlp.down_proj", "ffn_down"),
        };
        match self {
            NameScheme::HuggingFace => hf,
            NameScheme::Gguf => gg,
        }
    }

    /// `(embedding, final norm, lm head)` tensor names.
    pub fn globals(self) -> (&'static str, &'static str, &'static str) {
        match self {
            NameScheme::HuggingFace => (
                "model.embed_tokens.weight",
                "model.norm.weight",
                "lm_head.weight",
            ),
            NameScheme::Gguf => ("token_embd.weight", "output_norm.weight", "output.weight"),
        }
    }
}

/// The names of one decoder layer's tensors: a prefix and a scheme.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerNames {
    /// Everything before the part name, including the trailing dot.
    pub prefix: String,
    /// How the checkpoint names the parts after the prefix.
    pub scheme: NameScheme,
}

impl LayerNames {
    /// A layer named the Hugging Face way under `prefix` (`"mtp.layers.0."`).
    pub fn hugging_face(prefix: impl Into<String>) -> Self {
        LayerNames {
            prefix: prefix.into(),
            scheme: NameScheme::HuggingFace,
        }
    }

    /// `part`'s name (without `.weight` / `.bias`).
    pub fn part(&self, part: Part) -> String {
        format!("{}{}", self.prefix, self.scheme.part(part))
    }

    /// A name under the prefix given in Hugging Face's spelling (`"mlp.gate"`), for the
    /// parts only Hugging Face checkpoints have.
    pub fn hf(&self, suffix: &str) -> String {
        format!("{}{suffix}", self.prefix)
    }

    /// A routed-MoE part given in Hugging Face's spelling (`"mlp.gate"`,
    /// `"mlp.experts.3.up_proj"`, `"mlp.shared_experts.down_proj"`), in this scheme. In GGUF,
    /// llama.cpp's names: `ffn_gate_inp`, `exp_probs_b.bias`, `ffn_{gate,up,down}_shexp`,
    /// `ffn_gate_inp_shexp`, and expert `e` of the stacked `ffn_{gate,up,down}_exps` as
    /// `ffn_{..}_exps.{e}` (which [`super::super::GgufFile`] serves as a slice).
    pub fn moe(&self, suffix: &str) -> String {
        if self.scheme == NameScheme::HuggingFace {
            return self.hf(suffix);
        }
        let short = |p: &str| match p {
            "gate_proj" => "gate",
            "up_proj" => "up",
            _ => "down",
        };
        let gguf = match suffix {
            "mlp.gate" => "ffn_gate_inp".to_string(),
            "mlp.gate.e_score_correction_bias" => "exp_probs_b.bias".to_string(),
            "mlp.shared_expert_gate" => "ffn_gate_inp_shexp".to_string(),
            _ => {
                let parts: Vec<&str> = suffix.split('.').collect();
                match parts.as_slice() {
                    ["mlp", "shared_experts" | "shared_expert", p] => {
                        format!("ffn_{}_shexp", short(p))
                    }
                    ["mlp", "experts", e, p] => format!("ffn_{}_exps.{e}", short(p)),
                    _ => suffix.to_string(),
                }
            }
        };
        format!("{}{gguf}", self.prefix)
    }
}
