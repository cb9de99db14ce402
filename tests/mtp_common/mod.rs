//! Tiny random MTP checkpoints in the three real layouts, written as safetensors folders
//! with a `config.json`, shared by the MTP integration tests.
#![allow(dead_code)]

mod fixture;
#[allow(unused_imports)]
pub use fixture::*;

use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::{Dtype as StDtype, TensorView};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const HIDDEN: usize = 64;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = 16;
pub const FFN: usize = 96;
pub const VOCAB: usize = 100;
pub const MAIN_LAYERS: usize = 1;

/// A fresh, empty folder under the target directory (removed first if it exists).
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create test folder");
    dir
}

struct Tensors {
    rng: SmallRng,
    data: BTreeMap<String, (Vec<usize>, Vec<u8>)>,
}

impl Tensors {
    fn put(&mut self, name: &str, shape: &[usize], values: Vec<f32>) {
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect();
        self.data.insert(name.to_string(), (shape.to_vec(), bytes));
    }

    fn uniform(&mut self, name: &str, shape: &[usize], scale: f32) {
        let n: usize = shape.iter().product();
        let v = (0..n)
            .map(|_| self.rng.random_range(-scale..scale))
            .collect();
        self.put(name, shape, v);
    }

    /// A norm weight: around 1, or around 0 when the family stores `w` for `1 + w`.
    fn norm(&mut self, name: &str, len: usize, zero_centered: bool) {
        let base = if zero_centered { 0.0 } else { 1.0 };
        let v = (0..len)
            .map(|_| base + self.rng.random_range(-0.2..0.2))
            .collect();
        self.put(name, &[len], v);
    }
}

/// Writes a tiny checkpoint of `layout` (`deepseek_v3`, `glm4_moe`, `mimo`, `qwen3_next`)
/// into `dir` and returns `dir`.
pub fn write_checkpoint(dir: &Path, layout: &str, seed: u64) -> PathBuf {
    write_checkpoint_with(dir, layout, seed, false)
}

/// Experts of the MoE checkpoints: GLM routes 8 (2 groups, 1 kept), Qwen3-Next 4; top-2.
pub const GLM_EXPERTS: usize = 8;
pub const QWEN_EXPERTS: usize = 4;
pub const EXPERT_FFN: usize = 32;

