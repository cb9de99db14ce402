//! A request's life in the engine, from its checks to its release: [`SpecEngine::check_request`]
//! and [`SpecEngine::check_fits`] (what a request must satisfy to start), `new_seq` (the
//! sequence built from it, already failed when a check refused it), and `release` /
//! `free_held` (what a sequence gives back when it ends or is preempted).
//!
//! Invariants: a refused request becomes a sequence that holds nothing; `release` frees
//! each resource a sequence holds once, whatever ended it, and records a failure to free as
//! the sequence's error rather than returning it.

use super::error::Stage;
use super::sequence::EngineSequence;
use super::{CarriedKv, EngineError, GenerateRequest, Metrics, SpecEngine, Target};
use crate::backend::{DevicePtr, GpuBackend};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::time::Instant;

impl<T: Target> SpecEngine<T> {
    /// A new sequence for the `index`-th request of a call, failed at once (holding
    /// nothing) when [`SpecEngine::check_request`] or [`SpecEngine::check_fits`] refuses it.
    pub(super) fn new_seq(
        &self,
        index: usize,
        r: GenerateRequest,
        carry: Option<CarriedKv>,
    ) -> EngineSequence<T::KvSequence> {
        let checked = self
            .check_request(index, &r)
            .and_then(|()| self.check_fits(index, &r));
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
            stack: Default::default(),
            pending: None,
            drafts: Vec::new(),
            tree: None,
            tree_nodes: None,
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
            prefilled: 0,
            prefill_end: 0,
            row_cap: usize::MAX,
            queued_at: Instant::now(),
            streamed: 0,
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

    /// Checks that `request` can ever run to its `max_tokens`: prompt plus `max_tokens` must
    /// fit the target's context, and the most KV rows it can need (that sum less the last
    /// token, which never enters the KV) must fit the target's whole KV pool. A request
    /// refused here fails alone, before it holds anything.
    pub fn check_fits(
        &self,
        index: usize,
        request: &GenerateRequest,
    ) -> std::result::Result<(), EngineError> {
        let max_seq_len = self.target.max_seq_len();
        if request.prompt.len().saturating_add(request.max_tokens) > max_seq_len {
            return Err(EngineError::ExceedsContext {
                request: index,
                prompt_len: request.prompt.len(),
                max_tokens: request.max_tokens,
                max_seq_len,
            });
        }
        let Some(pool) = self.target.kv_pool() else {
            return Ok(());
        };
        let rows = self.most_kv_rows(request.prompt.len(), request.max_tokens);
        if pool.blocks_for(rows) > pool.num_blocks {
            return Err(EngineError::NeverFits {
                request: index,
                prompt_len: request.prompt.len(),
                max_tokens: request.max_tokens,
                rows,
                pool_rows: pool.capacity_rows(),
            });
        }
        Ok(())
    }

    /// The most target KV rows a sequence with this prompt and `max_tokens` ever holds.
    pub(super) fn most_kv_rows(&self, prompt_len: usize, max_tokens: usize) -> usize {
        prompt_len
            .saturating_add(max_tokens)
            .min(self.target.max_seq_len())
            .saturating_sub(1)
    }

    /// Releases everything `seq` holds (each resource once), taking its drafter KV first
    /// when the caller carries it. A failure here is recorded as the sequence's error.
    pub(super) fn release(&self, seq: &mut EngineSequence<T::KvSequence>, want_carry: bool) {
        seq.released = true;
        self.free_held(seq, want_carry);
        if let (Some(kv), Some(prop)) = (seq.carry_in.take(), &self.proposer) {
            prop.free_drafter_kv(&kv.blocks);
        }
        seq.metrics.wall_time = seq.started.elapsed();
    }

    /// Frees what an admitted `seq` holds (proposer state, engine buffers, target KV),
    /// keeping its tokens, sampler and grammar: what a preemption gives up.
    pub(super) fn free_held(&self, seq: &mut EngineSequence<T::KvSequence>, want_carry: bool) {
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
            for p in std::iter::once(pp.hiddens).chain(pp.stack) {
                if let Err(e) = gpu.free(p) {
                    seq.fail_at(Stage::Release, e.into());
                }
            }
        }
        if let Err(e) = seq.stack.free(gpu) {
            seq.fail_at(Stage::Release, e.into());
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
    }
}
