//! Reading an EAGLE-3 checkpoint's tensors: `fc`, the decoder layer (`layers.0.*` in the
//! speculators layout, `midlayer.*` in the original one, with `hidden_norm` beside the usual
//! parts and q/k/v reading `2 * hidden` columns), `norm`, `lm_head` over the draft
//! vocabulary, the draft-to-target offsets `d2t`, and an optional `embed_tokens`.
//!
//! Invariants: every shape is checked against the config before the tensor is uploaded, and
//! `d2t` (read on the host) is checked whole before anything is allocated: each draft id `d`
//! maps to `d + d2t[d]`, inside the target's vocabulary, or loading fails naming the tensor,
//! the draft id and the target id. A missing `d2t` is allowed only when the draft vocabulary
//! is the target's (ids map to themselves). Errors name the folder and the tensor.

use super::config::Eagle3Config;
use crate::model::layers::{
    load_dense, load_linear, load_norm, LayerNames, LayerOptions, LayerWeights,
};
use crate::model::tensors::{TensorSource, TensorType};
use crate::model::{DenseWeight, DeviceAllocations, Linear, ModelError};
use crate::speculative::mtp::{MtpLayout, MtpWeights};

/// The two names of the decoder layer, speculators' first.
const LAYER_PREFIXES: [&str; 2] = ["layers.0.", "midlayer."];

/// What [`load_weights`] reads.
pub(super) struct Loaded {
    /// The head's weights in the MTP head's terms (`eh_proj` is `fc`).
    pub weights: MtpWeights,
    /// `[draft_vocab, hidden]`.
    pub lm_head: Linear,
    /// The checkpoint's own `[vocab, hidden]` embedding, when it has one.
    pub embed: Option<DenseWeight>,
}

fn format_err(src: &dyn TensorSource, message: String) -> crate::Error {
    ModelError::Format {
        path: src.path().to_string(),
        format: "EAGLE-3 checkpoint",
        message,
    }
    .into()
}

/// The decoder layer's prefix: `layers.0.` (speculators) or `midlayer.` (the original).
pub(super) fn layer_prefix(src: &dyn TensorSource) -> crate::Result<&'static str> {
    for prefix in LAYER_PREFIXES {
        if src
            .tensor(&format!("{prefix}self_attn.q_proj.weight"))?
            .is_some()
        {
            return Ok(prefix);
        }
    }
    let mut held: Vec<String> = src.names();
    held.truncate(12);
    Err(format_err(
        src,
        format!(
            "no EAGLE-3 decoder layer: looked for {} (speculators) and {} (original); the checkpoint holds {}",
            "layers.0.self_attn.q_proj.weight",
            "midlayer.self_attn.q_proj.weight",
            held.join(", ")
        ),
    ))
}

/// Whether the checkpoint carries its own `embed_tokens.weight`.
pub(super) fn has_embedding(src: &dyn TensorSource) -> crate::Result<bool> {
    Ok(src.tensor("embed_tokens.weight")?.is_some())
}

/// The target id of every draft id (`d + d2t[d]`), from the `d2t` tensor (int64 or int32
/// `[draft_vocab]`), every one checked to lie in `0..vocab`.
pub(super) fn draft_to_target(
    src: &dyn TensorSource,
    draft_vocab: usize,
    vocab: usize,
) -> crate::Result<Vec<u32>> {
    let name = "d2t";
    let Some(t) = src.tensor(name)? else {
        if draft_vocab == vocab {
            return Ok((0..vocab as u32).collect());
        }
        return Err(ModelError::MissingTensor {
            path: src.path().to_string(),
            tensor: format!(
                "{name} (the draft vocabulary of {draft_vocab} is not the target's {vocab}, so the offsets are needed)"
            ),
        }
        .into());
    };
    if t.shape != [draft_vocab] {
        return Err(ModelError::ShapeMismatch {
            path: src.path().to_string(),
            tensor: name.into(),
            expected: vec![draft_vocab],
            found: t.shape.clone(),
        }
        .into());
    }
    let width = match &t.dtype {
        TensorType::Other(d) if d == "I64" => 8,
        TensorType::Other(d) if d == "I32" => 4,
        other => {
            return Err(format_err(
                src,
                format!("tensor {name:?} is {}, expected I64 (or I32)", other.name()),
            ))
        }
    };
    if t.data.len() != draft_vocab * width {
        return Err(format_err(
            src,
            format!(
                "tensor {name:?} holds {} bytes, expected {} for {draft_vocab} ids",
                t.data.len(),
                draft_vocab * width
            ),
        ));
    }
    let mut out = Vec::with_capacity(draft_vocab);
    for (d, b) in t.data.chunks_exact(width).enumerate() {
        let offset = match width {
            8 => i64::from_le_bytes(b.try_into().unwrap_or([0; 8])),
            _ => i64::from(i32::from_le_bytes(b.try_into().unwrap_or([0; 4]))),
        };
        let target = (d as i64).checked_add(offset);
        match target {
            Some(id) if (0..vocab as i64).contains(&id) => out.push(id as u32),
            _ => {
                return Err(format_err(
                    src,
                    format!(
                        "tensor {name:?} maps draft id {d} (offset {offset}) to target id {}, outside the target's vocabulary of {vocab}",
                        target.map_or_else(|| "an overflow".to_string(), |t| t.to_string())
                    ),
                ))
            }
        }
    }
    Ok(out)
}

/// Loads every weight of the head under `prefix` (see [`layer_prefix`]), for `n_aux`
/// captured layers.
pub(super) fn load_weights(
    allocs: &DeviceAllocations,
    src: &dyn TensorSource,
    cfg: &Eagle3Config,
    prefix: &str,
    n_aux: usize,
) -> crate::Result<Loaded> {
    let config = &cfg.layer;
    let (h, vocab) = (config.hidden_size, config.vocab_size);
    let has = |part: &str| -> crate::Result<bool> {
        Ok(src.tensor(&format!("{prefix}{part}"))?.is_some())
    };
    let options = LayerOptions {
        attention_bias: has("self_attn.q_proj.bias")?,
        qk_norm: has("self_attn.q_norm.weight")? || has("self_attn.k_norm.weight")?,
        gated_attention: false,
        zero_centered_norms: false,
        experts: None,
        mlp_width: None,
        expert_shard: None,
    };
    let names = LayerNames::hugging_face(prefix.to_string());
    let fc = load_linear(allocs, src, "fc", h, n_aux * cfg.target_hidden_size)?;
    let layer =
        LayerWeights::load_with_attention_input(allocs, src, config, &names, &options, 2 * h)?;
    let hidden_norm = load_norm(
        allocs,
        src,
        &format!("{prefix}hidden_norm.weight"),
        h,
        false,
    )?;
    let norm = load_norm(allocs, src, "norm.weight", h, false)?;
    let lm_head = load_linear(allocs, src, "lm_head", cfg.draft_vocab_size, h)?;
    let embed = match has_embedding(src)? {
        true => Some(load_dense(allocs, src, "embed_tokens.weight", &[vocab, h])?),
        false => None,
    };
    Ok(Loaded {
        weights: MtpWeights {
            layout: MtpLayout::Eagle3,
            // The layer's input_layernorm normalizes the embedding half of its input.
            enorm: layer.attn_norm.clone(),
            hnorm: hidden_norm,
            eh_proj: fc,
            layer,
            final_norm: norm,
        },
        lm_head,
        embed,
    })
}
