//! Random learned drafters beside a tiny target, written as real checkpoints in their
//! published layouts so the loaders run: an EAGLE-3 head in the speculators layout (its own
//! draft vocabulary, mapped through `d2t` offsets that are not all zero; the target's
//! embedding shared) and a DFlash head in z-lab's layout (GQA, q/k norms, a mask token).
//!
//! Invariant: a head written for a [`Tiny`] target loads beside it (same hidden size and
//! vocabulary; layer ids inside the target).
#![allow(dead_code)]

use super::model_util::{temp_dir, write_hf, Rng, Tiny};
use half::bf16;
use specdraft::backend::GpuBackend;
use specdraft::model::{LoadOptions, ModelLevers, TargetModel};
use specdraft::speculative::Eagle3Head;
use std::path::PathBuf;
use std::sync::Arc;

/// The target [`eagle3_beside`] loads its head beside: a tiny Llama of four layers.
pub fn eagle3_target_shape() -> Tiny {
    Tiny {
        layers: 4,
        ..Tiny::default()
    }
}

/// A seeded [`eagle3_target_shape`] target (its files named by `tag`) and a random EAGLE-3
/// head beside it, tapping the hiddens entering layers 1, 2 and 3, whose draft vocabulary is
/// every other target id (so draft ids map to other target ids).
pub fn eagle3_beside(gpu: &Arc<dyn GpuBackend>, tag: &str) -> (Arc<TargetModel>, Arc<Eagle3Head>) {
    let t = eagle3_target_shape();
    let dir = temp_dir(&format!("eagle3_target_{tag}"));
    write_hf(&dir, &t, &t.tensors(23));
    let opts = LoadOptions {
        max_rows: 64,
        max_seq_len: Some(128),
        kv_blocks: Some(96),
    };
    let model = Arc::new(TargetModel::load(&dir, gpu.clone(), opts).unwrap());
    let vocab: Vec<u32> = (0..t.vocab as u32 / 2).map(|i| 2 * i + 1).collect();
    let ckpt = write_eagle3(tag, &t, &[1, 2, 3], &vocab);
    let head = Eagle3Head::from_checkpoint_for_target(
        &ckpt,
        model.clone(),
        128,
        64,
        &ModelLevers::default(),
    );
    (model, Arc::new(head.unwrap()))
}

/// One tensor: name, shape, and either values (stored as BF16) or little-endian i64 ids.
enum Data {
    Bf16(Vec<f32>),
    I64(Vec<i64>),
}

fn write_safetensors(path: &std::path::Path, tensors: &[(String, Vec<usize>, Data)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        let dtype = match values {
            Data::Bf16(v) => {
                for &x in v {
                    data.extend_from_slice(&bf16::from_f32(x).to_le_bytes());
                }
                "BF16"
            }
            Data::I64(v) => {
                for &x in v {
                    data.extend_from_slice(&x.to_le_bytes());
                }
                "I64"
            }
        };
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    std::fs::write(path, out).unwrap();
}

/// Random tensors: norms near one, projections scaled by `gain / sqrt(fan_in)`.
struct Random {
    rng: Rng,
    out: Vec<(String, Vec<usize>, Data)>,
}

impl Random {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize, gain: f32) {
        let s = gain / (cols as f32).sqrt();
        let v = (0..rows * cols).map(|_| s * self.rng.next_f32()).collect();
        self.out
            .push((name.into(), vec![rows, cols], Data::Bf16(v)));
    }
    fn norm(&mut self, name: &str, n: usize) {
        let v = (0..n).map(|_| 1.0 + 0.2 * self.rng.next_f32()).collect();
        self.out.push((name.into(), vec![n], Data::Bf16(v)));
    }
}

