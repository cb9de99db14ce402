//! The head as a circuit executor binds it ([`DraftBinding`]), and [`ReferenceDraftRunner`],
//! which drafts from a binding alone.
//!
//! A binding's `kind` is `mtp:<layout>` (`deepseek_v3`, `mimo`, `qwen3_next`) followed by
//! `+target_postnorm` and/or `+chain_postnorm` when those levers are on. Slot names:
//! `embed_tokens`, `target_final_norm`, `enorm`, `hnorm`, `eh_proj`, `final_norm`,
//! `lm_head` (the draft-vocabulary rows; NVFP4, or the target's own when shared), `rope_inv_freq` (f32 `[rotary_dim / 2]`), and
//! `layer.<hf name>` for the decoder layer (`layer.self_attn.q_proj`, `...q_proj.bias`,
//! `layer.self_attn.q_norm`, `layer.input_layernorm`, `layer.mlp.gate_proj`, ...).
//! NVFP4 weights are `U8` slots with the logical `[out, in]` shape, the FP8 block scales in
//! `block_scale` and `weight_scale_2` in `global_scale`. FP8 weights are `F8E4M3` slots of
//! shape `[out, in]` with their f32 scales per 128 x 128 block (`weight_scale_inv`,
//! `[ceil(out / 128), ceil(in / 128)]`) in `block_scale` and no `global_scale`.
//!
//! A head with a routed MoE MLP or multi-head latent attention, and an EAGLE-3 head, have no
//! binding yet (`circuit_draft` returns `None` and a runner is ignored), since the slots
//! above do not describe experts, MLA's extra weights and latent cache, or EAGLE-3's fusion.
//!
//! The reference runner rebuilds the head's forward from nothing but those slots, so a
//! binding that leaves anything out fails to draft, and one that is complete drafts exactly
//! what the head does.

use super::forward::{Depth, HeadSpec, HiddenKind, Row};
use super::head::MtpHead;
use super::scratch::Scratch;
use super::state::MtpState;
use super::weight_checks::first_rows;
use super::weights::{MtpLayout, MtpWeights};
use crate::backend::{ArgmaxArgs, DevicePtr, Dtype, GpuBackend, GpuBackendExt};
use crate::model::layers::{LayerWeights, Mlp, QkNorm, SwiGlu};
use crate::model::{
    DenseWeight, ForwardContext, Fp8Weight, Linear, ModelConfig, ModelLevers, QuantizedWeight,
};
use crate::speculative::{DraftBinding, DraftRunner, ProposerError, ProposerState, WeightSlot};

fn dense_slot(name: &str, w: &DenseWeight) -> WeightSlot {
    WeightSlot {
        name: name.to_string(),
        ptr: w.ptr,
        dtype: Dtype::Bf16,
        shape: w.shape.clone(),
        block_scale: None,
        global_scale: None,
    }
}

fn quant_slot(name: &str, w: &QuantizedWeight) -> WeightSlot {
    WeightSlot {
        name: name.to_string(),
        ptr: w.weight,
        dtype: Dtype::U8,
        shape: vec![w.out_features, w.in_features],
        block_scale: Some(w.weight_scale),
        global_scale: Some(w.weight_scale_2),
    }
}

fn fp8_slot(name: &str, w: &Fp8Weight) -> WeightSlot {
    WeightSlot {
        name: name.to_string(),
        ptr: w.weight,
        dtype: Dtype::F8E4M3,
        shape: vec![w.out_features, w.in_features],
        block_scale: Some(w.block_scales),
        global_scale: None,
    }
}

fn linear_slot(name: &str, w: &Linear) -> WeightSlot {
    match w {
        Linear::Dense(d) => dense_slot(name, d),
        Linear::Nvfp4(q) => quant_slot(name, q),
        Linear::Fp8(f) => fp8_slot(name, f),
        // GGUF blocks repacked for the CPU kernels have no slot layout: a U8 slot without
        // scales, which a runner refuses rather than misreads.
        Linear::Packed(p) => WeightSlot {
            name: name.to_string(),
            ptr: p.blocks,
            dtype: Dtype::U8,
            shape: vec![p.out_features, p.in_features],
            block_scale: None,
            global_scale: None,
        },
    }
}

