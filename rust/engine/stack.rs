//! The target layer capture as the engine keeps it, for a proposer that names
//! `target_layer_ids`: each forward asks the target for those layers' hiddens (a
//! `[rows, n * hidden]` BF16 stack), and the engine copies the rows its proposer will be
//! given out of the target's output, as it does the single hidden row `hidden_rows`.
//!
//! What the proposer receives (pairing as for `target_hidden`: a token's row is the one
//! computed at the position before it, whose logits picked it):
//! - `propose`'s `target_hidden_stack`: the rows of every token committed since the previous
//!   propose, oldest first, the last one paired with `last_token`. A verify forward's rows
//!   are `[last_token, d_1..d_n]`; with `m` drafts accepted, rows `0..=m` are paired with
//!   `d_1..d_m` and the bonus token, so the next propose gets those `m + 1`. The first
//!   propose after a prefill gets one row, the last prefill row's.
//! - `propose_batch`: `ctx.target_hidden_stacks`, one entry per member, each what that
//!   member's `propose` would get.
//! - `prefill_drafter` / `catchup_drafter`: `ctx.target_hidden_stack`, the rows paired with
//!   their `hiddens`, gathered across the prefill chunks in a sibling of the buffer that
//!   gathers those hiddens.
//! - `catchup_batch`: called one sequence at a time, `ctx.target_hidden_stack` the rows
//!   paired with its `hiddens` (the rows of the accepted drafts).
//!
//! Invariants:
//! - With no layers named the engine asks no capture of the target, allocates no stack and
//!   passes `None` everywhere.
//! - Rows `0..len` of a sequence's [`StackRows`] are the rows its next propose gets; a step
//!   that did not propose (no room for drafts) appends its one row instead of starting over.
//! - A preempted sequence frees its stack with everything else and rebuilds it from its
//!   re-prefill, whose rows are what a fresh forward of the same tokens computes.

use super::sequence::EngineSequence;
use super::{EngineError, SpecEngine, Target, TargetOutput};
use crate::backend::{BackendError, DevicePtr, GpuBackend, DEFAULT_STREAM};
use crate::Result;

/// One sequence's engine-owned stack rows: BF16 `[cap, n * hidden]`, rows `0..len` valid.
#[derive(Debug, Default)]
pub(super) struct StackRows {
    pub ptr: DevicePtr,
    pub cap: usize,
    pub len: usize,
}

impl StackRows {
    /// The rows for `propose`, when the engine captures.
    pub fn for_propose(&self) -> Option<DevicePtr> {
        (!self.ptr.is_null()).then_some(self.ptr)
    }

    /// Frees the buffer (once); the rows are empty afterwards.
    pub fn free(&mut self, gpu: &dyn GpuBackend) -> std::result::Result<(), BackendError> {
        let ptr = std::mem::take(&mut self.ptr);
        self.cap = 0;
        self.len = 0;
        if ptr.is_null() {
            Ok(())
        } else {
            gpu.free(ptr)
        }
    }
}

impl<T: Target> SpecEngine<T> {
    /// Whether the proposer names target layers.
    pub(super) fn captures(&self) -> bool {
        !self.capture_layers.is_empty()
    }

    /// Bytes of one stack row (0 without capture).
    pub(super) fn stack_row_bytes(&self) -> usize {
        self.capture_layers.len() * self.row_bytes()
    }

    /// A forward of `seqs` over `tokens`, asking the target for the proposer's layers; the
    /// stack is checked to be there when asked for.
    pub(super) fn forward_rows_of(
        &self,
        kvs: &mut [&mut T::KvSequence],
        tokens: &[&[u32]],
        last_logits_only: bool,
    ) -> Result<TargetOutput> {
        let out = if self.captures() {
            self.target
                .forward_capturing(kvs, tokens, last_logits_only, &self.capture_layers)?
        } else if last_logits_only {
            self.target.forward_last(kvs, tokens)?
        } else {
            self.target.forward(kvs, tokens)?
        };
        if self.captures() && out.hidden_stack.is_none() {
            return Err(EngineError::TargetOutput(format!(
                "no hidden stack for the {} capture layers asked",
                self.capture_layers.len()
            ))
            .into());
        }
        Ok(out)
    }

    /// Takes `seq`'s stack buffer, with room for a verify step's rows (none without capture).
    pub(super) fn alloc_stack(&self, seq: &mut EngineSequence<T::KvSequence>) -> Result<()> {
        if !self.captures() {
            return Ok(());
        }
        let rows = self.num_drafts + 1;
        let ptr = self
            .target
            .gpu()
            .alloc(rows * self.stack_row_bytes(), "engine:stack_rows")?;
        seq.stack = StackRows {
            ptr,
            cap: rows,
            len: 0,
        };
        Ok(())
    }

    /// Keeps rows `offset..offset + rows` of a forward's stack for `seq`'s next propose: from
    /// row 0 when the step proposed (its rows start afresh), else after the rows still
    /// waiting for a propose. Returns the row they start at.
    pub(super) fn keep_stack_rows(
        &self,
        seq: &mut EngineSequence<T::KvSequence>,
        out: &TargetOutput,
        offset: usize,
        rows: usize,
    ) -> Result<usize> {
        let (Some(stack), false) = (out.hidden_stack, seq.stack.ptr.is_null()) else {
            return Ok(0);
        };
        let sb = self.stack_row_bytes();
        let gpu = self.target.gpu();
        let base = if seq.proposed { 0 } else { seq.stack.len };
        if base + rows > seq.stack.cap {
            // Only steps without a propose pile rows up: rare, so grow by doubling.
            let cap = (base + rows).max(2 * seq.stack.cap);
            let grown = gpu.alloc(cap * sb, "engine:stack_rows")?;
            gpu.copy_dtod(grown, seq.stack.ptr, base * sb, DEFAULT_STREAM)?;
            gpu.free(seq.stack.ptr)?;
            seq.stack.ptr = grown;
            seq.stack.cap = cap;
        }
        gpu.copy_dtod(
            seq.stack.ptr.offset(base * sb),
            stack.offset(offset * sb),
            rows * sb,
            DEFAULT_STREAM,
        )?;
        Ok(base)
    }
}
