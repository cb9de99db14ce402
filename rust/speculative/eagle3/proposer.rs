//! `DraftProposer` for `Eagle3Head`: the MTP head's methods, given the captured target rows
//! in place of the final hidden.
//!
//! Where the rows come from: `propose` reads the last row of `target_hidden_stack` (the row
//! paired with `last_token`), `prefill_drafter` and `catchup_drafter` read
//! `ctx.target_hidden_stack` (paired row for row with their `hiddens`); the `hiddens`
//! arguments themselves are not read. Without the captured rows these methods fail saying
//! so. The stack holds the rows of every token committed since the previous propose, so the
//! state keeps the position through which rows were consumed, and the last row is row
//! `position - consumed - 1` (row 0 when nothing was consumed yet).
//!
//! Invariants (beyond the MTP head's, which hold as they are):
//! - after `prefill_drafter` of `P` tokens the consumed position is `P - 1`; after
//!   `after_verify` it is the position the verified propose drafted from; after
//!   `catchup_drafter` it is the last position it wrote; after `take_drafter_kv` nothing is
//!   consumed, as in a fresh state.
//! - `propose_tree` grows the MTP head's tree from the same captured row `propose` reads,
//!   and `after_verify_tree` settles it as `after_verify` does a chain.
//! - accepted drafts keep the KV rows written when they were drafted (`mtp_kv_exact` does not
//!   apply: `catchup_batch` writes nothing).
//! - `propose_batch` drafts as `propose` does for each sequence, from the last row of its
//!   entry in `ctx.target_hidden_stacks`, in the MTP head's batched draft loop, and
//!   `propose_tree_batch` grows what `propose_tree` would, in the MTP head's batched tree
//!   growth; without those rows both fail saying so.

use super::head::Eagle3Head;
use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig};
use crate::speculative::error::bad;
use crate::speculative::{DraftProposer, DraftTree, MtpState, ProposerError, ProposerState};

/// Per-sequence state of an [`Eagle3Head`]: the MTP head's state, and where the captured
/// rows stand.
pub struct Eagle3State {
    pub(crate) inner: MtpState,
    /// The position of the last token whose captured row the head has consumed.
    consumed: Option<usize>,
    /// The position the latest propose drafted from, until `after_verify` settles it.
    proposed_at: Option<usize>,
}

crate::impl_proposer_state!(Eagle3State);

impl Eagle3State {
    /// The MTP head's state inside (rows, blocks, pair keys).
    pub fn drafter(&self) -> &MtpState {
        &self.inner
    }
}

fn needs_capture(method: &'static str) -> crate::Error {
    let field = match method {
        "propose_batch" | "propose_tree_batch" => "ctx.target_hidden_stacks",
        _ => "target_hidden_stack",
    };
    bad(
        method,
        format!("Eagle3Head needs the target's captured layers ({field}): run it in an engine that captures its target_layer_ids, or pass the rows"),
    )
}

impl Eagle3Head {
    fn state<'s>(
        &self,
        state: &'s mut dyn ProposerState,
        method: &'static str,
    ) -> crate::Result<&'s mut Eagle3State> {
        state
            .as_any_mut()
            .downcast_mut::<Eagle3State>()
            .ok_or_else(|| {
                ProposerError::WrongState {
                    method,
                    expected: "Eagle3State",
                }
                .into()
            })
    }

    /// The row of `stack` paired with the token at `position`.
    fn last_stack_row(
        &self,
        st: &Eagle3State,
        stack: DevicePtr,
        position: usize,
    ) -> crate::Result<DevicePtr> {
        let back = match st.consumed {
            None => 0,
            Some(c) if position > c => position - c - 1,
            Some(c) => {
                return Err(bad(
                    "propose",
                    format!(
                        "position {position} is not after position {c}, whose captured row was already consumed"
                    ),
                ))
            }
        };
        Ok(stack.offset(back * self.head.spec.target_row_bytes()))
    }

    /// A batched method of the MTP head for `n` sequences, `call(rows, inner states)`, given
    /// each sequence's row paired with its last token (from `ctx.target_hidden_stacks`);
    /// each state is then marked as proposed from its position when the head batched.
    fn batched<A>(
        &self,
        method: &'static str,
        n: usize,
        positions: &[usize],
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        call: impl FnOnce(&[DevicePtr], &mut [&mut dyn ProposerState]) -> crate::Result<Option<A>>,
    ) -> crate::Result<Option<A>> {
        let stacks = ctx
            .target_hidden_stacks
            .ok_or_else(|| needs_capture(method))?;
        ProposerError::check_batch(
            method,
            n,
            &[
                ("captured row sets", stacks.len()),
                ("positions", positions.len()),
                ("states", states.len()),
            ],
        )?;
        let mut rows = Vec::with_capacity(n);
        let mut inner: Vec<&mut dyn ProposerState> = Vec::with_capacity(n);
        for (i, s) in states.iter_mut().enumerate() {
            let st = self.state(&mut **s, method)?;
            rows.push(self.last_stack_row(st, stacks[i], positions[i])?);
            inner.push(&mut st.inner);
        }
        let answer = call(&rows, &mut inner)?;
        if answer.is_some() {
            for (s, &p) in states.iter_mut().zip(positions) {
                self.state(&mut **s, method)?.proposed_at = Some(p);
            }
        }
        Ok(answer)
    }
}

