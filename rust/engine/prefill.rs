//! Starting a sequence: admission (proposer state with carried drafter KV installed, the
//! engine's buffers), the target's prefill in chunks that several sequences share in one
//! forward, the first token (a greedy sequence without a grammar picks it on the device when
//! the target has room for picks, as its verify steps do; the others without a grammar draw
//! theirs side by side on the host, `host_verify`), and the drafter prefill (now, or at the
//! first propose when deferred).
//!
//! A sequence readmitted after a preemption prefills again every token but its last (its
//! "prompt" from the target's and the drafter's point of view is then `tokens[..len - 1]`)
//! and picks no token: its last token was already emitted, and the hidden of the last
//! prefill row is the one that picked it, as after a decode step.
//!
//! The target hiddens the drafter prefill needs are copied out of the target's outputs as
//! each prefill chunk lands, since those outputs are overwritten by the next forward and may
//! live in the shared scratch a deferred drafter prefill uses; so are the captured layer
//! rows, into a sibling buffer, when the proposer names target layers (see `stack`).
//!
//! Invariants:
//! - Carried drafter KV is either installed into the new state (and only the prompt rows
//!   after it are caught up) or freed: never both, never neither.
//! - The drafter prefill runs at most once per admission and before its first propose: when
//!   the target prefill completes, or at the first step when deferred. Its hiddens are
//!   engine-owned copies, freed as soon as it has run.
//! - When the target prefill completes, the target KV holds `tokens[..prefill_end]`,
//!   `hidden_rows` row 0 is the hidden of the last of those rows, and (on a first
//!   admission) the first token is emitted or the sequence has finished.
//! - Every failure is returned wrapped with the sequence's request and the stage.

use super::error::Stage;
use super::host_verify::{host_verdicts, HostVerdict};
use super::sequence::{grammar_of, members_mut, DrafterPrefill, EngineSequence, PendingPrefill};
use super::{
    verify, verify_picks, EngineError, FinishReason, SpecEngine, Target, TargetOutput, Verdict,
};
use crate::backend::{ArgmaxArgs, GpuBackendExt, DEFAULT_STREAM};
use crate::model::ForwardContext;
use crate::Result;
use std::time::{Duration, Instant};

impl<T: Target> SpecEngine<T> {
    /// Admits `seq`: takes its engine buffers and proposer state and sets up its
    /// (re)prefill; the target KV fills as its prefill chunks run.
    pub(super) fn admit(&self, seq: &mut EngineSequence<T::KvSequence>) -> Result<()> {
        seq.admitted = true;
        seq.leave_queue();
        seq.prefilled = 0;
        seq.prefill_end = if seq.generated() == 0 {
            seq.prompt_len
        } else {
            seq.tokens.len() - 1
        };
        seq.row_cap = usize::MAX;
        let request = seq.request;
        self.allocate(seq)
            .map_err(|e| EngineError::at(request, Stage::Start, e))
    }

