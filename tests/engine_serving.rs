//! A long-lived run serving requests submitted and cancelled between its steps: each request
//! gets exactly the greedy output it gets alone, a cancelled one gives its KV back before the
//! next step, and nothing is left held once the run is dropped.

mod engine_common;
mod mtp_common;

use engine_common::*;
use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{
    mtp_pool_probe, EngineError, FinishReason, GenerateRequest, GenerationRun, Metrics, SpecEngine,
};
use specdraft::model::ModelLevers;
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization, PromptLookup};
use std::collections::HashMap;
use std::sync::Arc;

/// The table target of `engine_common::table`, its KV in `blocks` blocks of 4 rows.
fn pooled(gpu: &Arc<dyn GpuBackend>, blocks: usize) -> Arc<TableTarget> {
    Arc::new(
        TableTarget::new(gpu.clone(), 48, 256, 64, 11, 0.2)
            .unwrap()
            .with_kv_blocks(blocks, 4)
            .unwrap(),
    )
}

/// Ten prompts of 3 to 21 tokens, some repetitive (so prompt lookup gets accepted).
fn workload() -> Vec<Vec<u32>> {
    (0..10)
        .map(|i: usize| {
            let len = 3 + (i * 7) % 19;
            (0..len)
                .map(|k| ((i * 5 + (k % (2 + i % 4)) * 3) % 48) as u32)
                .collect()
        })
        .collect()
}