/// A random EAGLE-3 head for `target` (speculators layout, 4 query heads on 2 KV heads):
/// fusing the hiddens entering target layers `aux` (EAGLE-3's ids), drafting over a draft
/// vocabulary whose id `d` is target id `targets[d]` (stored as the offsets `d2t[d] =
/// targets[d] - d`, as a trained head's most frequent target tokens are). Returns its folder.
pub fn write_eagle3(tag: &str, target: &Tiny, aux: &[usize], targets: &[u32]) -> PathBuf {
    let draft_vocab = targets.len();
    let dir = temp_dir(&format!("eagle3_{tag}"));
    let (h, heads, kvh, hd, ffn) = (target.hidden, 4, 2, target.hidden / 4, 2 * target.hidden);
    let mut r = Random {
        rng: Rng::new(31),
        out: Vec::new(),
    };
    r.matrix("fc.weight", h, aux.len() * h, 1.5);
    let p = "layers.0.";
    r.norm(&format!("{p}input_layernorm.weight"), h);
    r.norm(&format!("{p}hidden_norm.weight"), h);
    r.matrix(
        &format!("{p}self_attn.q_proj.weight"),
        heads * hd,
        2 * h,
        1.5,
    );
    r.matrix(&format!("{p}self_attn.k_proj.weight"), kvh * hd, 2 * h, 1.5);
    r.matrix(&format!("{p}self_attn.v_proj.weight"), kvh * hd, 2 * h, 1.5);
    r.matrix(&format!("{p}self_attn.o_proj.weight"), h, heads * hd, 1.5);
    r.norm(&format!("{p}post_attention_layernorm.weight"), h);
    r.matrix(&format!("{p}mlp.gate_proj.weight"), ffn, h, 1.5);
    r.matrix(&format!("{p}mlp.up_proj.weight"), ffn, h, 1.5);
    r.matrix(&format!("{p}mlp.down_proj.weight"), h, ffn, 1.5);
    r.norm("norm.weight", h);
    r.matrix("lm_head.weight", draft_vocab, h, 3.0);
    let d2t = targets
        .iter()
        .enumerate()
        .map(|(d, &t)| i64::from(t) - d as i64)
        .collect();
    r.out
        .push(("d2t".into(), vec![draft_vocab], Data::I64(d2t)));
    write_safetensors(&dir.join("model.safetensors"), &r.out);
    let config = serde_json::json!({
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {
            "model_type": "llama", "hidden_size": h, "intermediate_size": ffn,
            "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kvh,
            "head_dim": hd, "vocab_size": target.vocab, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
        },
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": false,
        "target_hidden_size": null,
        "eagle_aux_hidden_state_layer_ids": aux,
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}},
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

/// A random DFlash head for `target` (z-lab's layout, two layers of 4 query heads on one KV
/// head): fusing the outputs of target layers `taps`, `gamma` rows a block, the last id of
/// the vocabulary its mask token. Returns its folder.
pub fn write_dflash(tag: &str, target: &Tiny, taps: &[usize], gamma: usize, seed: u64) -> PathBuf {
    let dir = temp_dir(&format!("dflash_{tag}"));
    let (h, heads, kvh, hd, ffn) = (target.hidden, 4, 1, target.hidden / 4, 2 * target.hidden);
    let config = serde_json::json!({
        "model_type": "qwen3", "architectures": ["DFlashDraftModel"],
        "hidden_size": h, "intermediate_size": ffn, "num_hidden_layers": 2,
        "num_attention_heads": heads, "num_key_value_heads": kvh, "head_dim": hd,
        "vocab_size": target.vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "num_target_layers": target.layers,
        "block_size": gamma,
        "dflash_config": {"target_layer_ids": taps, "mask_token_id": target.vocab - 1},
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut r = Random {
        rng: Rng::new(seed),
        out: Vec::new(),
    };
    r.matrix("fc.weight", h, taps.len() * h, 1.5);
    r.norm("hidden_norm.weight", h);
    for l in 0..2 {
        let p = |x: &str| format!("layers.{l}.{x}.weight");
        r.norm(&p("input_layernorm"), h);
        r.matrix(&p("self_attn.q_proj"), heads * hd, h, 1.5);
        r.matrix(&p("self_attn.k_proj"), kvh * hd, h, 1.5);
        r.matrix(&p("self_attn.v_proj"), kvh * hd, h, 1.5);
        r.matrix(&p("self_attn.o_proj"), h, heads * hd, 1.5);
        r.norm(&p("self_attn.q_norm"), hd);
        r.norm(&p("self_attn.k_norm"), hd);
        r.norm(&p("post_attention_layernorm"), h);
        r.matrix(&p("mlp.gate_proj"), ffn, h, 1.5);
        r.matrix(&p("mlp.up_proj"), ffn, h, 1.5);
        r.matrix(&p("mlp.down_proj"), h, ffn, 1.5);
    }
    r.norm("norm.weight", h);
    write_safetensors(&dir.join("model.safetensors"), &r.out);
    dir
}
