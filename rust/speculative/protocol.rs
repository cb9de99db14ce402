//! The `DraftProposer` protocol: three required methods and twenty-four provided ones, with the
//! defaults the specification documents (`target_layer_ids`, which the specification does
//! not have, asks the engine for the target hiddens of chosen layers).
//!
//! The engine drives a proposer in this order: `alloc_state_for` → `prefill_drafter` →
//! (`propose` | `propose_batch` | `propose_tree` | `propose_tree_batch`) → verify →
//! `after_verify` (+ `catchup_batch` under `ModelLevers::mtp_kv_exact`) → `take_drafter_kv` /
//! `install_drafter_kv` between turns → `free_state`. Hidden states at these seams are BF16 `[rows, hidden_size]`; token ids are
//! `u32`; `DevicePtr` has no `Drop`, so whatever `alloc_state` allocates is freed in
//! `free_state` or leaks.
//!
//! [`ProtocolMethod`](super::ProtocolMethod) (in `protocol_methods.rs`) is the one list of
//! these methods' names and signatures; a test there keeps it equal to this trait.
//!
//! Invariants (the contract between the engine and every proposer):
//! - A state belongs to one sequence, from `alloc_state`/`alloc_state_for` to `free_state`;
//!   `free_state` releases every allocation the proposer made for it.
//! - `propose` returns at most `num_drafts` ids, each inside the vocabulary and, when a
//!   grammar mask is given, allowed by it; `propose_batch` returns what per-sequence
//!   `propose` would, or `None`.
//! - `propose_tree` returns a well-formed [`DraftTree`] of at most `budget` nodes, each
//!   token inside the vocabulary and allowed by the grammar mask when one is given;
//!   `propose_tree_batch` returns what per-sequence `propose_tree` would, or `None`.
//! - Every `propose` is followed by exactly one `after_verify`, with `num_accepted` at most
//!   the number of drafts returned, before the next `propose` on the same state (unless the
//!   sequence ends first, and `free_state` follows instead); a `propose_tree` likewise, by
//!   `after_verify` when its tree is a chain and by `after_verify_tree` with the accepted
//!   path when it branches.
//! - `take_drafter_kv` leaves the state as freshly allocated; blocks it hands out are owned
//!   by the caller until `install_drafter_kv` accepts them or `free_drafter_kv` frees them.

use super::{DraftBinding, DraftRunner};
use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig, ModelLevers};
use crate::speculative::DraftTree;
use crate::Result;
use std::any::Any;
use std::sync::Arc;

/// Per-sequence proposer state; proposers downcast it through `as_any` / `as_any_mut`.
///
/// Implement it with [`impl_proposer_state!`](crate::impl_proposer_state) for a plain type.
pub trait ProposerState: Send {
    /// The state as `Any`, to downcast to the proposer's own type.
    fn as_any(&self) -> &dyn Any;
    /// The state as mutable `Any`.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// Implements [`ProposerState`] for one or more `'static + Send` types.
#[macro_export]
macro_rules! impl_proposer_state {
    ($($ty:ty),+ $(,)?) => {$(
        impl $crate::speculative::ProposerState for $ty {
            fn as_any(&self) -> &dyn ::std::any::Any { self }
            fn as_any_mut(&mut self) -> &mut dyn ::std::any::Any { self }
        }
    )+};
}

/// A draft-token proposer. The model calls `propose` for draft tokens, verifies them with
/// the target, then calls `after_verify` with the accepted count so the proposer can trim
/// its state.
#[allow(clippy::too_many_arguments)]
pub trait DraftProposer: Send + Sync {
    /// Allocates per-sequence proposer state.
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>>;

