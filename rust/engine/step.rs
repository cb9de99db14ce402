//! One decode step for every live sequence: drafting (batched where the proposer allows;
//! the calls themselves are `step_propose`'s), the verify forward(s), verification,
//! trimming, `after_verify`, and the exact-KV catch-up.
//!
//! Invariants:
//! - A sequence's drafts never exceed its budget ([`SpecEngine::draft_budget`]): what
//!   `max_tokens`, the context and one forward's rows leave room for. Drafts that break the
//!   protocol (too many, outside the vocabulary) end the sequence; they are never verified.
//! - Each sequence's verify input is `[last_token, drafts..]`; the emitted tokens are the
//!   verdict's (the accepted drafts, then the target's own pick), so greedy output does not
//!   depend on what was drafted. A greedy sequence without a grammar is verified from its
//!   rows' argmax, made on the device for the whole forward when the target has room for
//!   the picks (`TargetOutput::picks`): the same tokens the host's argmax of the downloaded
//!   logits gives (one definition, `backend::argmax`), for a token a row downloaded. The
//!   other sequences without a grammar (sampled ones) get their verdicts side by side on
//!   the host after one download a run of their rows (`host_verify`), the same verdicts
//!   one at a time would give. A
//!   sequence that drafted a branching tree (see `step_tree`) has its nodes as `drafts`,
//!   verified in the same forward under the tree mask, and keeps its accepted path as if it
//!   had drafted that chain.
//! - After a step the target KV holds every token but the last (rejected rows trimmed), and
//!   `hidden_rows` row `hidden_row` is the hidden whose logits picked the last token; with
//!   capture, the last of the `stack` rows is its captured counterpart (see `stack`).
//! - `after_verify` (or `after_verify_tree`) is called once for every successful `propose`
//!   (or `propose_batch` entry, `propose_tree`, `propose_tree_batch` entry) of the step, and never otherwise, with the number of accepted drafts that
//!   entered the sequence: drafts accepted past an EOS are not counted, so the proposer's
//!   state (carried into a conversation's next turn) never runs ahead of the sequence.

use super::error::Stage;
use super::host_verify::{host_verdicts, HostVerdict};
use super::sequence::{grammar_of, members_mut, EngineSequence};
use super::step_drafts::batch_groups;
use super::{
    verify, verify_picks, EngineError, FinishReason, Metrics, SpecEngine, Target, Verdict,
};
use crate::backend::{ArgmaxArgs, DevicePtr, GpuBackendExt, DEFAULT_STREAM};
use crate::model::ForwardContext;
use crate::speculative::{DraftProposer, ProposerState};
use crate::Result;
use std::time::{Duration, Instant};

impl<T: Target> SpecEngine<T> {
    /// Drafts this step may hold: no more than can be emitted before `max_tokens`, than
    /// fits the context, than one forward's rows allow, or than the KV rows the scheduler
    /// granted the sequence for this step.
    pub(super) fn draft_budget(&self, seq: &EngineSequence<T::KvSequence>) -> usize {
        let remaining = seq.max_tokens.saturating_sub(seq.generated());
        let room = self.target.max_seq_len().saturating_sub(seq.tokens.len());
        self.num_drafts
            .min(remaining.saturating_sub(1))
            .min(room.saturating_sub(1))
            .min(self.forward_rows().saturating_sub(1))
            .min(seq.row_cap.saturating_sub(1))
    }

