//! The `DraftProposer` protocol: three required methods and twenty-four provided ones, with the
//! defaults the specification documents (`target_layer_ids`, which the specification does
//! not have, asks the engine for the target hiddens of chosen layers).
//!
//! The engine drives a proposer in this order: `alloc_state_for` → `prefill_drafter` →
//! (`propose` | `propose_batch` | `propose_tree` | `propose_tree_batch`) → verify → `after_verify` (+ `catchup_batch` under
//! `ModelLevers::mtp_kv_exact`) → `take_drafter_kv` / `install_drafter_kv` between turns →
//! `free_state`. Hidden states at these seams are BF16 `[rows, hidden_size]`; token ids are
//! `u32`; `DevicePtr` has no `Drop`, so whatever `alloc_state` allocates is freed in
//! `free_state` or leaks.
//!
//! [`ProtocolMethod`] is the one list of the protocol's method names: the Python bindings
//! (the base class, the adapter for Python proposers, `specdraft.PROTOCOL_METHODS`) take
//! them from it, each name is checked at compile time to be a method of the trait, and a
//! test checks that the trait has no method the list lacks.
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

use crate::backend::{DevicePtr, Dtype, GpuBackend};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig, ModelLevers};
use crate::speculative::DraftTree;
use crate::Result;
use std::any::Any;
use std::sync::Arc;