    /// Proposes up to `num_drafts` tokens autoregressively.
    ///
    /// `last_token`: the last verified token. `target_hidden`: the target's `[1,
    /// hidden_size]` BF16 hidden for it, saved before the final norm. `position`: the
    /// sequence position, for RoPE. `grammar_bitmask`: when `Some`, one bit per token id in
    /// i32 words; drafts are limited to tokens whose bit is set.
    ///
    /// `target_hidden_stack`: `Some` when the proposer names [`Self::target_layer_ids`],
    /// else `None`. It points at `k` rows of BF16 `[n * hidden_size]` (the named layers'
    /// hiddens side by side): the captured rows paired with every token committed to the
    /// sequence since the previous propose, oldest first, the last paired with `last_token`.
    /// A token's row is the one computed at the position before it (whose logits picked
    /// it), as for `target_hidden`, so the last row is the stack counterpart of
    /// `target_hidden`. `k = 1 + num_accepted` of the `after_verify` before this propose,
    /// and `k = 1` for the first propose after `prefill_drafter` (its row is the last prompt
    /// row's). A step in which the engine did not call `propose` (no room for drafts) adds
    /// its one committed token's row to the next propose's stack. So `k` is always
    /// `position` less the previous propose's `position` (less `P - 1` after a
    /// `prefill_drafter` of `P` tokens).
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
    ) -> Result<Vec<u32>>;

    /// Trims the proposer's state after a verify that accepted `num_accepted` drafts.
    fn after_verify(
        &self,
        num_accepted: usize,
        state: &mut dyn ProposerState,
        stream: u64,
    ) -> Result<()>;

    /// [`Self::alloc_state`] given the sequence's token budget (prompt length plus
    /// max_tokens), so state that scales with context can be sized to the request.
    /// `usize::MAX` means unknown. The default ignores the budget.
    fn alloc_state_for(
        &self,
        gpu: &dyn GpuBackend,
        budget_tokens: usize,
    ) -> Result<Box<dyn ProposerState>> {
        let _ = budget_tokens;
        self.alloc_state(gpu)
    }

    /// The block size γ of a block-diffusion (DFlash) drafter; `None` for other proposers.
    ///
    /// The engine asks `Some(γ)` for `γ - 1` drafts a step (at least 1), whatever draft
    /// count it was built with, and reads it once, when it is built. Its adaptive policy may
    /// still verify fewer of them, and charges the drafting of any count the cost of one
    /// block forward.
    fn block_gamma(&self) -> Option<usize> {
        None
    }

    /// The target layers whose hidden states this proposer fuses (EAGLE-3, DFlash); empty
    /// (the default) for none, and then nothing is captured and nothing is paid for it.
    ///
    /// Id `i` names the residual stream after decoder layer `i` (0-based), before any final
    /// norm: the output of layer `i`. EAGLE-3's "hidden entering layer `k`" is id `k - 1`.
    /// Ids must be below the target's `num_hidden_layers` and distinct: the engine checks
    /// them once, when it is built, and refuses the proposer otherwise.
    ///
    /// For each named layer the engine passes the captured rows as BF16 `[rows, n *
    /// hidden_size]` (`n` ids, side by side in this order): to `propose` as
    /// `target_hidden_stack`, and to `prefill_drafter`, `catchup_drafter` and `catchup_batch`
    /// as `ctx.target_hidden_stack` (paired row for row with their `hiddens`); to
    /// `propose_batch` and `propose_tree_batch` as `ctx.target_hidden_stacks`, one per
    /// sequence.
    fn target_layer_ids(&self) -> Vec<usize> {
        Vec::new()
    }

    /// Rows of the prefill hidden capture this proposer can use, given the served
    /// `max_seq_len`; the model sizes that `[rows, hidden]` BF16 buffer from it. The default
    /// is `max_seq_len`. A smaller cap corrupts nothing: a longer prompt is not fully
    /// captured, so its drafter prefill is skipped, which costs acceptance.
    fn prefill_hidden_rows(&self, max_seq_len: usize) -> usize {
        max_seq_len
    }

