//! The MTP head's draft loop and drafter-row writing, shared by `propose`,
//! `propose_batch`, `prefill_drafter` and the catch-up methods.
//!
//! Row accounting (DESIGN.md, "MTP pairing"): `propose(t, h, p, n)` writes n rows, at
//! positions `p .. p+n-1` with pair keys `p-1 .. p+n-2`: the first from `(t, h)`, each later
//! one from the previous draft and the head's own output hidden. A propose whose rows were
//! never verified, or rows at or after the position being drafted from, are rolled back
//! first, so proposing twice from the same point gives the same drafts. A sequence whose
//! budget or the pool runs out stops drafting early instead of failing.
//!
//! A propose of 0 drafts keeps the one row a drafting propose writes first, written at once
//! or deferred (see `deferred`).
//!
//! Invariants:
//! - The row at position `q` is built from the token at `q` and the hidden paired with
//!   `q - 1`: the target's for a verified token, the head's own output for a draft.
//! - After `propose(t, h, p, n)` no row lies at or past `p + max(n, 1)`, and the rows from
//!   `p` on are this propose's own: earlier unverified rows there were rolled back first.
//! - Running out of the state's budget or of pool blocks shortens the drafts; it does not
//!   fail the call.

use super::bad;
use super::forward::{Depth, HiddenKind, Row};
use super::head::{MtpHead, DRAFT_SLACK_ROWS, MTP_CHUNK_ROWS};
use super::scratch::Scratch;
use super::state::{MtpState, DRAFTER_BLOCK_SIZE};
use crate::backend::{ArgmaxArgs, DevicePtr, GpuBackend, GpuBackendExt, PickArgs, SoftmaxArgs};
use crate::model::ForwardContext;
use crate::speculative::{DraftRunner, ProposerError, ProposerState};
use std::sync::{Arc, MutexGuard};

/// One sequence of a draft loop.
pub(crate) struct DraftSeq<'s> {
    pub state: &'s mut MtpState,
    pub token: u32,
    pub hidden: DevicePtr,
    pub position: usize,
}

