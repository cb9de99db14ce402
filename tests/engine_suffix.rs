//! SuffixDecoding in the engine: greedy speculative output equals plain greedy output on
//! every pass, and a second pass over the same prompts drafts from the first pass's outputs.

mod engine_common;

use engine_common::*;
use specdraft::engine::{DraftPolicyKind, Generation, SpecEngine};
use specdraft::speculative::{DraftProposer, SuffixDecoding};
use std::sync::Arc;

const MAX: usize = 40;

fn run(engine: &SpecEngine<specdraft::engine::testing::TableTarget>) -> Generation {
    let g = engine.generate(requests(&prompts(), MAX));
    for r in &g.results {
        assert!(r.error.is_none(), "{:?}", r.error);
    }
    g
}

#[test]
fn greedy_output_equals_plain_output_on_every_pass() {
    let gpu = cpu();
    let target = table(&gpu);
    let base = baseline(&target, &prompts(), MAX);
    for n in [1, 3, 6] {
        let proposer = Arc::new(SuffixDecoding::default());
        let engine = SpecEngine::new(
            target.clone(),
            Some(proposer.clone() as Arc<dyn DraftProposer>),
            n,
        )
        .unwrap()
        // Every step asks for `n` drafts, so the passes' acceptance can be compared.
        .with_draft_policy(DraftPolicyKind::Fixed);
        let first = run(&engine);
        let second = run(&engine);
        for g in [&first, &second] {
            let tokens: Vec<Vec<u32>> = g.results.iter().map(|r| r.tokens.clone()).collect();
            assert_eq!(tokens, base, "num_drafts {n}");
        }
        // Every output of the first pass went into the shared tree.
        assert!(proposer.shared_tree().unwrap().outputs >= prompts().len());
        // The second pass finds the first pass's outputs and drafts them.
        assert!(
            second.metrics.accepted > first.metrics.accepted,
            "num_drafts {n}: accepted {} then {}",
            first.metrics.accepted,
            second.metrics.accepted
        );
    }
    assert_eq!(target.live_sequences(), 0);
    drop(target);
    assert_eq!(gpu.ledger().live_count(), 0);
}
