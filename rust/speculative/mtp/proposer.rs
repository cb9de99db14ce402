//! `DraftProposer` for `MtpHead`: the draft loop, the drafter-KV bookkeeping of every
//! protocol method, and the batched variants.
//!
//! Row accounting (DESIGN.md, "MTP pairing"): `propose(t, h, p, n)` writes n rows, at
//! positions `p .. p+n-1` with pair keys `p-1 .. p+n-2`: the first from `(t, h)`, each later
//! one from the previous draft and the head's own output hidden. `after_verify(k)` keeps
//! the first `k + 1` of them (the verified token's row and the accepted drafts' rows), or
//! only the first under `mtp_kv_exact`, where `catchup_batch` then writes exact rows for the
//! accepted drafts from the target's hiddens. A propose whose rows were never verified, or
//! rows at or after the position being drafted from, are rolled back first, so proposing
//! twice from the same point gives the same drafts.

use super::forward::{Depth, HiddenKind, Row, Scratch};
use super::head::{MtpHead, DRAFT_SLACK_ROWS, MTP_CHUNK_ROWS, MTP_MAX_BATCH};
use super::state::{MtpState, DRAFTER_BLOCK_SIZE};
use crate::backend::{DevicePtr, GpuBackend, GpuBackendExt};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig, ModelLevers};
use crate::speculative::{DraftBinding, DraftProposer, DraftRunner, ProposerError, ProposerState};
use std::sync::{Arc, MutexGuard};

fn bad(method: &'static str, message: String) -> crate::Error {
    ProposerError::InvalidArgument { method, message }.into()
}