    pub(super) fn step(
        &self,
        seqs: &mut [EngineSequence<T::KvSequence>],
        ctx: &ForwardContext<'_>,
        total: &mut Metrics,
    ) {
        let t_draft = Instant::now();
        for seq in seqs.iter_mut() {
            seq.drafts.clear();
            seq.tree = None;
            seq.tree_nodes = None;
            seq.proposed = false;
            if seq.active() && seq.pending.is_some() {
                if let Err(e) = self.run_drafter_prefill(seq, ctx) {
                    seq.fail(e);
                }
            }
        }
        if let Some(prop) = &self.proposer {
            let budgets: Vec<usize> = seqs.iter().map(|s| self.draft_budget(s)).collect();
            let wants = |i: usize, s: &EngineSequence<T::KvSequence>| {
                s.active() && s.state.is_some() && budgets[i] > 0
            };
            let may: Vec<bool> = seqs.iter().enumerate().map(|(i, s)| wants(i, s)).collect();
            let asked = self.plan_drafts(seqs, &budgets, |i| may[i]);
            let mut single = Vec::new();
            let mut batchable = Vec::new();
            for (i, s) in seqs.iter().enumerate().filter(|(i, s)| wants(*i, s)) {
                // A grammar's mask is per sequence: the batched methods take none.
                if s.grammar.is_some() {
                    single.push(i);
                } else {
                    batchable.push(i);
                }
            }
            let batch_max = self.batch_max(prop.as_ref(), ctx);
            if batch_max > 1 {
                for group in batch_groups(&batchable, &asked, batch_max) {
                    let batched = if self.trees {
                        self.propose_tree_group(prop.as_ref(), &group, &asked, seqs, ctx)
                    } else {
                        self.propose_group(prop.as_ref(), &group, &asked, seqs, ctx)
                    };
                    if !batched {
                        single.extend_from_slice(&group);
                    }
                }
            } else {
                single.extend(batchable);
            }
            single.sort_unstable();
            for i in single {
                if self.trees {
                    self.propose_tree_one(prop.as_ref(), &mut seqs[i], asked[i], ctx);
                } else {
                    self.propose_one(prop.as_ref(), &mut seqs[i], asked[i], ctx);
                }
            }
        }
        total.draft_time += t_draft.elapsed();

        let t_verify = Instant::now();
        let live: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].active()).collect();
        let returned: Vec<usize> = seqs.iter().map(|s| s.drafts.len()).collect();
        let step_rows: usize = live.iter().map(|&i| 1 + returned[i]).sum();
        let max_rows = self.forward_rows();
        let mut proposer_time = Duration::ZERO;
        let mut chunk: Vec<usize> = Vec::new();
        let mut chunk_rows = 0;
        for &i in &live {
            let rows = 1 + seqs[i].drafts.len();
            if !chunk.is_empty() && chunk_rows + rows > max_rows {
                proposer_time += self.verify_chunk(&chunk, seqs);
                chunk.clear();
                chunk_rows = 0;
            }
            chunk.push(i);
            chunk_rows += rows;
        }
        if !chunk.is_empty() {
            proposer_time += self.verify_chunk(&chunk, seqs);
        }
        if self.levers.mtp_kv_exact {
            proposer_time += self.catchup(seqs, ctx);
        }
        let verify_time = t_verify.elapsed().saturating_sub(proposer_time);
        total.verify_time += verify_time;
        total.draft_time += proposer_time;
        self.observe_step(seqs, &returned, step_rows, verify_time);
    }

    /// The widest `propose_batch` group: what the proposer says. A proposer that names
    /// target layers gets each member's stack rows in `ctx.target_hidden_stacks`.
    fn batch_max(&self, prop: &dyn DraftProposer, ctx: &ForwardContext<'_>) -> usize {
        prop.propose_batch_max(&ctx.buffers, &ctx.config).max(1)
    }

    /// One verify forward over `chunk`, then verification and bookkeeping for each of its
    /// sequences. Returns the time spent inside the proposer (`after_verify`).
    pub(super) fn verify_chunk(
        &self,
        chunk: &[usize],
        seqs: &mut [EngineSequence<T::KvSequence>],
    ) -> Duration {
        let inputs: Vec<Vec<u32>> = chunk
            .iter()
            .map(|&i| {
                let mut v = Vec::with_capacity(1 + seqs[i].drafts.len());
                v.push(seqs[i].last_token());
                v.extend_from_slice(&seqs[i].drafts);
                v
            })
            .collect();
        let rows_total: usize = inputs.iter().map(Vec::len).sum();
        let trees: Vec<bool> = seqs.iter().map(|s| s.tree.is_some()).collect();
        let tree_parents = self.tree_parents(chunk, seqs);
        let t = Instant::now();
        let out = {
            let kvs: std::result::Result<Vec<&mut T::KvSequence>, EngineError> =
                members_mut(seqs, chunk.iter().copied())
                    .map(|s| s.kv_mut())
                    .collect();
            let toks: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
            match kvs {
                Ok(mut kvs) if chunk.iter().any(|&i| trees[i]) => {
                    self.forward_trees(&tree_parents, &mut kvs, &toks)
                }
                Ok(mut kvs) => self.forward_rows_of(&mut kvs, &toks, false),
                Err(e) => Err(e.into()),
            }
        };
        let forward_time = t.elapsed();
        let out = match out {
            Ok(o)
                if o.rows == rows_total
                    && o.row_offsets.len() >= chunk.len()
                    && !o.last_logits_only =>
            {
                o
            }
            Ok(o) => {
                for &i in chunk {
                    seqs[i].fail(
                        EngineError::TargetOutput(format!(
                            "{} rows and {} offsets for {rows_total} tokens of {} sequences",
                            o.rows,
                            o.row_offsets.len(),
                            chunk.len()
                        ))
                        .into(),
                    );
                }
                return Duration::ZERO;
            }
            Err(e) => {
                for &i in chunk {
                    seqs[i].fail_at(Stage::Verify, e.clone());
                }
                return Duration::ZERO;
            }
        };
        let t = Instant::now();
        let picks = match self.device_picks(chunk, seqs, &out) {
            Ok(p) => p,
            Err(e) => {
                for &i in chunk {
                    seqs[i].fail_at(Stage::Verify, e.clone());
                }
                return Duration::ZERO;
            }
        };
        let ranges: Vec<Option<(usize, usize)>> = chunk
            .iter()
            .enumerate()
            .map(|(k, &i)| {
                let (first, rows) = (out.row_offsets[k], inputs[k].len());
                let on_host = seqs[i].grammar.is_none()
                    && !(picks.is_some() && verifies_from_picks(&seqs[i]));
                (on_host && first + rows <= out.rows).then_some((first, rows))
            })
            .collect();
        let vocab = self.target.config().vocab_size;
        let gpu = self.target.gpu().as_ref();
        let mut host = host_verdicts(gpu, &out, vocab, chunk, &ranges, seqs);
        let forward_time = forward_time + t.elapsed();
        let mut proposer_time = Duration::ZERO;
        for (k, &i) in chunk.iter().enumerate() {
            let seq = &mut seqs[i];
            let rows = inputs[k].len();
            seq.metrics.verify_time += forward_time.mul_f64(rows as f64 / rows_total as f64);
            let offset = out.row_offsets[k];
            let seq_picks = picks
                .as_deref()
                .filter(|_| verifies_from_picks(seq))
                // Rows the output lacks are refused by the logits path, by name.
                .and_then(|p| p.get(offset..offset + rows));
            let verified = match host[k].take() {
                Some(Err(e)) => Err(e),
                Some(Ok(HostVerdict::Tree(v))) => {
                    self.verify_tree_one(seq, &out, offset, rows, seq_picks, Some(v))
                }
                Some(Ok(HostVerdict::Chain(v))) => {
                    self.verify_one(seq, &out, offset, rows, seq_picks, Some(v))
                }
                None if seq.tree.is_some() => {
                    self.verify_tree_one(seq, &out, offset, rows, seq_picks, None)
                }
                None => self.verify_one(seq, &out, offset, rows, seq_picks, None),
            };
            match verified {
                Ok(dt) => proposer_time += dt,
                Err(e) => seq.fail_at(Stage::Verify, e),
            }
        }
        proposer_time
    }

    /// Every verify row's greedy pick, made on the device, when some sequence of `chunk`
    /// verifies from picks ([`verifies_from_picks`]) and the target has room for them: one
    /// `argmax` over the forward's rows and one download of a token a row, where each such
    /// sequence would otherwise download its rows' logits (on a GPU, a synchronisation and
    /// `vocab` floats a row). `None` otherwise.
    fn device_picks(
        &self,
        chunk: &[usize],
        seqs: &[EngineSequence<T::KvSequence>],
        out: &super::TargetOutput,
    ) -> Result<Option<Vec<u32>>> {
        let Some(room) = out.picks else {
            return Ok(None);
        };
        if !chunk.iter().any(|&i| verifies_from_picks(&seqs[i])) {
            return Ok(None);
        }
        let gpu = self.target.gpu();
        gpu.argmax(ArgmaxArgs {
            out: room,
            logits: out.logits,
            bitmask: None,
            rows: out.rows,
            vocab: self.target.config().vocab_size,
            stream: DEFAULT_STREAM,
        })?;
        Ok(Some(gpu.download::<u32>(room, out.rows)?))
    }

    /// Verification of `seq`'s chain against its verify rows `offset..offset + rows` of
    /// `out` (the verdict `ready` when the host made it already, else from `picks`, those
    /// rows' device picks, when given), then the bookkeeping. Returns the time spent in the
    /// proposer.
    pub(super) fn verify_one(
        &self,
        seq: &mut EngineSequence<T::KvSequence>,
        out: &super::TargetOutput,
        offset: usize,
        rows: usize,
        picks: Option<&[u32]>,
        ready: Option<Verdict>,
    ) -> Result<Duration> {
        let gpu = self.target.gpu();
        let vocab = self.target.config().vocab_size;
        let hb = self.row_bytes();
        if offset + rows > out.rows {
            return Err(EngineError::TargetOutput(format!(
                "rows {offset}..{} lie outside the {} rows returned",
                offset + rows,
                out.rows
            ))
            .into());
        }
        let t = Instant::now();
        if !seq.hidden_rows.is_null() {
            gpu.copy_dtod(
                seq.hidden_rows,
                out.hiddens.offset(offset * hb),
                rows * hb,
                DEFAULT_STREAM,
            )?;
        }
        let stack_base = self.keep_stack_rows(seq, out, offset, rows)?;
        let verdict = match (ready, picks) {
            (Some(verdict), _) => verdict,
            (None, Some(picks)) => verify_picks(picks, &seq.drafts)?,
            (None, None) => {
                let logits =
                    gpu.download::<f32>(out.logits.offset(offset * vocab * 4), rows * vocab)?;
                let row_refs: Vec<&[f32]> = logits.chunks(vocab).collect();
                verify(
                    &row_refs,
                    &seq.drafts,
                    None,
                    &seq.sampling,
                    &mut seq.rng,
                    grammar_of(&mut seq.grammar),
                )?
            }
        };
        seq.metrics.verify_time += t.elapsed();
        let spent = self.apply(seq, verdict)?;
        // The rows of the accepted drafts and of the emitted token: verify rows 0..=a.
        seq.stack.len = stack_base + seq.hidden_row + 1;
        Ok(spent)
    }

    /// Trims the rejected rows, tells the proposer, and emits the verdict's tokens.
    pub(super) fn apply(
        &self,
        seq: &mut EngineSequence<T::KvSequence>,
        verdict: Verdict,
    ) -> Result<Duration> {
        let drafted = seq.drafts.len();
        let last_pos = seq.last_pos();
        let eos = &self.target.config().eos_token_ids;
        let kept = seq.emit(&verdict.tokens, eos, self.target.max_seq_len());
        // Emitting stops at EOS, `max_tokens` or the context: drafts verification accepted
        // past that point never enter the sequence, so neither the target's KV nor the
        // proposer (whose state a conversation carries on) keeps them.
        let a = verdict.accepted.min(kept);
        // The last token and the accepted drafts stay in the KV; the rejected rows go.
        if a < drafted {
            let request = seq.request;
            self.target
                .trim(seq.kv_mut()?, last_pos + 1 + a)
                .map_err(|e| EngineError::at(request, Stage::Trim, e))?;
        }
        let mut proposer_time = Duration::ZERO;
        if let (true, Some(prop), Some(state)) =
            (seq.proposed, &self.proposer, seq.state.as_deref_mut())
        {
            let t = Instant::now();
            let r = prop.after_verify(a, state, DEFAULT_STREAM);
            proposer_time = t.elapsed();
            seq.metrics.draft_time += proposer_time;
            r.map_err(|e| EngineError::at(seq.request, Stage::AfterVerify, e))?;
        }
        // Accepted drafts stay in `drafts` for the catch-up; the rest is dropped.
        seq.drafts.truncate(a);
        seq.catchup_pos = last_pos + 1;
        seq.metrics.record_step(drafted, verdict.accepted, kept);
        if verdict.grammar_exhausted && seq.active() {
            seq.finish = Some(FinishReason::Grammar);
        }
        seq.hidden_row = a;
        Ok(proposer_time)
    }

    /// `catchup_batch` with each sequence's accepted drafts and their paired hiddens
    /// (verify row k picked draft k, so its hidden is row k). A failing call ends every
    /// sequence of its group: the protocol gives no way to tell which one failed.
    pub(super) fn catchup(
        &self,
        seqs: &mut [EngineSequence<T::KvSequence>],
        ctx: &ForwardContext<'_>,
    ) -> Duration {
        let Some(prop) = &self.proposer else {
            return Duration::ZERO;
        };
        let hb = self.row_bytes();
        let ready: Vec<usize> = (0..seqs.len())
            .filter(|&i| {
                let s = &seqs[i];
                s.error.is_none() && s.proposed && !s.drafts.is_empty() && s.state.is_some()
            })
            .collect();
        // One sequence a call when capturing: its stack rows go in the context.
        let batch_max = match self.captures() {
            true => 1,
            false => self.batch_max(prop.as_ref(), ctx),
        };
        let mut spent = Duration::ZERO;
        for group in ready.chunks(batch_max) {
            let ctx = &ForwardContext {
                target_hidden_stack: match group {
                    [i] => seqs[*i].stack.for_propose(),
                    _ => None,
                },
                ..ctx.clone()
            };
            let tokens: Vec<Vec<u32>> = group.iter().map(|&i| seqs[i].drafts.clone()).collect();
            let hiddens: Vec<Vec<DevicePtr>> = group
                .iter()
                .map(|&i| {
                    (0..seqs[i].drafts.len())
                        .map(|k| seqs[i].hidden_rows.offset(k * hb))
                        .collect()
                })
                .collect();
            // Recorded at verification: EOS may have cut the emitted tokens since.
            let first_pos: Vec<usize> = group.iter().map(|&i| seqs[i].catchup_pos).collect();
            let t = Instant::now();
            let result = {
                let mut states: Vec<&mut dyn ProposerState> =
                    members_mut(seqs, group.iter().copied())
                        .filter_map(|s| s.state_mut())
                        .collect();
                prop.catchup_batch(
                    &tokens,
                    &hiddens,
                    &first_pos,
                    &mut states,
                    ctx,
                    DEFAULT_STREAM,
                )
            };
            let dt = t.elapsed();
            spent += dt;
            for &i in group {
                seqs[i].metrics.draft_time += dt / group.len() as u32;
                if let Err(e) = &result {
                    seqs[i].fail_at(Stage::Catchup, e.clone());
                }
            }
        }
        spent
    }
}

/// Whether `seq` verifies from its rows' greedy picks alone: greedy, with no grammar (whose
/// masks need the rows on the host, one position at a time).
pub(super) fn verifies_from_picks<K>(seq: &EngineSequence<K>) -> bool {
    seq.sampling.is_greedy() && seq.grammar.is_none()
}
