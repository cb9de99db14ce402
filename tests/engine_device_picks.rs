//! Greedy picks made on the device. With a target that has room for picks
//! (`TargetOutput::picks`), a greedy sequence without a grammar downloads one token for its
//! first token and one a verify row, not the rows' logits; its output and acceptance are
//! those of the same engine picking from downloaded logits (a target without that room),
//! which are plain greedy decoding's. Counted on a backend that records every download:
//! exactly 4 bytes for each first token and each verify row with picks, or a whole logits
//! row for each without.

mod engine_common;

use engine_common::counting::{counting, Counting};
use engine_common::{prompts, requests, tokens_of, Oracle, RandomDrafter};
use specdraft::backend::GpuBackend;
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{DraftPolicyKind, DraftShape, Metrics, SamplingParams, SpecEngine};
use specdraft::speculative::{DraftProposer, SuffixDecoding, SuffixDecodingOptions};
use std::sync::atomic::Ordering;
use std::sync::Arc;

const VOCAB: usize = 48;
const MAX_TOKENS: usize = 24;

/// The shared prompts and two longer than one forward's 64 rows, whose prefills land in
/// chunks.
fn all_prompts() -> Vec<Vec<u32>> {
    let mut prompts = prompts();
    prompts.push((0..100).map(|i| (i * 7 % VOCAB) as u32).collect());
    prompts.push((0..70).map(|i| (i * 5 % VOCAB) as u32).collect());
    prompts
}

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
    counting.observer.reset();
    let engine = SpecEngine::new(target.clone(), proposer, 4)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed)
        .with_draft_shape(shape)
        .with_max_batch(4);
    let g = engine.generate(requests(&all_prompts(), MAX_TOKENS));
    let metrics = g.metrics.clone();
    (
        tokens_of(g),
        metrics,
        counting.observer.dtoh_bytes.load(Ordering::Relaxed),
        counting.observer.argmax.load(Ordering::Relaxed),
    )
}

#[test]
fn greedy_picks_download_a_token_a_row_and_decode_as_from_the_logits() {
    let counting = Arc::new(counting());
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
    let first_tokens = all_prompts().len();
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
        assert_eq!(bytes, (first_tokens + rows) * 4, "{name}: a token a row");
        assert_eq!(
            host_bytes,
            (first_tokens + rows) * VOCAB * 4,
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

/// A batch of greedy and sampled sequences, prompts long enough to prefill in several
/// chunks: the greedy ones take their first token and their verify rows from the device's
/// picks, the sampled ones from downloaded logits, in the same forwards; on a target whose
/// prefill returns every row's logits too. Every output equals the host path's, token for
/// token (the sampled ones draw the same random numbers), and the downloads are a token for
/// each greedy pick and a logits row for each sampled one, with at most a token more for a
/// sampled verify row (a forward's picks come down in one piece).
#[test]
fn greedy_and_sampled_sequences_share_forwards_each_downloading_what_it_needs() {
    let counting = Arc::new(counting());
    let gpu: Arc<dyn GpuBackend> = counting.clone();
    let base = gpu.ledger().live_count();
    let prompts = all_prompts();
    let sampled = |i: usize| i % 2 == 1;
    let reqs = || {
        requests(&prompts, MAX_TOKENS)
            .into_iter()
            .enumerate()
            .map(|(i, r)| match sampled(i) {
                true => r.with_sampling(SamplingParams::sampled(0.9, 40 + i as u64)),
                false => r,
            })
            .collect::<Vec<_>>()
    };
    let run = |target: TableTarget| {
        counting.observer.reset();
        let drafter = RandomDrafter {
            seed: 9,
            vocab: VOCAB as u32,
        };
        let engine = SpecEngine::new(Arc::new(target), Some(Arc::new(drafter)), 3)
            .unwrap()
            .with_draft_policy(DraftPolicyKind::Fixed)
            .with_max_batch(4);
        let g = engine.generate(reqs());
        let bytes = counting.observer.dtoh_bytes.load(Ordering::Relaxed);
        // A first token and a verify row a step and a draft, per request.
        let picked: Vec<usize> = g
            .results
            .iter()
            .map(|r| 1 + (r.metrics.verify_steps + r.metrics.drafted) as usize)
            .collect();
        (tokens_of(g), picked, bytes)
    };
    let (host_out, host_picked, host_bytes) = run(target(&gpu).without_picks());
    let total: usize = host_picked.iter().sum();
    assert_eq!(
        host_bytes,
        total * VOCAB * 4,
        "the host path: a logits row each"
    );
    for (name, t) in [
        ("last logits only", target(&gpu)),
        ("every row's logits", target(&gpu).with_all_logits()),
    ] {
        let (out, picked, bytes) = run(t);
        assert_eq!(out, host_out, "{name}");
        assert_eq!(picked, host_picked, "{name}");
        let on_host: usize = (0..picked.len())
            .filter(|&i| sampled(i))
            .map(|i| picked[i])
            .sum();
        let needed = (total - on_host) * 4 + on_host * VOCAB * 4;
        // A verify forward's picks come down in one piece, so a sampled sequence's verify
        // rows (its picks less its first token) may ride along at 4 bytes each.
        let riders = on_host - prompts.len() / 2;
        assert!(
            bytes >= needed && bytes - needed <= riders * 4 && (bytes - needed).is_multiple_of(4),
            "{name}: {bytes} bytes, where greedy picks at a token each and sampled ones at a \
             logits row each need {needed}, plus at most {riders} riders"
        );
    }
    let greedy = baseline_of(&gpu, &prompts);
    for (i, out) in host_out.iter().enumerate().filter(|(i, _)| !sampled(*i)) {
        assert_eq!(out, &greedy[i], "request {i} against plain greedy");
    }
    assert_eq!(gpu.ledger().live_count(), base);
}

fn baseline_of(gpu: &Arc<dyn GpuBackend>, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    engine_common::baseline(&Arc::new(target(gpu)), prompts, MAX_TOKENS)
}
