//! SuffixDecoding in the engine: greedy speculative output equals plain greedy output on
//! every pass, and a second pass over the same prompts drafts from the first pass's outputs.

mod engine_common;

use engine_common::*;
use specdraft::engine::{DraftPolicyKind, DraftShape, Generation, SpecEngine};
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

/// The output and accepted drafts of `prompt`, 8 drafts a step, with a suffix proposer
/// whose shared tree holds the prompt followed by each of `wrong` and twice by `right`.
fn seeded_run(
    target: &Arc<specdraft::engine::testing::TableTarget>,
    prompt: &[u32],
    right: &[u32],
    wrong: &[Vec<u32>],
    shape: DraftShape,
) -> (Vec<u32>, u64) {
    let proposer = Arc::new(SuffixDecoding::default().with_trees(true));
    for continuation in wrong.iter().map(|w| &w[..]).chain([right, right]) {
        proposer
            .remember_output(&[prompt, continuation].concat())
            .unwrap();
    }
    let engine = SpecEngine::new(target.clone(), Some(proposer as Arc<dyn DraftProposer>), 8)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed)
        .with_draft_shape(shape);
    let g = engine.generate(requests(&[prompt.to_vec()], MAX));
    let r = g.results.into_iter().next().unwrap();
    assert!(r.error.is_none(), "{:?}", r.error);
    (r.tokens, g.metrics.accepted)
}

#[test]
fn with_trees_the_less_frequent_branch_is_accepted_where_the_chain_fails() {
    let gpu = cpu();
    let target = table(&gpu);
    // A prompt that does not repeat itself, so the sequence's own tree offers nothing.
    let prompt = vec![10, 20, 30, 11, 21, 31, 12, 22];
    let right = baseline(&target, std::slice::from_ref(&prompt), MAX).remove(0);
    // Three continuations agree on a second token the target does not pick, then part: after
    // the prompt and the first token (the prefill's) the chain follows the token they share
    // (3 in 5) and fails, where a tree also holds the target's continuation (2 in 5).
    let wrong: Vec<Vec<u32>> = (0..3)
        .map(|j| {
            let mut w = right.clone();
            w[1] = (w[1] + 1) % 48;
            w[2] = (w[2] + 2 + j) % 48;
            w
        })
        .collect();
    let (tree_out, tree_accepted) = seeded_run(&target, &prompt, &right, &wrong, DraftShape::Tree);
    let (chain_out, chain_accepted) =
        seeded_run(&target, &prompt, &right, &wrong, DraftShape::Chain);
    assert_eq!(tree_out, right, "greedy output with suffix trees");
    assert_eq!(chain_out, right, "greedy output with suffix chains");
    assert!(
        tree_accepted > chain_accepted,
        "the tree accepted {tree_accepted}, the chain {chain_accepted}"
    );
    assert_eq!(target.live_sequences(), 0);
    drop(target);
    assert_eq!(gpu.ledger().live_count(), 0);
}
