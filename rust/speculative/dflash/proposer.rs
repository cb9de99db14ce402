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
//!   between turns: the next turn prefills the whole history); `propose_batch` is
//!   unsupported, since each sequence has its own captured rows.

use super::head::DFlashHead;
use super::state::DFlashState;
use crate::backend::{DevicePtr, GpuBackend};
use crate::model::ForwardContext;
use crate::speculative::{DraftProposer, ProposerError, ProposerState};

fn bad(method: &'static str, message: String) -> crate::Error {
    ProposerError::InvalidArgument { method, message }.into()
}

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

    /// The drafts of one propose on a checked state (see the module doc).
    #[allow(clippy::too_many_arguments)]
    fn propose_on(
        &self,
        gpu: &dyn GpuBackend,
        st: &mut DFlashState,
        last_token: u32,
        position: usize,
        num_drafts: usize,
        mask: Option<&[i32]>,
        stack: DevicePtr,
        stream: u64,
    ) -> crate::Result<Vec<u32>> {
        let start = st.stack_start.unwrap_or(position.saturating_sub(1));
        if start >= position {
            return Err(bad(
                "propose",
                format!(
                    "position {position} is not after position {start}, where the captured rows of this propose would start"
                ),
            ));
        }
        let k = position - start;
        st.keep_before(start);
        let sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let drafts = if num_drafts == 0 {
            if self.defers_rows() {
                self.defer_context(gpu, &sc, st, stack, start, k, stream)?;
            } else {
                self.write_context(gpu, &sc, st, stack, start, k, stream)?;
            }
            Vec::new()
        } else {
            // This propose's rows join the backlog, so one context forward writes them all.
            let written = self.defer_context(gpu, &sc, st, stack, start, k, stream)?
                && self.flush_deferred(gpu, &sc, st, stream)?;
            if written && st.reserve(gpu, &self.pool, st.rows() + self.block_size, stream)? {
                self.block_forward(gpu, &sc, st, last_token, position, num_drafts, mask, stream)?
            } else {
                Vec::new()
            }
        };
        st.proposed_at = Some(position);
        st.last_drafts = drafts.len();
        Ok(drafts)
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
        let vocab = self.config.vocab_size;
        if last_token as usize >= vocab {
            return Err(ProposerError::TokenOutOfVocab {
                method: "propose",
                token: last_token as u64,
                vocab_size: vocab,
            }
            .into());
        }
        if position == 0 {
            return Err(bad(
                "propose",
                "position must be at least 1: the row paired with last_token is computed at position - 1".into(),
            ));
        }
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
        self.propose_on(
            gpu,
            st,
            last_token,
            position,
            num_drafts,
            grammar_bitmask,
            stack,
            stream,
        )
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