    /// The target's KV, the engine's hidden rows, the proposer state (with carried drafter
    /// KV installed when the proposer takes it) and the buffer for the drafter prefill's
    /// hiddens.
    fn allocate(&self, seq: &mut EngineSequence<T::KvSequence>) -> Result<()> {
        let gpu = self.target.gpu();
        let hb = self.row_bytes();
        let p = seq.prefill_end;
        seq.kv = Some(self.target.new_sequence());
        let Some(prop) = &self.proposer else {
            return Ok(());
        };
        seq.hidden_rows = gpu.alloc((self.num_drafts + 1) * hb, "engine:hidden_rows")?;
        self.alloc_stack(seq)?;
        let t = Instant::now();
        let budget = seq.prompt_len.saturating_add(seq.max_tokens);
        let mut state = prop.alloc_state_for(gpu.as_ref(), budget)?;
        let mut kind = DrafterPrefill::Prefill;
        // The first prefill row whose hidden the drafter prefill needs.
        let mut first_row = 0;
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
                    first_row = key + 1;
                }
                _ => prop.free_drafter_kv(&kv.blocks),
            }
        }
        seq.state = Some(state);
        seq.metrics.draft_time += t.elapsed();
        let tokens = match kind {
            DrafterPrefill::Prefill => seq.tokens[..p].to_vec(),
            DrafterPrefill::Catchup { pos_base, .. } => seq.tokens[pos_base.min(p)..p].to_vec(),
        };
        let cap = prop.prefill_hidden_rows(self.target.max_seq_len());
        if !tokens.is_empty() && tokens.len() <= cap {
            let hiddens = gpu.alloc(tokens.len() * hb, "engine:prefill_hiddens")?;
            let stack = match self.captures() {
                false => Ok(None),
                true => gpu
                    .alloc(
                        tokens.len() * self.stack_row_bytes(),
                        "engine:prefill_stack",
                    )
                    .map(Some),
            };
            let stack = match stack {
                Ok(s) => s,
                Err(e) => {
                    // Not yet held by the sequence, so not freed by its release.
                    let _ = gpu.free(hiddens);
                    return Err(e.into());
                }
            };
            seq.pending = Some(PendingPrefill {
                kind,
                first_row,
                tokens,
                hiddens,
                stack,
            });
        }
        Ok(())
    }

    /// One prefill forward over `work`: `(sequence, rows)` pairs in sequence order, each
    /// sequence's next `rows` prompt tokens. A sequence whose prefill this completes gets its first token
    /// (on a first admission) and its drafter prefill (unless deferred). A failed forward
    /// ends every sequence it carried. Returns the forward's time.
    pub(super) fn prefill_forward(
        &self,
        work: &[(usize, usize)],
        seqs: &mut [EngineSequence<T::KvSequence>],
        ctx: &ForwardContext<'_>,
    ) -> Duration {
        let chunks: Vec<Vec<u32>> = work
            .iter()
            .map(|&(i, n)| {
                let begin = seqs[i].prefilled;
                seqs[i].tokens[begin..begin + n].to_vec()
            })
            .collect();
        let rows_total: usize = work.iter().map(|w| w.1).sum();
        let t = Instant::now();
        let out = {
            // `work` is in sequence order, so the members' KV come out in its order.
            let kvs: std::result::Result<Vec<&mut T::KvSequence>, EngineError> =
                members_mut(seqs, work.iter().map(|w| w.0))
                    .map(|s| s.kv_mut())
                    .collect();
            let toks: Vec<&[u32]> = chunks.iter().map(Vec::as_slice).collect();
            match kvs {
                Ok(mut kvs) => self.forward_rows_of(&mut kvs, &toks, true),
                Err(e) => Err(e.into()),
            }
        };
        let elapsed = t.elapsed();
        let out = match out {
            Ok(o) if o.rows == rows_total && o.row_offsets.len() >= work.len() => o,
            Ok(o) => {
                let e = EngineError::TargetOutput(format!(
                    "prefill of {rows_total} tokens of {} sequences returned {} rows and {} offsets",
                    work.len(),
                    o.rows,
                    o.row_offsets.len()
                ));
                for &(i, _) in work {
                    seqs[i].fail(e.clone().into());
                }
                return elapsed;
            }
            Err(e) => {
                for &(i, _) in work {
                    seqs[i].fail_at(Stage::TargetPrefill, e.clone());
                }
                return elapsed;
            }
        };
        let picks = match self.first_picks(work, seqs, &out) {
            Ok(p) => p,
            Err(e) => {
                for &(i, _) in work {
                    seqs[i].fail_at(Stage::TargetPrefill, e.clone());
                }
                return elapsed;
            }
        };
        let mut firsts = self.first_verdicts(work, seqs, &out, &picks);
        for (k, &(i, n)) in work.iter().enumerate() {
            let seq = &mut seqs[i];
            seq.metrics.prefill_time += elapsed.mul_f64(n as f64 / rows_total as f64);
            let request = seq.request;
            let landed = self
                .land_chunk(seq, &out, k, n, firsts[k].take())
                .map_err(|e| EngineError::at(request, Stage::TargetPrefill, e));
            match landed {
                Err(e) => seq.fail(e),
                Ok(())
                    if seq.live()
                        && seq.prefilled == seq.prefill_end
                        && !self.deferred_prefill() =>
                {
                    if let Err(e) = self.run_drafter_prefill(seq, ctx) {
                        seq.fail(e);
                    }
                }
                Ok(()) => {}
            }
        }
        elapsed
    }

    /// Row of `out.logits` that holds chunk `k`'s last row (`n` rows long).
    fn last_logits_row(out: &TargetOutput, k: usize, n: usize) -> usize {
        match out.last_logits_only {
            true => k,
            false => out.row_offsets[k] + n - 1,
        }
    }

    /// The first token of each sequence of `work` whose prefill this forward completes on
    /// a first admission and that picks greedily without a grammar
    /// ([`super::step::verifies_from_picks`]), made on the device when the target has room
    /// for picks: an `argmax` of each such sequence's last logits row into the room, then
    /// one download of a token each, where each would otherwise download its logits row.
    /// `None` for every other entry, which then picks from its downloaded row.
    fn first_picks(
        &self,
        work: &[(usize, usize)],
        seqs: &[EngineSequence<T::KvSequence>],
        out: &TargetOutput,
    ) -> Result<Vec<Option<u32>>> {
        let mut picks = vec![None; work.len()];
        let Some(room) = out.picks else {
            return Ok(picks);
        };
        let picking: Vec<usize> = (0..work.len())
            .filter(|&k| {
                let (seq, n) = (&seqs[work[k].0], work[k].1);
                seq.first_token_due(n) && super::step::verifies_from_picks(seq)
            })
            .collect();
        if picking.is_empty() {
            return Ok(picks);
        }
        let gpu = self.target.gpu();
        let vocab = self.target.config().vocab_size;
        for (j, &k) in picking.iter().enumerate() {
            let row = Self::last_logits_row(out, k, work[k].1);
            gpu.argmax(ArgmaxArgs {
                out: room.offset(j * 4),
                logits: out.logits.offset(row * vocab * 4),
                bitmask: None,
                rows: 1,
                vocab,
                stream: DEFAULT_STREAM,
            })?;
        }
        let made = gpu.download::<u32>(room, picking.len())?;
        for (&k, &pick) in picking.iter().zip(&made) {
            picks[k] = Some(pick);
        }
        Ok(picks)
    }

    /// The first-token verdict of each sequence of `work` whose prefill this forward
    /// completes on a first admission ([`EngineSequence::first_token_due`]): from its
    /// device pick (`picks`), or, without a grammar, from its last logits row on the host,
    /// side by side with the others ([`host_verdicts`]). `None` for every other entry.
    fn first_verdicts(
        &self,
        work: &[(usize, usize)],
        seqs: &mut [EngineSequence<T::KvSequence>],
        out: &TargetOutput,
        picks: &[Option<u32>],
    ) -> Vec<Option<Result<Verdict>>> {
        let ranges: Vec<Option<(usize, usize)>> = work
            .iter()
            .enumerate()
            .map(|(k, &(i, n))| {
                let seq = &seqs[i];
                let host = picks[k].is_none() && seq.grammar.is_none() && seq.first_token_due(n);
                host.then(|| (Self::last_logits_row(out, k, n), 1))
            })
            .collect();
        let members: Vec<usize> = work.iter().map(|w| w.0).collect();
        let vocab = self.target.config().vocab_size;
        let gpu = self.target.gpu().as_ref();
        let mut host = host_verdicts(gpu, out, vocab, &members, &ranges, seqs);
        (0..work.len())
            .map(|k| match (picks[k], host[k].take()) {
                (Some(pick), _) => Some(verify_picks(&[pick], &[])),
                (None, Some(Ok(HostVerdict::Chain(v)))) => Some(Ok(v)),
                (None, Some(Err(e))) => Some(Err(e)),
                // A sequence on its first admission has no tree: left to `land_chunk`.
                (None, Some(Ok(HostVerdict::Tree(_)))) | (None, None) => None,
            })
            .collect()
    }

    /// Takes in chunk `k` of a prefill forward (`n` rows of `seq`): copies the hiddens the
    /// drafter prefill needs and, when the prefill is complete, the last row's hidden and
    /// (on a first admission) the first token: `first` when it was made already
    /// ([`Self::first_verdicts`]), else from the downloaded last logits row.
    fn land_chunk(
        &self,
        seq: &mut EngineSequence<T::KvSequence>,
        out: &TargetOutput,
        k: usize,
        n: usize,
        first: Option<Result<Verdict>>,
    ) -> Result<()> {
        let gpu = self.target.gpu();
        let hb = self.row_bytes();
        let row0 = out.row_offsets[k];
        let begin = seq.prefilled;
        let end = begin + n;
        if let Some(pp) = &seq.pending {
            let lo = begin.max(pp.first_row);
            let hi = end.min(pp.first_row + pp.tokens.len());
            if lo < hi {
                let copies = [(pp.hiddens, out.hiddens, hb)].into_iter().chain(
                    pp.stack
                        .zip(out.hidden_stack)
                        .map(|(dst, src)| (dst, src, self.stack_row_bytes())),
                );
                for (dst, src, rb) in copies {
                    gpu.copy_dtod(
                        dst.offset((lo - pp.first_row) * rb),
                        src.offset((row0 + lo - begin) * rb),
                        (hi - lo) * rb,
                        DEFAULT_STREAM,
                    )?;
                }
            }
        }
        seq.prefilled = end;
        if end < seq.prefill_end {
            return Ok(());
        }
        let last = row0 + n - 1;
        if !seq.hidden_rows.is_null() {
            gpu.copy_dtod(
                seq.hidden_rows,
                out.hiddens.offset(last * hb),
                hb,
                DEFAULT_STREAM,
            )?;
        }
        seq.hidden_row = 0;
        if let (Some(stack), false) = (out.hidden_stack, seq.stack.ptr.is_null()) {
            let sb = self.stack_row_bytes();
            gpu.copy_dtod(seq.stack.ptr, stack.offset(last * sb), sb, DEFAULT_STREAM)?;
            seq.stack.len = 1;
        }
        if seq.generated() > 0 {
            // A recomputation: the last token was picked before the preemption.
            seq.metrics.recomputed_tokens += seq.prefill_end as u64;
            return Ok(());
        }
        seq.metrics.prompt_tokens = seq.prompt_len as u64;
        let verdict = match first {
            Some(verdict) => verdict?,
            None => {
                let vocab = self.target.config().vocab_size;
                let row = Self::last_logits_row(out, k, n);
                let last_logits = gpu.download::<f32>(out.logits.offset(row * vocab * 4), vocab)?;
                verify(
                    &[&last_logits],
                    &[],
                    None,
                    &seq.sampling,
                    &mut seq.rng,
                    grammar_of(&mut seq.grammar),
                )?
            }
        };
        if verdict.grammar_exhausted {
            seq.finish = Some(FinishReason::Grammar);
            return Ok(());
        }
        let eos = &self.target.config().eos_token_ids;
        seq.metrics.emitted += seq.emit(&verdict.tokens, eos, self.target.max_seq_len()) as u64;
        seq.mark_first_token();
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
        let ctx = ForwardContext {
            target_hidden_stack: pp.stack,
            ..ctx.clone()
        };
        let ctx = &ctx;
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
        let gpu = self.target.gpu();
        let freed = std::iter::once(pp.hiddens)
            .chain(pp.stack)
            .map(|p| gpu.free(p))
            .fold(Ok(()), std::result::Result::and);
        seq.metrics.draft_time += t.elapsed();
        let at = |e| EngineError::at(seq.request, Stage::DrafterPrefill, e);
        ran.map_err(at)?;
        freed.map_err(|e| at(e.into()))?;
        Ok(())
    }
}
