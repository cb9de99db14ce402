//! `SpecEngine`: the speculative decoding loop, driving any [`DraftProposer`] (or none,
//! plain decoding) in the order the protocol specifies.
//!
//! Per request: `alloc_state_for(prompt + max_tokens)` → (install carried drafter KV) →
//! target prefill → `prefill_drafter` (or `catchup_drafter` after carried KV; deferred to
//! the first propose when `prefill_uses_shared_buffers()` or `defer_drafter_prefill`).
//! Per step, for all live sequences: `propose_batch` for groups of up to
//! `propose_batch_max` sequences without a grammar (per-sequence `propose` when it returns
//! `None` or fails, so a failure is pinned on its own sequence) → one verify forward of
//! `[last_token, drafts..]` per sequence (split only by the target's row limit) →
//! verification → `trim` of the rejected rows → `after_verify(num_accepted)` →
//! `catchup_batch` under `mtp_kv_exact`. At the end (or on any error) `take_drafter_kv`
//! when the caller carries KV, then `free_state`, and the target sequence is freed.
//!
//! MTP pairing: `propose` gets `last_token` at `position` with the hidden whose logits
//! picked it (the row before it); `prefill_drafter` gets the hidden of every prompt row.
//!
//! Invariants:
//! - A bad request ([`SpecEngine::check_request`]) never starts: it holds nothing and its
//!   result carries the request error.
//! - Requests are admitted in order, at most `max_batch` at a time; a waiting request
//!   holds nothing.
//! - A failure ends only its own sequence (a failing `catchup_batch` ends its whole group,
//!   since the protocol cannot say which member failed), and is recorded with its request
//!   and stage, the layer's error kept as its source.
//! - Everything a sequence holds (proposer state, engine buffers, target KV, carried
//!   drafter KV that was not installed) is released exactly once, by `release`, however
//!   the sequence ended.
//! - A result's tokens are exactly the tokens emitted after its prompt.

use super::draft_policy::{DraftPolicy, DraftPolicyKind};
use super::error::Stage;
use super::sequence::EngineSequence;
use super::{
    CarriedKv, Conversation, CostModel, EngineError, FinishReason, GenerateRequest, GenerateResult,
    Generation, Metrics, Target,
};
use crate::backend::{DevicePtr, GpuBackend};
use crate::model::{ForwardContext, ModelLevers};
use crate::speculative::DraftProposer;
use crate::Result;
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The speculative decoding engine over one target and at most one proposer.
///
/// One `generate` at a time per target: the target's outputs are valid only until its next
/// forward, so callers that share a target across threads serialise their calls (the
/// Python binding does).
pub struct SpecEngine<T: Target> {
    pub(super) target: Arc<T>,
    pub(super) proposer: Option<Arc<dyn DraftProposer>>,
    pub(super) num_drafts: usize,
    pub(super) levers: ModelLevers,
    pub(super) max_batch: usize,
    pub(super) draft_policy: DraftPolicy,
}

impl<T: Target> Clone for SpecEngine<T> {
    fn clone(&self) -> Self {
        SpecEngine {
            target: self.target.clone(),
            proposer: self.proposer.clone(),
            num_drafts: self.num_drafts,
            levers: self.levers,
            max_batch: self.max_batch,
            draft_policy: self.draft_policy.clone(),
        }
    }
}

impl<T: Target> SpecEngine<T> {
    /// An engine drafting up to `num_drafts` tokens a step with `proposer` (`None`: plain
    /// decoding, one token per forward). Levers default to off.
    pub fn new(
        target: Arc<T>,
        proposer: Option<Arc<dyn DraftProposer>>,
        num_drafts: usize,
    ) -> Result<Self> {
        if proposer.is_some() && num_drafts == 0 {
            return Err(EngineError::InvalidArgument {
                what: "num_drafts",
                message: "0 with a proposer (it must be at least 1)".into(),
            }
            .into());
        }
        Ok(SpecEngine {
            target,
            proposer,
            num_drafts,
            levers: ModelLevers::default(),
            max_batch: usize::MAX,
            draft_policy: DraftPolicy::default(),
        })
    }

    /// The same engine with `levers`.
    pub fn with_levers(mut self, levers: ModelLevers) -> Self {
        self.levers = levers;
        self
    }

    /// The same engine running at most `max_batch` sequences at once (at least 1); the
    /// others wait and start as running ones finish, so the target's KV pool only has to
    /// hold `max_batch` sequences.
    pub fn with_max_batch(mut self, max_batch: usize) -> Self {
        self.max_batch = max_batch.max(1);
        self
    }

