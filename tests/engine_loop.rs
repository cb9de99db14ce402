//! The engine loop against a deterministic table target: greedy equivalence, the protocol's
//! call order and hidden pairing, batching, failures and cleanup.

mod engine_common;

use engine_common::*;
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{
    DraftPolicyKind, EngineError, FinishReason, GenerateRequest, SamplingParams, SpecEngine,
};
use specdraft::model::ModelLevers;
use specdraft::speculative::{DraftProposer, PromptLookup, ProposerState};
use std::sync::{Arc, Mutex};

const MAX: usize = 40;

fn run(target: &Arc<TableTarget>, p: Arc<dyn DraftProposer>, n: usize) -> Vec<Vec<u32>> {
    let engine = SpecEngine::new(target.clone(), Some(p), n).unwrap();
    let g = engine.generate(requests(&prompts(), MAX));
    g.results
        .into_iter()
        .map(|r| {
            assert!(r.error.is_none(), "{:?}", r.error);
            r.tokens
        })
        .collect()
}

#[test]
fn greedy_speculative_equals_plain_greedy_for_every_proposer() {
    let gpu = cpu();
    let target = table(&gpu);
    let base = baseline(&target, &prompts(), MAX);
    assert!(base.iter().all(|t| t.len() == MAX));
    let proposers: Vec<Arc<dyn DraftProposer>> = vec![
        Arc::new(PromptLookup::default()),
        Arc::new(RandomDrafter { seed: 3, vocab: 48 }),
        Arc::new(Oracle {
            target: target.clone(),
            fail: None,
        }),
    ];
    for p in proposers {
        for n in [1, 3, 6] {
            assert_eq!(run(&target, p.clone(), n), base, "num_drafts {n}");
        }
    }
    assert_eq!(target.live_sequences(), 0);
    drop(target);
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn oracle_is_always_accepted_and_metrics_add_up() {
    let gpu = cpu();
    let target = table(&gpu);
    let engine = SpecEngine::new(
        target.clone(),
        Some(Arc::new(Oracle {
            target: target.clone(),
            fail: None,
        })),
        4,
    )
    .unwrap()
    // Exact step counts: the whole budget every step.
    .with_draft_policy(DraftPolicyKind::Fixed);
    let g = engine.generate(vec![GenerateRequest::new(vec![1, 2, 3], 21)]);
    let r = &g.results[0];
    assert_eq!(r.tokens.len(), 21);
    let m = &r.metrics;
    // 1 token from the prefill, then 4 steps of 4 drafts + bonus = 20 tokens.
    assert_eq!((m.verify_steps, m.drafted, m.accepted), (4, 16, 16));
    assert_eq!(m.emitted, 21);
    assert!((m.mean_acceptance_length() - 5.0).abs() < 1e-12);
    assert_eq!(m.acceptance_by_position(), vec![1.0; 4]);
    assert_eq!(g.metrics.drafted, 16);
    // Plain decoding takes one forward per token: 1 prefill + 20.
    let before = target.forward_count();
    SpecEngine::new(target.clone(), None, 0)
        .unwrap()
        .generate(vec![GenerateRequest::new(vec![1, 2, 3], 21)]);
    assert_eq!(target.forward_count() - before, 21);
}

#[test]
fn calls_follow_the_protocol_order_with_mtp_pairing() {
    let gpu = cpu();
    let target = table(&gpu);
    let rec = Arc::new(Recorder::new(
        Arc::new(Oracle {
            target: target.clone(),
            fail: None,
        }),
        gpu.clone(),
    ));
    let engine = SpecEngine::new(target.clone(), Some(rec.clone()), 2)
        .unwrap()
        // The exact call log: the whole budget every step.
        .with_draft_policy(DraftPolicyKind::Fixed)
        .with_levers(ModelLevers {
            mtp_kv_exact: true,
            ..ModelLevers::default()
        });
    let prompt = vec![7, 8, 9];
    let g = engine.generate(vec![GenerateRequest::new(prompt.clone(), 7)]);
    let out = &g.results[0].tokens;
    let log = rec.entries();
    let full: Vec<u32> = prompt.iter().chain(out).copied().collect();
    let pairs: Vec<(u32, usize)> = prompt.iter().enumerate().map(|(i, &t)| (t, i)).collect();
    // Each verify of 2 accepted drafts emits 3 tokens: positions 3 | 4 5 6 | 7 8 9.
    let expected = vec![
        "alloc_state_for 10".to_string(),
        format!("prefill_drafter {prompt:?} {pairs:?}"),
        format!("propose {} 3 2 {:?}", full[3], (full[2], 2)),
        "after_verify 2".into(),
        format!(
            "catchup {:?} 4 {:?}",
            &full[4..6],
            [(full[3], 3), (full[4], 4)]
        ),
        format!("propose {} 6 2 {:?}", full[6], (full[5], 5)),
        "after_verify 2".into(),
        format!(
            "catchup {:?} 7 {:?}",
            &full[7..9],
            [(full[6], 6), (full[7], 7)]
        ),
        "free_state".into(),
    ];
    assert_eq!(log, expected);
}

#[test]
fn shared_buffer_proposers_prefill_at_their_first_propose() {
    let gpu = cpu();
    let target = table(&gpu);
    let mut rec = Recorder::new(Arc::new(PromptLookup::default()), gpu.clone());
    rec.shared_buffers = true;
    let rec = Arc::new(rec);
    let engine = SpecEngine::new(target.clone(), Some(rec.clone()), 3).unwrap();
    let g = engine.generate(requests(&prompts()[..2], 6));
    let log = rec.entries();
    // Both sequences are set up (and their targets prefilled) before either drafter
    // prefill; the drafter prefills run at the first step, before its proposes, each with
    // its own prompt's hiddens (copied out of the target's outputs, which the second
    // prefill overwrote).
    let kinds: Vec<&str> = log.iter().map(|s| s.split(' ').next().unwrap()).collect();
    assert_eq!(
        &kinds[..6],
        [
            "alloc_state_for",
            "alloc_state_for",
            "prefill_drafter",
            "prefill_drafter",
            "propose",
            "propose"
        ]
    );
    for (k, p) in prompts()[..2].iter().enumerate() {
        let pairs: Vec<(u32, usize)> = p.iter().enumerate().map(|(i, &t)| (t, i)).collect();
        assert_eq!(log[2 + k], format!("prefill_drafter {p:?} {pairs:?}"));
    }
    assert_eq!(
        g.results
            .iter()
            .map(|r| r.tokens.clone())
            .collect::<Vec<_>>(),
        baseline(&target, &prompts()[..2], 6)
    );
}

#[test]
fn batched_generation_equals_each_alone() {
    let gpu = cpu();
    let target = table(&gpu);
    let mut rec = Recorder::new(Arc::new(PromptLookup::default()), gpu.clone());
    rec.batch_max = 3;
    let rec = Arc::new(rec);
    // Sampled output follows the drafts asked for (rejection sampling draws per draft), so
    // batched and alone runs must ask for the same ones.
    let engine = SpecEngine::new(target.clone(), Some(rec.clone()), 4)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed);
    let sampled = |i: usize| SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        top_k: 20,
        seed: 100 + i as u64,
    };
    let together = engine.generate(
        prompts()
            .iter()
            .enumerate()
            .map(|(i, p)| GenerateRequest::new(p.clone(), 30).with_sampling(sampled(i)))
            .collect(),
    );
    assert!(
        rec.entries().iter().any(|e| e == "propose_batch 3"),
        "groups of propose_batch_max"
    );
    for (i, p) in prompts().iter().enumerate() {
        let alone = engine.generate(vec![
            GenerateRequest::new(p.clone(), 30).with_sampling(sampled(i))
        ]);
        assert_eq!(
            alone.results[0].tokens, together.results[i].tokens,
            "request {i}"
        );
        assert_eq!(
            alone.results[0].metrics.accepted,
            together.results[i].metrics.accepted
        );
    }
    let greedy = engine.generate(requests(&prompts(), 30));
    let greedy: Vec<_> = greedy.results.into_iter().map(|r| r.tokens).collect();
    assert_eq!(greedy, baseline(&target, &prompts(), 30));
}

