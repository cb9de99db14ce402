//! Cost of one `propose` call through `dyn DraftProposer`, for PromptLookup, printed as JSON.
//!
//! Run: `cargo bench --bench protocol`. The Python-side figures (a trivial Python proposer
//! called from Rust) come from `specdraft bench --protocol`.

use specdraft::backend::{CpuBackend, DevicePtr};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig, ModelLevers};
use specdraft::speculative::{DraftProposer, PromptLookup};
use std::sync::Arc;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let gpu = Arc::new(CpuBackend::new());
    let ctx = ForwardContext::new(
        gpu.clone(),
        Arc::new(BufferArena::empty(1)),
        Arc::new(ModelConfig::tiny(49152)),
        ModelLevers::default(),
    );
    let mut json = Vec::new();
    for history_len in [256usize, 4096] {
        let proposer: Box<dyn DraftProposer> = Box::new(PromptLookup::default());
        let mut state = proposer.alloc_state(&*gpu).expect("state");
        let prompt: Vec<u32> = (0..history_len as u32).map(|i| (i * 7919) % 1000).collect();
        proposer
            .prefill_drafter(&prompt, DevicePtr::NULL, &mut *state, &ctx, 0)
            .expect("prefill");
        let (rounds, per_round) = (31, 200);
        let mut samples = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let start = Instant::now();
            for _ in 0..per_round {
                // Same position every call: the proposer truncates and re-drafts, so the
                // history length stays fixed.
                let d = proposer
                    .propose(
                        prompt[history_len / 2],
                        DevicePtr::NULL,
                        history_len,
                        4,
                        &mut *state,
                        &ctx,
                        0,
                        None,
                        None,
                        None,
                    )
                    .expect("propose");
                std::hint::black_box(d);
            }
            samples.push(start.elapsed().as_secs_f64() * 1e6 / per_round as f64);
        }
        json.push(format!(
            "{{\"proposer\": \"prompt-lookup\", \"history_tokens\": {history_len}, \"us_per_propose\": {:.3}}}",
            median(samples)
        ));
    }
    println!("[{}]", json.join(", "));
}