    /// The same engine choosing draft counts by `kind` (adaptive by default); the cost
    /// model and the running acceptance figures start afresh.
    pub fn with_draft_policy(mut self, kind: DraftPolicyKind) -> Self {
        self.draft_policy = DraftPolicy::new(kind, self.draft_policy.cost.clone());
        self
    }

    /// The same engine reading the adaptive policy's costs from `cost` (by default, what
    /// it measures as it runs); the running acceptance figures start afresh.
    pub fn with_cost_model(mut self, cost: Arc<dyn CostModel>) -> Self {
        self.draft_policy = DraftPolicy::new(self.draft_policy.kind, cost);
        self
    }

    /// The rule that picks each step's draft count.
    pub fn draft_policy(&self) -> DraftPolicyKind {
        self.draft_policy.kind
    }

    /// The target model.
    pub fn target(&self) -> &Arc<T> {
        &self.target
    }

    /// The proposer, if any.
    pub fn proposer(&self) -> Option<&Arc<dyn DraftProposer>> {
        self.proposer.as_ref()
    }

    /// Most drafts per step.
    pub fn num_drafts(&self) -> usize {
        self.num_drafts
    }

    /// The levers in force.
    pub fn levers(&self) -> ModelLevers {
        self.levers
    }

    /// A multi-turn conversation on this engine.
    pub fn conversation(&self) -> Conversation<T> {
        Conversation::new(self.clone())
    }

    /// Generates every request, all sequences stepping together. Per-request problems (bad
    /// prompt, failing proposer) end only that request and are reported in its result.
    pub fn generate(&self, requests: Vec<GenerateRequest>) -> Generation {
        self.run(requests, Vec::new(), false).0
    }

    pub(super) fn max_rows(&self) -> usize {
        match self.target.buffers().max_rows() {
            0 => usize::MAX,
            m => m,
        }
    }

    pub(super) fn row_bytes(&self) -> usize {
        self.target.config().hidden_size * 2
    }

    pub(super) fn deferred_prefill(&self) -> bool {
        self.levers.defer_drafter_prefill
            || self
                .proposer
                .as_ref()
                .is_some_and(|p| p.prefill_uses_shared_buffers())
    }

    /// The generation loop; `carry_in[i]` is request `i`'s carried drafter KV, and with
    /// `want_carry` each finished sequence's drafter KV is taken and returned.
    pub(super) fn run(
        &self,
        requests: Vec<GenerateRequest>,
        carry_in: Vec<Option<CarriedKv>>,
        want_carry: bool,
    ) -> (Generation, Vec<Option<CarriedKv>>) {
        let started = Instant::now();
        let gpu = self.target.gpu().clone();
        let ctx = ForwardContext::new(
            gpu,
            self.target.buffers().clone(),
            self.target.config().clone(),
            self.levers,
        );
        let mut carry_in = carry_in.into_iter();
        let mut seqs: Vec<EngineSequence<T::KvSequence>> = requests
            .into_iter()
            .enumerate()
            .map(|(i, r)| self.new_seq(i, r, carry_in.next().flatten()))
            .collect();
        // Entries without a request still own their blocks.
        for extra in carry_in.flatten() {
            if let Some(p) = &self.proposer {
                p.free_drafter_kv(&extra.blocks);
            }
        }
        let mut total = Metrics::default();
        let mut next = 0;
        loop {
            // Admit waiting sequences while fewer than `max_batch` are active.
            let mut active = seqs.iter().filter(|s| s.active()).count();
            while active < self.max_batch && next < seqs.len() {
                let seq = &mut seqs[next];
                next += 1;
                if seq.live() {
                    seq.admitted = true;
                    let t = Instant::now();
                    if let Err(e) = self.start(seq, &ctx) {
                        seq.fail(e);
                    }
                    total.prefill_time += t.elapsed();
                }
                if seq.live() {
                    active += 1;
                } else {
                    self.release(seq, want_carry);
                }
            }
            if active == 0 {
                break;
            }
            self.step(&mut seqs, &ctx, &mut total);
            for seq in seqs
                .iter_mut()
                .filter(|s| s.admitted && !s.live() && !s.released)
            {
                self.release(seq, want_carry);
            }
        }
        for seq in seqs.iter_mut().filter(|s| !s.released) {
            self.release(seq, want_carry);
        }
        let mut results = Vec::with_capacity(seqs.len());
        let mut carry_out = Vec::with_capacity(seqs.len());
        for seq in seqs {
            let mut counters = seq.metrics.clone();
            counters.draft_time = Duration::ZERO;
            counters.verify_time = Duration::ZERO;
            counters.prefill_time = Duration::ZERO;
            counters.wall_time = Duration::ZERO;
            total.merge(&counters);
            carry_out.push(seq.carry_out);
            results.push(GenerateResult {
                tokens: seq.tokens[seq.prompt_len.min(seq.tokens.len())..].to_vec(),
                finish: seq.finish.unwrap_or(FinishReason::Error),
                metrics: seq.metrics,
                error: seq.error,
            });
        }
        total.wall_time = started.elapsed();
        (
            Generation {
                results,
                metrics: total,
            },
            carry_out,
        )
    }