#[test]
fn forwards_split_at_the_row_limit_without_changing_output() {
    let gpu = cpu();
    let wide = table(&gpu);
    let narrow = Arc::new(TableTarget::new(gpu.clone(), 48, 256, 3, 11, 0.2).unwrap());
    let base = baseline(&wide, &prompts(), 25);
    assert_eq!(baseline(&narrow, &prompts(), 25), base);
    let engine = SpecEngine::new(
        narrow.clone(),
        Some(Arc::new(Oracle {
            target: narrow.clone(),
            fail: None,
        })),
        6,
    )
    .unwrap();
    let g = engine.generate(requests(&prompts(), 25));
    for (r, b) in g.results.iter().zip(&base) {
        assert_eq!(&r.tokens, b);
        // Drafts are capped so one sequence's verify fits a forward.
        assert!(r.metrics.drafted_at.len() <= 2);
    }
}

#[test]
fn a_failing_proposer_ends_only_its_sequence_and_nothing_leaks() {
    let gpu = cpu();
    let target = table(&gpu);
    let base = baseline(&target, &prompts(), MAX);
    // The third prompt starts with 40: its proposer fails once it reaches position 20.
    let p = Arc::new(Oracle {
        target: target.clone(),
        fail: Some((40, 20)),
    });
    let engine = SpecEngine::new(target.clone(), Some(p), 4).unwrap();
    let g = engine.generate(requests(&prompts(), MAX));
    for (i, r) in g.results.iter().enumerate() {
        if i == 2 {
            assert_eq!(r.finish, FinishReason::Error);
            let msg = r.error.as_ref().unwrap().to_string();
            assert!(msg.contains("deliberate failure"), "{msg}");
            // What it emitted before failing is still plain greedy's prefix.
            assert!(!r.tokens.is_empty() && base[i].starts_with(&r.tokens));
        } else {
            assert!(r.error.is_none());
            assert_eq!(r.tokens, base[i]);
        }
    }
    assert_eq!(target.live_sequences(), 0);
    drop((engine, target));
    assert_eq!(gpu.ledger().live_count(), 0);
}

