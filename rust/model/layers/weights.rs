//! One decoder layer's weights, the options they encode, and loading them from a checkpoint.
//!
//! A layer's options are which weights it holds: q/k/v biases (Qwen2, MiMo), a per-head
//! q/k RMSNorm (Qwen3, Qwen3-Next), attention with a sigmoid output gate (Qwen3-Next, whose
//! `q_proj` then yields per head `head_dim` query rows and `head_dim` gate rows), and a
//! dense SwiGLU MLP or a routed mixture of experts with shared experts.
//!
//! Invariants of a [`LayerWeights`] that passed [`LayerWeights::check`] (and of every one
//! [`LayerWeights::load`] returns): every projection has the shape the [`LayerShape`]
//! implies, the MLP's three projections agree on one width, and every norm is a plain
//! RMSNorm weight (zero-centred ones were stored with the 1 added).

use super::expert_shard::ExpertShard;
use super::load::{load_dense, load_linear, load_norm};
use super::mla::{self, MlaParts};
use super::moe::{MoeMlp, MoeScoring};
use super::names::{LayerNames, Part};
use super::LayerShape;
use crate::model::tensors::TensorSource;
use crate::model::{DenseWeight, DeviceAllocations, Linear, ModelConfig, ModelError};

/// The per-head RMSNorm of q and k (`[head_dim]` each); the two come together.
#[derive(Clone, Debug, PartialEq)]
pub struct QkNorm {
    /// The query heads' norm weight.
    pub q: DenseWeight,
    /// The key heads' norm weight.
    pub k: DenseWeight,
}

/// A SwiGLU MLP: `down(silu(gate(x)) * up(x))`, `gate`/`up` `[width, hidden]`, `down`
/// `[hidden, width]`.
#[derive(Clone, Debug, PartialEq)]
pub struct SwiGlu {
    /// `[width, hidden]`: the projection that goes through SiLU.
    pub gate: Linear,
    /// `[width, hidden]`: the projection the gate multiplies.
    pub up: Linear,
    /// `[hidden, width]`: back to the residual width.
    pub down: Linear,
}

impl SwiGlu {
    /// The MLP's inner width.
    pub fn width(&self) -> usize {
        self.gate.dims().0
    }

    /// Bytes of its three projections.
    pub fn nbytes(&self) -> usize {
        self.gate.nbytes() + self.up.nbytes() + self.down.nbytes()
    }

    /// Loads `[gate, up, down]` (names without `.weight`) for `width` and `hidden`.
    pub(super) fn load(
        allocs: &DeviceAllocations,
        src: &dyn TensorSource,
        [gate, up, down]: [String; 3],
        width: usize,
        hidden: usize,
    ) -> crate::Result<Self> {
        Ok(SwiGlu {
            gate: load_linear(allocs, src, &gate, width, hidden)?,
            up: load_linear(allocs, src, &up, width, hidden)?,
            down: load_linear(allocs, src, &down, hidden, width)?,
        })
    }

    /// `Err(message)` unless the projections are `[width, hidden]` / `[hidden, width]`.
    fn check(&self, hidden: usize, what: &str) -> Result<(), String> {
        let f = self.width();
        let dims = [
            ("gate_proj", self.gate.dims(), (f, hidden)),
            ("up_proj", self.up.dims(), (f, hidden)),
            ("down_proj", self.down.dims(), (hidden, f)),
        ];
        for (name, found, want) in dims {
            if found != want || f == 0 {
                return Err(format!(
                    "{what}{name} is [{}, {}], expected [{}, {}] for hidden_size {hidden}",
                    found.0, found.1, want.0, want.1
                ));
            }
        }
        Ok(())
    }
}

/// A layer's MLP.
#[derive(Clone, Debug, PartialEq)]
pub enum Mlp {
    /// One SwiGLU MLP.
    Dense(SwiGlu),
    /// Routed experts plus shared experts.
    Experts(Box<MoeMlp>),
}

impl Mlp {
    /// The SwiGLU that every row runs: the dense MLP or the shared expert(s), if any.
    pub fn always_run(&self) -> Option<&SwiGlu> {
        match self {
            Mlp::Dense(m) => Some(m),
            Mlp::Experts(moe) => moe.shared.as_ref(),
        }
    }

    /// The widest SwiGLU the layer runs (its scratch width).
    pub fn max_width(&self) -> usize {
        match self {
            Mlp::Dense(m) => m.width(),
            Mlp::Experts(moe) => moe
                .shared
                .as_ref()
                .map_or(0, SwiGlu::width)
                .max(moe.expert_width()),
        }
    }
}