impl DraftProposer for Eagle3Head {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> crate::Result<Box<dyn ProposerState>> {
        self.alloc_state_for(gpu, usize::MAX)
    }

    fn alloc_state_for(
        &self,
        gpu: &dyn GpuBackend,
        budget_tokens: usize,
    ) -> crate::Result<Box<dyn ProposerState>> {
        let cap = self.head.capacity_blocks(budget_tokens);
        let inner = MtpState::new(gpu, self.head.id, cap)?;
        Ok(Box::new(Eagle3State {
            inner,
            consumed: None,
            proposed_at: None,
        }))
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
        draft_embed_target: Option<DevicePtr>,
        grammar_bitmask: Option<&[i32]>,
        target_hidden_stack: Option<DevicePtr>,
    ) -> crate::Result<Vec<u32>> {
        let stack = target_hidden_stack.ok_or_else(|| needs_capture("propose"))?;
        let st = self.state(state, "propose")?;
        let row = self.last_stack_row(st, stack, position)?;
        let drafts = self.head.propose(
            last_token,
            row,
            position,
            num_drafts,
            &mut st.inner,
            ctx,
            stream,
            draft_embed_target,
            grammar_bitmask,
            None,
        )?;
        st.proposed_at = Some(position);
        Ok(drafts)
    }

    fn after_verify(
        &self,
        num_accepted: usize,
        state: &mut dyn ProposerState,
        stream: u64,
    ) -> crate::Result<()> {
        let st = self.state(state, "after_verify")?;
        self.head
            .after_verify(num_accepted, &mut st.inner, stream)?;
        if let Some(p) = st.proposed_at.take() {
            st.consumed = Some(p);
        }
        Ok(())
    }

    fn propose_tree(
        &self,
        last_token: u32,
        _target_hidden: DevicePtr,
        position: usize,
        budget: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        draft_embed_target: Option<DevicePtr>,
        grammar_bitmask: Option<&[i32]>,
        target_hidden_stack: Option<DevicePtr>,
    ) -> crate::Result<DraftTree> {
        let stack = target_hidden_stack.ok_or_else(|| needs_capture("propose_tree"))?;
        let st = self.state(state, "propose_tree")?;
        let row = self.last_stack_row(st, stack, position)?;
        let tree = self.head.propose_tree(
            last_token,
            row,
            position,
            budget,
            &mut st.inner,
            ctx,
            stream,
            draft_embed_target,
            grammar_bitmask,
            None,
        )?;
        st.proposed_at = Some(position);
        Ok(tree)
    }

    fn grows_trees(&self) -> bool {
        self.head.grows_trees()
    }

    fn after_verify_tree(
        &self,
        path: &[usize],
        state: &mut dyn ProposerState,
        stream: u64,
    ) -> crate::Result<()> {
        let st = self.state(state, "after_verify_tree")?;
        self.head.after_verify_tree(path, &mut st.inner, stream)?;
        if let Some(p) = st.proposed_at.take() {
            st.consumed = Some(p);
        }
        Ok(())
    }

    fn target_layer_ids(&self) -> Vec<usize> {
        self.capture_layer_ids()
    }

