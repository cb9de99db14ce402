//! Shared helpers of the model tests: a seeded tiny Llama written as a real safetensors
//! checkpoint or a real GGUF file, and an independent f32 reference forward.

#![allow(dead_code)]

mod batch;
mod checkpoint_edits;
mod gguf_writer;
mod greedy;
mod reference;
mod schedule;
mod twins;
// Used by the tests whose spies propose in batches only.
#[allow(unused_imports)]
pub use batch::propose_each;
// Used by the refusal tests of the MoE and latent attention loaders only.
#[allow(unused_imports)]
pub use checkpoint_edits::{check_refusal, edit_config, edit_header};
// Used by the batch tests of the heads that read captured rows only.
pub use gguf_writer::*;
#[allow(unused_imports)]
pub use twins::{RowAt, Twins};
// Used by the engine comparisons of the MoE and latent attention tests only.
#[allow(unused_imports)]
pub use greedy::greedy_fixed;
// Used by the tests that compare against a numpy reference script only.
#[allow(unused_imports)]
pub use reference::{floats, rows, run_reference};
// Used by the backend tests only; the other model tests share this module.
#[allow(unused_imports)]
pub use schedule::*;

use half::bf16;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A deterministic generator (xorshift64*), so the tests need no extra dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// The tiny model's sizes.
#[derive(Clone, Copy, Debug)]
pub struct Tiny {
    pub hidden: usize,
    pub ffn: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub theta: f32,
    pub eps: f32,
    pub tied: bool,
    /// `"llama"`, `"qwen2"` (q/k/v biases) or `"qwen3"` (per-head q/k RMSNorm).
    pub family: &'static str,
}

impl Default for Tiny {
    fn default() -> Self {
        Tiny {
            hidden: 64,
            ffn: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            vocab: 96,
            theta: 10_000.0,
            eps: 1e-5,
            tied: false,
            family: "llama",
        }
    }
}

/// name -> (shape outermost first, values exactly representable in BF16).
pub type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

fn bf16_round(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

impl Tiny {
    pub fn config_json(&self) -> String {
        format!(
            r#"{{"model_type": "{}", "hidden_size": {}, "intermediate_size": {}, "num_hidden_layers": {},
 "num_attention_heads": {}, "num_key_value_heads": {}, "vocab_size": {}, "rms_norm_eps": {},
 "rope_theta": {}, "max_position_embeddings": 256, "tie_word_embeddings": {}, "eos_token_id": 2}}"#,
            self.family,
            self.hidden,
            self.ffn,
            self.layers,
            self.heads,
            self.kv_heads,
            self.vocab,
            self.eps,
            self.theta,
            self.tied
        )
    }

    /// Random weights in HF names; norms near one, projections scaled by 1/sqrt(fan_in).
    pub fn tensors(&self, seed: u64) -> Tensors {
        let mut rng = Rng::new(seed);
        let mut out = Tensors::new();
        let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32, rng: &mut Rng| {
            let n: usize = shape.iter().product();
            let v = (0..n)
                .map(|_| bf16_round(offset + scale * rng.next_f32()))
                .collect();
            out.push((name, shape, v));
        };
        let (h, q, kv) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        );
        add(
            "model.embed_tokens.weight".into(),
            vec![self.vocab, h],
            1.0,
            0.0,
            &mut rng,
        );
        for l in 0..self.layers {
            let p = format!("model.layers.{l}.");
            let s = |fan: usize| 1.7 / (fan as f32).sqrt();
            add(
                format!("{p}input_layernorm.weight"),
                vec![h],
                0.2,
                1.0,
                &mut rng,
            );
            add(
                format!("{p}self_attn.q_proj.weight"),
                vec![q, h],
                s(h),
                0.0,
                &mut rng,
            );
            add(
                format!("{p}self_attn.k_proj.weight"),
                vec![kv, h],
                s(h),
                0.0,
                &mut rng,
            );
            add(
                format!("{p}self_attn.v_proj.weight"),
                vec![kv, h],
                s(h),
                0.0,
                &mut rng,
            );
            add(
                format!("{p}self_attn.o_proj.weight"),
                vec![h, q],
                s(q),
                0.0,
                &mut rng,
            );
            if self.family == "qwen2" {
                add(
                    format!("{p}self_attn.q_proj.bias"),
                    vec![q],
                    0.5,
                    0.0,
                    &mut rng,
                );
                add(
                    format!("{p}self_attn.k_proj.bias"),
                    vec![kv],
                    0.5,
                    0.0,
                    &mut rng,
                );
                add(
                    format!("{p}self_attn.v_proj.bias"),
                    vec![kv],
                    0.5,
                    0.0,
                    &mut rng,
                );
            }
            if self.family == "qwen3" {
                let d = self.head_dim;
                add(
                    format!("{p}self_attn.q_norm.weight"),
                    vec![d],
                    0.3,
                    1.0,
                    &mut rng,
                );
                add(
                    format!("{p}self_attn.k_norm.weight"),
                    vec![d],
                    0.3,
                    1.0,
                    &mut rng,
                );
            }
            add(
                format!("{p}post_attention_layernorm.weight"),
                vec![h],
                0.2,
                1.0,
                &mut rng,
            );
            add(
                format!("{p}mlp.gate_proj.weight"),
                vec![self.ffn, h],
                s(h),
                0.0,
                &mut rng,
            );
            add(
                format!("{p}mlp.up_proj.weight"),
                vec![self.ffn, h],
                s(h),
                0.0,
                &mut rng,
            );
            add(
                format!("{p}mlp.down_proj.weight"),
                vec![h, self.ffn],
                s(self.ffn),
                0.0,
                &mut rng,
            );
        }
        add("model.norm.weight".into(), vec![h], 0.2, 1.0, &mut rng);
        if !self.tied {
            add(
                "lm_head.weight".into(),
                vec![self.vocab, h],
                1.7 / (h as f32).sqrt(),
                0.0,
                &mut rng,
            );
        }
        out
    }
}

