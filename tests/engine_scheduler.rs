//! The scheduler against a paged KV pool it cannot hold everything in: requests queue, are
//! preempted and recomputed, and have long prompts prefilled in chunks, and still every
//! greedy output is the output of the request run alone on a target without a pool.

mod engine_common;
mod mtp_common;

use engine_common::*;
use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{
    mtp_pool_probe, EngineError, FinishReason, GenerateRequest, Generation, SpecEngine,
};
use specdraft::model::ModelLevers;
use specdraft::speculative::{
    DraftProposer, MtpHead, MtpQuantization, PromptLookup, SuffixDecoding,
};
use std::sync::Arc;

const BLOCK: usize = 4;

/// The table target of `engine_common::table`, its KV in `blocks` blocks of 4 rows.
fn pooled(gpu: &Arc<dyn GpuBackend>, blocks: usize) -> Arc<TableTarget> {
    Arc::new(
        TableTarget::new(gpu.clone(), 48, 256, 64, 11, 0.2)
            .unwrap()
            .with_kv_blocks(blocks, BLOCK)
            .unwrap(),
    )
}

/// Prompts of 1 to 33 tokens, some repetitive (so n-gram drafters get accepted).
fn workload() -> Vec<Vec<u32>> {
    (0..14)
        .map(|i: usize| {
            let len = 1 + (i * 7) % 33;
            (0..len)
                .map(|k| ((i * 5 + (k % (2 + i % 5)) * 3) % 48) as u32)
                .collect()
        })
        .collect()
}

/// Each prompt's greedy output, run alone with no proposer on a target without a pool.
fn solo(prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    let gpu = cpu();
    let target = table(&gpu);
    let engine = SpecEngine::new(target, None, 0).unwrap();
    prompts
        .iter()
        .map(|p| {
            let g = engine.generate(vec![
                GenerateRequest::new(p.clone(), max_tokens).ignore_eos()
            ]);
            let r = g.results.into_iter().next().unwrap();
            assert!(r.error.is_none(), "{:?}", r.error);
            r.tokens
        })
        .collect()
}

fn ignoring_eos(prompts: &[Vec<u32>], max_tokens: usize) -> Vec<GenerateRequest> {
    prompts
        .iter()
        .map(|p| GenerateRequest::new(p.clone(), max_tokens).ignore_eos())
        .collect()
}

