//! The cost of an EAGLE-3 draft step against a one-row target decode step, on the real
//! default model (SmolLM2-135M) and a random EAGLE-3 head of its shape (speculators layout:
//! hidden 576, 9 heads on 3 KV heads, MLP 1536, vLLM's default aux layers 2, 15 and 27, the
//! target's embedding shared), as JSON lines: one per draft vocabulary (8192 and 32768 ids,
//! mapped through `d2t`) and storage of the head's matrices (BF16 as stored, and Q8_0 for
//! `fc`, the layer's projections and the head's own LM head, as the MTP head keeps its own
//! on the CPU).
//!
//! Three calls are timed interleaved in the same rounds, so that a change of machine load
//! hits them alike (medians, and minimums: the least disturbed rounds): a target decode step
//! (then rolled back), a `propose` of one draft and a `propose` of three, both from the same
//! point with the row the target captured for the last context token (proposing again from
//! one point rolls the unverified rows back). A propose of one draft is one draft step: the
//! row of the last token through `fc`, the decoder layer, `norm`, the LM head over the draft
//! vocabulary and its argmax. The goal: a draft step of at most 12% of a target step
//! (`step_vs_target`, of medians; `min_step_vs_target`, of the least disturbed rounds);
//! `chain_step_vs_target` is each further draft of a chain (no `fc`), from the 3-draft call.
//!
//! Each propose follows a target step, as in decoding: a Q8_0 head of 10 MB fits a 32 MiB
//! L3 cache, so a propose timed right after another one reads its weights from the cache
//! (measured: a 3-draft propose then cost what a 1-draft one did), while the target's step
//! in between evicts them. The chain's further drafts still read a warm cache, as they do
//! in decoding.
//!
//! `cargo bench --bench eagle3 [-- PATH] [--quick]`; without a path it uses
//! `$SPECDRAFT_SMOLLM2_GGUF` or fetches the default model through `specdraft.models`.

use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::quant::BlockFormat;
use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend};
use specdraft::model::{
    ForwardContext, LoadOptions, LogitRows, ModelConfig, ModelLevers, TargetModel,
};
use specdraft::speculative::{DraftProposer, Eagle3Head, MtpQuantization};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

#[path = "common/default_model.rs"]
mod default_model;

/// A draft step may cost at most this fraction of a one-row target step.
const GOAL: f64 = 0.12;
const DRAFT_VOCABS: [usize; 2] = [8192, 32768];
/// Context tokens before the proposes.
const CONTEXT: usize = 48;

/// One tensor of the checkpoint: BF16 values or i64 ids.
enum Data {
    Bf16(Vec<f32>),
    I64(Vec<i64>),
}

fn write_safetensors(path: &Path, tensors: Vec<(String, Vec<usize>, Data)>) {
    let (mut header, mut data) = (serde_json::Map::new(), Vec::new());
    for (name, shape, values) in tensors {
        let start = data.len();
        let dtype = match values {
            Data::Bf16(v) => {
                for x in v {
                    data.extend_from_slice(&bf16::from_f32(x).to_le_bytes());
                }
                "BF16"
            }
            Data::I64(v) => {
                for x in v {
                    data.extend_from_slice(&x.to_le_bytes());
                }
                "I64"
            }
        };
        header.insert(
            name,
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut head = serde_json::to_vec(&serde_json::Value::Object(header)).expect("header");
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let mut bytes = (head.len() as u64).to_le_bytes().to_vec();
    bytes.extend(head);
    bytes.extend(data);
    std::fs::write(path, bytes).expect("weights");
}

/// Writes a random EAGLE-3 head of the target's shape in the speculators layout, drafting
/// over `draft_vocab` ids spread evenly over the target's vocabulary; returns its folder.
fn write_head(cfg: &ModelConfig, draft_vocab: usize) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "specdraft-bench-eagle3-{draft_vocab}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (h, ffn, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (q, kv, hd) = (cfg.q_size(), cfg.kv_size(), cfg.head_dim);
    let config = serde_json::json!({
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {
            "model_type": "llama", "hidden_size": h, "intermediate_size": ffn,
            "num_hidden_layers": 1, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": hd,
            "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": cfg.rope_theta,
        },
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": false,
        "target_hidden_size": null,
        "eagle_aux_hidden_state_layer_ids": null,
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "smollm2"}},
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    let p = |x: &str| format!("layers.0.{x}.weight");
    let shapes: Vec<(String, Vec<usize>)> = vec![
        ("fc.weight".into(), vec![h, 3 * h]),
        (p("input_layernorm"), vec![h]),
        (p("hidden_norm"), vec![h]),
        (p("self_attn.q_proj"), vec![q, 2 * h]),
        (p("self_attn.k_proj"), vec![kv, 2 * h]),
        (p("self_attn.v_proj"), vec![kv, 2 * h]),
        (p("self_attn.o_proj"), vec![h, q]),
        (p("post_attention_layernorm"), vec![h]),
        (p("mlp.gate_proj"), vec![ffn, h]),
        (p("mlp.up_proj"), vec![ffn, h]),
        (p("mlp.down_proj"), vec![h, ffn]),
        ("norm.weight".into(), vec![h]),
        ("lm_head.weight".into(), vec![draft_vocab, h]),
    ];
    let mut rng = SmallRng::seed_from_u64(7);
    let mut tensors: Vec<(String, Vec<usize>, Data)> = shapes
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let (scale, base) = match shape.len() {
                1 => (0.1, 1.0),
                _ => (1.0 / (shape[1] as f32).sqrt(), 0.0),
            };
            let v = (0..n)
                .map(|_| base + scale * rng.random_range(-1.0f32..1.0))
                .collect();
            (name, shape, Data::Bf16(v))
        })
        .collect();
    let d2t = (0..draft_vocab)
        .map(|d| (d * vocab / draft_vocab) as i64 - d as i64)
        .collect();
    tensors.push(("d2t".into(), vec![draft_vocab], Data::I64(d2t)));
    write_safetensors(&dir.join("model.safetensors"), tensors);
    dir
}

