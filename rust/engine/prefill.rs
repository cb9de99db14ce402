//! Starting a sequence: proposer state (with carried drafter KV installed), the target's
//! prefill (split at the target's row limit), the first token, and the drafter prefill
//! (now, or at the first propose when deferred).
//!
//! The target hiddens the drafter prefill needs are copied out of the target's outputs as
//! each prefill chunk lands, since those outputs are overwritten by the next forward and may
//! live in the shared scratch a deferred drafter prefill uses.
//!
//! Invariants:
//! - Carried drafter KV is either installed into the new state (and only the prompt rows
//!   after it are caught up) or freed: never both, never neither.
//! - The drafter prefill runs at most once per sequence and before its first propose: at
//!   the end of `start`, or at the first step when deferred. Its hiddens are engine-owned
//!   copies, freed as soon as it has run.
//! - After `start`, the target KV holds the whole prompt, `hidden_rows` row 0 is the hidden
//!   of the last prompt row, and the first token is emitted (or the sequence has finished).
//! - Every failure is returned wrapped with the sequence's request and the stage.

use super::error::Stage;
use super::sequence::{grammar_of, DrafterPrefill, EngineSequence, PendingPrefill};
use super::{verify, EngineError, FinishReason, SpecEngine, Target};
use crate::backend::{GpuBackendExt, DEFAULT_STREAM};
use crate::model::ForwardContext;
use crate::Result;
use std::time::Instant;

impl<T: Target> SpecEngine<T> {
    /// Allocates the sequence's state, prefills the target, picks the first token and
    /// (unless deferred) prefills the drafter.
    pub(super) fn start(
        &self,
        seq: &mut EngineSequence<T::KvSequence>,
        ctx: &ForwardContext<'_>,
    ) -> Result<()> {
        let request = seq.request;
        let capture_first = self
            .allocate(seq)
            .map_err(|e| EngineError::at(request, Stage::Start, e))?;
        self.prefill_target(seq, capture_first)
            .map_err(|e| EngineError::at(request, Stage::TargetPrefill, e))?;
        if seq.live() && !self.deferred_prefill() {
            self.run_drafter_prefill(seq, ctx)?;
        }
        Ok(())
    }

    /// The target's KV, the engine's hidden rows, the proposer state (with carried drafter
    /// KV installed when the proposer takes it) and the buffer for the drafter prefill's
    /// hiddens. Returns the first prompt row whose hidden the drafter prefill needs.
    fn allocate(&self, seq: &mut EngineSequence<T::KvSequence>) -> Result<usize> {
        let gpu = self.target.gpu();
        let hb = self.row_bytes();
        let p = seq.prompt_len;
        seq.kv = Some(self.target.new_sequence());
        // The first prompt row whose hidden the drafter prefill needs.
        let mut capture_first = 0;
        if let Some(prop) = &self.proposer {
            seq.hidden_rows = gpu.alloc((self.num_drafts + 1) * hb, "engine:hidden_rows")?;
            let t = Instant::now();
            let mut state = prop.alloc_state_for(gpu.as_ref(), p.saturating_add(seq.max_tokens))?;
            let mut kind = DrafterPrefill::Prefill;
            if let Some(kv) = seq.carry_in.take() {
                // The newest carried row sits at position key + 1; it must lie inside the
                // prompt, which by construction extends the sequence the rows came from.
                match kv.last_pair_key {
                    Some(key)
                        if key + 1 < p
                            && prop.install_drafter_kv(
                                state.as_mut(),
                                kv.blocks.clone(),
                                kv.rows,
                                Some(key),
                            ) =>
                    {
                        kind = DrafterPrefill::Catchup {
                            row_base: kv.rows,
                            pos_base: key + 2,
                        };
                        capture_first = key + 1;
                    }
                    _ => prop.free_drafter_kv(&kv.blocks),
                }
            }
            seq.state = Some(state);
            seq.metrics.draft_time += t.elapsed();
            let tokens = match kind {
                DrafterPrefill::Prefill => seq.tokens.clone(),
                DrafterPrefill::Catchup { pos_base, .. } => seq.tokens[pos_base.min(p)..].to_vec(),
            };
            let cap = prop.prefill_hidden_rows(self.target.max_seq_len());
            if !tokens.is_empty() && tokens.len() <= cap {
                let hiddens = gpu.alloc(tokens.len() * hb, "engine:prefill_hiddens")?;
                seq.pending = Some(PendingPrefill {
                    kind,
                    tokens,
                    hiddens,
                });
            }
        }
        Ok(capture_first)
    }