/// Hands the protocol's method list to the macro `$callback`: one entry per method, in the
/// specification's order (the three required methods first), as
/// `Variant => fn name(argument: Type, ...) -> Return, answer;`.
///
/// `answer` is `fallible` for a method that reports failure through its `Result`, and
/// `default(VALUE)` for one without an error channel: `VALUE` is what the protocol's default
/// returns, the answer when the method cannot run. Every place that must name each method
/// ([`ProtocolMethod`], the engine's panic guard, the adapter for Python proposers) is
/// written from this list, so a new method is one entry here and one in the trait. A
/// signature that differs from the trait's does not compile where it implements the trait.
macro_rules! with_protocol_methods {
    ($callback:ident) => {
        $callback! {
            AllocState => fn alloc_state(
                gpu: &dyn $crate::backend::GpuBackend,
            ) -> $crate::Result<Box<dyn $crate::speculative::ProposerState>>, fallible;
            Propose => fn propose(
                last_token: u32,
                target_hidden: $crate::backend::DevicePtr,
                position: usize,
                num_drafts: usize,
                state: &mut dyn $crate::speculative::ProposerState,
                ctx: &$crate::model::ForwardContext<'_>,
                stream: u64,
                draft_embed_target: Option<$crate::backend::DevicePtr>,
                grammar_bitmask: Option<&[i32]>,
                target_hidden_stack: Option<$crate::backend::DevicePtr>,
            ) -> $crate::Result<Vec<u32>>, fallible;
            AfterVerify => fn after_verify(
                num_accepted: usize,
                state: &mut dyn $crate::speculative::ProposerState,
                stream: u64,
            ) -> $crate::Result<()>, fallible;
            AllocStateFor => fn alloc_state_for(
                gpu: &dyn $crate::backend::GpuBackend,
                budget_tokens: usize,
            ) -> $crate::Result<Box<dyn $crate::speculative::ProposerState>>, fallible;
            BlockGamma => fn block_gamma() -> Option<usize>, default(None);
            TargetLayerIds => fn target_layer_ids() -> Vec<usize>, default(Vec::new());
            PrefillHiddenRows => fn prefill_hidden_rows(max_seq_len: usize) -> usize,
                default(max_seq_len);
            NeedsComm => fn needs_comm() -> bool, default(false);
            PrefillUsesSharedBuffers => fn prefill_uses_shared_buffers() -> bool, default(false);
            DrafterRows => fn drafter_rows(
                state: &mut dyn $crate::speculative::ProposerState,
            ) -> usize, default(0);
            LastPairKey => fn last_pair_key(
                state: &mut dyn $crate::speculative::ProposerState,
            ) -> Option<usize>, default(None);
            TakeDrafterKv => fn take_drafter_kv(
                state: &mut dyn $crate::speculative::ProposerState,
            ) -> Option<(Vec<u32>, usize, Option<usize>)>, default(None);
            InstallDrafterKv => fn install_drafter_kv(
                state: &mut dyn $crate::speculative::ProposerState,
                blocks: Vec<u32>,
                rows: usize,
                last_pair_key: Option<usize>,
            ) -> bool, default(false);
            FreeDrafterKv => fn free_drafter_kv(blocks: &[u32]) -> (), default(());
            CatchupDrafter => fn catchup_drafter(
                tokens: &[u32],
                hiddens: $crate::backend::DevicePtr,
                row_base: usize,
                pos_base: usize,
                state: &mut dyn $crate::speculative::ProposerState,
                ctx: &$crate::model::ForwardContext<'_>,
                stream: u64,
            ) -> $crate::Result<usize>, fallible;
            ProposeBatch => fn propose_batch(
                last_tokens: &[u32],
                target_hiddens: &[$crate::backend::DevicePtr],
                positions: &[usize],
                num_drafts: usize,
                states: &mut [&mut dyn $crate::speculative::ProposerState],
                ctx: &$crate::model::ForwardContext<'_>,
                stream: u64,
                out_conf: Option<&mut Vec<Vec<f32>>>,
            ) -> $crate::Result<Option<Vec<Vec<u32>>>>, fallible;
            ProposeBatchMax => fn propose_batch_max(
                buffers: &$crate::memory::BufferArena,
                config: &$crate::model::ModelConfig,
            ) -> usize, default(1);
            ProposeTree => fn propose_tree(
                last_token: u32,
                target_hidden: $crate::backend::DevicePtr,
                position: usize,
                budget: usize,
                state: &mut dyn $crate::speculative::ProposerState,
                ctx: &$crate::model::ForwardContext<'_>,
                stream: u64,
                draft_embed_target: Option<$crate::backend::DevicePtr>,
                grammar_bitmask: Option<&[i32]>,
                target_hidden_stack: Option<$crate::backend::DevicePtr>,
            ) -> $crate::Result<$crate::speculative::DraftTree>, fallible;
            ProposeTreeBatch => fn propose_tree_batch(
                last_tokens: &[u32],
                target_hiddens: &[$crate::backend::DevicePtr],
                positions: &[usize],
                budget: usize,
                states: &mut [&mut dyn $crate::speculative::ProposerState],
                ctx: &$crate::model::ForwardContext<'_>,
                stream: u64,
            ) -> $crate::Result<Option<Vec<$crate::speculative::DraftTree>>>, fallible;
            GrowsTrees => fn grows_trees() -> bool, default(false);
            AfterVerifyTree => fn after_verify_tree(
                path: &[usize],
                state: &mut dyn $crate::speculative::ProposerState,
                stream: u64,
            ) -> $crate::Result<()>, fallible;
            CatchupBatch => fn catchup_batch(
                tokens: &[Vec<u32>],
                hiddens: &[Vec<$crate::backend::DevicePtr>],
                first_pos: &[usize],
                states: &mut [&mut dyn $crate::speculative::ProposerState],
                ctx: &$crate::model::ForwardContext<'_>,
                stream: u64,
            ) -> $crate::Result<usize>, fallible;
            PrefillDrafter => fn prefill_drafter(
                prompt_tokens: &[u32],
                hiddens: $crate::backend::DevicePtr,
                state: &mut dyn $crate::speculative::ProposerState,
                ctx: &$crate::model::ForwardContext<'_>,
                stream: u64,
            ) -> $crate::Result<usize>, fallible;
            ReadDeferredDraftToken => fn read_deferred_draft_token(
                gpu: &dyn $crate::backend::GpuBackend,
            ) -> $crate::Result<u32>, fallible;
            FreeState => fn free_state(
                gpu: &dyn $crate::backend::GpuBackend,
                state: &mut dyn $crate::speculative::ProposerState,
            ) -> $crate::Result<()>, fallible;
            CircuitDraft => fn circuit_draft(
                config: &$crate::model::ModelConfig,
                levers: &$crate::model::ModelLevers,
            ) -> Option<$crate::speculative::DraftBinding>, default(None);
            SetCircuitDraft => fn set_circuit_draft(
                runner: Option<std::sync::Arc<dyn $crate::speculative::DraftRunner>>,
            ) -> (), default(());
        }
    };
}
pub(crate) use with_protocol_methods;

/// Declares [`ProtocolMethod`] from the method list.
macro_rules! declare_protocol_method {
    ($($variant:ident => fn $name:ident ($($args:tt)*) -> $ret:ty, $answer:ident $(($default:expr))?;)+) => {
        /// One method of the [`DraftProposer`] protocol.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum ProtocolMethod {
            $(
                #[doc = concat!("`", stringify!($name), "`")]
                $variant,
            )+
        }

        impl ProtocolMethod {
            /// How many methods the protocol has.
            pub const COUNT: usize = [$(stringify!($name)),+].len();
            /// Every method, in the specification's order.
            pub const ALL: [ProtocolMethod; ProtocolMethod::COUNT] = [$(ProtocolMethod::$variant),+];
            /// Every method's name, in the same order.
            pub const NAMES: [&'static str; ProtocolMethod::COUNT] = [$(stringify!($name)),+];
        }

        // Each name must be a method of the trait: a typo does not compile.
        const _: () = {
            #[allow(dead_code)]
            fn every_name_is_a_trait_method() {
                $(let _ = <dyn DraftProposer as DraftProposer>::$name;)+
            }
        };
    };
}

