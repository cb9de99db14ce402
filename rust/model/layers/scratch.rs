//! The scratch a decoder layer computes in, as arena slots: which slots a layer of a given
//! shape and kind needs ([`layer_slots`]), the target model's whole arena
//! ([`arena_slots`]), and the layer's view of an arena made from them ([`LayerScratch`]).
//!
//! Invariant: an arena made from [`layer_slots`] for a layer holds every buffer
//! [`super::decoder_layer`] touches for that layer, for up to the arena's `max_rows` rows.

use super::mla::MlaScratch;
use crate::backend::{DevicePtr, Dtype};
use crate::memory::{BufferArena, MemoryError, SlotSpec};
use crate::model::{MlaConfig, ModelConfig};

/// What sizes a layer's scratch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScratchShape {
    /// Width of the residual stream.
    pub hidden: usize,
    /// `heads * head_dim`.
    pub q_size: usize,
    /// `kv_heads * head_dim`.
    pub kv_size: usize,
    /// The widest SwiGLU the layer runs.
    pub mlp_width: usize,
    /// Whether attention has the sigmoid output gate.
    pub gated_attention: bool,
    /// Routed experts (0: a dense MLP).
    pub experts: usize,
    /// Multi-head latent attention's sizes and heads, when attention is MLA.
    pub mla: Option<(MlaConfig, usize)>,
}

const fn slot(name: &'static str, dtype: Dtype, row_elems: usize) -> SlotSpec {
    SlotSpec {
        name,
        dtype,
        row_elems,
    }
}

/// The slots one decoder layer needs, per row.
pub fn layer_slots(s: &ScratchShape) -> Vec<SlotSpec> {
    use Dtype::*;
    let mut slots = vec![
        slot("normed", Bf16, s.hidden),
        slot("q", Bf16, s.q_size),
        slot("k", Bf16, s.kv_size),
        slot("v", Bf16, s.kv_size),
        slot("attn_out", Bf16, s.q_size),
        slot("gate", Bf16, s.mlp_width),
        slot("up", Bf16, s.mlp_width),
    ];
    if s.gated_attention {
        slots.extend([
            slot("q_full", Bf16, 2 * s.q_size),
            slot("q_gate", Bf16, s.q_size),
        ]);
    }
    if s.experts > 0 {
        slots.extend([
            slot("moe_router_logits", F32, s.experts),
            slot("moe_acc", Bf16, s.hidden),
            slot("moe_expert_out", Bf16, s.hidden),
            slot("moe_scaled", Bf16, s.hidden),
            slot("moe_weight", Bf16, 1),
            slot("moe_gate_logit", Bf16, 1),
        ]);
    }
    if let Some((m, heads)) = &s.mla {
        let half = m.latent_width() / 2;
        slots.extend([
            slot("mla_q_a", Bf16, m.q_lora_rank.unwrap_or(1)),
            slot("mla_q", Bf16, heads * m.qk_head_dim()),
            slot("mla_q_rope", Bf16, heads * m.qk_rope_head_dim),
            slot("mla_kv", Bf16, m.latent_width()),
            slot("mla_c_kv", Bf16, m.kv_lora_rank),
            slot("mla_k_rope", Bf16, m.qk_rope_head_dim),
            slot("mla_lo", Bf16, half),
            slot("mla_hi", Bf16, half),
            slot("mla_out", Bf16, heads * m.v_head_dim),
        ]);
    }
    slots
}

/// The target model's shared forward scratch for `config`: the residual stream buffers,
/// one layer's scratch, and the logits and token rows.
pub fn arena_slots(config: &ModelConfig) -> Vec<SlotSpec> {
    let mlp_width = config.moe.as_ref().map_or(config.intermediate_size, |m| {
        let shared = m.expert_intermediate_size * m.num_shared_experts.max(1);
        shared.max(config.intermediate_size)
    });
    let layer = ScratchShape {
        hidden: config.hidden_size,
        q_size: config.q_size(),
        kv_size: config.kv_size(),
        mlp_width,
        gated_attention: false,
        experts: config.moe.as_ref().map_or(0, |m| m.num_experts),
        mla: config.mla.map(|m| (m, config.num_attention_heads)),
    };
    let mut slots = vec![
        slot("hidden", Dtype::Bf16, config.hidden_size),
        slot("residual", Dtype::Bf16, config.hidden_size),
    ];
    slots.extend(layer_slots(&layer));
    slots.extend([
        slot("logits", Dtype::F32, config.vocab_size),
        slot("token_ids", Dtype::U32, 1),
        slot("positions", Dtype::U32, 1),
    ]);
    slots
}

