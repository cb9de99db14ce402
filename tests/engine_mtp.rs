//! The engine driving the real `MtpHead` (a tiny random DeepSeek-V3-layout checkpoint) on a
//! table target with the same hidden size: greedy output equals plain greedy output with and
//! without `mtp_kv_exact`, batched equals alone, carried drafter KV across chat turns gives
//! the same drafts as a drafter rebuilt from scratch, draft trees keep the greedy output,
//! and nothing leaks.

mod engine_common;
mod mtp_common;

use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{GenerateRequest, SamplingParams, SpecEngine};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig, ModelLevers};
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization, ProposerState};
use specdraft::Result;
use std::sync::{Arc, Mutex};

/// `MtpHead` with every draft it returns logged, so two runs can be compared draft by draft;
/// it asks the head for no drafts at the positions `skip` names (a controlled draft policy).
struct Logged {
    inner: Arc<MtpHead>,
    drafts: Mutex<Vec<Vec<u32>>>,
    skip: fn(usize) -> bool,
    at: Mutex<Vec<(usize, Vec<u32>)>>,
}

impl Logged {
    fn new(inner: Arc<MtpHead>, skip: fn(usize) -> bool) -> Self {
        Logged {
            inner,
            drafts: Mutex::new(Vec::new()),
            skip,
            at: Mutex::new(Vec::new()),
        }
    }

    fn take(&self) -> Vec<Vec<u32>> {
        std::mem::take(&mut *self.drafts.lock().unwrap())
    }

    /// `(position, drafts)` of every propose that drafted, in order.
    fn take_at(&self) -> Vec<(usize, Vec<u32>)> {
        std::mem::take(&mut *self.at.lock().unwrap())
    }
}

#[allow(clippy::too_many_arguments)]
impl DraftProposer for Logged {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        self.inner.alloc_state(gpu)
    }
    fn alloc_state_for(
        &self,
        gpu: &dyn GpuBackend,
        budget: usize,
    ) -> Result<Box<dyn ProposerState>> {
        self.inner.alloc_state_for(gpu, budget)
    }
    fn propose(
        &self,
        last: u32,
        h: DevicePtr,
        pos: usize,
        n: usize,
        s: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        st: u64,
        d: Option<DevicePtr>,
        m: Option<&[i32]>,
        k: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        let n = if (self.skip)(pos) { 0 } else { n };
        let out = self.inner.propose(last, h, pos, n, s, ctx, st, d, m, k)?;
        self.drafts.lock().unwrap().push(out.clone());
        if n > 0 {
            self.at.lock().unwrap().push((pos, out.clone()));
        }
        Ok(out)
    }
    fn after_verify(&self, a: usize, s: &mut dyn ProposerState, st: u64) -> Result<()> {
        self.inner.after_verify(a, s, st)
    }
    fn prefill_drafter(
        &self,
        p: &[u32],
        h: DevicePtr,
        s: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        st: u64,
    ) -> Result<usize> {
        self.inner.prefill_drafter(p, h, s, ctx, st)
    }
    fn catchup_drafter(
        &self,
        t: &[u32],
        h: DevicePtr,
        rb: usize,
        pb: usize,
        s: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        st: u64,
    ) -> Result<usize> {
        self.inner.catchup_drafter(t, h, rb, pb, s, ctx, st)
    }
    fn catchup_batch(
        &self,
        t: &[Vec<u32>],
        h: &[Vec<DevicePtr>],
        fp: &[usize],
        s: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        st: u64,
    ) -> Result<usize> {
        self.inner.catchup_batch(t, h, fp, s, ctx, st)
    }
    fn take_drafter_kv(
        &self,
        s: &mut dyn ProposerState,
    ) -> Option<(Vec<u32>, usize, Option<usize>)> {
        self.inner.take_drafter_kv(s)
    }
    fn install_drafter_kv(
        &self,
        s: &mut dyn ProposerState,
        b: Vec<u32>,
        r: usize,
        k: Option<usize>,
    ) -> bool {
        self.inner.install_drafter_kv(s, b, r, k)
    }
    fn free_drafter_kv(&self, b: &[u32]) {
        self.inner.free_drafter_kv(b)
    }
    fn free_state(&self, gpu: &dyn GpuBackend, s: &mut dyn ProposerState) -> Result<()> {
        self.inner.free_state(gpu, s)
    }
    fn prefill_hidden_rows(&self, max_seq_len: usize) -> usize {
        self.inner.prefill_hidden_rows(max_seq_len)
    }
    fn prefill_uses_shared_buffers(&self) -> bool {
        self.inner.prefill_uses_shared_buffers()
    }
    fn propose_batch_max(&self, _b: &BufferArena, _c: &ModelConfig) -> usize {
        1 // per-sequence proposes, so every draft is logged
    }
}

