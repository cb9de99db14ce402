//! `PanicGuard`: the engine's boundary around a proposer. Every call the engine makes into
//! a proposer goes through it, and a panic inside the proposer becomes a
//! `ProposerError::Failed` naming the method and the panic's message, so it ends only the
//! sequence (or `catchup_batch` group) the call was for, as an error would; the process
//! goes on and what the sequence held is released as usual.
//!
//! Invariants:
//! - A call that does not panic returns exactly what the proposer returned.
//! - Methods without an error channel answer a panic with their protocol default: no
//!   drafter KV taken or installed (the engine then frees the blocks itself), the protocol's
//!   default widths and capacities, no circuit.
//!
//! The proposer's own data may be left half-updated by a panic; the engine never calls it
//! again for the failed sequence except to free its state, which is guarded the same way.

use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig, ModelLevers};
use crate::speculative::{DraftBinding, DraftProposer, DraftRunner, ProposerError, ProposerState};
use crate::Result;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// A proposer whose panics become errors (see the module documentation).
pub(super) struct PanicGuard(pub Arc<dyn DraftProposer>);

/// The panic's message, when it carried a string.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// Runs `f`, turning a panic into the error of `method`.
fn guarded<R>(method: &'static str, f: impl FnOnce() -> Result<R>) -> Result<R> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => Err(ProposerError::Failed {
            method: method.to_string(),
            message: format!("panicked: {}", panic_message(payload.as_ref())),
        }
        .into()),
    }
}

/// Runs `f`, answering a panic with `default`.
fn or_default<R>(default: R, f: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(default)
}

impl DraftProposer for PanicGuard {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        guarded("alloc_state", || self.0.alloc_state(gpu))
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
        target_hidden_stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        guarded("propose", || {
            self.0.propose(
                last_token,
                target_hidden,
                position,
                num_drafts,
                state,
                ctx,
                stream,
                draft_embed_target,
                grammar_bitmask,
                target_hidden_stack,
            )
        })
    }

    fn after_verify(
        &self,
        num_accepted: usize,
        state: &mut dyn ProposerState,
        stream: u64,
    ) -> Result<()> {
        guarded("after_verify", || {
            self.0.after_verify(num_accepted, state, stream)
        })
    }

    fn alloc_state_for(
        &self,
        gpu: &dyn GpuBackend,
        budget_tokens: usize,
    ) -> Result<Box<dyn ProposerState>> {
        guarded("alloc_state_for", || {
            self.0.alloc_state_for(gpu, budget_tokens)
        })
    }

    fn block_gamma(&self) -> Option<usize> {
        or_default(None, || self.0.block_gamma())
    }

    fn prefill_hidden_rows(&self, max_seq_len: usize) -> usize {
        or_default(max_seq_len, || self.0.prefill_hidden_rows(max_seq_len))
    }

    fn needs_comm(&self) -> bool {
        or_default(false, || self.0.needs_comm())
    }

    fn prefill_uses_shared_buffers(&self) -> bool {
        or_default(false, || self.0.prefill_uses_shared_buffers())
    }

    fn drafter_rows(&self, state: &mut dyn ProposerState) -> usize {
        or_default(0, || self.0.drafter_rows(state))
    }

    fn last_pair_key(&self, state: &mut dyn ProposerState) -> Option<usize> {
        or_default(None, || self.0.last_pair_key(state))
    }

    fn take_drafter_kv(
        &self,
        state: &mut dyn ProposerState,
    ) -> Option<(Vec<u32>, usize, Option<usize>)> {
        or_default(None, || self.0.take_drafter_kv(state))
    }

    fn install_drafter_kv(
        &self,
        state: &mut dyn ProposerState,
        blocks: Vec<u32>,
        rows: usize,
        last_pair_key: Option<usize>,
    ) -> bool {
        or_default(false, || {
            self.0
                .install_drafter_kv(state, blocks, rows, last_pair_key)
        })
    }

    fn free_drafter_kv(&self, blocks: &[u32]) {
        or_default((), || self.0.free_drafter_kv(blocks))
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
    ) -> Result<usize> {
        guarded("catchup_drafter", || {
            self.0
                .catchup_drafter(tokens, hiddens, row_base, pos_base, state, ctx, stream)
        })
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
    ) -> Result<Option<Vec<Vec<u32>>>> {
        guarded("propose_batch", || {
            self.0.propose_batch(
                last_tokens,
                target_hiddens,
                positions,
                num_drafts,
                states,
                ctx,
                stream,
                out_conf,
            )
        })
    }

    fn propose_batch_max(&self, buffers: &BufferArena, config: &ModelConfig) -> usize {
        or_default(1, || self.0.propose_batch_max(buffers, config))
    }

    fn catchup_batch(
        &self,
        tokens: &[Vec<u32>],
        hiddens: &[Vec<DevicePtr>],
        first_pos: &[usize],
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<usize> {
        guarded("catchup_batch", || {
            self.0
                .catchup_batch(tokens, hiddens, first_pos, states, ctx, stream)
        })
    }

    fn prefill_drafter(
        &self,
        prompt_tokens: &[u32],
        hiddens: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<usize> {
        guarded("prefill_drafter", || {
            self.0
                .prefill_drafter(prompt_tokens, hiddens, state, ctx, stream)
        })
    }

    fn read_deferred_draft_token(&self, gpu: &dyn GpuBackend) -> Result<u32> {
        guarded("read_deferred_draft_token", || {
            self.0.read_deferred_draft_token(gpu)
        })
    }

    fn free_state(&self, gpu: &dyn GpuBackend, state: &mut dyn ProposerState) -> Result<()> {
        guarded("free_state", || self.0.free_state(gpu, state))
    }

    fn circuit_draft(&self, config: &ModelConfig, levers: &ModelLevers) -> Option<DraftBinding> {
        or_default(None, || self.0.circuit_draft(config, levers))
    }

    fn set_circuit_draft(&self, runner: Option<Arc<dyn DraftRunner>>) {
        or_default((), || self.0.set_circuit_draft(runner))
    }
}
