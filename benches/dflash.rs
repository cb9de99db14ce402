//! The cost of a DFlash block forward against a one-row target decode step, on the real
//! default model (SmolLM2-135M) and a random DFlash head of its shape (hidden 576, 9 heads on
//! 3 KV heads, MLP 1536, two draft layers over taps 1 and 27, γ = 8), as JSON lines: one per
//! draft vocabulary (the LM head's first 8192 rows, and all 49152) and storage of the head's
//! projections (BF16 as stored, and Q8_0 as the MTP head keeps its own on the CPU).
//!
//! Three calls are timed interleaved in the same rounds, so that a change of machine load
//! hits them alike (medians, and minimums: the least disturbed rounds): a target decode
//! step (then rolled back), a `propose` of γ - 1 drafts and a `propose` of none, both from
//! the same point with a one-row stack (proposing again from one point rewrites that context
//! row). The first is one context row and one block forward, the second the context row
//! alone, so `block_ms` (their difference) is the block forward. The goal: a block forward
//! of at most 30% of a target step (`block_vs_target`, of medians; `min_block_vs_target`, of
//! the least disturbed rounds); `propose_vs_target` is the whole drafting call a step with
//! nothing accepted pays. The head writes each context row at once here
//! (`set_defer_zero_draft_rows(false)`), so `context_row_ms` is one row's context forward.
//!
//! A second figure is what deferring those rows saves while the policy declines: a run of
//! [`DECLINED`] proposes of 0 drafts (each settled by `after_verify(0)`) and one block,
//! timed with each row written at once (`declined_run_ms_at_once`) and deferred to one
//! batched write before the block (`declined_run_ms_deferred`), in the same rounds.
//!
//! A third is what batching saves: `propose_batch_max` sequences at the same point each
//! proposing γ - 1 drafts, one by one (`batch_proposes_ms_one_by_one`) and in one
//! `propose_batch` (`batch_propose_ms`), in the same rounds.
//!
//! `cargo bench --bench dflash [-- PATH] [--quick]`; without a path it uses
//! `$SPECDRAFT_SMOLLM2_GGUF` or fetches the default model through `specdraft.models`.