impl MtpHead {
    /// Whether the head has a binding: its slots describe neither routed experts, latent
    /// attention nor EAGLE-3's fusion.
    pub(crate) fn has_binding(&self) -> bool {
        let layer = &self.spec.weights.layer;
        layer.moe().is_none() && layer.mla.is_none() && self.spec.eagle3.is_none()
    }

    /// The binding of this head under `levers` (the sizes come from the head itself; `config`
    /// only has to describe the same model).
    pub(crate) fn binding(&self, _config: &ModelConfig, levers: &ModelLevers) -> DraftBinding {
        let s = &self.spec;
        let w = &s.weights;
        let l = &w.layer;
        let mut kind = format!("mtp:{}", w.layout.name());
        if levers.mtp_target_postnorm {
            kind.push_str("+target_postnorm");
        }
        if levers.mtp_chain_postnorm {
            kind.push_str("+chain_postnorm");
        }
        let mut slots = vec![
            linear_slot("embed_tokens", &s.embed),
            dense_slot("target_final_norm", &s.target_final_norm),
            dense_slot("enorm", &w.enorm),
            dense_slot("hnorm", &w.hnorm),
            dense_slot("final_norm", &w.final_norm),
            dense_slot("layer.input_layernorm", &l.attn_norm),
            dense_slot("layer.post_attention_layernorm", &l.ffn_norm),
            linear_slot("lm_head", &s.lm_head),
            WeightSlot {
                name: "rope_inv_freq".into(),
                ptr: s.inv_freq,
                dtype: Dtype::F32,
                shape: vec![s.rotary_dim / 2],
                block_scale: None,
                global_scale: None,
            },
        ];
        for (name, lin) in w.projections() {
            slots.push(linear_slot(&name, lin));
        }
        let qk_norm = l.qk_norm.as_ref();
        let optional = [
            ("layer.self_attn.q_proj.bias", l.q_bias.as_ref()),
            ("layer.self_attn.k_proj.bias", l.k_bias.as_ref()),
            ("layer.self_attn.v_proj.bias", l.v_bias.as_ref()),
            ("layer.self_attn.q_norm", qk_norm.map(|n| &n.q)),
            ("layer.self_attn.k_norm", qk_norm.map(|n| &n.k)),
        ];
        for (name, wt) in optional {
            if let Some(wt) = wt {
                slots.push(dense_slot(name, wt));
            }
        }
        let c = &s.config;
        DraftBinding {
            kind,
            weights: slots,
            hidden_size: c.hidden_size,
            num_attention_heads: c.num_attention_heads,
            num_key_value_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            rope_theta: c.rope_theta,
            rms_norm_eps: c.rms_norm_eps,
            vocab_size: c.vocab_size,
            draft_vocab_size: s.draft_vocab,
            kv_block_size: super::state::DRAFTER_BLOCK_SIZE,
            kv_num_blocks: self.kv.num_blocks,
            k_cache: self.kv.k,
            v_cache: self.kv.v,
        }
    }
}

/// Drafts from a [`DraftBinding`] alone, with the head's equations (it rebuilds the head's
/// forward from the slots and runs it); the reference a circuit executor is checked against,
/// grammar masks included. It allocates its scratch per call and frees it before returning.
/// The state must be an [`MtpState`] whose rows the head has reserved.
#[derive(Debug, Default, Clone, Copy)]
pub struct ReferenceDraftRunner;

fn missing(message: String) -> crate::Error {
    ProposerError::Failed {
        method: "ReferenceDraftRunner::run".into(),
        message,
    }
    .into()
}

