//! The `DraftProposer` implementation of [`PyProposer`]: each method hands over to its
//! group's file, where the Rust path (the class does not override the method) and the call
//! into Python (it does) are written: `adapter_lifecycle` (state and carried drafter KV),
//! `adapter_drafting` (propose, batches, verify feedback), `adapter_prefill` (drafter KV
//! from target hiddens), `adapter_capabilities` (what the proposer is, the circuit binding).

use super::adapter::PyProposer;
use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig, ModelLevers};
use crate::speculative::{DraftBinding, DraftProposer, DraftRunner, ProposerState};
use crate::Result;
use std::sync::Arc;

impl DraftProposer for PyProposer {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        self.dispatch_alloc_state(gpu)
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
        self.dispatch_propose(
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
    }

    fn after_verify(
        &self,
        num_accepted: usize,
        state: &mut dyn ProposerState,
        stream: u64,
    ) -> Result<()> {
        self.dispatch_after_verify(num_accepted, state, stream)
    }

    fn alloc_state_for(
        &self,
        gpu: &dyn GpuBackend,
        budget_tokens: usize,
    ) -> Result<Box<dyn ProposerState>> {
        self.dispatch_alloc_state_for(gpu, budget_tokens)
    }

    fn block_gamma(&self) -> Option<usize> {
        self.dispatch_block_gamma()
    }

    fn prefill_hidden_rows(&self, max_seq_len: usize) -> usize {
        self.dispatch_prefill_hidden_rows(max_seq_len)
    }

    fn needs_comm(&self) -> bool {
        self.dispatch_needs_comm()
    }

    fn prefill_uses_shared_buffers(&self) -> bool {
        self.dispatch_prefill_uses_shared_buffers()
    }

    fn drafter_rows(&self, state: &mut dyn ProposerState) -> usize {
        self.dispatch_drafter_rows(state)
    }

    fn last_pair_key(&self, state: &mut dyn ProposerState) -> Option<usize> {
        self.dispatch_last_pair_key(state)
    }

    fn take_drafter_kv(
        &self,
        state: &mut dyn ProposerState,
    ) -> Option<(Vec<u32>, usize, Option<usize>)> {
        self.dispatch_take_drafter_kv(state)
    }

    fn install_drafter_kv(
        &self,
        state: &mut dyn ProposerState,
        blocks: Vec<u32>,
        rows: usize,
        last_pair_key: Option<usize>,
    ) -> bool {
        self.dispatch_install_drafter_kv(state, blocks, rows, last_pair_key)
    }

    fn free_drafter_kv(&self, blocks: &[u32]) {
        self.dispatch_free_drafter_kv(blocks)
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
        self.dispatch_catchup_drafter(tokens, hiddens, row_base, pos_base, state, ctx, stream)
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
        self.dispatch_propose_batch(
            last_tokens,
            target_hiddens,
            positions,
            num_drafts,
            states,
            ctx,
            stream,
            out_conf,
        )
    }

    fn propose_batch_max(&self, buffers: &BufferArena, config: &ModelConfig) -> usize {
        self.dispatch_propose_batch_max(buffers, config)
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
        self.dispatch_catchup_batch(tokens, hiddens, first_pos, states, ctx, stream)
    }

    fn prefill_drafter(
        &self,
        prompt_tokens: &[u32],
        hiddens: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<usize> {
        self.dispatch_prefill_drafter(prompt_tokens, hiddens, state, ctx, stream)
    }

    fn read_deferred_draft_token(&self, gpu: &dyn GpuBackend) -> Result<u32> {
        self.dispatch_read_deferred_draft_token(gpu)
    }

    fn free_state(&self, gpu: &dyn GpuBackend, state: &mut dyn ProposerState) -> Result<()> {
        self.dispatch_free_state(gpu, state)
    }

    fn circuit_draft(&self, config: &ModelConfig, levers: &ModelLevers) -> Option<DraftBinding> {
        self.dispatch_circuit_draft(config, levers)
    }

    fn set_circuit_draft(&self, runner: Option<Arc<dyn DraftRunner>>) {
        self.dispatch_set_circuit_draft(runner)
    }
}