use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::quant::BlockFormat;
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::model::{ForwardContext, LoadOptions, ModelLevers, TargetModel};
use specdraft::speculative::{DFlashHead, DraftProposer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

#[path = "common/default_model.rs"]
mod default_model;

/// A block forward may cost at most this fraction of a one-row target step.
const GOAL: f64 = 0.30;
const GAMMA: usize = 8;
const DRAFT_LAYERS: usize = 2;
/// z-lab's default taps for two draft layers over SmolLM2's 30 layers.
const TAPS: [usize; 2] = [1, 27];
/// Declined steps before the block in the deferral figure: one deferred-row backlog.
const DECLINED: usize = specdraft::speculative::dflash::DEFERRED_ROWS;

/// Writes a random DFlash head of the target's shape in z-lab's layout; returns its folder.
fn write_head(cfg: &specdraft::model::ModelConfig) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specdraft-bench-dflash-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (h, ffn) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv, hd) = (cfg.q_size(), cfg.kv_size(), cfg.head_dim);
    let config = serde_json::json!({
        "model_type": "qwen3", "architectures": ["DFlashDraftModel"], "hidden_size": h,
        "intermediate_size": ffn, "num_hidden_layers": DRAFT_LAYERS,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": hd,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": 1e-6, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": 8192, "num_target_layers": cfg.num_hidden_layers,
        "block_size": GAMMA,
        "dflash_config": {"target_layer_ids": TAPS, "mask_token_id": 0},
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("fc.weight".into(), vec![h, TAPS.len() * h]),
        ("hidden_norm.weight".into(), vec![h]),
        ("norm.weight".into(), vec![h]),
    ];
    for l in 0..DRAFT_LAYERS {
        let p = |x: &str| format!("layers.{l}.{x}.weight");
        shapes.extend([
            (p("input_layernorm"), vec![h]),
            (p("post_attention_layernorm"), vec![h]),
            (p("self_attn.q_proj"), vec![q, h]),
            (p("self_attn.k_proj"), vec![kv, h]),
            (p("self_attn.v_proj"), vec![kv, h]),
            (p("self_attn.o_proj"), vec![h, q]),
            (p("self_attn.q_norm"), vec![hd]),
            (p("self_attn.k_norm"), vec![hd]),
            (p("mlp.gate_proj"), vec![ffn, h]),
            (p("mlp.up_proj"), vec![ffn, h]),
            (p("mlp.down_proj"), vec![h, ffn]),
        ]);
    }
    let mut rng = SmallRng::seed_from_u64(7);
    let (mut header, mut data) = (serde_json::Map::new(), Vec::new());
    for (name, shape) in shapes {
        let n: usize = shape.iter().product();
        let (scale, base) = match shape.len() {
            1 => (0.1, 1.0),
            _ => (1.0 / (shape[1] as f32).sqrt(), 0.0),
        };
        let start = data.len();
        for _ in 0..n {
            let v = bf16::from_f32(base + scale * rng.random_range(-1.0f32..1.0));
            data.extend_from_slice(&v.to_le_bytes());
        }
        header.insert(
            name,
            serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut head = serde_json::to_vec(&serde_json::Value::Object(header)).expect("header");
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let mut bytes = (head.len() as u64).to_le_bytes().to_vec();
    bytes.extend(head);
    bytes.extend(data);
    std::fs::write(dir.join("model.safetensors"), bytes).expect("weights");
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

fn bench(
    model: &Arc<TargetModel>,
    dir: &Path,
    draft_vocab: Option<usize>,
    quant: Option<BlockFormat>,
    path: &Path,
    quick: bool,
) {
    let gpu = model.gpu().clone();
    let head =
        DFlashHead::from_checkpoint_for_target(dir, model.clone(), draft_vocab, quant, 512, 64)
            .expect("head loads");
    let width = TAPS.len() * model.config().hidden_size;
    let mut rng = SmallRng::seed_from_u64(3);
    let context = 48;
    let values: Vec<f32> = (0..(context + DECLINED) * width)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let stack = gpu.upload_bf16(&values, "bench stack").expect("stack");
    let mut ctx = ForwardContext::new(
        gpu.clone(),
        model.buffers().clone(),
        model.config().clone(),
        ModelLevers::default(),
    );
    ctx.target_hidden_stack = Some(stack);
    let all_tokens: Vec<u32> = (0..(context + DECLINED + 1) as u32)
        .map(|i| 300 + 37 * i)
        .collect();
    let tokens = &all_tokens[..context];
    let mut st = head.alloc_state_for(gpu.as_ref(), 512).expect("state");
    head.set_defer_zero_draft_rows(false);
    head.prefill_drafter(tokens, stack, &mut *st, &ctx, 0)
        .expect("drafter prefill");
    let last_row = stack.offset((context - 1) * width * 2);
    let mut propose = |n: usize| {
        head.propose(
            tokens[context - 1],
            last_row,
            context,
            n,
            &mut *st,
            &ctx,
            0,
            None,
            None,
            Some(last_row),
        )
        .expect("propose")
    };
    let drafts = propose(GAMMA - 1);
    // The target: the same context, then one-row decode steps rolled back after each.
    let mut seq = model.new_sequence();
    model.forward(&mut [&mut seq], &[tokens]).expect("prefill");
    let base_len = seq.len();
    let rounds = if quick { 7 } else { 31 };
    let (mut target, mut full, mut ctx_only) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        target.push(timed(|| {
            model
                .forward(&mut [&mut seq], &[&[tokens[5]]])
                .expect("step");
        }));
        model.trim(&mut seq, base_len).expect("trim");
        full.push(timed(|| {
            propose(GAMMA - 1);
        }));
        ctx_only.push(timed(|| {
            propose(0);
        }));
    }
    // The declined run, from a fresh prefill each time, rows at once and deferred in turn.
    let row = |q: usize| stack.offset(q * width * 2);
    let declined_run = |defer: bool| {
        head.set_defer_zero_draft_rows(defer);
        let mut st = head.alloc_state_for(gpu.as_ref(), 512).expect("state");
        head.prefill_drafter(tokens, stack, &mut *st, &ctx, 0)
            .expect("drafter prefill");
        let t = timed(|| {
            for k in 0..=DECLINED {
                let p = context + k;
                let n = if k == DECLINED { GAMMA - 1 } else { 0 };
                let r = row(p - 1);
                head.propose(
                    all_tokens[p],
                    r,
                    p,
                    n,
                    &mut *st,
                    &ctx,
                    0,
                    None,
                    None,
                    Some(r),
                )
                .expect("propose");
                head.after_verify(0, &mut *st, 0).expect("after_verify");
            }
        });
        head.free_state(gpu.as_ref(), &mut *st).expect("free state");
        t
    };
    let (mut at_once, mut deferred) = (Vec::new(), Vec::new());
    for _ in 0..rounds.min(11) {
        at_once.push(declined_run(false));
        deferred.push(declined_run(true));
    }
    let (a, d) = (stats(&mut at_once), stats(&mut deferred));
    // A batch of blocks, one forward, against the same sequences proposing one by one.
    head.set_defer_zero_draft_rows(true);
    let width_n = head.propose_batch_max(model.buffers(), model.config());
    let mut states: Vec<_> = (0..width_n)
        .map(|_| {
            let mut st = head.alloc_state_for(gpu.as_ref(), 512).expect("state");
            head.prefill_drafter(tokens, stack, &mut *st, &ctx, 0)
                .expect("drafter prefill");
            st
        })
        .collect();
    let (mut one_by_one, mut batched) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        one_by_one.push(timed(|| {
            for st in states.iter_mut() {
                head.propose(
                    tokens[context - 1],
                    last_row,
                    context,
                    GAMMA - 1,
                    &mut **st,
                    &ctx,
                    0,
                    None,
                    None,
                    Some(last_row),
                )
                .expect("propose");
            }
        }));
        let stacks = vec![last_row; width_n];
        let bctx = ForwardContext {
            target_hidden_stacks: Some(&stacks),
            ..ctx.clone()
        };
        let mut refs: Vec<&mut dyn specdraft::speculative::ProposerState> =
            states.iter_mut().map(|s| &mut **s as _).collect();
        batched.push(timed(|| {
            head.propose_batch(
                &vec![tokens[context - 1]; width_n],
                &vec![last_row; width_n],
                &vec![context; width_n],
                GAMMA - 1,
                &mut refs,
                &bctx,
                0,
                None,
            )
            .expect("propose_batch");
        }));
    }
    for st in states.iter_mut() {
        head.free_state(gpu.as_ref(), &mut **st)
            .expect("free state");
    }
    let (o, bt) = (stats(&mut one_by_one), stats(&mut batched));
    let blocks: Vec<f64> = full.iter().zip(&ctx_only).map(|(a, b)| a - b).collect();
    let (t, f, c, b) = (
        stats(&mut target),
        stats(&mut full),
        stats(&mut ctx_only),
        stats(&mut blocks.clone()),
    );
    println!(
        "{}",
        serde_json::json!({
            "bench": "dflash_block_cost", "backend": gpu.name(),
            "model": path.display().to_string(), "gamma": GAMMA, "draft_layers": DRAFT_LAYERS,
            "taps": TAPS, "draft_vocab": head.draft_vocab_size(),
            "projections": head.projection_format(),
            "lm_head": head_format(model), "context_tokens": context, "rounds": rounds,
            "target_step_ms": t.0 * 1e3, "propose_ms": f.0 * 1e3,
            "context_row_ms": c.0 * 1e3, "block_ms": b.0 * 1e3,
            "block_vs_target": b.0 / t.0, "propose_vs_target": f.0 / t.0,
            "min_target_step_ms": t.1 * 1e3, "min_propose_ms": f.1 * 1e3,
            "min_propose_vs_target": f.1 / t.1, "min_block_vs_target": (f.1 - c.1) / t.1,
            "goal_block_vs_target": GOAL, "meets_goal": b.0 / t.0 <= GOAL,
            "declined_steps": DECLINED,
            "declined_run_ms_at_once": a.0 * 1e3, "declined_run_ms_deferred": d.0 * 1e3,
            "deferred_vs_at_once": d.0 / a.0,
            "batch_sequences": width_n,
            "batch_proposes_ms_one_by_one": o.0 * 1e3, "batch_propose_ms": bt.0 * 1e3,
            "batch_vs_one_by_one": bt.0 / o.0,
            "weight_bytes_per_block": head.bytes_per_block(),
            "target_weight_bytes_per_token": model.weight_bytes_per_token(),
            "drafts": drafts,
        })
    );
    model.free_sequence(&mut seq).expect("free sequence");
    head.free_state(gpu.as_ref(), &mut *st).expect("free state");
    gpu.free(stack).expect("free stack");
}

/// The storage of the target's LM head (the tied embedding when it has none).
fn head_format(model: &TargetModel) -> &'static str {
    let w = model.weights();
    w.lm_head.as_ref().unwrap_or(&w.embed).format_name()
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
    let dir = write_head(model.config());
    for quant in [None, Some(BlockFormat::Q8_0)] {
        for draft_vocab in [Some(8192), None] {
            bench(&model, &dir, draft_vocab, quant, &path, quick);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