/// A fresh, empty temporary folder for one test.
pub fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specdraft-model-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The bytes of a safetensors file holding `tensors` as BF16 (or F32 when `f32`).
pub fn safetensors_bytes(tensors: &Tensors, f32_dtype: bool) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        for &v in values {
            if f32_dtype {
                data.extend_from_slice(&v.to_le_bytes());
            } else {
                data.extend_from_slice(&bf16::from_f32(v).to_le_bytes());
            }
        }
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": if f32_dtype {"F32"} else {"BF16"}, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    out
}

/// Writes `config.json` and the tensors split over two safetensors files.
pub fn write_hf(dir: &Path, tiny: &Tiny, tensors: &Tensors) {
    std::fs::write(dir.join("config.json"), tiny.config_json()).unwrap();
    let mid = tensors.len() / 2;
    let (a, b) = tensors.split_at(mid);
    std::fs::write(
        dir.join("model-00001-of-00002.safetensors"),
        safetensors_bytes(&a.to_vec(), false),
    )
    .unwrap();
    std::fs::write(
        dir.join("model-00002-of-00002.safetensors"),
        safetensors_bytes(&b.to_vec(), true),
    )
    .unwrap();
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(a, b)| a * inv * b).collect()
}

fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks(x.len())
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// An independent f32 forward of the tiny model (HF layout, rotate-half RoPE, causal
/// attention over the whole prefix): the logits at every position of `tokens`.
pub fn reference_logits(tiny: &Tiny, tensors: &Tensors, tokens: &[u32]) -> Vec<Vec<f32>> {
    reference_forward(tiny, tensors, tokens).0
}

