//! Wrapping a proposer: `Timed` measures how long `PromptLookup` spends drafting, and
//! writes nothing else. As a `DelegatingProposer` every other protocol method is the inner
//! proposer's, so the wrapped drafter drafts exactly what it drafts alone: the same
//! batches, the same trees. Because the engine asks a batch of sequences through
//! `propose_batch`, the wrapper times that method too.
//!
//! `cargo run --example 05_wrapping_proposer`

use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{DraftPolicyKind, GenerateRequest, SpecEngine};
use specdraft::model::ForwardContext;
use specdraft::speculative::{DelegatingProposer, DraftProposer, PromptLookup, ProposerState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// `inner`, with the time spent in its drafting calls added up.
struct Timed {
    inner: Arc<dyn DraftProposer>,
    nanos: AtomicU64,
    calls: AtomicU64,
}

impl Timed {
    fn time<R>(&self, f: impl FnOnce() -> R) -> R {
        let start = Instant::now();
        let r = f();
        self.nanos
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
        r
    }
}

#[allow(clippy::too_many_arguments)]
impl DelegatingProposer for Timed {
    fn inner(&self) -> &dyn DraftProposer {
        self.inner.as_ref()
    }

    fn propose(
        &self,
        last_token: u32,
        target_hidden: DevicePtr,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        draft_embed_target: Option<DevicePtr>,
        grammar_bitmask: Option<&[i32]>,
        target_hidden_stack: Option<DevicePtr>,
    ) -> specdraft::Result<Vec<u32>> {
        self.time(|| {
            self.inner.propose(
                last_token,
                target_hidden,
                position,
                num_drafts,
                state,
                ctx,
                stream,
                draft_embed_target,
                grammar_bitmask,
                target_hidden_stack,
            )
        })
    }

    fn propose_batch(
        &self,
        last_tokens: &[u32],
        target_hiddens: &[DevicePtr],
        positions: &[usize],
        num_drafts: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
        out_conf: Option<&mut Vec<Vec<f32>>>,
    ) -> specdraft::Result<Option<Vec<Vec<u32>>>> {
        self.time(|| {
            self.inner.propose_batch(
                last_tokens,
                target_hiddens,
                positions,
                num_drafts,
                states,
                ctx,
                stream,
                out_conf,
            )
        })
    }
}

fn main() -> specdraft::Result<()> {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let target = Arc::new(TableTarget::new(gpu.clone(), 64, 512, 64, 4, 0.0)?);
    let prompts: Vec<Vec<u32>> = vec![
        vec![3, 14, 15, 9, 26, 5, 3, 14, 15, 9],
        vec![2, 7, 1, 8, 2, 8, 1, 8, 2, 7],
    ];
    let requests = || {
        prompts
            .iter()
            .map(|p| GenerateRequest::new(p.clone(), 48))
            .collect::<Vec<_>>()
    };
    let lookup: Arc<dyn DraftProposer> = Arc::new(PromptLookup::default());
    let timed = Arc::new(Timed {
        inner: lookup.clone(),
        nanos: AtomicU64::new(0),
        calls: AtomicU64::new(0),
    });
    // The fixed policy drafts every step, so both runs draft the same (the adaptive one
    // follows measured timings, which differ from run to run).
    let engine = |p: Arc<dyn DraftProposer>| {
        SpecEngine::new(target.clone(), Some(p), 4)
            .map(|e| e.with_draft_policy(DraftPolicyKind::Fixed))
    };
    let alone = engine(lookup)?.generate(requests());
    let wrapped = engine(timed.clone())?.generate(requests());
    for (a, w) in alone.results.iter().zip(&wrapped.results) {
        if let Some(e) = a.error.as_ref().or(w.error.as_ref()) {
            eprintln!("generation failed: {e}");
            std::process::exit(1);
        }
        assert_eq!(a.tokens, w.tokens, "the wrapper changes no output");
    }
    assert_eq!(
        alone.metrics.drafted, wrapped.metrics.drafted,
        "the wrapper drafts what it wraps"
    );
    let calls = timed.calls.load(Ordering::Relaxed);
    assert!(calls > 0, "no drafting call was timed");
    println!(
        "{} drafts in {calls} drafting calls, {:.1} us a call",
        wrapped.metrics.drafted,
        timed.nanos.load(Ordering::Relaxed) as f64 / calls as f64 / 1e3,
    );
    drop((timed, wrapped, alone, target));
    assert_eq!(gpu.ledger().live_count(), 0);
    Ok(())
}