/// [`write_checkpoint`], with a routed MoE MLP (and shared experts) when `moe`.
pub fn write_checkpoint_with(dir: &Path, layout: &str, seed: u64, moe: bool) -> PathBuf {
    let mut t = Tensors {
        rng: SmallRng::seed_from_u64(seed),
        data: BTreeMap::new(),
    };
    let h = HIDDEN;
    let zc = layout == "qwen3_next";
    let gated = if zc { 2 } else { 1 };
    let (module, layer, names): (String, String, [&str; 4]) = match layout {
        "deepseek_v3" | "glm4_moe" => {
            let p = format!("model.layers.{MAIN_LAYERS}.");
            (
                p.clone(),
                p,
                ["enorm", "hnorm", "eh_proj", "shared_head.norm"],
            )
        }
        "mimo" => {
            let p = "model.mtp_layers.0.".to_string();
            (
                p.clone(),
                p,
                [
                    "token_layernorm",
                    "hidden_layernorm",
                    "input_proj",
                    "final_layernorm",
                ],
            )
        }
        "qwen3_next" => (
            "mtp.".into(),
            "mtp.layers.0.".into(),
            ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"],
        ),
        other => panic!("unknown layout {other}"),
    };
    t.uniform("model.embed_tokens.weight", &[VOCAB, h], 1.0);
    t.norm("model.norm.weight", h, zc);
    t.uniform("lm_head.weight", &[VOCAB, h], 3.0 / (h as f32).sqrt());
    // A main-model tensor, so the checkpoint looks like a real one to the layout search.
    t.norm("model.layers.0.input_layernorm.weight", h, zc);
    t.norm(&format!("{module}{}.weight", names[0]), h, zc);
    t.norm(&format!("{module}{}.weight", names[1]), h, zc);
    t.uniform(
        &format!("{module}{}.weight", names[2]),
        &[h, 2 * h],
        1.0 / (2.0 * h as f32).sqrt(),
    );
    t.norm(&format!("{module}{}.weight", names[3]), h, zc);
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let s = 1.5 / (h as f32).sqrt();
    t.norm(&format!("{layer}input_layernorm.weight"), h, zc);
    t.norm(&format!("{layer}post_attention_layernorm.weight"), h, zc);
    t.uniform(
        &format!("{layer}self_attn.q_proj.weight"),
        &[gated * q, h],
        s,
    );
    t.uniform(&format!("{layer}self_attn.k_proj.weight"), &[kv, h], s);
    t.uniform(&format!("{layer}self_attn.v_proj.weight"), &[kv, h], s);
    t.uniform(&format!("{layer}self_attn.o_proj.weight"), &[h, q], s);
    if layout == "mimo" {
        t.uniform(&format!("{layer}self_attn.q_proj.bias"), &[q], 0.2);
        t.uniform(&format!("{layer}self_attn.k_proj.bias"), &[kv], 0.2);
        t.uniform(&format!("{layer}self_attn.v_proj.bias"), &[kv], 0.2);
    }
    if zc {
        t.norm(&format!("{layer}self_attn.q_norm.weight"), HEAD_DIM, zc);
        t.norm(&format!("{layer}self_attn.k_norm.weight"), HEAD_DIM, zc);
    }
    let (mlp, mlp_ffn) = match (moe, zc) {
        (false, _) => ("mlp", FFN),
        (true, false) => ("mlp.shared_experts", EXPERT_FFN),
        (true, true) => ("mlp.shared_expert", 48),
    };
    t.uniform(&format!("{layer}{mlp}.gate_proj.weight"), &[mlp_ffn, h], s);
    t.uniform(&format!("{layer}{mlp}.up_proj.weight"), &[mlp_ffn, h], s);
    let down_scale = 1.5 / (mlp_ffn as f32).sqrt();
    t.uniform(
        &format!("{layer}{mlp}.down_proj.weight"),
        &[h, mlp_ffn],
        down_scale,
    );
    if moe {
        let experts = if zc { QWEN_EXPERTS } else { GLM_EXPERTS };
        t.uniform(
            &format!("{layer}mlp.gate.weight"),
            &[experts, h],
            2.0 / (h as f32).sqrt(),
        );
        if zc {
            t.uniform(&format!("{layer}mlp.shared_expert_gate.weight"), &[1, h], s);
        } else {
            t.uniform(
                &format!("{layer}mlp.gate.e_score_correction_bias"),
                &[experts],
                0.1,
            );
        }
        let down_scale = 1.5 / (EXPERT_FFN as f32).sqrt();
        for e in 0..experts {
            let p = format!("{layer}mlp.experts.{e}.");
            t.uniform(&format!("{p}gate_proj.weight"), &[EXPERT_FFN, h], s);
            t.uniform(&format!("{p}up_proj.weight"), &[EXPERT_FFN, h], s);
            t.uniform(
                &format!("{p}down_proj.weight"),
                &[h, EXPERT_FFN],
                down_scale,
            );
        }
    }
    if layout != "mimo" && layout != "qwen3_next" {
        t.uniform(
            &format!("{module}shared_head.head.weight"),
            &[VOCAB, h],
            3.0 / (h as f32).sqrt(),
        );
    }
    let views: Vec<(String, TensorView<'_>)> = t
        .data
        .iter()
        .map(|(n, (shape, bytes))| {
            (
                n.clone(),
                TensorView::new(StDtype::BF16, shape.clone(), bytes).expect("tensor view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))
        .expect("write safetensors");
    let mut config = serde_json::json!({
        "model_type": layout,
        "hidden_size": h,
        "intermediate_size": FFN,
        "num_hidden_layers": MAIN_LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": false,
        "num_nextn_predict_layers": 1,
    });
    // Stated for every layout: the families' defaults differ (GLM-4.5's is 0.5).
    config["partial_rotary_factor"] = serde_json::json!(if zc { 0.25 } else { 1.0 });
    if moe && zc {
        config["num_experts"] = serde_json::json!(QWEN_EXPERTS);
        config["num_experts_per_tok"] = serde_json::json!(2);
        config["moe_intermediate_size"] = serde_json::json!(EXPERT_FFN);
        config["shared_expert_intermediate_size"] = serde_json::json!(48);
        config["norm_topk_prob"] = serde_json::json!(true);
    } else if moe {
        config["n_routed_experts"] = serde_json::json!(GLM_EXPERTS);
        config["num_experts_per_tok"] = serde_json::json!(2);
        config["moe_intermediate_size"] = serde_json::json!(EXPERT_FFN);
        config["n_shared_experts"] = serde_json::json!(1);
        config["norm_topk_prob"] = serde_json::json!(true);
        config["routed_scaling_factor"] = serde_json::json!(2.5);
        config["n_group"] = serde_json::json!(2);
        config["topk_group"] = serde_json::json!(1);
    }
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write config");
    dir.to_path_buf()
}

/// The path from a root child of `tree` to `node`, root side first.
pub fn path_to(tree: &specdraft::speculative::DraftTree, node: usize) -> Vec<usize> {
    let mut path = vec![node];
    while let Some(p) = tree.parents[*path.last().unwrap()] {
        path.push(p);
    }
    path.reverse();
    path
}