fn spec_from_binding(b: &DraftBinding, max_blocks_per_seq: usize) -> crate::Result<HeadSpec> {
    let mut parts = b.kind.split('+');
    let layout = parts
        .next()
        .and_then(|k| k.strip_prefix("mtp:"))
        .and_then(MtpLayout::parse)
        .filter(|l| *l != MtpLayout::Eagle3)
        .ok_or_else(|| missing(format!("binding kind {:?} is not an MTP head", b.kind)))?;
    let mut levers = ModelLevers::default();
    for flag in parts {
        match flag {
            "target_postnorm" => levers.mtp_target_postnorm = true,
            "chain_postnorm" => levers.mtp_chain_postnorm = true,
            other => return Err(missing(format!("unknown binding flag {other:?}"))),
        }
    }
    let slot = |name: &str| b.weights.iter().find(|s| s.name == name);
    let need =
        |name: &str| slot(name).ok_or_else(|| missing(format!("the binding has no slot {name:?}")));
    let dense = |name: &str| -> crate::Result<DenseWeight> {
        let s = need(name)?;
        if s.dtype != Dtype::Bf16 {
            return Err(missing(format!(
                "slot {name:?} is {}, expected bf16",
                s.dtype.name()
            )));
        }
        Ok(DenseWeight {
            ptr: s.ptr,
            shape: s.shape.clone(),
        })
    };
    let opt_dense = |name: &str| slot(name).map(|_| dense(name)).transpose();
    let quant = |s: &WeightSlot| -> crate::Result<QuantizedWeight> {
        match (s.block_scale, s.global_scale, s.shape.as_slice()) {
            (Some(scale), Some(g), &[o, i]) => Ok(QuantizedWeight {
                weight: s.ptr,
                weight_scale: scale,
                weight_scale_2: g,
                input_scale: None,
                out_features: o,
                in_features: i,
            }),
            _ => Err(missing(format!(
                "slot {:?} is u8 but lacks its scales or a 2-d shape",
                s.name
            ))),
        }
    };
    let linear = |name: &str| -> crate::Result<Linear> {
        let s = need(name)?;
        match (s.dtype, s.block_scale, s.shape.as_slice()) {
            (Dtype::U8, ..) => Ok(Linear::Nvfp4(quant(s)?)),
            (Dtype::F8E4M3, Some(block_scales), &[o, i]) => Ok(Linear::Fp8(Fp8Weight {
                weight: s.ptr,
                block_scales,
                out_features: o,
                in_features: i,
            })),
            (Dtype::F8E4M3, ..) => Err(missing(format!(
                "slot {name:?} is f8_e4m3 but lacks its block scales or a 2-d shape"
            ))),
            _ => Ok(Linear::Dense(dense(name)?)),
        }
    };
    let qk_norm = match (
        opt_dense("layer.self_attn.q_norm")?,
        opt_dense("layer.self_attn.k_norm")?,
    ) {
        (Some(q), Some(k)) => Some(QkNorm { q, k }),
        (None, None) => None,
        _ => return Err(missing("q_norm and k_norm come together".into())),
    };
    let layer = LayerWeights {
        attn_norm: dense("layer.input_layernorm")?,
        q: linear("layer.self_attn.q_proj")?,
        k: linear("layer.self_attn.k_proj")?,
        v: linear("layer.self_attn.v_proj")?,
        o: linear("layer.self_attn.o_proj")?,
        q_bias: opt_dense("layer.self_attn.q_proj.bias")?,
        k_bias: opt_dense("layer.self_attn.k_proj.bias")?,
        v_bias: opt_dense("layer.self_attn.v_proj.bias")?,
        qk_norm,
        gated_attention: layout.gated_attention(),
        ffn_norm: dense("layer.post_attention_layernorm")?,
        mlp: Mlp::Dense(SwiGlu {
            gate: linear("layer.mlp.gate_proj")?,
            up: linear("layer.mlp.up_proj")?,
            down: linear("layer.mlp.down_proj")?,
        }),
        mla: None,
    };
    let ffn = layer.mlp.max_width();
    let weights = MtpWeights {
        layout,
        enorm: dense("enorm")?,
        hnorm: dense("hnorm")?,
        eh_proj: linear("eh_proj")?,
        layer,
        final_norm: dense("final_norm")?,
    };
    let lm_head = linear("lm_head")?;
    let draft_vocab = b.draft_vocab_size.min(lm_head.dims().0);
    let lm_head = first_rows(&lm_head, draft_vocab)?;
    let freq = need("rope_inv_freq")?;
    let mut config = ModelConfig::tiny(b.vocab_size);
    config.hidden_size = b.hidden_size;
    config.num_attention_heads = b.num_attention_heads;
    config.num_key_value_heads = b.num_key_value_heads;
    config.head_dim = b.head_dim;
    config.rope_theta = b.rope_theta;
    config.rms_norm_eps = b.rms_norm_eps;
    config.intermediate_size = ffn;
    Ok(HeadSpec {
        config,
        levers,
        weights,
        embed: linear("embed_tokens")?,
        target_final_norm: dense("target_final_norm")?,
        draft_vocab,
        lm_head,
        k_cache: b.k_cache,
        v_cache: b.v_cache,
        num_slots: b.kv_num_blocks * b.kv_block_size,
        inv_freq: freq.ptr,
        rotary_dim: freq.shape.first().copied().unwrap_or(0) * 2,
        max_blocks_per_seq,
        eagle3: None,
    })
}

