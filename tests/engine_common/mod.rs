//! Proposers and helpers shared by the engine's integration tests.
#![allow(dead_code)]

pub mod counted;
pub mod counting;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend, GpuBackendExt};
use specdraft::engine::testing::{decode_hidden, TableTarget};
use specdraft::engine::{GenerateRequest, Generation, SpecEngine};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig};
use specdraft::speculative::{DraftProposer, ProposerError, ProposerState};
use specdraft::Result;
use std::sync::{Arc, Mutex};

pub fn cpu() -> Arc<dyn GpuBackend> {
    Arc::new(CpuBackend::new())
}

/// A table target over 48 tokens, 256 positions, 64 rows a forward.
pub fn table(gpu: &Arc<dyn GpuBackend>) -> Arc<TableTarget> {
    Arc::new(TableTarget::new(gpu.clone(), 48, 256, 64, 11, 0.2).unwrap())
}

pub fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 2, 3, 4, 5, 6, 7, 1, 2, 3],
        vec![9, 9, 8, 7, 9, 9, 8],
        vec![40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42, 43],
        vec![5],
    ]
}

pub fn requests(prompts: &[Vec<u32>], max_tokens: usize) -> Vec<GenerateRequest> {
    prompts
        .iter()
        .map(|p| GenerateRequest::new(p.clone(), max_tokens))
        .collect()
}

/// Greedy output of `target` with no proposer.
pub fn baseline(
    target: &Arc<TableTarget>,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Vec<Vec<u32>> {
    let engine = SpecEngine::new(target.clone(), None, 0).unwrap();
    tokens_of(engine.generate(requests(prompts, max_tokens)))
}

/// Each request's tokens, in request order; a request that failed fails the test.
pub fn tokens_of(g: Generation) -> Vec<Vec<u32>> {
    g.results
        .into_iter()
        .map(|r| {
            assert!(r.error.is_none(), "{:?}", r.error);
            r.tokens
        })
        .collect()
}

/// History kept like PromptLookup's: prompt from `prefill_drafter`, verified tokens from
/// `propose` (placed at `position`), accepted drafts from `after_verify`.
#[derive(Default)]
pub struct History {
    pub tokens: Vec<u32>,
    pub pending: Vec<u32>,
    pub fail_at: Option<usize>,
}
specdraft::impl_proposer_state!(History);

fn hist<'a>(s: &'a mut dyn ProposerState, m: &'static str) -> Result<&'a mut History> {
    s.as_any_mut().downcast_mut::<History>().ok_or_else(|| {
        ProposerError::WrongState {
            method: m,
            expected: "History",
        }
        .into()
    })
}

/// Drafts uniformly random ids (acceptance near 1 / vocab).
pub struct RandomDrafter {
    pub seed: u64,
    pub vocab: u32,
}

impl DraftProposer for RandomDrafter {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(History::default()))
    }
    fn propose(
        &self,
        _last: u32,
        _h: DevicePtr,
        position: usize,
        n: usize,
        _state: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _stream: u64,
        _d: Option<DevicePtr>,
        _mask: Option<&[i32]>,
        _stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        let mut rng = SmallRng::seed_from_u64(self.seed ^ position as u64);
        Ok((0..n).map(|_| rng.random_range(0..self.vocab)).collect())
    }
    fn after_verify(&self, _a: usize, _s: &mut dyn ProposerState, _stream: u64) -> Result<()> {
        Ok(())
    }
}

/// Knows the table target and drafts its greedy continuation (acceptance 1 under greedy
/// decoding without EOS), unless `fail_after` positions are reached.
pub struct Oracle {
    pub target: Arc<TableTarget>,
    /// Fail `propose` once the position reaches this, for sequences whose prompt starts
    /// with `fail_token`.
    pub fail: Option<(u32, usize)>,
}

impl DraftProposer for Oracle {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(History::default()))
    }
    fn prefill_drafter(
        &self,
        prompt: &[u32],
        _h: DevicePtr,
        state: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _stream: u64,
    ) -> Result<usize> {
        let st = hist(state, "prefill_drafter")?;
        st.tokens = prompt.to_vec();
        if let Some((tok, at)) = self.fail {
            if prompt.first() == Some(&tok) {
                st.fail_at = Some(at);
            }
        }
        Ok(0)
    }
    fn propose(
        &self,
        last: u32,
        _h: DevicePtr,
        position: usize,
        n: usize,
        state: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _stream: u64,
        _d: Option<DevicePtr>,
        _mask: Option<&[i32]>,
        _stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        let st = hist(state, "propose")?;
        if st.fail_at.is_some_and(|at| position >= at) {
            return Err(ProposerError::Failed {
                method: "propose".into(),
                message: format!("deliberate failure at position {position}"),
            }
            .into());
        }
        st.tokens.truncate(position);
        st.tokens.push(last);
        let mut ctx = st.tokens.clone();
        let mut drafts = Vec::new();
        for _ in 0..n {
            let logits = self.target.logits_for(&ctx);
            let t = specdraft::engine::argmax(&logits, None).unwrap();
            drafts.push(t);
            ctx.push(t);
        }
        st.pending = drafts.clone();
        Ok(drafts)
    }
    fn after_verify(&self, a: usize, state: &mut dyn ProposerState, _stream: u64) -> Result<()> {
        let st = hist(state, "after_verify")?;
        let p = std::mem::take(&mut st.pending);
        st.tokens.extend_from_slice(&p[..a.min(p.len())]);
        Ok(())
    }
}

