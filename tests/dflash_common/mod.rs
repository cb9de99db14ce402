//! A tiny seeded Llama target (four layers) and random DFlash checkpoints in z-lab's layout
//! (GQA 4:1, two draft layers, a mask token), shared by the DFlash integration tests. A test
//! crate using it declares `mod model_util;` beside it.
#![allow(dead_code)]

use crate::model_util::*;
use specdraft::backend::GpuBackend;
use specdraft::model::{LoadOptions, TargetModel};
use specdraft::speculative::DFlashHead;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const H: usize = 64;
pub const VOCAB: usize = 96;
pub const TARGET_LAYERS: usize = 4;
pub const TAPS: [usize; 2] = [1, 3];

pub fn target(gpu: &Arc<dyn GpuBackend>, tag: &str) -> Arc<TargetModel> {
    let t = Tiny {
        layers: TARGET_LAYERS,
        ..Tiny::default()
    };
    let dir = temp_dir(&format!("dflash_target_{tag}"));
    write_hf(&dir, &t, &t.tensors(5));
    let opts = LoadOptions {
        max_rows: 32,
        max_seq_len: Some(128),
        kv_blocks: Some(64),
    };
    Arc::new(TargetModel::load(&dir, gpu.clone(), opts).unwrap())
}

/// A random DFlash checkpoint: `block_size` rows a block, taps [`TAPS`], mask token
/// `VOCAB - 1`, its config edited by `edit` and its tensors by `drop` (names left out) and
/// `fc_in` (the width of `fc`'s input).
pub struct Ckpt {
    pub block_size: usize,
    pub edit: fn(&mut serde_json::Value),
    pub drop: &'static [&'static str],
    pub fc_in: usize,
}

impl Default for Ckpt {
    fn default() -> Self {
        Ckpt {
            block_size: 4,
            edit: |_| {},
            drop: &[],
            fc_in: TAPS.len() * H,
        }
    }
}

impl Ckpt {
    pub fn write(&self, tag: &str) -> PathBuf {
        let dir = temp_dir(&format!("dflash_head_{tag}"));
        let (heads, kvh, hd, ffn) = (4, 1, 16, 96);
        let mut cfg = serde_json::json!({
            "model_type": "qwen3", "architectures": ["DFlashDraftModel"],
            "hidden_size": H, "intermediate_size": ffn, "num_hidden_layers": 2,
            "num_attention_heads": heads, "num_key_value_heads": kvh, "head_dim": hd,
            "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 256, "num_target_layers": TARGET_LAYERS,
            "block_size": self.block_size,
            "dflash_config": {"target_layer_ids": TAPS, "mask_token_id": VOCAB - 1},
        });
        (self.edit)(&mut cfg);
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        let mut rng = Rng::new(17);
        let mut tensors = Tensors::new();
        let mut add = |name: String, shape: Vec<usize>, scale: f32, base: f32| {
            let n: usize = shape.iter().product();
            let v = (0..n).map(|_| base + scale * rng.next_f32()).collect();
            tensors.push((name, shape, v));
        };
        let s = |fan: usize| 1.5 / (fan as f32).sqrt();
        add("fc.weight".into(), vec![H, self.fc_in], s(self.fc_in), 0.0);
        add("hidden_norm.weight".into(), vec![H], 0.2, 1.0);
        for l in 0..2 {
            let p = |x: &str| format!("layers.{l}.{x}.weight");
            add(p("input_layernorm"), vec![H], 0.2, 1.0);
            add(p("self_attn.q_proj"), vec![heads * hd, H], s(H), 0.0);
            add(p("self_attn.k_proj"), vec![kvh * hd, H], s(H), 0.0);
            add(p("self_attn.v_proj"), vec![kvh * hd, H], s(H), 0.0);
            add(
                p("self_attn.o_proj"),
                vec![H, heads * hd],
                s(heads * hd),
                0.0,
            );
            add(p("self_attn.q_norm"), vec![hd], 0.2, 1.0);
            add(p("self_attn.k_norm"), vec![hd], 0.2, 1.0);
            add(p("post_attention_layernorm"), vec![H], 0.2, 1.0);
            add(p("mlp.gate_proj"), vec![ffn, H], s(H), 0.0);
            add(p("mlp.up_proj"), vec![ffn, H], s(H), 0.0);
            add(p("mlp.down_proj"), vec![H, ffn], s(ffn), 0.0);
        }
        add("norm.weight".into(), vec![H], 0.2, 1.0);
        tensors.retain(|(n, _, _)| !self.drop.contains(&n.as_str()));
        std::fs::write(
            dir.join("model.safetensors"),
            safetensors_bytes(&tensors, false),
        )
        .unwrap();
        dir
    }
}

pub fn load(
    dir: &Path,
    model: &Arc<TargetModel>,
    draft_vocab: Option<usize>,
) -> specdraft::Result<DFlashHead> {
    DFlashHead::from_checkpoint_for_target(dir, model.clone(), draft_vocab, None, 128, 64)
}