    fn prefill_hidden_rows(&self, max_seq_len: usize) -> usize {
        self.head.prefill_hidden_rows(max_seq_len)
    }

    fn drafter_rows(&self, state: &mut dyn ProposerState) -> usize {
        self.state(state, "drafter_rows")
            .map_or(0, |st| self.head.drafter_rows(&mut st.inner))
    }

    fn last_pair_key(&self, state: &mut dyn ProposerState) -> Option<usize> {
        let st = self.state(state, "last_pair_key").ok()?;
        self.head.last_pair_key(&mut st.inner)
    }

    fn take_drafter_kv(
        &self,
        state: &mut dyn ProposerState,
    ) -> Option<(Vec<u32>, usize, Option<usize>)> {
        let st = self.state(state, "take_drafter_kv").ok()?;
        let taken = self.head.take_drafter_kv(&mut st.inner)?;
        st.consumed = None;
        st.proposed_at = None;
        Some(taken)
    }

    fn install_drafter_kv(
        &self,
        state: &mut dyn ProposerState,
        blocks: Vec<u32>,
        rows: usize,
        last_pair_key: Option<usize>,
    ) -> bool {
        let Ok(st) = self.state(state, "install_drafter_kv") else {
            return false;
        };
        self.head
            .install_drafter_kv(&mut st.inner, blocks, rows, last_pair_key)
    }

    fn free_drafter_kv(&self, blocks: &[u32]) {
        self.head.free_drafter_kv(blocks)
    }

    fn catchup_drafter(
        &self,
        tokens: &[u32],
        _hiddens: DevicePtr,
        row_base: usize,
        pos_base: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> crate::Result<usize> {
        let stack = ctx
            .target_hidden_stack
            .ok_or_else(|| needs_capture("catchup_drafter"))?;
        let st = self.state(state, "catchup_drafter")?;
        let written = self.head.catchup_drafter(
            tokens,
            stack,
            row_base,
            pos_base,
            &mut st.inner,
            ctx,
            stream,
        )?;
        if !tokens.is_empty() {
            st.consumed = Some(pos_base + tokens.len() - 1);
            st.proposed_at = None;
        }
        Ok(written)
    }

    fn propose_batch(
        &self,
        last_tokens: &[u32],
        _target_hiddens: &[DevicePtr],
        positions: &[usize],
        num_drafts: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
        out_conf: Option<&mut Vec<Vec<f32>>>,
    ) -> crate::Result<Option<Vec<Vec<u32>>>> {
        self.batched(
            "propose_batch",
            last_tokens.len(),
            positions,
            states,
            ctx,
            |rows, inner| {
                self.head.propose_batch(
                    last_tokens,
                    rows,
                    positions,
                    num_drafts,
                    inner,
                    ctx,
                    stream,
                    out_conf,
                )
            },
        )
    }

    fn propose_tree_batch(
        &self,
        last_tokens: &[u32],
        _target_hiddens: &[DevicePtr],
        positions: &[usize],
        budget: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> crate::Result<Option<Vec<DraftTree>>> {
        self.batched(
            "propose_tree_batch",
            last_tokens.len(),
            positions,
            states,
            ctx,
            |rows, inner| {
                self.head.propose_tree_batch(
                    last_tokens,
                    rows,
                    positions,
                    budget,
                    inner,
                    ctx,
                    stream,
                )
            },
        )
    }

    fn propose_batch_max(&self, buffers: &BufferArena, config: &ModelConfig) -> usize {
        self.head.propose_batch_max(buffers, config)
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
        let written =
            self.head
                .prefill_drafter(prompt_tokens, stack, &mut st.inner, ctx, stream)?;
        st.consumed = prompt_tokens.len().checked_sub(1);
        st.proposed_at = None;
        Ok(written)
    }

    fn read_deferred_draft_token(&self, gpu: &dyn GpuBackend) -> crate::Result<u32> {
        self.head.read_deferred_draft_token(gpu)
    }

    fn free_state(&self, gpu: &dyn GpuBackend, state: &mut dyn ProposerState) -> crate::Result<()> {
        let st = self.state(state, "free_state")?;
        self.head.free_state(gpu, &mut st.inner)
    }
}