/// What kind of layer a checkpoint holds; [`LayerWeights::load`] loads exactly this.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerOptions {
    /// q/k/v projections carry biases.
    pub attention_bias: bool,
    /// A per-head RMSNorm of q and k after the projections.
    pub qk_norm: bool,
    /// Attention with a sigmoid output gate (`q_proj` twice as tall).
    pub gated_attention: bool,
    /// RMSNorm weights are stored as `w` for a scale of `1 + w`.
    pub zero_centered_norms: bool,
    /// A routed mixture of experts scored this way; `None`: a dense MLP.
    pub experts: Option<MoeScoring>,
    /// Width of the dense MLP (or of the shared experts); `None` takes it from the
    /// checkpoint's `gate_proj`.
    pub mlp_width: Option<usize>,
    /// The routed experts this rank holds, on a multi-rank load; `None`: all of them.
    pub expert_shard: Option<ExpertShard>,
}

/// One decoder layer's weights.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerWeights {
    /// `[hidden]`: the RMSNorm before attention.
    pub attn_norm: DenseWeight,
    /// `[heads * head_dim, hidden]`, or `[2 * heads * head_dim, hidden]` with gated attention
    /// (per head: `head_dim` query rows, then `head_dim` gate rows).
    pub q: Linear,
    /// `[kv_heads * head_dim, hidden]`.
    pub k: Linear,
    /// `[kv_heads * head_dim, hidden]`.
    pub v: Linear,
    /// `[hidden, heads * head_dim]`: attention's output projection.
    pub o: Linear,
    /// `[heads * head_dim]`, when the family's q projection has a bias.
    pub q_bias: Option<DenseWeight>,
    /// `[kv_heads * head_dim]`, when the family's k projection has a bias.
    pub k_bias: Option<DenseWeight>,
    /// `[kv_heads * head_dim]`, when the family's v projection has a bias.
    pub v_bias: Option<DenseWeight>,
    /// The per-head q/k RMSNorm, for the families that have one.
    pub qk_norm: Option<QkNorm>,
    /// Whether attention has the sigmoid output gate.
    pub gated_attention: bool,
    /// `[hidden]`: the RMSNorm before the MLP.
    pub ffn_norm: DenseWeight,
    /// The MLP, dense or routed.
    pub mlp: Mlp,
    /// Multi-head latent attention's other weights, when attention is MLA; `q`, `k`, `v`
    /// and `o` are then `q_b_proj` (or `q_proj`), `kv_a_proj_with_mqa`, `kv_b_proj` and
    /// `o_proj` (see the `mla` module).
    pub mla: Option<Box<MlaParts>>,
}

impl LayerWeights {
    /// The routed experts, if the MLP has them.
    pub fn moe(&self) -> Option<&MoeMlp> {
        match &self.mlp {
            Mlp::Experts(moe) => Some(moe),
            Mlp::Dense(_) => None,
        }
    }

    /// The routed experts, if the MLP has them, to adjust.
    pub fn moe_mut(&mut self) -> Option<&mut MoeMlp> {
        match &mut self.mlp {
            Mlp::Experts(moe) => Some(moe),
            Mlp::Dense(_) => None,
        }
    }

    /// The attention projections and the always-run MLP's (when there is one), with their
    /// Hugging Face names.
    pub fn projections(&self) -> Vec<(&'static str, &Linear)> {
        let mut all = match &self.mla {
            None => vec![
                ("self_attn.q_proj", &self.q),
                ("self_attn.k_proj", &self.k),
                ("self_attn.v_proj", &self.v),
                ("self_attn.o_proj", &self.o),
            ],
            Some(parts) => {
                let mut all = Vec::new();
                let q = match &parts.q_a {
                    Some((q_a, _)) => {
                        all.push(("self_attn.q_a_proj", q_a));
                        "self_attn.q_b_proj"
                    }
                    None => "self_attn.q_proj",
                };
                all.extend([
                    (q, &self.q),
                    ("self_attn.kv_a_proj_with_mqa", &self.k),
                    ("self_attn.kv_b_proj", &self.v),
                    ("self_attn.o_proj", &self.o),
                ]);
                all
            }
        };
        if let Some(m) = self.mlp.always_run() {
            all.extend([
                ("mlp.gate_proj", &m.gate),
                ("mlp.up_proj", &m.up),
                ("mlp.down_proj", &m.down),
            ]);
        }
        all
    }

