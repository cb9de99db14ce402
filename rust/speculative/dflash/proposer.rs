//! `DraftProposer` for `DFlashHead`: where the captured rows go, and what each protocol
//! method does to the state.
//!
//! `propose(t, _, p, n, .., stack)`: the stack's `k` rows are the target's captured rows
//! computed at `p - k .. p - 1` (the rows paired with the tokens committed since the previous
//! propose), which are exactly the context rows DFlash lacks; the head writes them, then runs
//! one block at `p` and returns its first `min(n, γ - 1)` drafts. `k` is not passed: it is `p`
//! less where the stack starts, which the state knows (`P - 1` after a prefill of `P`
//! tokens, the verified propose's position after `after_verify`, and `p - 1` for a state
//! never given rows). Proposing again from the same point before `after_verify` (the same
//! stack) rewrites the rows from `p - k` on, so it returns the same drafts. A propose of 0
//! drafts keeps its rows aside and the next drafting propose writes them with its own in one
//! forward (`deferred`), which drafts what writing them at once would.
//!
//! `prefill_drafter` writes the context rows of positions `0 .. P - 2` from
//! `ctx.target_hidden_stack` (`[P, taps * hidden]`, row `i` computed at `i`); the first
//! propose brings row `P - 1`. The `hiddens` arguments (the final hidden) are not read.
//!
//! Invariants:
//! - After a propose at `p` the state's context rows all lie before `p`, and the block's rows
//!   are never kept: `after_verify` only records where the next stack starts.
//! - A budget or pool too small for the rows costs drafts, never the sequence: the block is
//!   skipped, and if even the context does not fit its rows are dropped (the context
//!   restarts from the next stack).
//! - `take_drafter_kv` / `install_drafter_kv` keep their defaults (nothing is carried
//!   between turns: the next turn prefills the whole history).
//!
//! `propose_batch` (up to [`DFLASH_MAX_BATCH`] sequences, each with its own captured rows in
//! `ctx.target_hidden_stacks`) writes each sequence's context rows as its `propose` would,
//! then runs every block in one forward, so the draft layers and the LM head are read once
//! for the batch. Each sequence drafts what its `propose` would, and its confidences are the
//! head's softmax probability of each draft.

use super::forward::{BlockSeq, Scratch};
use super::head::{DFlashHead, DFLASH_MAX_BATCH};
use super::state::DFlashState;
use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig};
use crate::speculative::error::bad;
use crate::speculative::{DraftProposer, ProposerError, ProposerState};

fn needs_capture(method: &'static str) -> crate::Error {
    bad(
        method,
        "DFlashHead needs the target's captured layers (target_hidden_stack): run it in an engine that captures its target_layer_ids, or pass the rows".into(),
    )
}

