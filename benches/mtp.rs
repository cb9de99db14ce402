//! MTP head propose latency on the CPU backend, as JSON lines.
//!
//! For a SmolLM2-sized head (hidden 576) and a hidden-2048 head, with BF16, FP8, NVFP4 and Q8_0
//! projections (the LM head is NVFP4 in both, as `MtpHead::new` takes it): the time per
//! draft of `propose`, the weight bytes one draft step reads, and those bytes divided by the
//! time (GB/s), next to the memcpy bandwidth measured on the same machine. A draft step
//! reads every weight once, so GB/s near the memcpy figure means the forward is
//! memory-bound, as it is on a GPU.
//!
//! Under `cargo bench` it then compares the draft step of the shipped SmolLM2 head with a
//! one-row step of the real default model (`mtp/step_cost.rs`): `cargo bench --bench mtp
//! -- --step-cost` runs that comparison alone. Add `--quick` for fewer repetitions.

use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::quant::BlockFormat;
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::memory::BufferArena;
use specdraft::model::layers::{LayerWeights, Mlp, SwiGlu};
use specdraft::model::{
    DenseWeight, DeviceAllocations, ForwardContext, Linear, ModelConfig, ModelLevers,
};
use specdraft::speculative::mtp::{quantize_nvfp4, MtpLayout};
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization, MtpWeights};
use std::sync::Arc;
use std::time::Instant;

#[path = "common/default_model.rs"]
mod default_model;
#[path = "mtp/step_cost.rs"]
mod step_cost;
#[path = "mtp/tree_batch.rs"]
mod tree_batch;

struct Shape {
    name: &'static str,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
}