    /// Whether this proposer's block is sharded across ranks, so its forward is given the
    /// communicator. The default is false.
    fn needs_comm(&self) -> bool {
        false
    }

    /// Whether this proposer's context prefill uses the shared forward scratch
    /// (`ctx.buffers`). If so, the model skips the prefill at the end of the target's
    /// prefill and runs it at the first propose instead. The default is false.
    fn prefill_uses_shared_buffers(&self) -> bool {
        false
    }

    /// Drafter KV rows held in `state`; 0 when unknown.
    fn drafter_rows(&self, _state: &mut dyn ProposerState) -> usize {
        0
    }

    /// Sequence-space pair key of the newest drafter row; `None` when untracked.
    fn last_pair_key(&self, _state: &mut dyn ProposerState) -> Option<usize> {
        None
    }

    /// Moves this sequence's drafter KV blocks out of its state, so `free_state` does not
    /// release them and the model can carry them to the next turn. Returns `(blocks, rows,
    /// last_pair_key)`, or `None` when unsupported or empty. Afterwards the state must behave
    /// as freshly allocated.
    fn take_drafter_kv(
        &self,
        _state: &mut dyn ProposerState,
    ) -> Option<(Vec<u32>, usize, Option<usize>)> {
        None
    }

    /// Installs carried blocks into a fresh state, the inverse of [`Self::take_drafter_kv`].
    /// Returns false when unsupported; the caller then still owns the blocks and must free them.
    fn install_drafter_kv(
        &self,
        _state: &mut dyn ProposerState,
        _blocks: Vec<u32>,
        _rows: usize,
        _last_pair_key: Option<usize>,
    ) -> bool {
        false
    }

    /// Releases drafter KV blocks that no proposer state owns.
    fn free_drafter_kv(&self, _blocks: &[u32]) {}

    /// Appends drafter rows at KV slots `row_base ..` with RoPE positions `pos_base ..` from
    /// `(tokens, hiddens)` pairs. Returns the rows written; the default writes none.
    fn catchup_drafter(
        &self,
        _tokens: &[u32],
        _hiddens: DevicePtr,
        _row_base: usize,
        _pos_base: usize,
        _state: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _stream: u64,
    ) -> Result<usize> {
        Ok(0)
    }

    /// Proposes `num_drafts` tokens for each of `last_tokens.len()` sequences at once.
    /// `Ok(None)` when unsupported, and the caller proposes per sequence.
    ///
    /// `out_conf`, when given, may be filled with one list per sequence: the probability
    /// the proposer puts on each of that sequence's drafts, one a draft, or an empty list
    /// for a sequence it reports nothing on. Left empty, nothing is reported.
    fn propose_batch(
        &self,
        _last_tokens: &[u32],
        _target_hiddens: &[DevicePtr],
        _positions: &[usize],
        _num_drafts: usize,
        _states: &mut [&mut dyn ProposerState],
        _ctx: &ForwardContext<'_>,
        _stream: u64,
        _out_conf: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        Ok(None)
    }

    /// The widest batch [`Self::propose_batch`] accepts; 1 means per-sequence only.
    fn propose_batch_max(&self, _buffers: &BufferArena, _config: &ModelConfig) -> usize {
        1
    }

