//! `DraftProposer` for `MtpHead`: what each protocol method does to the state, on top of
//! the draft loop in `draft`.
//!
//! `after_verify(k)` keeps the first `k + 1` rows of the latest propose (the verified
//! token's row and the accepted drafts' rows), or only the first under `mtp_kv_exact`, where
//! `catchup_batch` then writes exact rows for the accepted drafts from the target's hiddens.
//! A propose of 0 drafts (a step the draft policy skips) writes the verified token's row
//! alone, so the head's KV has a row for every position whatever the policy chose.
//! `take_drafter_kv` leaves a fresh state; `install_drafter_kv` is its inverse.
//! `propose_tree` grows a dynamic tree (see `tree`); `after_verify_tree`, and `after_verify`
//! after a tree that came out a chain, keep the accepted path's rows.
//!
//! Invariants:
//! - After `after_verify(k)` the rows end at the last verified position: the verified
//!   token's row and the `k` accepted drafts' rows (only the first under `mtp_kv_exact`,
//!   until `catchup_batch` writes the exact ones).
//! - `take_drafter_kv` moves every block out of the state; `install_drafter_kv` takes
//!   blocks only into a state that holds none, and refuses (returning false, the caller
//!   keeping the blocks) a block count that does not match the rows or the state's budget.
//! - `free_state` returns every block the state holds to the head's pool and frees its
//!   block table.