with_protocol_methods!(declare_protocol_method);

impl ProtocolMethod {
    /// How many of the methods (the first ones) a proposer must implement.
    pub const REQUIRED: usize = 3;

    /// The method's name, as in the trait and in Python.
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// Its position in [`ProtocolMethod::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Whether every proposer must implement it (it has no default).
    pub fn is_required(self) -> bool {
        self.index() < Self::REQUIRED
    }
}

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

/// One weight of a draft head as the circuit executor binds it.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightSlot {
    /// The slot's name (`"eh_proj"`, `"layer.self_attn.q_proj"`, ...).
    pub name: String,
    /// Where the weight lives.
    pub ptr: DevicePtr,
    /// Element type of `ptr` (`U8` for packed NVFP4 codes).
    pub dtype: Dtype,
    /// Logical shape, outermost first.
    pub shape: Vec<usize>,
    /// Per-block scales (NVFP4's FP8 `weight_scale`), when quantized.
    pub block_scale: Option<DevicePtr>,
    /// The tensor-wide scale (NVFP4's `weight_scale_2`), when quantized.
    pub global_scale: Option<f32>,
}

/// A draft head described completely enough for a [`DraftRunner`] to run its forward.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftBinding {
    /// What kind of head this is (`"mtp:deepseek_v3"`, ...).
    pub kind: String,
    /// Every weight, by slot.
    pub weights: Vec<WeightSlot>,
    /// Model width.
    pub hidden_size: usize,
    /// Query heads of the head's attention.
    pub num_attention_heads: usize,
    /// Key/value heads.
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// RoPE base.
    pub rope_theta: f32,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Full vocabulary.
    pub vocab_size: usize,
    /// Rows of the LM head the drafts are chosen from (0: all).
    pub draft_vocab_size: usize,
    /// Rows per drafter KV block.
    pub kv_block_size: usize,
    /// Blocks in the drafter's KV pool.
    pub kv_num_blocks: usize,
    /// The key cache, `[kv_num_blocks, kv_block_size, num_key_value_heads, head_dim]` BF16.
    pub k_cache: DevicePtr,
    /// The value cache, same shape.
    pub v_cache: DevicePtr,
}

/// Runs a draft head's forward in place of the head's own (see
/// [`DraftProposer::set_circuit_draft`]).
pub trait DraftRunner: Send + Sync {
    /// Drafts `num_drafts` tokens for one sequence from the binding's weights, with the same
    /// meaning of every argument as [`DraftProposer::propose`], writing the drafter KV row of
    /// each step it runs. With a `grammar_bitmask`, every draft is a token whose bit is set,
    /// and the run ends at the first step whose mask allows no token of the draft
    /// vocabulary: that step's row is written, but no token drafted for it (so a run returns
    /// fewer than `num_drafts` tokens only when it ended that way).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        binding: &DraftBinding,
        last_token: u32,
        target_hidden: DevicePtr,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        grammar_bitmask: Option<&[i32]>,
    ) -> Result<Vec<u32>>;
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

#[cfg(test)]
mod tests {
    use super::ProtocolMethod;

    /// The method names of `trait DraftProposer` in this file, in order.
    fn trait_methods() -> Vec<String> {
        let source = include_str!("protocol.rs");
        let start = source
            .find("pub trait DraftProposer")
            .expect("the trait is defined here");
        let body = &source[start..];
        let end = body.find("\n}\n").expect("the trait ends");
        body[..end]
            .lines()
            .filter_map(|line| line.trim_start().strip_prefix("fn "))
            .map(|rest| rest.split(['(', '<']).next().unwrap_or("").to_string())
            .collect()
    }

    #[test]
    fn the_method_list_is_the_trait_in_order() {
        let names: Vec<&str> = ProtocolMethod::NAMES.to_vec();
        assert_eq!(trait_methods(), names);
        assert_eq!(ProtocolMethod::COUNT, 27);
        assert_eq!(
            ProtocolMethod::ALL[..ProtocolMethod::REQUIRED]
                .iter()
                .map(|m| m.name())
                .collect::<Vec<_>>(),
            ["alloc_state", "propose", "after_verify"]
        );
        for (i, m) in ProtocolMethod::ALL.iter().enumerate() {
            assert_eq!(m.index(), i);
            assert_eq!(m.is_required(), i < 3);
        }
    }
}
