//! Speculative decoding with the engine: plain greedy decoding, then PromptLookup drafting
//! four tokens a step, on a small deterministic table target (no weights needed). The
//! output is identical; the drafter saves verify forwards.
//!
//! `cargo run --example 02_spec_engine`

use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{GenerateRequest, SpecEngine};
use specdraft::speculative::PromptLookup;
use std::sync::Arc;

fn main() -> specdraft::Result<()> {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let target = Arc::new(TableTarget::new(gpu.clone(), 64, 512, 64, 4, 0.0)?);
    let prompt: Vec<u32> = vec![3, 14, 15, 9, 26, 5, 3, 14, 15, 9];

    let plain = SpecEngine::new(target.clone(), None, 0)?;
    let spec = SpecEngine::new(target.clone(), Some(Arc::new(PromptLookup::default())), 4)?;
    let a = plain.generate(vec![GenerateRequest::new(prompt.clone(), 64)]);
    let b = spec.generate(vec![GenerateRequest::new(prompt, 64)]);
    let (a, b) = (&a.results[0], &b.results[0]);
    if let Some(e) = a.error.as_ref().or(b.error.as_ref()) {
        eprintln!("generation failed: {e}");
        std::process::exit(1);
    }
    assert_eq!(
        a.tokens, b.tokens,
        "greedy speculative decoding changes nothing"
    );
    println!("tokens: {:?}", b.tokens);
    println!(
        "verify forwards: {} plain, {} with PromptLookup (mean acceptance length {:.2}, by position {:?})",
        a.metrics.verify_steps,
        b.metrics.verify_steps,
        b.metrics.mean_acceptance_length(),
        b.metrics.acceptance_by_position(),
    );
    drop((plain, spec, target));
    assert_eq!(gpu.ledger().live_count(), 0);
    Ok(())
}