use super::bad;
use super::draft::DraftSeq;
use super::head::{MtpHead, MTP_MAX_BATCH};
use super::state::MtpState;
use crate::backend::{DevicePtr, EmbeddingArgs, GpuBackend, GpuBackendExt};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig, ModelLevers};
use crate::speculative::{DraftBinding, DraftProposer, DraftRunner, ProposerState};
use crate::speculative::{DraftTree, ProposerError};
use std::sync::Arc;

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
        // A propose of no drafts only writes the verified token's row: the head's own
        // forward does that, with or without a circuit runner.
        let drafts = match self.runner().filter(|_| num_drafts > 0) {
            Some(runner) => self.propose_with_runner(
                &*runner,
                last_token,
                target_hidden,
                position,
                num_drafts,
                st,
                ctx,
                stream,
                grammar_bitmask,
            )?,
            None => {
                let mut seqs = [DraftSeq {
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
            gpu.embedding(EmbeddingArgs {
                out: target,
                table: self.spec.embed.descriptor(),
                ids: self.deferred,
                rows: 1,
                hidden: h,
                vocab: self.spec.config.vocab_size,
                stream,
            })?;
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
        if let Some(tree) = st.tree.take() {
            // A tree that came out a chain: its first nodes are the accepted path.
            let path: Vec<usize> = (0..num_accepted).collect();
            return self.keep_tree_path(st, tree, &path);
        }
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
        let rows = st.logical_rows() - st.pending + keep;
        st.pending = 0;
        st.truncate(&self.kv, rows)
    }

    fn propose_tree(
        &self,
        last_token: u32,
        target_hidden: DevicePtr,
        position: usize,
        budget: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        draft_embed_target: Option<DevicePtr>,
        grammar_bitmask: Option<&[i32]>,
        target_hidden_stack: Option<DevicePtr>,
    ) -> crate::Result<DraftTree> {
        // A circuit runner drafts chains, and the deferred draft embedding names one last
        // draft: both keep `propose`'s chain, as does a budget of no drafts. A one-node
        // tree is the head's first choice, a one-draft chain: `propose` drafts it on the
        // device, without the logits download and the host's choice of children.
        if budget <= 1 || draft_embed_target.is_some() || self.runner().is_some() {
            let drafts = self.propose(
                last_token,
                target_hidden,
                position,
                budget,
                state,
                ctx,
                stream,
                draft_embed_target,
                grammar_bitmask,
                target_hidden_stack,
            )?;
            return Ok(DraftTree::chain(drafts));
        }
        if let Some(m) = grammar_bitmask {
            self.check_mask(m)?;
        }
        let seq = DraftSeq {
            state: self.state_mut(state, "propose_tree")?,
            token: last_token,
            hidden: target_hidden,
            position,
        };
        let mut trees = self.propose_trees(
            "propose_tree",
            ctx,
            &mut [seq],
            grammar_bitmask,
            budget,
            stream,
        )?;
        Ok(trees.pop().unwrap_or_default())
    }

    fn propose_tree_batch(
        &self,
        last_tokens: &[u32],
        target_hiddens: &[DevicePtr],
        positions: &[usize],
        budget: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> crate::Result<Option<Vec<DraftTree>>> {
        let method = "propose_tree_batch";
        check_batch(method, last_tokens, target_hiddens, positions, states)?;
        if budget <= 1 || self.runner().is_some() {
            // As `propose_tree`: the chains `propose_batch` drafts (none under a runner).
            let chains = self.propose_batch(
                last_tokens,
                target_hiddens,
                positions,
                budget,
                states,
                ctx,
                stream,
                None,
            )?;
            return Ok(chains.map(|c| c.into_iter().map(DraftTree::chain).collect()));
        }
        let mut seqs = self.draft_seqs(method, last_tokens, target_hiddens, positions, states)?;
        self.propose_trees(method, ctx, &mut seqs, None, budget, stream)
            .map(Some)
    }

    fn grows_trees(&self) -> bool {
        self.grow_trees.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn after_verify_tree(
        &self,
        path: &[usize],
        state: &mut dyn ProposerState,
        stream: u64,
    ) -> crate::Result<()> {
        let st = self.state_mut(state, "after_verify_tree")?;
        match st.tree.take() {
            Some(tree) => self.keep_tree_path(st, tree, path),
            // The chain of a runner or of no budget: a path of its first nodes.
            None => self.after_verify(path.len(), state, stream),
        }
    }

    fn prefill_hidden_rows(&self, max_seq_len: usize) -> usize {
        max_seq_len.min(self.max_seq_len)
    }

    fn needs_comm(&self) -> bool {
        // True when the head's routed experts are split across ranks: its forward then
        // meets the other ranks in an all-reduce.
        self.spec
            .weights
            .layer
            .moe()
            .is_some_and(|m| m.shard.is_some())
    }

    fn prefill_uses_shared_buffers(&self) -> bool {
        // The head runs on its own scratch, never on ctx.buffers.
        false
    }

    fn drafter_rows(&self, state: &mut dyn ProposerState) -> usize {
        self.state_mut(state, "drafter_rows")
            .map_or(0, |s| s.logical_rows())
    }

    fn last_pair_key(&self, state: &mut dyn ProposerState) -> Option<usize> {
        self.state_mut(state, "last_pair_key")
            .ok()
            .and_then(|s| s.logical_rows().checked_sub(1).map(|r| s.logical_key(r)))
    }

    fn take_drafter_kv(
        &self,
        state: &mut dyn ProposerState,
    ) -> Option<(Vec<u32>, usize, Option<usize>)> {
        let st = self.state_mut(state, "take_drafter_kv").ok()?;
        st.drop_tree(&self.kv).ok()?;
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
        st.drop_tree(&self.kv)?;
        self.flush_deferred(ctx.gpu.as_ref(), &mut [&mut *st], stream)?;
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
        let row_bytes = self.spec.target_row_bytes();
        let items: Vec<_> = tokens
            .iter()
            .enumerate()
            .map(|(j, &t)| (0, t, hiddens.offset(j * row_bytes), pos_base + j))
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
        let method = "propose_batch";
        check_batch(method, last_tokens, target_hiddens, positions, states)?;
        if self.runner().is_some() && num_drafts > 0 {
            // The circuit runner drafts one sequence at a time.
            return Ok(None);
        }
        let mut seqs = self.draft_seqs(method, last_tokens, target_hiddens, positions, states)?;
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
        ProposerError::check_batch(
            "catchup_batch",
            n,
            &[
                ("hidden lists", hiddens.len()),
                ("first positions", first_pos.len()),
                ("states", states.len()),
            ],
        )?;
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
        self.flush_deferred(ctx.gpu.as_ref(), &mut sts, stream)?;
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
        let row_bytes = self.spec.target_row_bytes();
        // Row for position i pairs token i with the hidden computed at position i - 1.
        let items: Vec<_> = (1..prompt_tokens.len())
            .map(|i| (0, prompt_tokens[i], hiddens.offset((i - 1) * row_bytes), i))
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
        let deferred = st.deferred_hidden.take().map_or(Ok(()), |b| gpu.free(b));
        let tree_hidden = st.tree_hidden.take().map_or(Ok(()), |(b, _)| gpu.free(b));
        let tree_table = st.tree_table.take().map_or(Ok(()), |b| gpu.free(b));
        blocks?;
        table?;
        deferred?;
        tree_hidden?;
        tree_table?;
        Ok(())
    }

    fn circuit_draft(&self, config: &ModelConfig, levers: &ModelLevers) -> Option<DraftBinding> {
        // The binding's slots do not describe routed experts, nor EAGLE-3's fusion.
        self.has_binding().then(|| self.binding(config, levers))
    }

    fn set_circuit_draft(&self, runner: Option<Arc<dyn DraftRunner>>) {
        if !self.has_binding() {
            return;
        }
        *self.runner.write().unwrap_or_else(|e| e.into_inner()) = runner;
    }
}

/// Refuses a batch whose lists differ in length from `last_tokens`, or one wider than the
/// head drafts at once, naming `method`.
fn check_batch(
    method: &'static str,
    last_tokens: &[u32],
    target_hiddens: &[DevicePtr],
    positions: &[usize],
    states: &[&mut dyn ProposerState],
) -> crate::Result<()> {
    let n = last_tokens.len();
    ProposerError::check_batch(
        method,
        n,
        &[
            ("hiddens", target_hiddens.len()),
            ("positions", positions.len()),
            ("states", states.len()),
        ],
    )?;
    Ok(ProposerError::check_width(method, n, MTP_MAX_BATCH)?)
}

impl MtpHead {
    /// Each sequence of a checked batch as the draft loops take it.
    fn draft_seqs<'s>(
        &self,
        method: &'static str,
        last_tokens: &[u32],
        target_hiddens: &[DevicePtr],
        positions: &[usize],
        states: &'s mut [&mut dyn ProposerState],
    ) -> crate::Result<Vec<DraftSeq<'s>>> {
        let mut seqs = Vec::with_capacity(states.len());
        for (i, s) in states.iter_mut().enumerate() {
            seqs.push(DraftSeq {
                state: self.state_mut(&mut **s, method)?,
                token: last_tokens[i],
                hidden: target_hiddens[i],
                position: positions[i],
            });
        }
        Ok(seqs)
    }
}
