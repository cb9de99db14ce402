//! Greedy verification from picks made on the device. With a target that has room for picks
//! (`TargetOutput::picks`), a greedy step without a grammar downloads one token a verify row,
//! not the rows' logits; its output and acceptance are those of the same engine verifying
//! from downloaded logits (a target without that room), which are plain greedy decoding's.
//! Counted on a backend that records every download: the prefill's last logits row, then
//! exactly 4 bytes a verify row with picks, or a whole logits row a verify row without.

mod engine_common;

use engine_common::counting::Counting;
use engine_common::{prompts, requests, tokens_of, Oracle, RandomDrafter};
use specdraft::backend::GpuBackend;
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{DraftPolicyKind, DraftShape, Metrics, SpecEngine};
use specdraft::speculative::{DraftProposer, SuffixDecoding, SuffixDecodingOptions};
use std::sync::atomic::Ordering;
use std::sync::Arc;

const VOCAB: usize = 48;
const MAX_TOKENS: usize = 24;

fn target(gpu: &Arc<dyn GpuBackend>) -> TableTarget {
    TableTarget::new(gpu.clone(), VOCAB, 256, 64, 11, 0.2).unwrap()
}

/// One greedy run of every prompt under the fixed policy (the same drafts whatever the
/// timings), four at a time: the outputs, the metrics over all, and the bytes downloaded.
fn run(
    counting: &Counting,
    target: &Arc<TableTarget>,
    proposer: Option<Arc<dyn DraftProposer>>,
    shape: DraftShape,
) -> (Vec<Vec<u32>>, Metrics, usize, usize) {
    counting.reset();
    let engine = SpecEngine::new(target.clone(), proposer, 4)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed)
        .with_draft_shape(shape)
        .with_max_batch(4);
    let g = engine.generate(requests(&prompts(), MAX_TOKENS));
    let metrics = g.metrics.clone();
    (
        tokens_of(g),
        metrics,
        counting.dtoh_bytes.load(Ordering::Relaxed),
        counting.argmax.load(Ordering::Relaxed),
    )
}

#[test]
fn greedy_steps_download_a_token_a_row_and_decode_as_from_the_logits() {
    let counting = Arc::new(Counting::new());
    let gpu: Arc<dyn GpuBackend> = counting.clone();
    let with = Arc::new(target(&gpu));
    let without = Arc::new(target(&gpu).without_picks());
    let base = gpu.ledger().live_count();
    // Each run gets a fresh proposer: suffix decoding's shared tree learns from every run.
    type Make = Box<dyn Fn() -> Option<Arc<dyn DraftProposer>>>;
    let oracle_target = with.clone();
    let proposers: Vec<(&str, Make, DraftShape)> = vec![
        ("plain", Box::new(|| None), DraftShape::Chain),
        (
            "random",
            Box::new(|| {
                Some(Arc::new(RandomDrafter {
                    seed: 5,
                    vocab: VOCAB as u32,
                }))
            }),
            DraftShape::Chain,
        ),
        (
            "oracle",
            Box::new(move || {
                Some(Arc::new(Oracle {
                    target: oracle_target.clone(),
                    fail: None,
                }))
            }),
            DraftShape::Chain,
        ),
        (
            "suffix trees",
            Box::new(|| {
                let suffix = SuffixDecoding::new(SuffixDecodingOptions::default()).unwrap();
                Some(Arc::new(suffix.with_trees(true)))
            }),
            DraftShape::Tree,
        ),
    ];
    let (plain, ..) = run(&counting, &without, None, DraftShape::Chain);
    let prefill_bytes = prompts().len() * VOCAB * 4;
    for (name, make, shape) in proposers {
        let (out, m, bytes, argmaxes) = run(&counting, &with, make(), shape);
        let (host_out, host_m, host_bytes, host_argmaxes) = run(&counting, &without, make(), shape);
        assert_eq!(out, plain, "{name}: device picks against plain greedy");
        assert_eq!(host_out, plain, "{name}: host picks against plain greedy");
        let counts = |m: &Metrics| (m.verify_steps, m.drafted, m.accepted);
        assert_eq!(counts(&m), counts(&host_m), "{name}");
        // Every step verifies a row for its last token and one a draft.
        let rows = (m.verify_steps + m.drafted) as usize;
        assert!(m.verify_steps > 0, "{name}");
        assert_eq!(bytes, prefill_bytes + rows * 4, "{name}: a token a row");
        assert_eq!(
            host_bytes,
            prefill_bytes + rows * VOCAB * 4,
            "{name}: a logits row a row"
        );
        assert!(argmaxes > 0, "{name}: no argmax ran on the device");
        assert_eq!(host_argmaxes, 0, "{name}");
        if name != "plain" {
            assert!(m.drafted > 0, "{name} drafted nothing");
        }
    }
    assert_eq!(gpu.ledger().live_count(), base);
}