/// One sequence of a draft loop.
struct Seq<'s> {
    state: &'s mut MtpState,
    token: u32,
    hidden: DevicePtr,
    position: usize,
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

    fn lock_scratch(&self) -> MutexGuard<'_, Scratch> {
        // The scratch holds no invariant across calls; a poisoned lock is still usable.
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_token(&self, method: &'static str, token: u32) -> crate::Result<()> {
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
    fn draft(
        &self,
        gpu: &dyn GpuBackend,
        seqs: &mut [Seq<'_>],
        num_drafts: usize,
        mask: Option<&[i32]>,
        conf: Option<&mut Vec<Vec<f32>>>,
        stream: u64,
    ) -> crate::Result<Vec<Vec<u32>>> {
        let method = "propose";
        let vd = self.spec.draft_vocab;
        let words = vd.div_ceil(32);
        if let Some(m) = mask {
            if m.len() < words {
                return Err(bad(
                    method,
                    format!(
                        "grammar_bitmask has {} words; the draft vocabulary of {vd} needs {words}",
                        m.len()
                    ),
                ));
            }
            if seqs.len() != 1 {
                return Err(bad(method, "a grammar mask applies to one sequence".into()));
            }
        }
        for s in seqs.iter_mut() {
            self.check_token(method, s.token)?;
            if s.position == 0 {
                return Err(bad(
                    method,
                    "position must be at least 1: the hidden paired with last_token is computed at position - 1".into(),
                ));
            }
            s.state.settle_before(&self.kv, s.position)?;
            s.state.last_drafts.clear();
        }
        let sc = self.lock_scratch();
        if let Some(m) = mask {
            gpu.write(sc.mask, &m[..words], stream)?;
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
            let mask_ptr = mask.map(|_| sc.mask);
            gpu.argmax(sc.picks, sc.logits, mask_ptr, r, vd, stream)?;
            let picks: Vec<u32> = gpu.download(sc.picks, r)?;
            if conf.is_some() {
                gpu.softmax(sc.probs, sc.logits, r, vd, 1.0, stream)?;
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
                if conf.is_some() {
                    let at = sc.probs.offset((k * vd + pick as usize) * 4);
                    probs[i].push(gpu.download::<f32>(at, 1)?[0]);
                }
                drafts[i].push(pick);
                inputs[i] = (pick, self.spec.chain_hidden(&sc, k));
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
    fn write_rows(
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

    fn capacity_blocks(&self, budget_tokens: usize) -> usize {
        let rows = budget_tokens
            .min(self.max_seq_len)
            .saturating_add(DRAFT_SLACK_ROWS);
        rows.div_ceil(DRAFTER_BLOCK_SIZE)
            .min(self.spec.max_blocks_per_seq)
    }

    fn runner(&self) -> Option<Arc<dyn DraftRunner>> {
        self.runner
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl DraftProposer for MtpHead {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> crate::Result<Box<dyn ProposerState>> {
        self.alloc_state_for(gpu, usize::MAX)
    }

    fn alloc_state_for(
        &self,
        gpu: &dyn GpuBackend,
        budget_tokens: usize,
    ) -> crate::Result<Box<dyn ProposerState>> {
        let cap = self.capacity_blocks(budget_tokens);
        Ok(Box::new(MtpState::new(gpu, self.id, cap)?))
    }

    fn propose(
        &self,
        last_token: u32,
        target_hidden: DevicePtr,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        draft_embed_target: Option<DevicePtr>,
        grammar_bitmask: Option<&[i32]>,
        _target_hidden_stack: Option<DevicePtr>,
    ) -> crate::Result<Vec<u32>> {
        let gpu = ctx.gpu.as_ref();
        let st = self.state_mut(state, "propose")?;
        let drafts = match (self.runner(), grammar_bitmask) {
            (Some(runner), None) => self.propose_with_runner(
                &*runner,
                last_token,
                target_hidden,
                position,
                num_drafts,
                st,
                ctx,
                stream,
            )?,
            _ => {
                let mut seqs = [Seq {
                    state: st,
                    token: last_token,
                    hidden: target_hidden,
                    position,
                }];
                self.draft(gpu, &mut seqs, num_drafts, grammar_bitmask, None, stream)?
                    .pop()
                    .unwrap_or_default()
            }
        };
        if let (Some(target), Some(&last)) = (draft_embed_target, drafts.last()) {
            let h = self.spec.config.hidden_size;
            gpu.write(self.deferred, &[last], stream)?;
            gpu.embedding(
                target,
                self.spec.embed.ptr,
                self.deferred,
                1,
                h,
                self.spec.config.vocab_size,
                stream,
            )?;
        }
        Ok(drafts)
    }

    fn after_verify(
        &self,
        num_accepted: usize,
        state: &mut dyn ProposerState,
        _stream: u64,
    ) -> crate::Result<()> {
        let st = self.state_mut(state, "after_verify")?;
        if num_accepted > st.last_drafts.len() {
            return Err(bad(
                "after_verify",
                format!(
                    "{num_accepted} drafts accepted but the last propose drafted {}",
                    st.last_drafts.len()
                ),
            ));
        }
        let keep = if self.spec.levers.mtp_kv_exact {
            1
        } else {
            num_accepted + 1
        }
        .min(st.pending);
        let rows = st.rows() - st.pending + keep;
        st.pending = 0;
        st.truncate(&self.kv, rows)
    }

    fn prefill_hidden_rows(&self, max_seq_len: usize) -> usize {
        max_seq_len.min(self.max_seq_len)
    }

    fn needs_comm(&self) -> bool {
        false
    }

    fn prefill_uses_shared_buffers(&self) -> bool {
        // The head runs on its own scratch, never on ctx.buffers.
        false
    }

    fn drafter_rows(&self, state: &mut dyn ProposerState) -> usize {
        self.state_mut(state, "drafter_rows")
            .map_or(0, |s| s.rows())
    }

    fn last_pair_key(&self, state: &mut dyn ProposerState) -> Option<usize> {
        self.state_mut(state, "last_pair_key")
            .ok()
            .and_then(|s| s.pair_keys.last().copied())
    }

    fn take_drafter_kv(
        &self,
        state: &mut dyn ProposerState,
    ) -> Option<(Vec<u32>, usize, Option<usize>)> {
        let st = self.state_mut(state, "take_drafter_kv").ok()?;
        if st.rows() == 0 {
            return None;
        }
        let taken = (st.blocks.clone(), st.rows(), st.pair_keys.last().copied());
        st.forget();
        Some(taken)
    }

    fn install_drafter_kv(
        &self,
        state: &mut dyn ProposerState,
        blocks: Vec<u32>,
        rows: usize,
        last_pair_key: Option<usize>,
    ) -> bool {
        let Ok(st) = self.state_mut(state, "install_drafter_kv") else {
            return false;
        };
        st.install(blocks, rows, last_pair_key).is_ok()
    }

    fn free_drafter_kv(&self, blocks: &[u32]) {
        // Blocks no state owns; an id that is not allocated is ignored rather than panicking.
        let _ = self.kv.allocator.free(blocks);
    }

    fn catchup_drafter(
        &self,
        tokens: &[u32],
        hiddens: DevicePtr,
        row_base: usize,
        pos_base: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> crate::Result<usize> {
        let st = self.state_mut(state, "catchup_drafter")?;
        if row_base > st.rows() {
            return Err(bad(
                "catchup_drafter",
                format!(
                    "row_base {row_base} is past the {} rows the state holds",
                    st.rows()
                ),
            ));
        }
        st.pending = 0;
        st.truncate(&self.kv, row_base)?;
        let hb = self.spec.config.hidden_size * 2;
        let items: Vec<_> = tokens
            .iter()
            .enumerate()
            .map(|(j, &t)| (0, t, hiddens.offset(j * hb), pos_base + j))
            .collect();
        Ok(self.write_rows(ctx.gpu.as_ref(), &mut [st], &items, stream)?[0])
    }

    fn propose_batch(
        &self,
        last_tokens: &[u32],
        target_hiddens: &[DevicePtr],
        positions: &[usize],
        num_drafts: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
        out_conf: Option<&mut Vec<Vec<f32>>>,
    ) -> crate::Result<Option<Vec<Vec<u32>>>> {
        let n = last_tokens.len();
        if target_hiddens.len() != n || positions.len() != n || states.len() != n {
            return Err(bad(
                "propose_batch",
                format!(
                    "{n} tokens, {} hiddens, {} positions and {} states: one of each per sequence",
                    target_hiddens.len(),
                    positions.len(),
                    states.len()
                ),
            ));
        }
        if n > MTP_MAX_BATCH {
            return Err(bad(
                "propose_batch",
                format!("{n} sequences; propose_batch_max is {MTP_MAX_BATCH}"),
            ));
        }
        if self.runner().is_some() {
            // The circuit runner drafts one sequence at a time.
            return Ok(None);
        }
        let mut seqs = Vec::with_capacity(n);
        for (i, s) in states.iter_mut().enumerate() {
            seqs.push(Seq {
                state: self.state_mut(&mut **s, "propose_batch")?,
                token: last_tokens[i],
                hidden: target_hiddens[i],
                position: positions[i],
            });
        }
        self.draft(
            ctx.gpu.as_ref(),
            &mut seqs,
            num_drafts,
            None,
            out_conf,
            stream,
        )
        .map(Some)
    }

    fn propose_batch_max(&self, _buffers: &BufferArena, _config: &ModelConfig) -> usize {
        MTP_MAX_BATCH
    }

    fn catchup_batch(
        &self,
        tokens: &[Vec<u32>],
        hiddens: &[Vec<DevicePtr>],
        first_pos: &[usize],
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> crate::Result<usize> {
        let n = tokens.len();
        if hiddens.len() != n || first_pos.len() != n || states.len() != n {
            return Err(bad(
                "catchup_batch",
                "tokens, hiddens, first_pos and states need one entry per sequence".into(),
            ));
        }
        let mut items = Vec::new();
        for i in 0..n {
            if hiddens[i].len() != tokens[i].len() {
                return Err(bad(
                    "catchup_batch",
                    format!(
                        "sequence {i}: {} tokens but {} hiddens",
                        tokens[i].len(),
                        hiddens[i].len()
                    ),
                ));
            }
            for (k, (&t, &h)) in tokens[i].iter().zip(&hiddens[i]).enumerate() {
                items.push((i, t, h, first_pos[i] + k));
            }
        }
        let mut sts = Vec::with_capacity(n);
        for s in states.iter_mut() {
            let st = self.state_mut(&mut **s, "catchup_batch")?;
            st.pending = 0;
            sts.push(st);
        }
        Ok(self
            .write_rows(ctx.gpu.as_ref(), &mut sts, &items, stream)?
            .iter()
            .sum())
    }

    fn prefill_drafter(
        &self,
        prompt_tokens: &[u32],
        hiddens: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> crate::Result<usize> {
        let st = self.state_mut(state, "prefill_drafter")?;
        st.clear(&self.kv)?;
        let hb = self.spec.config.hidden_size * 2;
        // Row for position i pairs token i with the hidden computed at position i - 1.
        let items: Vec<_> = (1..prompt_tokens.len())
            .map(|i| (0, prompt_tokens[i], hiddens.offset((i - 1) * hb), i))
            .collect();
        Ok(self.write_rows(ctx.gpu.as_ref(), &mut [st], &items, stream)?[0])
    }

    fn read_deferred_draft_token(&self, gpu: &dyn GpuBackend) -> crate::Result<u32> {
        Ok(gpu.download::<u32>(self.deferred, 1)?[0])
    }

    fn free_state(&self, gpu: &dyn GpuBackend, state: &mut dyn ProposerState) -> crate::Result<()> {
        let st = self.state_mut(state, "free_state")?;
        st.freed = true;
        let blocks = st.clear(&self.kv);
        let table = gpu.free(st.table);
        blocks?;
        table?;
        Ok(())
    }

    fn circuit_draft(&self, config: &ModelConfig, levers: &ModelLevers) -> Option<DraftBinding> {
        Some(self.binding(config, levers))
    }

    fn set_circuit_draft(&self, runner: Option<Arc<dyn DraftRunner>>) {
        *self.runner.write().unwrap_or_else(|e| e.into_inner()) = runner;
    }
}

impl MtpHead {
    #[allow(clippy::too_many_arguments)]
    fn propose_with_runner(
        &self,
        runner: &dyn DraftRunner,
        last_token: u32,
        target_hidden: DevicePtr,
        position: usize,
        num_drafts: usize,
        st: &mut MtpState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> crate::Result<Vec<u32>> {
        self.check_token("propose", last_token)?;
        if position == 0 {
            return Err(bad("propose", "position must be at least 1".into()));
        }
        st.settle_before(&self.kv, position)?;
        st.last_drafts.clear();
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
        )?;
        if drafts.len() > room {
            return Err(bad(
                "propose",
                format!(
                    "the circuit runner drafted {} tokens, more than the {room} asked",
                    drafts.len()
                ),
            ));
        }
        // The runner writes one row per draft, at the rows after the state's.
        for step in 0..drafts.len() {
            st.pair_keys.push(position + step - 1);
        }
        st.pending = drafts.len();
        let rows = st.rows();
        st.truncate(&self.kv, rows)?;
        st.last_drafts = drafts.clone();
        Ok(drafts)
    }
}