struct Broken(u32, usize);
impl DraftProposer for Broken {
    fn alloc_state(
        &self,
        _g: &dyn specdraft::backend::GpuBackend,
    ) -> specdraft::Result<Box<dyn specdraft::speculative::ProposerState>> {
        Ok(Box::new(History::default()))
    }
    fn propose(
        &self,
        _l: u32,
        _h: specdraft::backend::DevicePtr,
        _p: usize,
        n: usize,
        _s: &mut dyn specdraft::speculative::ProposerState,
        _c: &specdraft::model::ForwardContext<'_>,
        _st: u64,
        _d: Option<specdraft::backend::DevicePtr>,
        _m: Option<&[i32]>,
        _k: Option<specdraft::backend::DevicePtr>,
    ) -> specdraft::Result<Vec<u32>> {
        Ok(vec![self.0; n + self.1])
    }
    fn after_verify(
        &self,
        _a: usize,
        _s: &mut dyn specdraft::speculative::ProposerState,
        _st: u64,
    ) -> specdraft::Result<()> {
        Ok(())
    }
}

#[test]
fn drafts_that_break_the_protocol_end_the_sequence_with_a_clear_error() {
    let gpu = cpu();
    let target = table(&gpu);
    for (p, what) in [
        (Broken(3, 1), "asked for at most 2"),
        (Broken(48, 0), "outside the vocabulary of 48"),
    ] {
        let engine = SpecEngine::new(target.clone(), Some(Arc::new(p)), 2).unwrap();
        let g = engine.generate(requests(&prompts()[..1], 10));
        let r = &g.results[0];
        assert_eq!(r.finish, FinishReason::Error);
        assert!(
            r.error.as_ref().unwrap().to_string().contains(what),
            "{:?}",
            r.error
        );
    }
    assert_eq!(target.live_sequences(), 0);
    drop(target);
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn bad_requests_get_named_errors_and_the_rest_still_run() {
    let gpu = cpu();
    let target = Arc::new(TableTarget::new(gpu.clone(), 48, 16, 64, 11, 0.2).unwrap());
    let engine =
        SpecEngine::new(target.clone(), Some(Arc::new(PromptLookup::default())), 4).unwrap();
    let reqs = vec![
        GenerateRequest::new(vec![1; 16], 4),
        GenerateRequest::new(vec![], 4),
        GenerateRequest::new(vec![1, 99], 4),
        GenerateRequest::new(vec![1, 2], 0),
        GenerateRequest::new(vec![1, 2], 4).with_sampling(SamplingParams::sampled(-1.0, 0)),
        GenerateRequest::new(vec![1, 2, 3], 100),
        GenerateRequest::new(vec![1, 2, 3], 13),
    ];
    let g = engine.generate(reqs);
    let msg = |i: usize| {
        g.results[i]
            .error
            .as_ref()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(
        msg(0).contains("16 tokens") && msg(0).contains("context holds 16"),
        "{}",
        msg(0)
    );
    assert!(msg(1).contains("empty"), "{}", msg(1));
    assert!(msg(2).contains("token 99"), "{}", msg(2));
    assert!(msg(3).contains("max_tokens"), "{}", msg(3));
    assert!(msg(4).contains("temperature"), "{}", msg(4));
    // 3 prompt + 100 max_tokens could never fit the context of 16: it fails alone, at
    // once, naming all three numbers.
    match g.results[5].error.as_ref() {
        Some(specdraft::Error::Engine(EngineError::ExceedsContext {
            request,
            prompt_len,
            max_tokens,
            max_seq_len,
        })) => assert_eq!(
            (*request, *prompt_len, *max_tokens, *max_seq_len),
            (5, 3, 100, 16)
        ),
        other => panic!("expected ExceedsContext, got {other:?}"),
    }
    assert!(
        msg(5).contains("3 tokens")
            && msg(5).contains("max_tokens (100)")
            && msg(5).contains("context of 16"),
        "{}",
        msg(5)
    );
    assert!(g.results[5].tokens.is_empty());
    assert_eq!(g.results[5].metrics.prompt_tokens, 0, "it never ran");
    // The good one fills the context exactly: 3 prompt + 13 generated = 16.
    assert!(g.results[6].error.is_none());
    assert_eq!(
        (g.results[6].tokens.len(), g.results[6].finish),
        (13, FinishReason::Length)
    );
    assert!(SpecEngine::new(target.clone(), Some(Arc::new(PromptLookup::default())), 0).is_err());
    assert_eq!(target.live_sequences(), 0);
}

#[test]
fn eos_and_max_tokens_end_sequences_exactly() {
    let gpu = cpu();
    let plain = table(&gpu);
    let base = baseline(&plain, &prompts()[..1], 30);
    let eos = base[0][7];
    let first = base[0].iter().position(|&t| t == eos).unwrap();
    let target = Arc::new(
        TableTarget::new(gpu.clone(), 48, 256, 64, 11, 0.2)
            .unwrap()
            .with_eos(vec![eos]),
    );
    let engine = SpecEngine::new(
        target.clone(),
        Some(Arc::new(Oracle {
            target: target.clone(),
            fail: None,
        })),
        4,
    )
    .unwrap();
    let g = engine.generate(requests(&prompts()[..1], 30));
    assert_eq!(g.results[0].tokens, base[0][..=first].to_vec());
    assert_eq!(g.results[0].finish, FinishReason::Stop);
    let g = engine.generate(vec![
        GenerateRequest::new(prompts()[0].clone(), 30).ignore_eos()
    ]);
    assert_eq!(
        (g.results[0].tokens.clone(), g.results[0].finish),
        (base[0].clone(), FinishReason::Length)
    );
}

#[test]
fn max_batch_bounds_live_sequences_without_changing_output() {
    let gpu = cpu();
    let target = table(&gpu);
    let many: Vec<Vec<u32>> = (0..7).map(|i| vec![i, i + 1, i + 2, i]).collect();
    let base = baseline(&target, &many, 12);
    let target = table(&gpu);
    let engine = SpecEngine::new(target.clone(), Some(Arc::new(PromptLookup::default())), 3)
        .unwrap()
        .with_max_batch(2);
    let mut reqs = requests(&many, 12);
    reqs.insert(3, GenerateRequest::new(vec![], 12));
    let g = engine.generate(reqs);
    let mut tokens: Vec<Vec<u32>> = g.results.into_iter().map(|r| r.tokens).collect();
    assert!(tokens.remove(3).is_empty());
    assert_eq!(tokens, base);
    assert_eq!(target.peak_sequences(), 2);
    assert_eq!(target.live_sequences(), 0);
}

/// An [`Oracle`] that keeps, for each sequence, the history its state holds when freed.
struct Snapshot {
    inner: Oracle,
    at_free: Mutex<Vec<Vec<u32>>>,
}

impl DraftProposer for Snapshot {
    fn alloc_state(
        &self,
        g: &dyn specdraft::backend::GpuBackend,
    ) -> specdraft::Result<Box<dyn ProposerState>> {
        self.inner.alloc_state(g)
    }
    fn prefill_drafter(
        &self,
        prompt: &[u32],
        h: specdraft::backend::DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &specdraft::model::ForwardContext<'_>,
        stream: u64,
    ) -> specdraft::Result<usize> {
        self.inner.prefill_drafter(prompt, h, state, ctx, stream)
    }
    fn propose(
        &self,
        last: u32,
        h: specdraft::backend::DevicePtr,
        position: usize,
        n: usize,
        state: &mut dyn ProposerState,
        ctx: &specdraft::model::ForwardContext<'_>,
        stream: u64,
        d: Option<specdraft::backend::DevicePtr>,
        mask: Option<&[i32]>,
        stack: Option<specdraft::backend::DevicePtr>,
    ) -> specdraft::Result<Vec<u32>> {
        self.inner
            .propose(last, h, position, n, state, ctx, stream, d, mask, stack)
    }
    fn after_verify(
        &self,
        a: usize,
        state: &mut dyn ProposerState,
        stream: u64,
    ) -> specdraft::Result<()> {
        self.inner.after_verify(a, state, stream)
    }
    fn free_state(
        &self,
        _g: &dyn specdraft::backend::GpuBackend,
        state: &mut dyn ProposerState,
    ) -> specdraft::Result<()> {
        if let Some(h) = state.as_any().downcast_ref::<History>() {
            self.at_free.lock().unwrap().push(h.tokens.clone());
        }
        Ok(())
    }
}

#[test]
fn drafts_accepted_past_eos_are_not_reported_to_the_proposer() {
    let gpu = cpu();
    let plain = table(&gpu);
    let base = baseline(&plain, &prompts()[..1], 30);
    // EOS is the 8th token greedy decoding emits: with an oracle drafting 4 tokens a step
    // it is accepted as a draft, and the oracle's drafts after it are accepted too.
    let eos = base[0][7];
    let first = base[0].iter().position(|&t| t == eos).unwrap();
    let target = Arc::new(
        TableTarget::new(gpu.clone(), 48, 256, 64, 11, 0.2)
            .unwrap()
            .with_eos(vec![eos]),
    );
    let proposer = Arc::new(Snapshot {
        inner: Oracle {
            target: target.clone(),
            fail: None,
        },
        at_free: Mutex::new(Vec::new()),
    });
    let engine = SpecEngine::new(target.clone(), Some(proposer.clone()), 4).unwrap();
    let g = engine.generate(requests(&prompts()[..1], 30));
    let r = &g.results[0];
    assert_eq!(r.tokens, base[0][..=first].to_vec());
    assert!(
        r.metrics.accepted > r.metrics.decode_tokens - r.metrics.verify_steps,
        "a draft past EOS was accepted by verification: {:?}",
        r.metrics
    );
    let mut sequence = prompts()[0].clone();
    sequence.extend_from_slice(&r.tokens);
    let held = proposer.at_free.lock().unwrap()[0].clone();
    assert!(
        sequence.starts_with(&held) && held.len() == sequence.len(),
        "the proposer's history {held:?} is not the sequence {sequence:?}"
    );
}