/// The gated-attention buffers: `q_proj`'s full output and the gate split from it.
#[derive(Clone, Copy, Debug)]
pub struct GatedScratch {
    /// BF16 `[rows, 2 * heads * head_dim]`: `q_proj`'s output, query and gate interleaved per head.
    pub q_full: DevicePtr,
    /// BF16 `[rows, heads * head_dim]`: the gate half.
    pub q_gate: DevicePtr,
}

/// The routed-experts buffers.
#[derive(Clone, Copy, Debug)]
pub struct MoeScratch {
    /// f32 `[rows, experts]`.
    pub router_logits: DevicePtr,
    /// `[rows, hidden]`: the MLP's output, accumulated.
    pub acc: DevicePtr,
    /// One expert's output for one row.
    pub expert_out: DevicePtr,
    /// A scaled copy of `expert_out`.
    pub scaled: DevicePtr,
    /// The BF16 scalar an output is scaled by.
    pub weight: DevicePtr,
    /// `[rows]`: the shared-expert gate's logit.
    pub gate_logit: DevicePtr,
}

/// A decoder layer's view of its scratch.
#[derive(Clone, Copy, Debug)]
pub struct LayerScratch {
    /// BF16 `[rows, hidden]`: the normalized residual a sublayer reads.
    pub normed: DevicePtr,
    /// BF16 `[rows, heads * head_dim]`: the queries.
    pub q: DevicePtr,
    /// BF16 `[rows, kv_heads * head_dim]`: the new keys.
    pub k: DevicePtr,
    /// BF16 `[rows, kv_heads * head_dim]`: the new values.
    pub v: DevicePtr,
    /// BF16 `[rows, heads * head_dim]`: attention's output before `o_proj`.
    pub attn_out: DevicePtr,
    /// The MLP's gate projection, then `silu(gate) * up`.
    pub gate: DevicePtr,
    /// BF16 `[rows, mlp_width]`: the MLP's up projection.
    pub up: DevicePtr,
    /// Present when the arena has the gated-attention slots.
    pub gated: Option<GatedScratch>,
    /// Present when the arena has the routed-experts slots.
    pub moe: Option<MoeScratch>,
    /// Present when the arena has the multi-head latent attention slots.
    pub mla: Option<MlaScratch>,
}

impl LayerScratch {
    /// The layer's buffers in an arena made from [`layer_slots`] (among other slots).
    pub fn from_arena(arena: &BufferArena) -> Result<Self, MemoryError> {
        let at = |name: &str| arena.slot(name).map(|s| s.ptr);
        let gated = match arena.slot("q_full") {
            Ok(_) => Some(GatedScratch {
                q_full: at("q_full")?,
                q_gate: at("q_gate")?,
            }),
            Err(_) => None,
        };
        let moe = match arena.slot("moe_acc") {
            Ok(_) => Some(MoeScratch {
                router_logits: at("moe_router_logits")?,
                acc: at("moe_acc")?,
                expert_out: at("moe_expert_out")?,
                scaled: at("moe_scaled")?,
                weight: at("moe_weight")?,
                gate_logit: at("moe_gate_logit")?,
            }),
            Err(_) => None,
        };
        let mla = match arena.slot("mla_q") {
            Ok(_) => Some(MlaScratch {
                q_a: at("mla_q_a")?,
                q: at("mla_q")?,
                q_rope: at("mla_q_rope")?,
                kv: at("mla_kv")?,
                c_kv: at("mla_c_kv")?,
                k_rope: at("mla_k_rope")?,
                lo: at("mla_lo")?,
                hi: at("mla_hi")?,
                out: at("mla_out")?,
            }),
            Err(_) => None,
        };
        Ok(LayerScratch {
            normed: at("normed")?,
            q: at("q")?,
            k: at("k")?,
            v: at("v")?,
            attn_out: at("attn_out")?,
            gate: at("gate")?,
            up: at("up")?,
            gated,
            moe,
            mla,
        })
    }
}