    /// The target's forward over the prompt (split at its row limit), capturing the
    /// hiddens the drafter prefill needs, then the first token.
    fn prefill_target(
        &self,
        seq: &mut EngineSequence<T::KvSequence>,
        capture_first: usize,
    ) -> Result<()> {
        let gpu = self.target.gpu();
        let hb = self.row_bytes();
        let p = seq.prompt_len;
        let vocab = self.target.config().vocab_size;
        let max_rows = self.max_rows();
        let prompt = seq.tokens.clone();
        let mut last_logits = Vec::new();
        let mut begin = 0;
        while begin < p {
            let end = p.min(begin.saturating_add(max_rows));
            let out = self
                .target
                .forward_last(&mut [seq.kv_mut()?], &[&prompt[begin..end]])?;
            if out.rows != end - begin {
                return Err(EngineError::TargetOutput(format!(
                    "prefill of {} tokens returned {} rows",
                    end - begin,
                    out.rows
                ))
                .into());
            }
            if let Some(pp) = &seq.pending {
                let lo = begin.max(capture_first);
                let hi = end.min(capture_first + pp.tokens.len());
                if lo < hi {
                    gpu.copy_dtod(
                        pp.hiddens.offset((lo - capture_first) * hb),
                        out.hiddens.offset((lo - begin) * hb),
                        (hi - lo) * hb,
                        DEFAULT_STREAM,
                    )?;
                }
            }
            if end == p {
                let last = end - begin - 1;
                let logits_row = if out.last_logits_only { 0 } else { last };
                last_logits =
                    gpu.download::<f32>(out.logits.offset(logits_row * vocab * 4), vocab)?;
                if !seq.hidden_rows.is_null() {
                    gpu.copy_dtod(
                        seq.hidden_rows,
                        out.hiddens.offset(last * hb),
                        hb,
                        DEFAULT_STREAM,
                    )?;
                }
            }
            begin = end;
        }
        seq.hidden_row = 0;
        seq.metrics.prompt_tokens = p as u64;
        let verdict = verify(
            &[&last_logits],
            &[],
            None,
            &seq.sampling,
            &mut seq.rng,
            grammar_of(&mut seq.grammar),
        )?;
        if verdict.grammar_exhausted {
            seq.finish = Some(FinishReason::Grammar);
            return Ok(());
        }
        let eos = &self.target.config().eos_token_ids;
        seq.metrics.emitted += seq.emit(&verdict.tokens, eos, self.target.max_seq_len()) as u64;
        Ok(())
    }

    /// Runs the pending drafter prefill (or catch-up after carried KV), if any, and frees
    /// its captured hiddens. A failure is returned wrapped with the request and the stage.
    pub(super) fn run_drafter_prefill(
        &self,
        seq: &mut EngineSequence<T::KvSequence>,
        ctx: &ForwardContext<'_>,
    ) -> Result<()> {
        let Some(pp) = seq.pending.take() else {
            return Ok(());
        };
        let t = Instant::now();
        let ran = match (&self.proposer, seq.state.as_deref_mut()) {
            (Some(prop), Some(state)) => match pp.kind {
                DrafterPrefill::Prefill => {
                    prop.prefill_drafter(&pp.tokens, pp.hiddens, state, ctx, DEFAULT_STREAM)
                }
                DrafterPrefill::Catchup { row_base, pos_base } => prop.catchup_drafter(
                    &pp.tokens,
                    pp.hiddens,
                    row_base,
                    pos_base,
                    state,
                    ctx,
                    DEFAULT_STREAM,
                ),
            },
            _ => Ok(0),
        };
        let freed = self.target.gpu().free(pp.hiddens);
        seq.metrics.draft_time += t.elapsed();
        let at = |e| EngineError::at(seq.request, Stage::DrafterPrefill, e);
        ran.map_err(at)?;
        freed.map_err(|e| at(e.into()))?;
        Ok(())
    }
}
