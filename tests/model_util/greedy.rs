//! The model tests' greedy engine run: the same prompts through `SpecEngine` with and
//! without a proposer, so a test can compare the two outputs.

use specdraft::engine::{DraftPolicyKind, GenerateRequest, SamplingParams, SpecEngine};
use specdraft::model::TargetModel;
use specdraft::speculative::DraftProposer;
use std::sync::Arc;

/// Greedy outputs of `prompts` (16 tokens each, EOS ignored) with `proposer` asked for
/// `num_drafts` a step under the fixed policy (so verification is always several rows), at
/// most `max_batch` sequences at once. Every request must succeed. Returns the tokens and
/// the engine's drafted and accepted counts.
pub fn greedy_fixed(
    model: &Arc<TargetModel>,
    proposer: Option<Arc<dyn DraftProposer>>,
    num_drafts: usize,
    max_batch: usize,
    prompts: &[Vec<u32>],
) -> (Vec<Vec<u32>>, u64, u64) {
    let engine = SpecEngine::new(model.clone(), proposer, num_drafts)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed)
        .with_max_batch(max_batch);
    let reqs = prompts
        .iter()
        .map(|p| {
            GenerateRequest::new(p.clone(), 16)
                .ignore_eos()
                .with_sampling(SamplingParams::greedy())
        })
        .collect();
    let out = engine.generate(reqs);
    let tokens = out
        .results
        .into_iter()
        .map(|r| {
            assert!(r.error.is_none(), "{:?}", r.error);
            r.tokens
        })
        .collect();
    (tokens, out.metrics.drafted, out.metrics.accepted)
}