    fn new_seq(
        &self,
        index: usize,
        r: GenerateRequest,
        carry: Option<CarriedKv>,
    ) -> EngineSequence<T::KvSequence> {
        let checked = self.check_request(index, &r);
        let mut seq = EngineSequence {
            request: index,
            kv: None,
            prompt_len: r.prompt.len(),
            tokens: r.prompt,
            max_tokens: r.max_tokens,
            sampling: r.sampling,
            rng: SmallRng::seed_from_u64(r.sampling.seed),
            grammar: r.grammar,
            stop_on_eos: r.stop_on_eos,
            state: None,
            hidden_rows: DevicePtr::NULL,
            hidden_row: 0,
            pending: None,
            drafts: Vec::new(),
            proposed: false,
            catchup_pos: 0,
            finish: None,
            error: None,
            metrics: Metrics::default(),
            started: Instant::now(),
            carry_in: carry,
            carry_out: None,
            released: false,
            admitted: false,
            draft_stats: Default::default(),
        };
        if let Err(e) = checked {
            seq.fail(e.into());
        }
        seq
    }

    /// Checks `request` (the `request`-th of a call) before it runs: sampling parameters,
    /// `max_tokens`, and a prompt that is non-empty, shorter than the context and inside the
    /// vocabulary. `generate` runs the same check and fails only the requests it refuses;
    /// callers that want to refuse a whole call up front run it first.
    pub fn check_request(
        &self,
        index: usize,
        request: &GenerateRequest,
    ) -> std::result::Result<(), EngineError> {
        let request_index = index;
        request.sampling.validate()?;
        if request.max_tokens == 0 {
            return Err(EngineError::InvalidArgument {
                what: "max_tokens",
                message: format!("request {request_index}: 0 (it must be at least 1)"),
            });
        }
        let prompt = &request.prompt;
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt {
                request: request_index,
            });
        }
        let max_seq_len = self.target.max_seq_len();
        if prompt.len() >= max_seq_len {
            return Err(EngineError::PromptTooLong {
                request: request_index,
                len: prompt.len(),
                max_seq_len,
            });
        }
        let vocab_size = self.target.config().vocab_size;
        if let Some((index, &token)) = prompt
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab_size)
        {
            return Err(EngineError::PromptTokenOutOfVocab {
                request: request_index,
                token,
                index,
                vocab_size,
            });
        }
        Ok(())
    }

    /// Releases everything `seq` holds (each resource once), taking its drafter KV first
    /// when the caller carries it. A failure here is recorded as the sequence's error.
    pub(super) fn release(&self, seq: &mut EngineSequence<T::KvSequence>, want_carry: bool) {
        seq.released = true;
        let gpu: &dyn GpuBackend = self.target.gpu().as_ref();
        if let (Some(mut state), Some(prop)) = (seq.state.take(), &self.proposer) {
            if want_carry && seq.error.is_none() {
                if let Some((blocks, rows, last_pair_key)) = prop.take_drafter_kv(state.as_mut()) {
                    seq.carry_out = Some(CarriedKv {
                        blocks,
                        rows,
                        last_pair_key,
                    });
                }
            }
            if let Err(e) = prop.free_state(gpu, state.as_mut()) {
                seq.fail_at(Stage::Release, e);
            }
        }
        if let Some(pp) = seq.pending.take() {
            if let Err(e) = gpu.free(pp.hiddens) {
                seq.fail_at(Stage::Release, e.into());
            }
        }
        if !seq.hidden_rows.is_null() {
            if let Err(e) = gpu.free(seq.hidden_rows) {
                seq.fail_at(Stage::Release, e.into());
            }
            seq.hidden_rows = DevicePtr::NULL;
        }
        if let Some(mut kv) = seq.kv.take() {
            if let Err(e) = self.target.free_sequence(&mut kv) {
                seq.fail_at(Stage::Release, e);
            }
        }
        if let (Some(kv), Some(prop)) = (seq.carry_in.take(), &self.proposer) {
            prop.free_drafter_kv(&kv.blocks);
        }
        seq.metrics.wall_time = seq.started.elapsed();
    }
}