fn memcpy_gbps(quick: bool) -> f64 {
    let n = 256 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let reps = if quick { 3 } else { 10 };
    dst.copy_from_slice(&src);
    let t = Instant::now();
    for _ in 0..reps {
        dst.copy_from_slice(std::hint::black_box(&src));
    }
    std::hint::black_box(&dst);
    (n * reps) as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn random(
    allocs: &DeviceAllocations,
    rng: &mut SmallRng,
    name: &str,
    shape: &[usize],
    scale: f32,
    base: f32,
) -> DenseWeight {
    let n: usize = shape.iter().product();
    let v: Vec<bf16> = (0..n)
        .map(|_| bf16::from_f32(base + rng.random_range(-scale..scale)))
        .collect();
    DenseWeight::upload(allocs, name, shape, &v).expect("upload")
}

fn bench(shape: &Shape, quant: MtpQuantization, memcpy: f64, quick: bool) {
    let cpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let allocs = DeviceAllocations::new(cpu.clone());
    let mut rng = SmallRng::seed_from_u64(1);
    let (h, q, kv, f) = (
        shape.hidden,
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
        shape.ffn,
    );
    let s = 1.0 / (h as f32).sqrt();
    let mut lin = |name: &str, o: usize, i: usize| {
        Linear::Dense(random(&allocs, &mut rng, name, &[o, i], s, 0.0))
    };
    let layer_proj = [
        lin("eh_proj", h, 2 * h),
        lin("q", q, h),
        lin("k", kv, h),
        lin("v", kv, h),
        lin("o", h, q),
        lin("gate", f, h),
        lin("up", f, h),
        lin("down", h, f),
    ];
    let [eh_proj, qp, kp, vp, op, gate, up, down] = layer_proj;
    let mut norm = |name: &str| random(&allocs, &mut rng, name, &[h], 0.1, 1.0);
    let weights = MtpWeights {
        layout: MtpLayout::DeepseekV3,
        enorm: norm("enorm"),
        hnorm: norm("hnorm"),
        eh_proj,
        layer: LayerWeights {
            attn_norm: norm("attn_norm"),
            q: qp,
            k: kp,
            v: vp,
            o: op,
            q_bias: None,
            k_bias: None,
            v_bias: None,
            qk_norm: None,
            gated_attention: false,
            ffn_norm: norm("ffn_norm"),
            mlp: Mlp::Dense(SwiGlu { gate, up, down }),
            mla: None,
        },
        final_norm: norm("final_norm"),
    };
    let final_norm = norm("model.norm");
    let embed = random(&allocs, &mut rng, "embed", &[shape.vocab, h], 1.0, 0.0);
    let lm: Vec<f32> = (0..shape.vocab * h)
        .map(|_| rng.random_range(-s..s))
        .collect();
    let lm_head = quantize_nvfp4(&lm, shape.vocab, h)
        .expect("quantize")
        .upload(&allocs, "lm_head")
        .expect("upload");
    drop(lm);
    let mut config = ModelConfig::tiny(shape.vocab);
    config.hidden_size = h;
    config.num_attention_heads = shape.heads;
    config.num_key_value_heads = shape.kv_heads;
    config.head_dim = shape.head_dim;
    config.intermediate_size = f;
    let levers = ModelLevers::default();
    let head = MtpHead::new(
        weights,
        embed,
        final_norm,
        lm_head,
        None,
        &config,
        cpu.as_ref(),
        quant,
        0,
        2048,
        4096,
        &levers,
    )
    .expect("head");
    let ctx = ForwardContext::new(
        cpu.clone(),
        Arc::new(BufferArena::empty(16)),
        Arc::new(config),
        levers,
    );
    let prompt = 64;
    let hid: Vec<f32> = (0..(prompt + 1) * h)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let hiddens = cpu.upload_bf16(&hid, "hiddens").expect("hiddens");
    let tokens: Vec<u32> = (0..=prompt)
        .map(|_| rng.random_range(0..shape.vocab as u32))
        .collect();
    let mut st = head.alloc_state_for(cpu.as_ref(), 1024).expect("state");
    head.prefill_drafter(&tokens[..prompt], hiddens, &mut *st, &ctx, 0)
        .expect("prefill");
    let n = 4;
    let last_hidden = hiddens.offset((prompt - 1) * h * 2);
    let mut propose = || {
        head.propose(
            tokens[prompt],
            last_hidden,
            prompt,
            n,
            &mut *st,
            &ctx,
            0,
            None,
            None,
            None,
        )
        .expect("propose")
        .len()
    };
    propose();
    let reps = if quick { 3 } else { 10 };
    let t = Instant::now();
    let mut drafts = 0;
    for _ in 0..reps {
        // Re-proposing from the same position rolls the unverified rows back first.
        drafts += propose();
    }
    let secs = t.elapsed().as_secs_f64() / drafts as f64;
    let bytes = head.bytes_per_draft();
    println!(
        "{}",
        serde_json::json!({
            "bench": "mtp_propose", "backend": "cpu", "head": shape.name, "hidden": h,
            "vocab": shape.vocab, "projections": quant.name(), "lm_head": "nvfp4",
            "num_drafts": n, "ms_per_draft": secs * 1e3, "weight_bytes_per_draft": bytes,
            "weight_gbps": bytes as f64 / secs / 1e9, "memcpy_gbps": memcpy,
        })
    );
    head.free_state(cpu.as_ref(), &mut *st).expect("free state");
    head.release(cpu.as_ref()).expect("release");
    cpu.free(hiddens).expect("free");
    drop(allocs);
    assert_eq!(cpu.ledger().live_count(), 0, "the benchmark leaked");
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    // The comparison needs the real model and an optimised build: only under `cargo bench`.
    let real = std::env::args().any(|a| a == "--bench");
    if std::env::args().any(|a| a == "--step-cost") {
        step_cost::run(quick);
        return;
    }
    let memcpy = memcpy_gbps(quick);
    println!(
        "{}",
        serde_json::json!({"bench": "memcpy", "gbps": memcpy, "bytes": 256 << 20})
    );
    let shapes = [
        Shape {
            name: "smollm2-135m",
            hidden: 576,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            ffn: 1536,
            vocab: 49152,
        },
        Shape {
            name: "hidden-2048",
            hidden: 2048,
            heads: 32,
            kv_heads: 8,
            head_dim: 64,
            ffn: 5632,
            vocab: 32000,
        },
    ];
    for shape in &shapes {
        for quant in [
            MtpQuantization::Bf16,
            MtpQuantization::Fp8,
            MtpQuantization::Nvfp4,
            MtpQuantization::Block(BlockFormat::Q8_0),
        ] {
            bench(shape, quant, memcpy, quick);
        }
    }
    if real {
        step_cost::run(quick);
    }
}