fn setup(tag: &str, levers: ModelLevers) -> (Arc<dyn GpuBackend>, Arc<TableTarget>, Arc<MtpHead>) {
    let dir = mtp_common::scratch_dir(&format!("engine_mtp_{tag}"));
    mtp_common::write_checkpoint(&dir, "deepseek_v3", 5);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let head = MtpHead::from_checkpoint(
        &dir,
        gpu.clone(),
        MtpQuantization::Bf16,
        0,
        512,
        256,
        &levers,
    )
    .unwrap();
    let target =
        Arc::new(TableTarget::new(gpu.clone(), mtp_common::VOCAB, 512, 64, 2, 0.1).unwrap());
    (gpu, target, Arc::new(head))
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 2, 3, 4, 5, 1, 2, 3],
        vec![50, 60, 70, 80, 50, 60],
        vec![7; 9],
    ]
}

fn tokens(g: specdraft::engine::Generation) -> Vec<Vec<u32>> {
    g.results
        .into_iter()
        .map(|r| {
            assert!(r.error.is_none(), "{:?}", r.error);
            r.tokens
        })
        .collect()
}

#[test]
fn mtp_head_in_the_engine_keeps_greedy_output_and_frees_everything() {
    for exact in [false, true] {
        let levers = ModelLevers {
            mtp_kv_exact: exact,
            ..ModelLevers::default()
        };
        let (gpu, target, head) = setup(&format!("greedy_{exact}"), levers);
        let plain = SpecEngine::new(target.clone(), None, 0).unwrap();
        let base = tokens(plain.generate(engine_common::requests(&prompts(), 20)));
        let engine = SpecEngine::new(
            target.clone(),
            Some(head.clone() as Arc<dyn DraftProposer>),
            3,
        )
        .unwrap()
        .with_levers(levers);
        let g = engine.generate(engine_common::requests(&prompts(), 20));
        assert!(g.metrics.drafted > 0);
        assert_eq!(tokens(g), base, "mtp_kv_exact {exact}");
        for (i, p) in prompts().iter().enumerate() {
            let alone = engine.generate(vec![GenerateRequest::new(p.clone(), 20)]);
            assert_eq!(tokens(alone)[0], base[i]);
        }
        // Sampling runs through the same path.
        let s = engine.generate(vec![GenerateRequest::new(prompts()[0].clone(), 12)
            .with_sampling(SamplingParams::sampled(1.0, 3))]);
        assert!(s.results[0].error.is_none(), "{:?}", s.results[0].error);
        assert_eq!(target.live_sequences(), 0);
        drop((engine, plain, target));
        let (total, free) = head.kv_blocks();
        assert_eq!(total, free, "drafter KV blocks still held");
        drop(head);
        assert_eq!(gpu.ledger().live_count(), 0);
    }
}