impl DFlashHead {
    fn state<'s>(
        &self,
        state: &'s mut dyn ProposerState,
        method: &'static str,
    ) -> crate::Result<&'s mut DFlashState> {
        let st =
            state
                .as_any_mut()
                .downcast_mut::<DFlashState>()
                .ok_or(ProposerError::WrongState {
                    method,
                    expected: "DFlashState",
                })?;
        if st.head_id != self.id {
            return Err(bad(
                method,
                "the state was made by another DFlashHead".into(),
            ));
        }
        if st.freed {
            return Err(bad(method, "the state was already freed".into()));
        }
        Ok(st)
    }

    /// Refuses a token outside the vocabulary or position 0 (its captured row would be
    /// computed before the sequence starts).
    fn check_step(
        &self,
        method: &'static str,
        last_token: u32,
        position: usize,
    ) -> crate::Result<()> {
        let vocab = self.config.vocab_size;
        if last_token as usize >= vocab {
            return Err(ProposerError::TokenOutOfVocab {
                method,
                token: last_token as u64,
                vocab_size: vocab,
            }
            .into());
        }
        if position == 0 {
            return Err(bad(
                method,
                "position must be at least 1: the row paired with last_token is computed at position - 1".into(),
            ));
        }
        Ok(())
    }

    /// The context part of a propose at `position` on a checked state (see the module doc):
    /// the stack's rows written, or deferred when it asks for no drafts. True when a block
    /// may run after them (the rows are written and there is room for the block).
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        &self,
        method: &'static str,
        gpu: &dyn GpuBackend,
        sc: &Scratch,
        st: &mut DFlashState,
        position: usize,
        num_drafts: usize,
        stack: DevicePtr,
        stream: u64,
    ) -> crate::Result<bool> {
        let start = st.stack_start.unwrap_or(position.saturating_sub(1));
        if start >= position {
            return Err(bad(
                method,
                format!(
                    "position {position} is not after position {start}, where the captured rows of this propose would start"
                ),
            ));
        }
        let k = position - start;
        st.keep_before(start);
        st.proposed_at = Some(position);
        st.last_drafts = 0;
        if num_drafts == 0 {
            if self.defers_rows() {
                self.defer_context(gpu, sc, st, stack, start, k, stream)?;
            } else {
                self.write_context(gpu, sc, st, stack, start, k, stream)?;
            }
            return Ok(false);
        }
        // This propose's rows join the backlog, so one context forward writes them all.
        let written = self.defer_context(gpu, sc, st, stack, start, k, stream)?
            && self.flush_deferred(gpu, sc, st, stream)?;
        Ok(written && st.reserve(gpu, &self.pool, st.rows() + self.block_size, stream)?)
    }
}

impl DraftProposer for DFlashHead {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> crate::Result<Box<dyn ProposerState>> {
        self.alloc_state_for(gpu, usize::MAX)
    }

    fn alloc_state_for(
        &self,
        gpu: &dyn GpuBackend,
        budget_tokens: usize,
    ) -> crate::Result<Box<dyn ProposerState>> {
        let cap = self.capacity_blocks(budget_tokens);
        Ok(Box::new(DFlashState::new(gpu, self.id, cap)?))
    }

    fn propose(
        &self,
        last_token: u32,
        _target_hidden: DevicePtr,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        _draft_embed_target: Option<DevicePtr>,
        grammar_bitmask: Option<&[i32]>,
        target_hidden_stack: Option<DevicePtr>,
    ) -> crate::Result<Vec<u32>> {
        let stack = target_hidden_stack.ok_or_else(|| needs_capture("propose"))?;
        let st = self.state(state, "propose")?;
        self.check_step("propose", last_token, position)?;
        if let Some(m) = grammar_bitmask {
            let words = self.draft_vocab.div_ceil(32);
            if m.len() < words {
                return Err(bad(
                    "propose",
                    format!(
                        "grammar_bitmask has {} words; the draft vocabulary of {} needs {words}",
                        m.len(),
                        self.draft_vocab
                    ),
                ));
            }
        }
        let gpu = ctx.gpu.as_ref();
        let sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if !self.prepare("propose", gpu, &sc, st, position, num_drafts, stack, stream)? {
            return Ok(Vec::new());
        }
        let block = BlockSeq {
            state: st,
            last_token,
            position,
        };
        let mut out = self.blocks_forward(
            gpu,
            &sc,
            &[block],
            num_drafts,
            grammar_bitmask,
            false,
            stream,
        )?;
        let drafts = out.pop().map(|(d, _)| d).unwrap_or_default();
        st.last_drafts = drafts.len();
        Ok(drafts)
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
        let stacks = ctx
            .target_hidden_stacks
            .ok_or_else(|| needs_capture("propose_batch"))?;
        ProposerError::check_batch(
            "propose_batch",
            n,
            &[
                ("hiddens", target_hiddens.len()),
                ("captured row sets", stacks.len()),
                ("positions", positions.len()),
                ("states", states.len()),
            ],
        )?;
        ProposerError::check_width("propose_batch", n, DFLASH_MAX_BATCH)?;
        let mut sts = Vec::with_capacity(n);
        for (s, state) in states.iter_mut().enumerate() {
            self.check_step("propose_batch", last_tokens[s], positions[s])?;
            sts.push(self.state(&mut **state, "propose_batch")?);
        }
        let gpu = ctx.gpu.as_ref();
        let sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let mut drafting = Vec::with_capacity(n);
        for (s, st) in sts.iter_mut().enumerate() {
            let stack = stacks[s];
            if self.prepare(
                "propose_batch",
                gpu,
                &sc,
                st,
                positions[s],
                num_drafts,
                stack,
                stream,
            )? {
                drafting.push(s);
            }
        }
        let blocks: Vec<BlockSeq<'_>> = drafting
            .iter()
            .map(|&s| BlockSeq {
                state: &*sts[s],
                last_token: last_tokens[s],
                position: positions[s],
            })
            .collect();
        let want_conf = out_conf.is_some();
        let got = self.blocks_forward(gpu, &sc, &blocks, num_drafts, None, want_conf, stream)?;
        let mut drafts = vec![Vec::new(); n];
        let mut confs = vec![Vec::new(); n];
        for (&s, (d, c)) in drafting.iter().zip(got) {
            sts[s].last_drafts = d.len();
            drafts[s] = d;
            confs[s] = c;
        }
        if let Some(out) = out_conf {
            *out = confs;
        }
        Ok(Some(drafts))
    }