/// A proposer under test: its name, the proposer (None: plain decoding), its draft count.
type Case = (&'static str, Option<Arc<dyn DraftProposer>>, usize);

fn proposers() -> Vec<Case> {
    vec![
        ("none", None, 0),
        ("prompt_lookup", Some(Arc::new(PromptLookup::default())), 4),
        ("suffix", Some(Arc::new(SuffixDecoding::default())), 5),
        (
            "random",
            Some(Arc::new(RandomDrafter { seed: 3, vocab: 48 })),
            3,
        ),
    ]
}

/// Every result is its solo output, ended by length, with consistent timing metrics.
fn assert_solo(g: &Generation, expect: &[Vec<u32>], what: &str) {
    for (i, r) in g.results.iter().enumerate() {
        assert!(r.error.is_none(), "{what}: request {i}: {:?}", r.error);
        assert_eq!(r.tokens, expect[i], "{what}: request {i}");
        assert_eq!(r.finish, FinishReason::Length, "{what}: request {i}");
        let m = &r.metrics;
        assert!(m.prefill_time > std::time::Duration::ZERO, "{what}: {i}");
        assert_eq!(m.first_tokens, 1, "{what}: {i}");
        // Waits after a preemption count too, and may come after the first token.
        if m.preemptions == 0 {
            assert!(m.queue_time <= m.time_to_first_token, "{what}: {i}");
        }
        assert!(m.queue_time <= m.wall_time, "{what}: {i}");
        assert!(m.time_to_first_token <= m.wall_time, "{what}: {i}");
    }
    let total_ttft: std::time::Duration = g
        .results
        .iter()
        .map(|r| r.metrics.time_to_first_token)
        .sum();
    assert_eq!(g.metrics.time_to_first_token, total_ttft, "{what}");
    assert_eq!(g.metrics.first_tokens, g.results.len() as u64, "{what}");
    assert!(g.metrics.prefill_time > std::time::Duration::ZERO, "{what}");
}

fn assert_pool_empty(target: &TableTarget, what: &str) {
    let (total, free) = target.kv_blocks().unwrap();
    assert_eq!(free, total, "{what}: KV blocks still held");
    assert_eq!(target.live_sequences(), 0, "{what}: sequences still live");
}

#[test]
fn queueing_preemption_and_chunked_prefill_keep_every_output() {
    let prompts = workload();
    let expect = solo(&prompts, 24);
    for (name, proposer, n) in proposers() {
        let gpu = cpu();
        // 96 rows: a request needs up to 56, so only a few run at once and they outgrow it.
        let target = pooled(&gpu, 24);
        let before = gpu.ledger().live_count();
        let engine = SpecEngine::new(target.clone(), proposer, n)
            .unwrap()
            .with_max_batch_tokens(8);
        let g = engine.generate(ignoring_eos(&prompts, 24));
        assert_solo(&g, &expect, name);
        assert!(g.metrics.preemptions > 0, "{name}: nothing was preempted");
        assert!(g.metrics.recomputed_tokens > 0, "{name}");
        assert!(
            target.peak_forward_rows() <= 8,
            "{name}: a forward of {} rows",
            target.peak_forward_rows()
        );
        assert!(target.peak_sequences() > 1, "{name}: nothing ran together");
        drop(engine);
        assert_pool_empty(&target, name);
        assert_eq!(
            gpu.ledger().live_count(),
            before,
            "{name}: allocations leaked"
        );
    }
}

#[test]
fn max_batch_bounds_running_sequences_under_a_large_pool() {
    let prompts = workload();
    let expect = solo(&prompts, 12);
    let gpu = cpu();
    let target = pooled(&gpu, 1000);
    let engine = SpecEngine::new(target.clone(), Some(Arc::new(PromptLookup::default())), 4)
        .unwrap()
        .with_max_batch(3);
    let g = engine.generate(ignoring_eos(&prompts, 12));
    assert_solo(&g, &expect, "max_batch 3");
    assert_eq!(target.peak_sequences(), 3);
    assert_eq!(g.metrics.preemptions, 0);
    assert_pool_empty(&target, "max_batch 3");
}

#[test]
fn three_hundred_requests_through_a_pool_that_holds_twenty_all_finish() {
    let prompt = vec![7, 100, 31, 4, 250, 12];
    let alone = {
        let gpu = cpu();
        let t = Arc::new(TableTarget::new(gpu.clone(), 256, 256, 64, 5, 0.2).unwrap());
        let g = SpecEngine::new(t, None, 0)
            .unwrap()
            .generate(ignoring_eos(std::slice::from_ref(&prompt), 40));
        g.results[0].tokens.clone()
    };
    assert_eq!(alone.len(), 40);
    let proposers: [(&str, Option<Arc<dyn DraftProposer>>); 2] = [
        ("none", None),
        ("prompt_lookup", Some(Arc::new(PromptLookup::default()))),
    ];
    for (name, proposer) in proposers {
        let gpu = cpu();
        // 64 blocks of 16 rows; a request holds up to 45 rows (3 blocks).
        let target = Arc::new(
            TableTarget::new(gpu.clone(), 256, 256, 64, 5, 0.2)
                .unwrap()
                .with_kv_blocks(64, 16)
                .unwrap(),
        );
        let engine = SpecEngine::new(target.clone(), proposer, 4).unwrap();
        let g = engine.generate(ignoring_eos(&vec![prompt.clone(); 300], 40));
        for (i, r) in g.results.iter().enumerate() {
            assert!(r.error.is_none(), "{name}: request {i}: {:?}", r.error);
            assert_eq!(r.tokens, alone, "{name}: request {i}");
        }
        // Continuous batching: many at once, never more than the pool holds.
        assert!(
            target.peak_sequences() >= 15,
            "{name}: {}",
            target.peak_sequences()
        );
        assert!(target.peak_sequences() <= 64, "{name}");
        drop(engine);
        assert_pool_empty(&target, name);
    }
}

#[test]
fn a_request_that_can_never_fit_fails_alone_at_once() {
    let prompts = workload()[..5].to_vec();
    let expect = solo(&prompts, 10);
    let gpu = cpu();
    // 40 rows in all.
    let target = pooled(&gpu, 10);
    let engine = SpecEngine::new(target.clone(), Some(Arc::new(PromptLookup::default())), 3)
        .unwrap()
        .with_max_batch_tokens(16);
    let mut reqs = ignoring_eos(&prompts, 10);
    reqs.insert(2, GenerateRequest::new(vec![3; 20], 30));
    let g = engine.generate(reqs);
    let bad = &g.results[2];
    assert_eq!(bad.finish, FinishReason::Error);
    assert!(bad.tokens.is_empty());
    assert_eq!(bad.metrics.prompt_tokens, 0, "it never ran");
    match bad.error.as_ref() {
        Some(specdraft::Error::Engine(EngineError::NeverFits {
            request,
            prompt_len,
            max_tokens,
            rows,
            pool_rows,
        })) => assert_eq!(
            (*request, *prompt_len, *max_tokens, *rows, *pool_rows),
            (2, 20, 30, 49, 40)
        ),
        other => panic!("expected NeverFits, got {other:?}"),
    }
    let msg = bad.error.as_ref().unwrap().to_string();
    assert!(
        msg.contains("20 tokens") && msg.contains("max_tokens (30)") && msg.contains("holds 40"),
        "{msg}"
    );
    let mut rest = g.results;
    rest.remove(2);
    let rest = Generation {
        results: rest,
        metrics: g.metrics,
    };
    for (i, r) in rest.results.iter().enumerate() {
        assert!(r.error.is_none(), "{i}: {:?}", r.error);
        assert_eq!(r.tokens, expect[i]);
    }
    drop(engine);
    assert_pool_empty(&target, "never fits");
}

#[test]
fn stepping_a_run_streams_every_token_once_and_dropping_it_frees_everything() {
    let prompts = workload();
    let expect = solo(&prompts, 16);
    let gpu = cpu();
    let target = pooled(&gpu, 20);
    let before = gpu.ledger().live_count();
    let engine = SpecEngine::new(target.clone(), Some(Arc::new(PromptLookup::default())), 4)
        .unwrap()
        .with_max_batch_tokens(8);
    let mut run = engine.begin(ignoring_eos(&prompts, 16));
    let mut streamed = vec![Vec::new(); prompts.len()];
    let mut ends = vec![None; prompts.len()];
    while run.step() {
        for u in run.take_updates() {
            assert!(
                ends[u.request].is_none(),
                "update after the end of {}",
                u.request
            );
            streamed[u.request].extend(u.tokens);
            ends[u.request] = u.finish;
        }
    }
    for u in run.take_updates() {
        assert!(ends[u.request].is_none());
        streamed[u.request].extend(u.tokens);
        ends[u.request] = u.finish;
    }
    assert!(run.take_updates().is_empty(), "each end is reported once");
    let g = run.finish();
    for (i, r) in g.results.iter().enumerate() {
        assert_eq!(streamed[i], expect[i], "request {i}");
        assert_eq!(r.tokens, expect[i]);
        assert_eq!(ends[i], Some(FinishReason::Length));
    }
    assert_pool_empty(&target, "streamed");
    assert_eq!(gpu.ledger().live_count(), before);

    // Abandoned half-way: dropping the run releases what it held.
    let mut run = engine.begin(ignoring_eos(&prompts, 16));
    for _ in 0..5 {
        assert!(run.step());
    }
    assert!(target.live_sequences() > 0);
    drop(run);
    assert_pool_empty(&target, "dropped");
    assert_eq!(gpu.ledger().live_count(), before);

    // Finished early: what had not ended says it was stopped.
    let mut run = engine.begin(ignoring_eos(&prompts, 16));
    run.step();
    let g = run.finish();
    assert!(g.results.iter().any(|r| matches!(
        r.error,
        Some(specdraft::Error::Engine(EngineError::Stopped { .. }))
    )));
    assert_pool_empty(&target, "finished early");
    assert_eq!(gpu.ledger().live_count(), before);
}

#[test]
fn mtp_head_under_preemption_keeps_output_and_returns_both_pools() {
    let dir = mtp_common::scratch_dir("engine_scheduler_mtp");
    mtp_common::write_checkpoint(&dir, "deepseek_v3", 5);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let levers = ModelLevers::default();
    let head = Arc::new(
        MtpHead::from_checkpoint(
            &dir,
            gpu.clone(),
            MtpQuantization::Bf16,
            0,
            512,
            64,
            &levers,
        )
        .unwrap(),
    );
    let vocab = mtp_common::VOCAB;
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i: u32| {
            (0..(3 + i * 4))
                .map(|k| (i * 11 + k % 4) % vocab as u32)
                .collect()
        })
        .collect();
    let plain = Arc::new(TableTarget::new(gpu.clone(), vocab, 512, 64, 2, 0.1).unwrap());
    let expect: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let e = SpecEngine::new(plain.clone(), None, 0).unwrap();
            e.generate(ignoring_eos(std::slice::from_ref(p), 20))
                .results[0]
                .tokens
                .clone()
        })
        .collect();
    let target = Arc::new(
        TableTarget::new(gpu.clone(), vocab, 512, 64, 2, 0.1)
            .unwrap()
            .with_kv_blocks(20, BLOCK)
            .unwrap(),
    );
    let engine = SpecEngine::new(
        target.clone(),
        Some(head.clone() as Arc<dyn DraftProposer>),
        3,
    )
    .unwrap()
    .with_max_batch_tokens(8)
    .with_drafter_pool(mtp_pool_probe(head.clone()));
    let g = engine.generate(ignoring_eos(&prompts, 20));
    for (i, r) in g.results.iter().enumerate() {
        assert!(r.error.is_none(), "{i}: {:?}", r.error);
        assert_eq!(r.tokens, expect[i], "request {i}");
    }
    assert!(g.metrics.preemptions > 0);
    assert!(g.metrics.drafted > 0);
    drop(engine);
    assert_pool_empty(&target, "mtp");
    let (total, free) = head.kv_blocks();
    assert_eq!(total, free, "drafter KV blocks still held");
}