    /// Proposes a tree of at most `budget` draft tokens rooted at `last_token`, with the
    /// same meaning of every other argument as [`Self::propose`]: each node's token is
    /// inside the vocabulary and allowed by `grammar_bitmask` when one is given, and each
    /// node's parent comes before it (see [`DraftTree`]). The default proposes a chain of
    /// `budget` drafts with `propose`, so every proposer can be asked for a tree.
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
    ) -> Result<DraftTree> {
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
        Ok(DraftTree::chain(drafts))
    }

    /// Proposes a tree of at most `budget` nodes for each of `last_tokens.len()` sequences
    /// at once: what [`Self::propose_tree`] would return for each, without a grammar mask
    /// or a deferred draft embedding. `Ok(None)` (the default) when unsupported, and the
    /// caller asks `propose_tree` per sequence. Captured layers come in
    /// `ctx.target_hidden_stacks`, one per sequence, as for [`Self::propose_batch`], whose
    /// width ([`Self::propose_batch_max`]) bounds this batch too.
    fn propose_tree_batch(
        &self,
        _last_tokens: &[u32],
        _target_hiddens: &[DevicePtr],
        _positions: &[usize],
        _budget: usize,
        _states: &mut [&mut dyn ProposerState],
        _ctx: &ForwardContext<'_>,
        _stream: u64,
    ) -> Result<Option<Vec<DraftTree>>> {
        Ok(None)
    }

    /// Whether [`Self::propose_tree`] grows trees that branch (the default's chain does
    /// not). The engine reads it once, when it is built: under its `"tree"` draft shape it
    /// asks such a proposer for trees, a group of sequences at a time through
    /// [`Self::propose_tree_batch`] where it batches (one at a time where it does not, and
    /// for a sequence under a grammar), and tells it the accepted path through
    /// [`Self::after_verify_tree`] when the tree branched.
    fn grows_trees(&self) -> bool {
        false
    }

    /// [`Self::after_verify`] after a `propose_tree` whose tree branched: `path` holds the
    /// accepted nodes (indices into the tree, root side first, each a child of the one
    /// before), the ones that entered the sequence. The target's KV already holds them as a
    /// chain would, right after the last verified token; a drafter with its own KV keeps the
    /// same path's rows. The default tells [`Self::after_verify`] the path's length, right
    /// for a proposer whose state does not depend on which nodes were drafted.
    fn after_verify_tree(
        &self,
        path: &[usize],
        state: &mut dyn ProposerState,
        stream: u64,
    ) -> Result<()> {
        self.after_verify(path.len(), state, stream)
    }

    /// Appends one drafter row per accepted draft of the last verify, for several
    /// sequences; called only with `ModelLevers::mtp_kv_exact` on. Returns the rows written;
    /// the default writes none.
    fn catchup_batch(
        &self,
        _tokens: &[Vec<u32>],
        _hiddens: &[Vec<DevicePtr>],
        _first_pos: &[usize],
        _states: &mut [&mut dyn ProposerState],
        _ctx: &ForwardContext<'_>,
        _stream: u64,
    ) -> Result<usize> {
        Ok(0)
    }

    /// Prefills the drafter's KV over the prompt before the sequence's first propose.
    /// `hiddens` is `[P, hidden_size]` BF16, row i the target's hidden for
    /// `prompt_tokens[i]` before the final norm. Returns the drafter rows written; the
    /// default writes none.
    fn prefill_drafter(
        &self,
        _prompt_tokens: &[u32],
        _hiddens: DevicePtr,
        _state: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _stream: u64,
    ) -> Result<usize> {
        Ok(0)
    }

    /// The draft token id the last propose with `draft_embed_target` left on the device;
    /// the default returns 0.
    fn read_deferred_draft_token(&self, _gpu: &dyn GpuBackend) -> Result<u32> {
        Ok(0)
    }

    /// Frees per-sequence proposer state when a sequence finishes; the default frees nothing.
    fn free_state(&self, _gpu: &dyn GpuBackend, _state: &mut dyn ProposerState) -> Result<()> {
        Ok(())
    }

    /// This proposer's draft head as the circuit executor binds it; `None` for a proposer
    /// the circuit does not model.
    fn circuit_draft(&self, _config: &ModelConfig, _levers: &ModelLevers) -> Option<DraftBinding> {
        None
    }

    /// Runs `runner` in place of the draft head's own forward from now on, or its own
    /// forward again with `None`. A proposer without a circuit binding ignores it.
    fn set_circuit_draft(&self, _runner: Option<Arc<dyn DraftRunner>>) {}
}