impl MtpHead {
    pub(crate) fn state_mut<'s>(
        &self,
        state: &'s mut dyn ProposerState,
        method: &'static str,
    ) -> crate::Result<&'s mut MtpState> {
        let s = state
            .as_any_mut()
            .downcast_mut::<MtpState>()
            .ok_or(ProposerError::WrongState {
                method,
                expected: "MtpState",
            })?;
        if s.head_id != self.id {
            return Err(bad(method, "the state was made by another MtpHead".into()));
        }
        if s.freed {
            return Err(bad(method, "the state was already freed".into()));
        }
        Ok(s)
    }

    pub(crate) fn lock_scratch(&self) -> MutexGuard<'_, Scratch> {
        // The scratch holds no invariant across calls; a poisoned lock is still usable.
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Refuses a grammar mask too short for the draft vocabulary (for the whole target
    /// vocabulary when draft ids map to other target ids).
    pub(crate) fn check_mask(&self, mask: &[i32]) -> crate::Result<()> {
        let words = self.spec.mask_words();
        if mask.len() < words {
            let (what, n) = match self.spec.eagle3 {
                Some(_) => ("target vocabulary", self.spec.config.vocab_size),
                None => ("draft vocabulary", self.spec.draft_vocab),
            };
            return Err(bad(
                "propose",
                format!(
                    "grammar_bitmask has {} words; the {what} of {n} needs {words}",
                    mask.len()
                ),
            ));
        }
        Ok(())
    }

    /// Checks each sequence's token and position (every one before any state changes),
    /// then settles each state before its position and forgets its last drafts.
    pub(crate) fn start_drafts(
        &self,
        method: &'static str,
        seqs: &mut [DraftSeq<'_>],
    ) -> crate::Result<()> {
        for s in seqs.iter() {
            self.check_token(method, s.token)?;
            if s.position == 0 {
                return Err(bad(
                    method,
                    "position must be at least 1: the hidden paired with last_token is computed at position - 1".into(),
                ));
            }
        }
        for s in seqs.iter_mut() {
            s.state.settle_before(&self.kv, s.position)?;
            s.state.last_drafts.clear();
        }
        Ok(())
    }

    pub(crate) fn check_token(&self, method: &'static str, token: u32) -> crate::Result<()> {
        let vocab = self.spec.config.vocab_size;
        if token as usize >= vocab {
            return Err(ProposerError::TokenOutOfVocab {
                method,
                token: token as u64,
                vocab_size: vocab,
            }
            .into());
        }
        Ok(())
    }

    /// The draft loop for one or more sequences (one row each per step).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn draft(
        &self,
        gpu: &dyn GpuBackend,
        seqs: &mut [DraftSeq<'_>],
        num_drafts: usize,
        mask: Option<&[i32]>,
        conf: Option<&mut Vec<Vec<f32>>>,
        stream: u64,
    ) -> crate::Result<Vec<Vec<u32>>> {
        let method = "propose";
        let vd = self.spec.draft_vocab;
        if let Some(m) = mask {
            self.check_mask(m)?;
            if seqs.len() != 1 {
                return Err(bad(method, "a grammar mask applies to one sequence".into()));
            }
        }
        self.start_drafts(method, seqs)?;
        if num_drafts == 0 && self.defers_rows() {
            self.defer_verified_rows(gpu, seqs, stream)?;
            if let Some(c) = conf {
                *c = vec![Vec::new(); seqs.len()];
            }
            return Ok(vec![Vec::new(); seqs.len()]);
        }
        let mut states: Vec<&mut MtpState> = seqs.iter_mut().map(|s| &mut *s.state).collect();
        self.flush_deferred(gpu, &mut states, stream)?;
        if num_drafts == 0 {
            self.write_verified_rows(gpu, seqs, stream)?;
            if let Some(c) = conf {
                *c = vec![Vec::new(); seqs.len()];
            }
            return Ok(vec![Vec::new(); seqs.len()]);
        }
        let sc = self.lock_scratch();
        if let Some(m) = mask {
            gpu.write(sc.grammar_mask, &self.spec.draft_mask(m), stream)?;
        }
        let n_seq = seqs.len();
        let mut drafts = vec![Vec::new(); n_seq];
        let mut probs = vec![Vec::new(); n_seq];
        let mut active: Vec<bool> = vec![true; n_seq];
        let mut inputs: Vec<(u32, DevicePtr)> = seqs.iter().map(|s| (s.token, s.hidden)).collect();
        for step in 0..num_drafts {
            let mut rows = Vec::new();
            let mut tables = Vec::new();
            let mut owners = Vec::new();
            for (i, s) in seqs.iter_mut().enumerate() {
                if !active[i] {
                    continue;
                }
                if s.state.reserve(gpu, &self.kv, 1)? == 0 {
                    // Budget or pool exhausted: this sequence drafts no further.
                    active[i] = false;
                    continue;
                }
                let row = s.state.rows();
                rows.push(Row {
                    token: inputs[i].0,
                    hidden: inputs[i].1,
                    position: s.position + step,
                    seq: tables.len(),
                    slot: s.state.slot(row).unwrap_or(0),
                    ctx_len: row + 1,
                });
                tables.push((s.state.table, s.state.capacity_blocks));
                owners.push(i);
            }
            if rows.is_empty() {
                break;
            }
            let kind = if step == 0 {
                HiddenKind::Target
            } else {
                HiddenKind::Chain
            };
            self.spec
                .forward_rows(gpu, &sc, &rows, &tables, kind, Depth::Logits, stream)?;
            let r = rows.len();
            gpu.argmax(ArgmaxArgs {
                out: sc.picks,
                logits: sc.logits,
                bitmask: mask.map(|_| sc.grammar_mask),
                rows: r,
                vocab: vd,
                stream,
            })?;
            let picks: Vec<u32> = gpu.download(sc.picks, r)?;
            let mut picked = Vec::new();
            if conf.is_some() {
                // Each row's probability of its pick, gathered on the device: one download.
                gpu.softmax(SoftmaxArgs {
                    out: sc.probs,
                    logits: sc.logits,
                    rows: r,
                    vocab: vd,
                    temperature: 1.0,
                    stream,
                })?;
                gpu.pick(PickArgs {
                    out: sc.picked_probs,
                    values: sc.probs,
                    index: sc.picks,
                    rows: r,
                    width: vd,
                    stream,
                })?;
                picked = gpu.download::<f32>(sc.picked_probs, r)?;
            }
            for (k, &i) in owners.iter().enumerate() {
                let s = &mut seqs[i];
                s.state.pair_keys.push(s.position + step - 1);
                s.state.pending += 1;
                let pick = picks[k];
                if pick == u32::MAX {
                    active[i] = false;
                    continue;
                }
                if let Some(&p) = picked.get(k) {
                    probs[i].push(p);
                }
                // A draft is drafted, and fed back, as its target id.
                let token = self.spec.to_target(pick);
                drafts[i].push(token);
                inputs[i] = (token, self.spec.chain_hidden(&sc, k));
            }
        }
        for (s, d) in seqs.iter_mut().zip(&drafts) {
            // Blocks reserved for rows that were not written go back to the pool.
            let rows = s.state.rows();
            s.state.truncate(&self.kv, rows)?;
            s.state.last_drafts = d.clone();
        }
        if let Some(c) = conf {
            *c = probs;
        }
        Ok(drafts)
    }

    /// Writes KV rows for `(sequence, token, hidden, position)` items, in chunks; returns
    /// the rows written per sequence (items that do not fit the budget or pool are skipped,
    /// with every later item of that sequence).
    pub(crate) fn write_rows(
        &self,
        gpu: &dyn GpuBackend,
        states: &mut [&mut MtpState],
        items: &[(usize, u32, DevicePtr, usize)],
        stream: u64,
    ) -> crate::Result<Vec<usize>> {
        let mut wanted = vec![0usize; states.len()];
        for &(s, token, _, pos) in items {
            self.check_token("catchup", token)?;
            if pos == 0 {
                return Err(bad("catchup", "a drafter row needs position >= 1".into()));
            }
            wanted[s] += 1;
        }
        let mut fits = vec![0usize; states.len()];
        for (s, st) in states.iter_mut().enumerate() {
            fits[s] = st.reserve(gpu, &self.kv, wanted[s])?;
        }
        let mut written = vec![0usize; states.len()];
        let sc = self.lock_scratch();
        let mut rows = Vec::with_capacity(MTP_CHUNK_ROWS);
        let flush = |rows: &mut Vec<Row>| -> crate::Result<()> {
            self.spec.forward_rows(
                gpu,
                &sc,
                rows,
                &[],
                HiddenKind::Target,
                Depth::KvOnly,
                stream,
            )?;
            rows.clear();
            Ok(())
        };
        for &(s, token, hidden, pos) in items {
            if written[s] >= fits[s] {
                continue;
            }
            let st = &mut *states[s];
            let row = st.rows();
            rows.push(Row {
                token,
                hidden,
                position: pos,
                seq: 0,
                slot: st.slot(row).unwrap_or(0),
                ctx_len: row + 1,
            });
            st.pair_keys.push(pos - 1);
            written[s] += 1;
            if rows.len() == MTP_CHUNK_ROWS.min(sc.rows) {
                flush(&mut rows)?;
            }
        }
        flush(&mut rows)?;
        drop(sc);
        for st in states.iter_mut() {
            let rows = st.rows();
            st.truncate(&self.kv, rows)?;
        }
        Ok(written)
    }

    pub(crate) fn capacity_blocks(&self, budget_tokens: usize) -> usize {
        let rows = budget_tokens
            .min(self.max_seq_len)
            .saturating_add(DRAFT_SLACK_ROWS);
        rows.div_ceil(DRAFTER_BLOCK_SIZE)
            .min(self.spec.max_blocks_per_seq)
    }

    pub(crate) fn runner(&self) -> Option<Arc<dyn DraftRunner>> {
        self.runner
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl MtpHead {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn propose_with_runner(
        &self,
        runner: &dyn DraftRunner,
        last_token: u32,
        target_hidden: DevicePtr,
        position: usize,
        num_drafts: usize,
        st: &mut MtpState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        mask: Option<&[i32]>,
    ) -> crate::Result<Vec<u32>> {
        self.check_token("propose", last_token)?;
        if position == 0 {
            return Err(bad("propose", "position must be at least 1".into()));
        }
        if let Some(m) = mask {
            self.check_mask(m)?;
        }
        st.settle_before(&self.kv, position)?;
        st.last_drafts.clear();
        self.flush_deferred(ctx.gpu.as_ref(), &mut [&mut *st], stream)?;
        let room = st.reserve(ctx.gpu.as_ref(), &self.kv, num_drafts)?;
        let binding = self.binding(&self.spec.config, &self.spec.levers);
        let drafts = runner.run(
            &binding,
            last_token,
            target_hidden,
            position,
            room,
            st,
            ctx,
            stream,
            mask,
        )?;
        // The runner wrote one row per step at the rows after the state's: one per draft,
        // and with a mask one more for the step whose mask allowed no token, if it ended so.
        let rows = match (drafts.len().cmp(&room), mask) {
            (std::cmp::Ordering::Equal, _) => drafts.len(),
            (std::cmp::Ordering::Less, Some(_)) => drafts.len() + 1,
            (std::cmp::Ordering::Less, None) => {
                return Err(bad(
                    "propose",
                    format!(
                        "the circuit runner drafted {} tokens of the {room} asked without a grammar mask",
                        drafts.len()
                    ),
                ))
            }
            (std::cmp::Ordering::Greater, _) => {
                return Err(bad(
                    "propose",
                    format!(
                        "the circuit runner drafted {} tokens, more than the {room} asked",
                        drafts.len()
                    ),
                ))
            }
        };
        for step in 0..rows {
            st.pair_keys.push(position + step - 1);
        }
        st.pending = rows;
        let rows = st.rows();
        st.truncate(&self.kv, rows)?;
        st.last_drafts = drafts.clone();
        Ok(drafts)
    }
}