    fn propose_batch_max(&self, _buffers: &BufferArena, _config: &ModelConfig) -> usize {
        DFLASH_MAX_BATCH
    }

    fn after_verify(
        &self,
        num_accepted: usize,
        state: &mut dyn ProposerState,
        _stream: u64,
    ) -> crate::Result<()> {
        let st = self.state(state, "after_verify")?;
        if num_accepted > st.last_drafts {
            return Err(bad(
                "after_verify",
                format!(
                    "num_accepted is {num_accepted}, but the latest propose returned {} drafts",
                    st.last_drafts
                ),
            ));
        }
        if let Some(p) = st.proposed_at.take() {
            st.stack_start = Some(p);
        }
        st.last_drafts = 0;
        Ok(())
    }

    fn block_gamma(&self) -> Option<usize> {
        Some(self.block_size)
    }

    fn target_layer_ids(&self) -> Vec<usize> {
        self.capture_layer_ids().to_vec()
    }

    fn drafter_rows(&self, state: &mut dyn ProposerState) -> usize {
        self.state(state, "drafter_rows")
            .map_or(0, |st| st.rows() + st.deferred_rows())
    }

    fn prefill_drafter(
        &self,
        prompt_tokens: &[u32],
        _hiddens: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> crate::Result<usize> {
        let stack = ctx
            .target_hidden_stack
            .ok_or_else(|| needs_capture("prefill_drafter"))?;
        let st = self.state(state, "prefill_drafter")?;
        let gpu = ctx.gpu.as_ref();
        st.clear(&self.pool)?;
        let n = prompt_tokens.len().saturating_sub(1);
        let mut written = 0;
        if n > 0 && st.reserve(gpu, &self.pool, n, stream)? {
            let sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            self.append_context(gpu, &sc, st, stack, 0, n, stream)?;
            written = n;
        }
        st.stack_start = prompt_tokens.len().checked_sub(1);
        Ok(written)
    }

    fn free_state(&self, gpu: &dyn GpuBackend, state: &mut dyn ProposerState) -> crate::Result<()> {
        let st =
            state
                .as_any_mut()
                .downcast_mut::<DFlashState>()
                .ok_or(ProposerError::WrongState {
                    method: "free_state",
                    expected: "DFlashState",
                })?;
        if st.head_id != self.id {
            return Err(bad(
                "free_state",
                "the state was made by another DFlashHead".into(),
            ));
        }
        if st.freed {
            return Ok(());
        }
        st.free(gpu, &self.pool)
    }
}