    /// Every projection, routed experts included, to re-store; under MLA not `kv_b_proj`,
    /// which the attention kernel reads in BF16.
    pub fn projections_mut(&mut self) -> Vec<&mut Linear> {
        let mut all: Vec<&mut Linear> = match &mut self.mla {
            None => vec![&mut self.q, &mut self.k, &mut self.v, &mut self.o],
            Some(parts) => {
                let mut all = vec![&mut self.q, &mut self.k, &mut self.o];
                if let Some((q_a, _)) = &mut parts.q_a {
                    all.push(q_a);
                }
                all
            }
        };
        match &mut self.mlp {
            Mlp::Dense(m) => all.extend([&mut m.gate, &mut m.up, &mut m.down]),
            Mlp::Experts(moe) => {
                let MoeMlp {
                    shared, experts, ..
                } = &mut **moe;
                if let Some(shared) = shared {
                    all.extend([&mut shared.gate, &mut shared.up, &mut shared.down]);
                }
                for x in experts.iter_mut() {
                    all.extend([&mut x.gate, &mut x.up, &mut x.down]);
                }
            }
        }
        all
    }

    /// The norms, biases and q/k norms, present ones only.
    pub fn vectors(&self) -> Vec<&DenseWeight> {
        let mut v = vec![&self.attn_norm, &self.ffn_norm];
        v.extend(
            [&self.q_bias, &self.k_bias, &self.v_bias]
                .into_iter()
                .flatten(),
        );
        if let Some(n) = &self.qk_norm {
            v.extend([&n.q, &n.k]);
        }
        if let Some(parts) = &self.mla {
            v.push(&parts.kv_a_norm);
            v.extend(parts.q_a.as_ref().map(|(_, norm)| norm));
        }
        v
    }

    /// Bytes one row reads: the norms, biases, attention, the always-run MLP (not the
    /// routed experts, which [`MoeMlp::nbytes_per_row`] counts).
    pub fn nbytes(&self) -> usize {
        let vectors: usize = self.vectors().iter().map(|w| w.nbytes()).sum();
        vectors
            + self
                .projections()
                .iter()
                .map(|(_, w)| w.nbytes())
                .sum::<usize>()
    }

    /// Loads the layer `names` points at, as `options` describe it, with every shape
    /// checked against `config`.
    pub fn load(
        allocs: &DeviceAllocations,
        src: &dyn TensorSource,
        config: &ModelConfig,
        names: &LayerNames,
        options: &LayerOptions,
    ) -> crate::Result<Self> {
        Self::load_with_attention_input(allocs, src, config, names, options, config.hidden_size)
    }

    /// [`LayerWeights::load`] of a layer whose q/k/v projections read `attn_in` columns
    /// (EAGLE-3's `2 * hidden`, run by
    /// [`decoder_layer_with_input`](super::decoder_layer_with_input)).
    pub fn load_with_attention_input(
        allocs: &DeviceAllocations,
        src: &dyn TensorSource,
        config: &ModelConfig,
        names: &LayerNames,
        options: &LayerOptions,
        attn_in: usize,
    ) -> crate::Result<Self> {
        let (h, hd) = (config.hidden_size, config.head_dim);
        let (qs, kvs) = (config.q_size(), config.kv_size());
        let q_rows = if options.gated_attention { 2 * qs } else { qs };
        let zc = options.zero_centered_norms;
        let n = |p: Part| names.part(p);
        let lin = |p: Part, o: usize, i: usize| load_linear(allocs, src, &n(p), o, i);
        let norm =
            |p: Part, len: usize| load_norm(allocs, src, &format!("{}.weight", n(p)), len, zc);
        let bias = |p: Part, len: usize| -> crate::Result<Option<DenseWeight>> {
            (options.attention_bias && config.mla.is_none())
                .then(|| load_dense(allocs, src, &format!("{}.bias", n(p)), &[len]))
                .transpose()
        };
        let attn_norm = norm(Part::AttnNorm, h)?;
        let (q, k, v, o, mla) = match &config.mla {
            Some(m) => {
                let (q, k, v, o, parts) = mla::load(allocs, src, config, m, names)?;
                (q, k, v, o, Some(Box::new(parts)))
            }
            None => (
                lin(Part::Q, q_rows, attn_in)?,
                lin(Part::K, kvs, attn_in)?,
                lin(Part::V, kvs, attn_in)?,
                lin(Part::O, h, qs)?,
                None,
            ),
        };
        let (q_bias, k_bias, v_bias) = (
            bias(Part::Q, q_rows)?,
            bias(Part::K, kvs)?,
            bias(Part::V, kvs)?,
        );
        let qk_norm = match options.qk_norm {
            true => Some(QkNorm {
                q: norm(Part::QNorm, hd)?,
                k: norm(Part::KNorm, hd)?,
            }),
            false => None,
        };
        let ffn_norm = norm(Part::FfnNorm, h)?;
        let mlp = match options.experts {
            None => {
                let width = mlp_width(src, names, "mlp", options)?;
                let parts = [Part::Gate, Part::Up, Part::Down].map(n);
                Mlp::Dense(SwiGlu::load(allocs, src, parts, width, h)?)
            }
            Some(scoring) => {
                let prefix = scoring.shared_expert_prefix();
                let parts = ["gate_proj", "up_proj", "down_proj"]
                    .map(|p| names.moe(&format!("{prefix}.{p}")));
                // A config that declares shared experts requires them; one that does not
                // (Qwen3-MoE, or a head's config that leaves the count out) takes what the
                // checkpoint holds.
                let declared = config
                    .moe
                    .as_ref()
                    .is_some_and(|m| m.num_shared_experts > 0);
                let present = src.tensor(&format!("{}.weight", parts[0]))?.is_some();
                let shared = match declared || present {
                    true => {
                        let width = mlp_width(src, names, prefix, options)?;
                        Some(SwiGlu::load(allocs, src, parts, width, h)?)
                    }
                    false => None,
                };
                Mlp::Experts(Box::new(MoeMlp::load(
                    allocs,
                    src,
                    config,
                    names,
                    scoring,
                    shared,
                    options.expert_shard.as_ref(),
                )?))
            }
        };
        Ok(LayerWeights {
            attn_norm,
            q,
            k,
            v,
            o,
            q_bias,
            k_bias,
            v_bias,
            qk_norm,
            gated_attention: options.gated_attention,
            ffn_norm,
            mlp,
            mla,
        })
    }

