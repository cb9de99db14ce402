//! Host-side cost of the engine loop, printed as JSON: tokens/s and microseconds per verify
//! step on a cheap deterministic table target (vocabulary 1024), for plain decoding and for
//! PromptLookup, with 1 and with 8 sequences stepping together. The target's own work is
//! small here, so the figures bound what the loop (drafting, verification, copies, metrics)
//! adds to a real model's forward.
//!
//! `cargo bench --bench engine_loop`

use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{GenerateRequest, SpecEngine};
use specdraft::speculative::{DraftProposer, PromptLookup};
use std::sync::Arc;
use std::time::Instant;

fn run(
    target: &Arc<TableTarget>,
    proposer: Option<Arc<dyn DraftProposer>>,
    seqs: usize,
) -> serde_json::Value {
    let engine = SpecEngine::new(target.clone(), proposer, 4).expect("engine");
    let requests = |n: usize| -> Vec<GenerateRequest> {
        (0..n)
            .map(|i| {
                GenerateRequest::new((0..32).map(|t| ((t * 7 + i) % 1024) as u32).collect(), 256)
                    .ignore_eos()
            })
            .collect()
    };
    engine.generate(requests(1)); // warm-up
    let t = Instant::now();
    let g = engine.generate(requests(seqs));
    let secs = t.elapsed().as_secs_f64();
    let m = &g.metrics;
    let steps = m.verify_steps as f64 / seqs as f64;
    serde_json::json!({
        "sequences": seqs,
        "tokens": m.emitted,
        "tokens_per_s": m.emitted as f64 / secs,
        "us_per_step": secs * 1e6 / steps,
        "mean_acceptance_length": m.mean_acceptance_length(),
    })
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`: do the work only
    // under `cargo bench`, where the build is optimised.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let target = Arc::new(TableTarget::new(gpu, 1024, 1024, 512, 4, 0.0).expect("target"));
    let mut out = serde_json::Map::new();
    for seqs in [1, 8] {
        out.insert(format!("plain_{seqs}"), run(&target, None, seqs));
        out.insert(
            format!("prompt_lookup_{seqs}"),
            run(&target, Some(Arc::new(PromptLookup::default())), seqs),
        );
    }
    println!("{}", serde_json::to_string_pretty(&out).expect("json"));
}