#[test]
fn carried_mtp_kv_drafts_like_a_head_rebuilt_from_scratch() {
    let levers = ModelLevers {
        mtp_kv_exact: true,
        ..ModelLevers::default()
    };
    let (gpu, target, head) = setup("carry", levers);
    let logged = Arc::new(Logged::new(head.clone(), |_| false));
    let engine = SpecEngine::new(
        target.clone(),
        Some(logged.clone() as Arc<dyn DraftProposer>),
        3,
    )
    .unwrap()
    .with_levers(levers)
    // Drafts compared step by step: the whole budget every step.
    .with_draft_policy(specdraft::engine::DraftPolicyKind::Fixed);
    let turns: Vec<Vec<u32>> = vec![vec![1, 2, 3, 4, 5, 1, 2], vec![9, 8, 1, 2], vec![3, 3, 4]];
    let mut conv = engine.conversation();
    let mut carried = Vec::new();
    for t in &turns {
        let r = conv.send(GenerateRequest::new(t.clone(), 16)).unwrap();
        assert!(conv.carried().is_some(), "MtpHead hands its KV over");
        carried.push((r.tokens, logged.take()));
    }
    let mut history = Vec::new();
    for (i, t) in turns.iter().enumerate() {
        history.extend_from_slice(t);
        let g = engine.generate(vec![GenerateRequest::new(history.clone(), 16)]);
        let r = &g.results[0];
        assert!(r.error.is_none(), "{:?}", r.error);
        // Same reply and the very same drafts, step by step: the carried rows plus the
        // catch-up equal a drafter prefilled over the whole history.
        assert_eq!((r.tokens.clone(), logged.take()), carried[i], "turn {i}");
        history.extend_from_slice(&r.tokens);
    }
    // Dropping the conversation freed the carried blocks.
    drop((conv, engine, target, logged));
    let (total, free) = head.kv_blocks();
    assert_eq!(total, free, "drafter KV blocks still held");
    drop(head);
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn steps_without_drafts_leave_the_drafter_kv_as_drafting_every_step_does() {
    // Exact drafter KV: every row comes from the target's hidden, so a head's rows, and so
    // its drafts at a position, depend only on the tokens before it, never on which steps
    // drafted. A head whose steps at positions 12..=17 draft nothing must still see those
    // tokens, and draft what a head that drafted every step drafts at the same positions.
    let levers = ModelLevers {
        mtp_kv_exact: true,
        ..ModelLevers::default()
    };
    let (gpu, target, head) = setup("zero_drafts", levers);
    let plain = SpecEngine::new(target.clone(), None, 0).unwrap();
    let base = tokens(plain.generate(engine_common::requests(&prompts(), 24)));
    let run = |skip: fn(usize) -> bool| {
        let logged = Arc::new(Logged::new(head.clone(), skip));
        let engine = SpecEngine::new(
            target.clone(),
            Some(logged.clone() as Arc<dyn DraftProposer>),
            3,
        )
        .unwrap()
        .with_levers(levers)
        .with_draft_policy(specdraft::engine::DraftPolicyKind::Fixed);
        let mut out = Vec::new();
        for p in prompts() {
            let g = engine.generate(vec![GenerateRequest::new(p, 24)]);
            out.push((tokens(g).remove(0), logged.take_at()));
        }
        out
    };
    let every = run(|_| false);
    let skipping = run(|pos| (12..=17).contains(&pos));
    let mut compared_after_skips = 0;
    for (i, ((t_every, at_every), (t_skip, at_skip))) in every.iter().zip(&skipping).enumerate() {
        assert_eq!(
            t_every, &base[i],
            "prompt {i}: greedy output, drafting every step"
        );
        assert_eq!(
            t_skip, &base[i],
            "prompt {i}: greedy output, skipping steps"
        );
        for (pos, drafts) in at_skip {
            if let Some((_, d)) = at_every.iter().find(|(p, _)| p == pos) {
                assert_eq!(drafts, d, "prompt {i}: drafts at position {pos}");
                compared_after_skips += usize::from(*pos > 17);
            }
        }
    }
    assert!(
        compared_after_skips > 0,
        "no position after the skipped steps was drafted by both runs: {every:?} {skipping:?}"
    );
    drop((plain, target));
    let (total, free) = head.kv_blocks();
    assert_eq!(total, free, "drafter KV blocks still held");
    drop(head);
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn deferred_drafter_rows_change_no_draft_and_no_token_in_the_engine() {
    // Steps at positions 10..=50 draft nothing: more declined steps in a row than the head's
    // deferred-row bound, so the backlog is flushed both when full and before drafting.
    // Deferring must leave every later draft, and the greedy output, as writing at once does.
    let levers = ModelLevers::default();
    let (gpu, target, head) = setup("deferred", levers);
    let plain = SpecEngine::new(target.clone(), None, 0).unwrap();
    let base = tokens(plain.generate(engine_common::requests(&prompts(), 60)));
    let run = |defer: bool| {
        head.set_defer_zero_draft_rows(defer);
        let logged = Arc::new(Logged::new(head.clone(), |pos| (10..=50).contains(&pos)));
        let engine = SpecEngine::new(
            target.clone(),
            Some(logged.clone() as Arc<dyn DraftProposer>),
            3,
        )
        .unwrap()
        .with_levers(levers)
        .with_draft_policy(specdraft::engine::DraftPolicyKind::Fixed);
        let out = tokens(engine.generate(engine_common::requests(&prompts(), 60)));
        (out, logged.take_at())
    };
    let (eager_out, eager_at) = run(false);
    let (lazy_out, lazy_at) = run(true);
    assert_eq!(eager_out, base);
    assert_eq!(lazy_out, base);
    assert!(
        lazy_at.iter().any(|(pos, _)| *pos > 50),
        "no draft after the declined steps: {lazy_at:?}"
    );
    assert_eq!(lazy_at, eager_at);
    drop((plain, target));
    let (total, free) = head.kv_blocks();
    assert_eq!(total, free, "drafter KV blocks still held");
    drop(head);
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn mtp_trees_in_the_engine_keep_greedy_output_and_free_everything() {
    for exact in [false, true] {
        let levers = ModelLevers {
            mtp_kv_exact: exact,
            ..ModelLevers::default()
        };
        let (gpu, target, head) = setup(&format!("trees_{exact}"), levers);
        head.set_grow_trees(true);
        let plain = SpecEngine::new(target.clone(), None, 0).unwrap();
        let base = tokens(plain.generate(engine_common::requests(&prompts(), 24)));
        let engine = SpecEngine::new(
            target.clone(),
            Some(head.clone() as Arc<dyn DraftProposer>),
            5,
        )
        .unwrap()
        .with_levers(levers)
        .with_draft_policy(specdraft::engine::DraftPolicyKind::Fixed);
        assert!(engine.drafts_trees(), "the head grows trees when asked");
        let g = engine.generate(engine_common::requests(&prompts(), 24));
        assert!(g.metrics.drafted > 0);
        assert_eq!(tokens(g), base, "mtp_kv_exact {exact}");
        let s = engine.generate(vec![GenerateRequest::new(prompts()[0].clone(), 12)
            .with_sampling(SamplingParams::sampled(1.0, 3))]);
        assert!(s.results[0].error.is_none(), "{:?}", s.results[0].error);
        assert_eq!(target.live_sequences(), 0);
        drop((engine, plain, target));
        let (total, free) = head.kv_blocks();
        assert_eq!(total, free, "drafter KV blocks still held");
        drop(head);
        assert_eq!(gpu.ledger().live_count(), 0);
    }
}