    /// `Err(message)` naming the first weight whose shape `shape` does not imply.
    pub fn check(&self, shape: &LayerShape) -> Result<(), String> {
        self.check_with_attention_input(shape, shape.hidden)
    }

    /// [`LayerWeights::check`] of a layer whose q/k/v projections read `attn_in` columns.
    pub fn check_with_attention_input(
        &self,
        shape: &LayerShape,
        attn_in: usize,
    ) -> Result<(), String> {
        let LayerShape {
            hidden: h,
            heads,
            kv_heads: kvh,
            head_dim: hd,
            ..
        } = *shape;
        let gated = if self.gated_attention { 2 } else { 1 };
        type Dims = (usize, usize);
        let expect: [(&str, Dims, Dims); 4] = [
            ("q_proj", self.q.dims(), (gated * heads * hd, attn_in)),
            ("k_proj", self.k.dims(), (kvh * hd, attn_in)),
            ("v_proj", self.v.dims(), (kvh * hd, attn_in)),
            ("o_proj", self.o.dims(), (h, heads * hd)),
        ];
        // An MLA layer's attention shapes come from its MLA sizes, checked at load.
        let expect = if self.mla.is_some() {
            &[][..]
        } else {
            &expect[..]
        };
        for &(name, found, want) in expect {
            if found != want {
                return Err(format!(
                    "{name} is [{}, {}], expected [{}, {}] for hidden_size {h}, {heads} heads, {kvh} KV heads, head_dim {hd}",
                    found.0, found.1, want.0, want.1
                ));
            }
        }
        let vectors = [
            ("input_layernorm", Some(&self.attn_norm), h),
            ("post_attention_layernorm", Some(&self.ffn_norm), h),
            ("q_bias", self.q_bias.as_ref(), gated * heads * hd),
            ("k_bias", self.k_bias.as_ref(), kvh * hd),
            ("v_bias", self.v_bias.as_ref(), kvh * hd),
            ("q_norm", self.qk_norm.as_ref().map(|n| &n.q), hd),
            ("k_norm", self.qk_norm.as_ref().map(|n| &n.k), hd),
        ];
        for (name, wt, len) in vectors {
            if let Some(wt) = wt {
                if wt.shape != [len] {
                    return Err(format!("{name} has shape {:?}, expected [{len}]", wt.shape));
                }
            }
        }
        match &self.mlp {
            Mlp::Dense(m) => m.check(h, ""),
            Mlp::Experts(moe) => {
                if let Some(shared) = &moe.shared {
                    shared.check(h, "the shared expert's ")?;
                }
                moe.check(h)
            }
        }
    }
}

/// The width of the SwiGLU at `{prefix}{mlp}.gate_proj`: the options' when given (the
/// loader then checks the tensor against it), else the tensor's.
fn mlp_width(
    src: &dyn TensorSource,
    names: &LayerNames,
    mlp: &str,
    options: &LayerOptions,
) -> crate::Result<usize> {
    if let Some(w) = options.mlp_width {
        return Ok(w);
    }
    let name = match mlp {
        "mlp" => format!("{}.weight", names.part(Part::Gate)),
        shared => format!("{}.weight", names.moe(&format!("{shared}.gate_proj"))),
    };
    match src.tensor(&name)? {
        Some(t) if t.shape.len() == 2 => Ok(t.shape[0]),
        _ => Err(ModelError::MissingTensor {
            path: src.path().to_string(),
            tensor: name,
        }
        .into()),
    }
}