/// Each prompt's greedy output, run alone with no proposer on a target without a pool.
fn solo(prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    let gpu = cpu();
    let engine = SpecEngine::new(table(&gpu), None, 0).unwrap();
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

/// What a poll loop saw of each request: its tokens, its end and its final metrics.
#[derive(Default)]
struct Seen {
    tokens: HashMap<usize, Vec<u32>>,
    ends: HashMap<usize, (FinishReason, Option<specdraft::Error>, Option<Metrics>)>,
}

impl Seen {
    fn poll<T: specdraft::engine::Target>(&mut self, run: &mut GenerationRun<T>) {
        for u in run.poll() {
            assert!(
                !self.ends.contains_key(&u.id),
                "update after the end of {}",
                u.id
            );
            self.tokens.entry(u.id).or_default().extend(u.tokens);
            if let Some(f) = u.finish {
                self.ends.insert(u.id, (f, u.error, u.metrics));
            }
        }
    }
}

#[test]
fn requests_submitted_between_steps_get_their_solo_greedy_output() {
    let prompts = workload();
    let expect = solo(&prompts, 20);
    let gpu = cpu();
    // 24 blocks of 4 rows: too few for all ten at once, so some wait and some are preempted.
    let target = pooled(&gpu, 24);
    let before = gpu.ledger().live_count();
    let engine = SpecEngine::new(target.clone(), Some(Arc::new(PromptLookup::default())), 4)
        .unwrap()
        .with_max_batch_tokens(16);
    let mut run = engine.serve();
    let mut seen = Seen::default();
    let mut ids = Vec::new();
    let mut steps = 0;
    // Two requests at a time, every third step, while the earlier ones run.
    while ids.len() < prompts.len() || !run.is_done() {
        if steps % 3 == 0 {
            for p in prompts.iter().skip(ids.len()).take(2) {
                ids.push(run.submit(GenerateRequest::new(p.clone(), 20).ignore_eos()));
            }
        }
        run.step();
        seen.poll(&mut run);
        steps += 1;
        assert!(steps < 1000, "the run does not end");
    }
    seen.poll(&mut run);
    assert!(
        steps > 3 * (prompts.len() / 2 - 1),
        "later requests joined a running batch"
    );
    for (k, id) in ids.iter().enumerate() {
        assert_eq!(seen.tokens[id], expect[k], "request {k} (id {id})");
        let (finish, error, metrics) = &seen.ends[id];
        assert_eq!(*finish, FinishReason::Length, "request {k}");
        assert!(error.is_none(), "request {k}: {error:?}");
        let m = metrics.as_ref().expect("metrics on the last update");
        assert_eq!(m.emitted, 20, "request {k}");
        assert_eq!(m.first_tokens, 1, "request {k}");
        assert!(m.accepted <= m.drafted, "request {k}");
    }
    assert_eq!(run.tracked(), 0, "ended requests are forgotten");
    let (total, free) = target.kv_blocks().unwrap();
    assert_eq!(
        free, total,
        "KV blocks still held after every request ended"
    );
    // Later submissions still run on the same run.
    let id = run.submit(GenerateRequest::new(prompts[0].clone(), 20).ignore_eos());
    while run.step() {
        seen.poll(&mut run);
    }
    seen.poll(&mut run);
    assert_eq!(seen.tokens[&id], expect[0]);
    drop(run);
    assert_eq!(target.live_sequences(), 0);
    assert_eq!(
        gpu.ledger().live_count(),
        before,
        "device ledger after drop"
    );
}

#[test]
fn cancel_frees_a_request_at_once_and_the_others_run_on() {
    let prompts = workload();
    let expect = solo(&prompts, 24);
    let gpu = cpu();
    let target = pooled(&gpu, 64);
    let before = gpu.ledger().live_count();
    let engine = SpecEngine::new(target.clone(), Some(Arc::new(PromptLookup::default())), 4)
        .unwrap()
        .with_max_batch(3);
    let mut run = engine.serve();
    let mut seen = Seen::default();
    let ids: Vec<usize> = prompts
        .iter()
        .take(5)
        .map(|p| run.submit(GenerateRequest::new(p.clone(), 24).ignore_eos()))
        .collect();
    for _ in 0..3 {
        run.step();
        seen.poll(&mut run);
    }
    assert_eq!((run.running(), run.waiting()), (3, 2));
    let (total, free_before) = target.kv_blocks().unwrap();
    // One running, one waiting.
    assert!(run.cancel(ids[1]));
    assert!(run.cancel(ids[4]));
    let (_, free_after) = target.kv_blocks().unwrap();
    assert!(
        free_after > free_before,
        "the running request's blocks came back at once"
    );
    assert_eq!(target.live_sequences(), 2);
    assert_eq!((run.running(), run.waiting()), (2, 1));
    assert!(!run.cancel(ids[1]), "a request is cancelled once");
    assert!(!run.cancel(999), "unknown ids are refused");
    while run.step() {
        seen.poll(&mut run);
    }
    seen.poll(&mut run);
    for &k in &[1, 4] {
        let (finish, error, _) = &seen.ends[&ids[k]];
        assert_eq!(*finish, FinishReason::Cancelled, "request {k}");
        assert!(error.is_none());
        let got = &seen.tokens.get(&ids[k]).cloned().unwrap_or_default();
        assert!(
            expect[k].starts_with(got),
            "a cancelled request's tokens are its own"
        );
    }
    for &k in &[0, 2, 3] {
        assert_eq!(seen.tokens[&ids[k]], expect[k], "request {k}");
        assert_eq!(seen.ends[&ids[k]].0, FinishReason::Length);
    }
    assert_eq!(target.kv_blocks().unwrap(), (total, total));
    // Cancelling mid-run and dropping the run: nothing is left.
    let id = run.submit(GenerateRequest::new(prompts[2].clone(), 24).ignore_eos());
    run.step();
    run.step();
    assert_eq!(target.live_sequences(), 1);
    assert!(run.cancel(id));
    assert_eq!(target.kv_blocks().unwrap(), (total, total));
    assert_eq!(target.live_sequences(), 0);
    drop(run);
    assert_eq!(
        gpu.ledger().live_count(),
        before,
        "device ledger after drop"
    );
}

#[test]
fn a_refused_submission_ends_with_its_error_and_holds_nothing() {
    let gpu = cpu();
    let target = pooled(&gpu, 64);
    let engine = SpecEngine::new(target.clone(), None, 0).unwrap();
    let mut run = engine.serve();
    let mut seen = Seen::default();
    let good = run.submit(GenerateRequest::new(vec![1, 2, 3], 8).ignore_eos());
    let bad = run.submit(GenerateRequest::new(vec![1, 2, 3], 300));
    let empty = run.submit(GenerateRequest::new(Vec::new(), 8));
    assert_eq!(run.waiting(), 1, "refused requests never queue");
    while run.step() {
        seen.poll(&mut run);
    }
    seen.poll(&mut run);
    assert!(matches!(
        seen.ends[&bad].1,
        Some(specdraft::Error::Engine(EngineError::ExceedsContext { request, max_tokens: 300, .. })) if request == bad
    ));
    assert!(matches!(
        seen.ends[&empty].1,
        Some(specdraft::Error::Engine(EngineError::EmptyPrompt { .. }))
    ));
    assert_eq!(seen.ends[&good].0, FinishReason::Length);
    assert_eq!(seen.tokens[&good].len(), 8);
    assert_eq!(run.tracked(), 0);
}

#[test]
fn cancelling_mtp_drafted_requests_returns_both_kv_pools() {
    let dir = mtp_common::scratch_dir("engine_serving_mtp");
    mtp_common::write_checkpoint(&dir, "deepseek_v3", 5);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let head = Arc::new(
        MtpHead::from_checkpoint(
            &dir,
            gpu.clone(),
            MtpQuantization::Bf16,
            0,
            512,
            64,
            &ModelLevers::default(),
        )
        .unwrap(),
    );
    let vocab = mtp_common::VOCAB as u32;
    let target = Arc::new(
        TableTarget::new(gpu.clone(), vocab as usize, 512, 64, 2, 0.1)
            .unwrap()
            .with_kv_blocks(64, 4)
            .unwrap(),
    );
    let engine = SpecEngine::new(
        target.clone(),
        Some(head.clone() as Arc<dyn DraftProposer>),
        3,
    )
    .unwrap()
    .with_drafter_pool(mtp_pool_probe(head.clone()));
    let mut run = engine.serve();
    let ids: Vec<usize> = (0..4u32)
        .map(|i| {
            let prompt = (0..6 + i).map(|k| (i * 7 + k % 3) % vocab).collect();
            run.submit(GenerateRequest::new(prompt, 40).ignore_eos())
        })
        .collect();
    for _ in 0..4 {
        run.step();
        run.poll();
    }
    let (head_total, head_free) = head.kv_blocks();
    assert!(
        head_free < head_total,
        "the drafter holds KV while its requests run"
    );
    for &id in &ids {
        assert!(run.cancel(id));
    }
    assert_eq!(target.kv_blocks().unwrap().1, target.kv_blocks().unwrap().0);
    assert_eq!(
        head.kv_blocks(),
        (head_total, head_total),
        "drafter KV after cancel"
    );
    assert!(run
        .poll()
        .iter()
        .all(|u| u.finish == Some(FinishReason::Cancelled)));
    assert_eq!(run.tracked(), 0);
}

#[test]
fn a_first_token_is_handed_over_before_the_batch_decodes() {
    let prompts = workload();
    let expect = solo(&prompts[..2], 12);
    let gpu = cpu();
    let target = pooled(&gpu, 64);
    let engine =
        SpecEngine::new(target.clone(), Some(Arc::new(PromptLookup::default())), 4).unwrap();
    let mut run = engine.serve();
    let mut seen = Seen::default();
    let first = run.submit(GenerateRequest::new(prompts[0].clone(), 12).ignore_eos());
    // The first request decodes for a while before the second arrives.
    for _ in 0..3 {
        run.step();
        seen.poll(&mut run);
    }
    let decoded = seen.tokens[&first].len();
    assert!(decoded > 1, "the first request is decoding");
    let second = run.submit(GenerateRequest::new(prompts[1].clone(), 12).ignore_eos());
    assert!(run.step(), "the run has work");
    seen.poll(&mut run);
    assert_eq!(
        seen.tokens[&second],
        expect[1][..1],
        "the step that prefilled the second request handed over its first token alone"
    );
    assert_eq!(
        seen.tokens[&first].len(),
        decoded,
        "no decode step ran before the first token was handed over"
    );
    run.step();
    seen.poll(&mut run);
    assert!(
        seen.tokens[&second].len() > 1 && seen.tokens[&first].len() > decoded,
        "the next step decodes both"
    );
    while run.step() {
        seen.poll(&mut run);
    }
    seen.poll(&mut run);
    assert_eq!(seen.tokens[&first], expect[0]);
    assert_eq!(seen.tokens[&second], expect[1]);
    let m = seen.ends[&second].2.as_ref().unwrap();
    assert_eq!(m.first_tokens, 1);
    let (total, free) = target.kv_blocks().unwrap();
    assert_eq!(free, total);
}