/// `(median, minimum)` seconds.
fn stats(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0])
}

fn timed(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// The context tokens and the rows the target captured for them at `layers`, copied out of
/// the model's scratch (freed by the caller).
fn captured(model: &TargetModel, tokens: &[u32], layers: &[usize]) -> DevicePtr {
    let gpu = model.gpu();
    let width = layers.len() * model.config().hidden_size * 2;
    let mut seq = model.new_sequence();
    let out = model
        .forward_capturing(
            &mut [&mut seq],
            &[tokens],
            LogitRows::LastPerSequence,
            layers,
        )
        .expect("capturing forward");
    let stack = gpu
        .alloc(tokens.len() * width, "bench stack")
        .expect("alloc");
    gpu.copy_dtod(
        stack,
        out.hidden_stack.expect("captured rows"),
        tokens.len() * width,
        0,
    )
    .expect("copy");
    model.free_sequence(&mut seq).expect("free sequence");
    stack
}

fn bench(model: &Arc<TargetModel>, dir: &Path, quant: MtpQuantization, path: &Path, quick: bool) {
    let gpu = model.gpu().clone();
    let levers = ModelLevers::default();
    let head = Eagle3Head::from_checkpoint_for_target_quantized(
        dir,
        model.clone(),
        quant,
        512,
        64,
        &levers,
    )
    .expect("head loads");
    let layers = head.target_layer_ids();
    let width = layers.len() * model.config().hidden_size * 2;
    let tokens: Vec<u32> = (0..CONTEXT as u32).map(|i| 300 + 37 * i).collect();
    let stack = captured(model, &tokens, &layers);
    let mut ctx = ForwardContext::new(
        gpu.clone(),
        model.buffers().clone(),
        model.config().clone(),
        levers,
    );
    ctx.target_hidden_stack = Some(stack);
    let p = CONTEXT - 1;
    let mut st = head.alloc_state_for(gpu.as_ref(), 512).expect("state");
    head.prefill_drafter(&tokens[..p], stack, &mut *st, &ctx, 0)
        .expect("drafter prefill");
    // The last token is paired with the row computed before it.
    let row = stack.offset((p - 1) * width);
    let mut propose = |n: usize| {
        head.propose(
            tokens[p],
            row,
            p,
            n,
            &mut *st,
            &ctx,
            0,
            None,
            None,
            Some(row),
        )
        .expect("propose")
    };
    let drafts = propose(3);
    // The target: the same context, then one-row decode steps rolled back after each.
    let mut seq = model.new_sequence();
    model.forward(&mut [&mut seq], &[&tokens]).expect("prefill");
    let base_len = seq.len();
    let rounds = if quick { 7 } else { 31 };
    let (mut target, mut one, mut three) = (Vec::new(), Vec::new(), Vec::new());
    let mut target_step = || {
        let t = timed(|| {
            model
                .forward(&mut [&mut seq], &[&[tokens[5]]])
                .expect("step");
        });
        model.trim(&mut seq, base_len).expect("trim");
        t
    };
    for _ in 0..rounds {
        target.push(target_step());
        one.push(timed(|| {
            propose(1);
        }));
        target.push(target_step());
        three.push(timed(|| {
            propose(3);
        }));
    }
    let chain: Vec<f64> = three.iter().zip(&one).map(|(c, s)| (c - s) / 2.0).collect();
    let (t, s, c3, ch) = (
        stats(&mut target),
        stats(&mut one),
        stats(&mut three),
        stats(&mut chain.clone()),
    );
    println!(
        "{}",
        serde_json::json!({
            "bench": "eagle3_step_cost", "backend": gpu.name(),
            "model": path.display().to_string(), "aux_layer_ids": head.aux_layer_ids(),
            "draft_vocab": head.draft_vocab_size(), "projections": head.projection_format(),
            "lm_head": head.lm_head_format(), "context_tokens": CONTEXT, "rounds": rounds,
            "target_step_ms": t.0 * 1e3, "step_ms": s.0 * 1e3, "propose3_ms": c3.0 * 1e3,
            "chain_step_ms": ch.0 * 1e3,
            "step_vs_target": s.0 / t.0, "chain_step_vs_target": ch.0 / t.0,
            "propose3_vs_target": c3.0 / t.0,
            "min_target_step_ms": t.1 * 1e3, "min_step_ms": s.1 * 1e3,
            "min_step_vs_target": s.1 / t.1, "min_propose3_vs_target": c3.1 / t.1,
            "goal_step_vs_target": GOAL, "meets_goal": s.0 / t.0 <= GOAL,
            "weight_bytes_per_draft": head.bytes_per_draft(),
            "target_weight_bytes_per_token": model.weight_bytes_per_token(),
            "drafts": drafts,
        })
    );
    model.free_sequence(&mut seq).expect("free sequence");
    head.free_state(gpu.as_ref(), &mut *st).expect("free state");
    gpu.free(stack).expect("free stack");
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let path = default_model::model_path();
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let opts = LoadOptions {
        max_rows: 64,
        max_seq_len: Some(512),
        kv_blocks: Some(64),
    };
    let model = Arc::new(TargetModel::load(&path, gpu.clone(), opts).expect("model loads"));
    for draft_vocab in DRAFT_VOCABS {
        let dir = write_head(model.config(), draft_vocab);
        for quant in [
            MtpQuantization::Bf16,
            MtpQuantization::Block(BlockFormat::Q8_0),
        ] {
            bench(&model, &dir, quant, &path, quick);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