impl DraftRunner for ReferenceDraftRunner {
    fn run(
        &self,
        binding: &DraftBinding,
        last_token: u32,
        target_hidden: DevicePtr,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        grammar_bitmask: Option<&[i32]>,
    ) -> crate::Result<Vec<u32>> {
        let st =
            state
                .as_any_mut()
                .downcast_mut::<MtpState>()
                .ok_or(ProposerError::WrongState {
                    method: "ReferenceDraftRunner::run",
                    expected: "MtpState",
                })?;
        let spec = spec_from_binding(binding, st.capacity_blocks())?;
        let gpu: &dyn GpuBackend = ctx.gpu.as_ref();
        let (sc, slots) = Scratch::alloc(gpu, &spec, 1)?;
        let result = (|| {
            let words = spec.draft_vocab.div_ceil(32);
            if let Some(m) = grammar_bitmask {
                let m = m.get(..words).ok_or_else(|| {
                    missing(format!(
                        "grammar_bitmask has {} words; the draft vocabulary needs {words}",
                        m.len()
                    ))
                })?;
                gpu.write(sc.grammar_mask, m, stream)?;
            }
            let mut drafts = Vec::new();
            let (mut token, mut hidden) = (last_token, target_hidden);
            let base = st.rows();
            for step in 0..num_drafts {
                let row = base + step;
                let slot = st
                    .slot(row)
                    .ok_or_else(|| missing(format!("row {row} has no reserved block")))?;
                let rows = [Row {
                    token,
                    hidden,
                    position: position + step,
                    seq: 0,
                    slot,
                    ctx_len: row + 1,
                }];
                let kind = if step == 0 {
                    HiddenKind::Target
                } else {
                    HiddenKind::Chain
                };
                let tables = [(st.block_table(), st.capacity_blocks())];
                spec.forward_rows(gpu, &sc, &rows, &tables, kind, Depth::Logits, stream)?;
                gpu.argmax(ArgmaxArgs {
                    out: sc.picks,
                    logits: sc.logits,
                    bitmask: grammar_bitmask.map(|_| sc.grammar_mask),
                    rows: 1,
                    vocab: spec.draft_vocab,
                    stream,
                })?;
                let pick = gpu.download::<u32>(sc.picks, 1)?[0];
                if pick == u32::MAX {
                    // The mask allows no token: this step's row stays, and the run ends.
                    break;
                }
                drafts.push(pick);
                token = pick;
                hidden = spec.chain_hidden(&sc, 0);
            }
            Ok(drafts)
        })();
        for s in slots.iter().rev() {
            // Ours and live: freeing cannot fail except on a backend bug the ledger reports.
            let _ = gpu.free(s.ptr);
        }
        result
    }
}