/// [`reference_logits`]' forward: the logits at every position of `tokens`, and at every
/// position the residual stream after each decoder layer (`[position][layer]`).
#[allow(clippy::type_complexity)]
pub fn reference_forward(
    tiny: &Tiny,
    tensors: &Tensors,
    tokens: &[u32],
) -> (Vec<Vec<f32>>, Vec<Vec<Vec<f32>>>) {
    let t: HashMap<&str, &Vec<f32>> = tensors.iter().map(|(n, _, v)| (n.as_str(), v)).collect();
    let (hd, nh, nkv) = (tiny.head_dim, tiny.heads, tiny.kv_heads);
    let mut keys: Vec<Vec<Vec<f32>>> = vec![Vec::new(); tiny.layers];
    let mut vals: Vec<Vec<Vec<f32>>> = vec![Vec::new(); tiny.layers];
    let mut logits = Vec::new();
    let mut layer_outputs = Vec::new();
    let rope = |x: &mut [f32], heads: usize, pos: usize| {
        for h in 0..heads {
            for i in 0..hd / 2 {
                let f = 1.0 / (tiny.theta as f64).powf(2.0 * i as f64 / hd as f64);
                let (s, c) = ((pos as f64 * f) as f32).sin_cos();
                let (a, b) = (x[h * hd + i], x[h * hd + i + hd / 2]);
                x[h * hd + i] = a * c - b * s;
                x[h * hd + i + hd / 2] = b * c + a * s;
            }
        }
    };
    for (pos, &tok) in tokens.iter().enumerate() {
        let emb = t["model.embed_tokens.weight"];
        let mut x: Vec<f32> =
            emb[tok as usize * tiny.hidden..(tok as usize + 1) * tiny.hidden].to_vec();
        let mut outputs = Vec::with_capacity(tiny.layers);
        for l in 0..tiny.layers {
            let p = |s: &str| t[format!("model.layers.{l}.{s}").as_str()];
            let n = rms_norm(&x, p("input_layernorm.weight"), tiny.eps);
            let mut q = matvec(p("self_attn.q_proj.weight"), &n);
            let mut k = matvec(p("self_attn.k_proj.weight"), &n);
            let mut v = matvec(p("self_attn.v_proj.weight"), &n);
            if tiny.family == "qwen2" {
                for (x, b) in [(&mut q, "q"), (&mut k, "k"), (&mut v, "v")] {
                    let bias = p(&format!("self_attn.{b}_proj.bias"));
                    x.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
                }
            }
            if tiny.family == "qwen3" {
                for (x, name) in [(&mut q, "q_norm"), (&mut k, "k_norm")] {
                    let w = p(&format!("self_attn.{name}.weight"));
                    let normed: Vec<f32> = x
                        .chunks(hd)
                        .flat_map(|c| rms_norm(c, w, tiny.eps))
                        .collect();
                    *x = normed;
                }
            }
            rope(&mut q, nh, pos);
            rope(&mut k, nkv, pos);
            keys[l].push(k);
            vals[l].push(v);
            let mut att = vec![0f32; nh * hd];
            for h in 0..nh {
                let kvh = h / (nh / nkv);
                let qh = &q[h * hd..(h + 1) * hd];
                let scores: Vec<f32> = keys[l]
                    .iter()
                    .map(|k| {
                        qh.iter()
                            .zip(&k[kvh * hd..(kvh + 1) * hd])
                            .map(|(a, b)| a * b)
                            .sum::<f32>()
                            / (hd as f32).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for (j, w) in e.iter().enumerate() {
                    for d in 0..hd {
                        att[h * hd + d] += w / z * vals[l][j][kvh * hd + d];
                    }
                }
            }
            let o = matvec(p("self_attn.o_proj.weight"), &att);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let n = rms_norm(&x, p("post_attention_layernorm.weight"), tiny.eps);
            let g = matvec(p("mlp.gate_proj.weight"), &n);
            let u = matvec(p("mlp.up_proj.weight"), &n);
            let a: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let d = matvec(p("mlp.down_proj.weight"), &a);
            x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
            outputs.push(x.clone());
        }
        layer_outputs.push(outputs);
        let n = rms_norm(&x, t["model.norm.weight"], tiny.eps);
        let head = if tiny.tied {
            t["model.embed_tokens.weight"]
        } else {
            t["lm_head.weight"]
        };
        logits.push(matvec(head, &n));
    }
    (logits, layer_outputs)
}

/// Largest absolute difference between two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