/// Records every protocol call (name, and for propose / prefill / catch-up the decoded
/// hiddens it was given) and forwards to `inner`.
pub struct Recorder {
    pub inner: Arc<dyn DraftProposer>,
    pub log: Mutex<Vec<String>>,
    pub shared_buffers: bool,
    pub batch_max: usize,
    pub gpu: Arc<dyn GpuBackend>,
    pub hidden: usize,
}

impl Recorder {
    pub fn new(inner: Arc<dyn DraftProposer>, gpu: Arc<dyn GpuBackend>) -> Self {
        Recorder {
            inner,
            log: Mutex::new(Vec::new()),
            shared_buffers: false,
            batch_max: 1,
            gpu,
            hidden: ModelConfig::tiny(2).hidden_size,
        }
    }
    fn push(&self, s: String) {
        self.log.lock().unwrap().push(s);
    }
    pub fn decode(&self, ptr: DevicePtr, rows: usize) -> Vec<(u32, usize)> {
        let h = self.gpu.download_bf16(ptr, rows * self.hidden).unwrap();
        h.chunks(self.hidden).map(decode_hidden).collect()
    }
    pub fn entries(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

impl DraftProposer for Recorder {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        self.push("alloc_state".into());
        self.inner.alloc_state(gpu)
    }
    fn alloc_state_for(
        &self,
        gpu: &dyn GpuBackend,
        budget: usize,
    ) -> Result<Box<dyn ProposerState>> {
        self.push(format!("alloc_state_for {budget}"));
        self.inner.alloc_state_for(gpu, budget)
    }
    fn prefill_uses_shared_buffers(&self) -> bool {
        self.shared_buffers
    }
    fn prefill_drafter(
        &self,
        prompt: &[u32],
        h: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<usize> {
        let pairs = self.decode(h, prompt.len());
        self.push(format!("prefill_drafter {prompt:?} {pairs:?}"));
        self.inner.prefill_drafter(prompt, h, state, ctx, stream)
    }
    fn propose(
        &self,
        last: u32,
        h: DevicePtr,
        position: usize,
        n: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        d: Option<DevicePtr>,
        mask: Option<&[i32]>,
        stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        let pair = self.decode(h, 1)[0];
        self.push(format!("propose {last} {position} {n} {pair:?}"));
        self.inner
            .propose(last, h, position, n, state, ctx, stream, d, mask, stack)
    }
    fn propose_batch(
        &self,
        last: &[u32],
        h: &[DevicePtr],
        positions: &[usize],
        n: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
        conf: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        self.push(format!("propose_batch {}", last.len()));
        self.inner
            .propose_batch(last, h, positions, n, states, ctx, stream, conf)
    }
    fn propose_batch_max(&self, _b: &BufferArena, _c: &ModelConfig) -> usize {
        self.batch_max
    }
    fn after_verify(&self, a: usize, state: &mut dyn ProposerState, stream: u64) -> Result<()> {
        self.push(format!("after_verify {a}"));
        self.inner.after_verify(a, state, stream)
    }
    fn catchup_batch(
        &self,
        tokens: &[Vec<u32>],
        hiddens: &[Vec<DevicePtr>],
        first_pos: &[usize],
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<usize> {
        for i in 0..tokens.len() {
            let pairs: Vec<(u32, usize)> =
                hiddens[i].iter().map(|&p| self.decode(p, 1)[0]).collect();
            self.push(format!(
                "catchup {:?} {} {pairs:?}",
                tokens[i], first_pos[i]
            ));
        }
        self.inner
            .catchup_batch(tokens, hiddens, first_pos, states, ctx, stream)
    }
    fn free_state(&self, gpu: &dyn GpuBackend, state: &mut dyn ProposerState) -> Result<()> {
        self.push("free_state".into());
        self.inner.free_state(gpu, state)
    }
}
