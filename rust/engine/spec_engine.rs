//! `SpecEngine`: the speculative decoding loop, driving any [`DraftProposer`] (or none,
//! plain decoding) in the order the protocol specifies.
//!
//! Per request: `alloc_state_for(prompt + max_tokens)` → (install carried drafter KV) →
//! target prefill → `prefill_drafter` (or `catchup_drafter` after carried KV; deferred to
//! the first propose when `prefill_uses_shared_buffers()` or `defer_drafter_prefill`).
//! Per step, for all live sequences: `propose_batch` for groups of up to
//! `propose_batch_max` sequences without a grammar (per-sequence `propose` when it returns
//! `None` or fails, so a failure is pinned on its own sequence) → one verify forward of
//! `[last_token, drafts..]` per sequence (split only by the target's row limit) →
//! verification → `trim` of the rejected rows → `after_verify(num_accepted)` →
//! `catchup_batch` under `mtp_kv_exact`. At the end (or on any error) `take_drafter_kv`
//! when the caller carries KV, then `free_state`, and the target sequence is freed.
//!
//! MTP pairing: `propose` gets `last_token` at `position` with the hidden whose logits
//! picked it (the row before it); `prefill_drafter` gets the hidden of every prompt row.
//!
//! Layer capture: a proposer that names `target_layer_ids` (checked against the target when
//! the engine is built) gets the hiddens of those layers with the same pairing, stacked
//! `[rows, n * hidden]`: the rows of every token committed since its last propose as
//! `propose`'s `target_hidden_stack`, and the prompt's rows as `ctx.target_hidden_stack` of
//! `prefill_drafter` (see `stack`); in a `propose_batch`, each member's rows, as its
//! `propose` would get them, are `ctx.target_hidden_stacks`. A proposer that names none
//! costs nothing: no capture is asked of the target and no buffer is allocated for it.
//!
//! Draft trees: under the `Tree` draft shape (the default), a proposer whose `grows_trees()`
//! is true is asked `propose_tree` instead, per sequence, on greedy steps without a grammar,
//! with a target that verifies trees; the accepted path's KV is compacted and
//! `after_verify_tree` replaces `after_verify` when the tree branched (see `step_tree`).
//!
//! Block drafters: a proposer whose `block_gamma()` is `Some(γ)` is asked for `γ - 1`
//! drafts a step (at least 1): γ takes precedence over the `num_drafts` the engine is built
//! with, which is ignored for it.
//!
//! Invariants:
//! - A bad request ([`SpecEngine::check_request`]) never starts: it holds nothing and its
//!   result carries the request error.
//! - Requests are admitted in order by the scheduler ([`GenerationRun`]), at most
//!   `max_batch` at a time and only while the target's KV pool has room; a waiting request
//!   holds nothing.
//! - A failure ends only its own sequence (a failing `catchup_batch` ends its whole group,
//!   since the protocol cannot say which member failed), and is recorded with its request
//!   and stage, the layer's error kept as its source.
//! - Everything a sequence holds (proposer state, engine buffers, target KV, carried
//!   drafter KV that was not installed) is released exactly once, by `release`, however
//!   the sequence ended.
//! - A result's tokens are exactly the tokens emitted after its prompt.

use super::draft_policy::{DraftPolicy, DraftPolicyKind};
use super::guard::PanicGuard;
use super::ranks::proposer::AnnouncedProposer;
use super::{
    CarriedKv, Conversation, CostModel, DraftShape, EngineError, GenerateRequest, Generation,
    GenerationRun, KvPoolStatus, Target,
};
use crate::model::ModelLevers;
use crate::speculative::mtp::DRAFTER_BLOCK_SIZE;
use crate::speculative::{DraftProposer, MtpHead};
use crate::Result;
use std::sync::Arc;

/// Reports the drafter's KV pool (see [`SpecEngine::with_drafter_pool`]).
pub type DrafterPoolProbe = Arc<dyn Fn() -> KvPoolStatus + Send + Sync>;

/// A probe of a drafter KV pool of `block_size` rows a block, whose `(total, free)` blocks
/// `blocks` reports.
pub fn drafter_pool_probe(
    block_size: usize,
    blocks: impl Fn() -> (usize, usize) + Send + Sync + 'static,
) -> DrafterPoolProbe {
    Arc::new(move || {
        let (num_blocks, num_free) = blocks();
        KvPoolStatus {
            block_size,
            num_blocks,
            num_free,
        }
    })
}

/// The probe of an [`MtpHead`]'s drafter KV pool.
pub fn mtp_pool_probe(head: Arc<MtpHead>) -> DrafterPoolProbe {
    drafter_pool_probe(DRAFTER_BLOCK_SIZE, move || head.kv_blocks())
}

/// The speculative decoding engine over one target and at most one proposer.
///
/// One `generate` at a time per target: the target's outputs are valid only until its next
/// forward, so callers that share a target across threads serialise their calls (the
/// Python binding does).
pub struct SpecEngine<T: Target> {
    pub(super) target: Arc<T>,
    pub(super) proposer: Option<Arc<dyn DraftProposer>>,
    pub(super) num_drafts: usize,
    pub(super) levers: ModelLevers,
    pub(super) max_batch: usize,
    pub(super) max_batch_tokens: usize,
    pub(super) drafter_pool: Option<DrafterPoolProbe>,
    pub(super) draft_policy: DraftPolicy,
    /// The proposer's `target_layer_ids`, read once (empty: no capture).
    pub(super) capture_layers: Arc<[usize]>,
    /// The draft shape asked for.
    pub(super) draft_shape: DraftShape,
    /// Whether steps ask for trees: the shape is `Tree`, the proposer grows them and the
    /// target verifies them.
    pub(super) trees: bool,
}

impl<T: Target> Clone for SpecEngine<T> {
    fn clone(&self) -> Self {
        SpecEngine {
            target: self.target.clone(),
            proposer: self.proposer.clone(),
            num_drafts: self.num_drafts,
            levers: self.levers,
            max_batch: self.max_batch,
            max_batch_tokens: self.max_batch_tokens,
            drafter_pool: self.drafter_pool.clone(),
            draft_policy: self.draft_policy.clone(),
            capture_layers: self.capture_layers.clone(),
            draft_shape: self.draft_shape,
            trees: self.trees,
        }
    }
}

impl<T: Target> SpecEngine<T> {
    /// An engine drafting up to `num_drafts` tokens a step with `proposer` (`None`: plain
    /// decoding, one token per forward). Levers default to off.
    ///
    /// A block drafter (`block_gamma()` is `Some(γ)`) drafts `γ - 1` tokens a step, at least
    /// one, whatever `num_drafts` says. The proposer's `target_layer_ids` are checked here
    /// against the target (each below its layer count, none twice, a target that can
    /// capture): a bad list is an error naming the id and the layer count.
    pub fn new(
        target: Arc<T>,
        proposer: Option<Arc<dyn DraftProposer>>,
        num_drafts: usize,
    ) -> Result<Self> {
        // On rank 0 of several, a proposer sharded across the ranks has each of its forwards
        // announced, so the workers run it too (see `ranks`).
        let proposer = proposer.map(|p| match target.leader_comm() {
            Some(comm) if p.needs_comm() => {
                Arc::new(AnnouncedProposer { inner: p, comm }) as Arc<dyn DraftProposer>
            }
            _ => p,
        });
        // Every call into the proposer goes through the guard, so a panic in it ends only
        // the sequence the call was for.
        let proposer = proposer.map(|p| Arc::new(PanicGuard(p)) as Arc<dyn DraftProposer>);
        let gamma = proposer.as_ref().and_then(|p| p.block_gamma());
        let num_drafts = gamma.map_or(num_drafts, |g| g.saturating_sub(1).max(1));
        if proposer.is_some() && num_drafts == 0 {
            return Err(EngineError::InvalidArgument {
                what: "num_drafts",
                message: "0 with a proposer (it must be at least 1)".into(),
            }
            .into());
        }
        let layers = proposer
            .as_ref()
            .map(|p| p.target_layer_ids())
            .unwrap_or_default();
        target
            .check_capture(&layers)
            .map_err(|message| EngineError::InvalidArgument {
                what: "target_layer_ids",
                message,
            })?;
        let trees = proposer.as_ref().is_some_and(|p| p.grows_trees()) && target.supports_trees();
        Ok(SpecEngine {
            target,
            proposer,
            num_drafts,
            levers: ModelLevers::default(),
            max_batch: usize::MAX,
            max_batch_tokens: usize::MAX,
            drafter_pool: None,
            draft_policy: DraftPolicy::default().for_block_drafter(gamma.is_some()),
            capture_layers: layers.into(),
            draft_shape: DraftShape::Tree,
            trees,
        })
    }

    /// The same engine asking its proposer for drafts of `shape`: `Tree` (the default)
    /// asks a proposer that grows trees for one each step, when the target verifies trees,
    /// greedy or sampled, with a grammar or without; `Chain` always asks `propose`.
    pub fn with_draft_shape(mut self, shape: DraftShape) -> Self {
        self.draft_shape = shape;
        self.trees = shape == DraftShape::Tree
            && self.proposer.as_ref().is_some_and(|p| p.grows_trees())
            && self.target.supports_trees();
        self
    }

    /// The draft shape asked for (see [`SpecEngine::with_draft_shape`]).
    pub fn draft_shape(&self) -> DraftShape {
        self.draft_shape
    }

    /// Whether steps draft trees: the shape is `Tree`, the proposer grows trees and the
    /// target verifies them.
    pub fn drafts_trees(&self) -> bool {
        self.trees
    }

    /// The same engine with `levers`.
    pub fn with_levers(mut self, levers: ModelLevers) -> Self {
        self.levers = levers;
        self
    }

    /// The same engine running at most `max_batch` sequences at once (at least 1); the
    /// others wait and start as running ones finish (the KV pool bounds them too).
    pub fn with_max_batch(mut self, max_batch: usize) -> Self {
        self.max_batch = max_batch.max(1);
        self
    }

    /// The same engine putting at most `max_batch_tokens` rows (at least 1) in one forward:
    /// verify forwards split at it and long prompts are prefilled in chunks of it. The
    /// target's own row limit applies as well.
    pub fn with_max_batch_tokens(mut self, max_batch_tokens: usize) -> Self {
        self.max_batch_tokens = max_batch_tokens.max(1);
        self
    }

    /// The same engine admitting a request only while `probe` reports free drafter KV blocks
    /// for its prompt and a step's rows (when other sequences are running). A drafter whose
    /// pool runs short drafts less; this keeps it from running short.
    pub fn with_drafter_pool(mut self, probe: DrafterPoolProbe) -> Self {
        self.drafter_pool = Some(probe);
        self
    }

    /// Most running sequences.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Most rows in one forward (the target's limit included).
    pub fn max_batch_tokens(&self) -> usize {
        self.forward_rows()
    }

    /// The same engine choosing draft counts by `kind` (adaptive by default); the cost
    /// model and the running acceptance figures start afresh.
    pub fn with_draft_policy(mut self, kind: DraftPolicyKind) -> Self {
        let block = self.draft_policy.block_drafter;
        self.draft_policy =
            DraftPolicy::new(kind, self.draft_policy.cost.clone()).for_block_drafter(block);
        self
    }

    /// The same engine reading the adaptive policy's costs from `cost` (by default, what
    /// it measures as it runs); the running acceptance figures start afresh.
    pub fn with_cost_model(mut self, cost: Arc<dyn CostModel>) -> Self {
        let block = self.draft_policy.block_drafter;
        self.draft_policy = DraftPolicy::new(self.draft_policy.kind, cost).for_block_drafter(block);
        self
    }

    /// The rule that picks each step's draft count.
    pub fn draft_policy(&self) -> DraftPolicyKind {
        self.draft_policy.kind
    }

    /// The target model.
    pub fn target(&self) -> &Arc<T> {
        &self.target
    }

    /// The proposer, if any (behind the engine's panic guard).
    pub fn proposer(&self) -> Option<&Arc<dyn DraftProposer>> {
        self.proposer.as_ref()
    }

    /// The target layers captured for the proposer (its `target_layer_ids`; empty: none).
    pub fn capture_layers(&self) -> &[usize] {
        &self.capture_layers
    }

    /// Most drafts per step (`γ - 1` for a block drafter).
    pub fn num_drafts(&self) -> usize {
        self.num_drafts
    }

    /// The levers in force.
    pub fn levers(&self) -> ModelLevers {
        self.levers
    }

    /// A multi-turn conversation on this engine.
    pub fn conversation(&self) -> Conversation<T> {
        Conversation::new(self.clone())
    }

    /// Generates every request, all sequences stepping together. Per-request problems (bad
    /// prompt, a request the KV pool can never hold, failing proposer) end only that request
    /// and are reported in its result.
    pub fn generate(&self, requests: Vec<GenerateRequest>) -> Generation {
        self.run(requests, Vec::new(), false).0
    }

    /// A generation of `requests` to be stepped by the caller (for streaming): see
    /// [`GenerationRun`].
    pub fn begin(&self, requests: Vec<GenerateRequest>) -> GenerationRun<T> {
        GenerationRun::new(self.clone(), requests, Vec::new(), false)
    }

    /// A long-lived run with no requests yet, to which requests are submitted and from
    /// which they are cancelled between steps (see [`GenerationRun::submit`]).
    pub fn serve(&self) -> GenerationRun<T> {
        self.begin(Vec::new())
    }

    pub(super) fn max_rows(&self) -> usize {
        match self.target.buffers().max_rows() {
            0 => usize::MAX,
            m => m,
        }
    }

    /// Most rows in one forward: the target's limit and `max_batch_tokens`.
    pub(super) fn forward_rows(&self) -> usize {
        self.max_rows().min(self.max_batch_tokens).max(1)
    }

    pub(super) fn row_bytes(&self) -> usize {
        self.target.config().hidden_size * 2
    }

    pub(super) fn deferred_prefill(&self) -> bool {
        self.levers.defer_drafter_prefill
            || self
                .proposer
                .as_ref()
                .is_some_and(|p| p.prefill_uses_shared_buffers())
    }

    /// The generation loop; `carry_in[i]` is request `i`'s carried drafter KV, and with
    /// `want_carry` each finished sequence's drafter KV is taken and returned.
    pub(super) fn run(
        &self,
        requests: Vec<GenerateRequest>,
        carry_in: Vec<Option<CarriedKv>>,
        want_carry: bool,
    ) -> (Generation, Vec<Option<CarriedKv>>) {
        GenerationRun::new(self.clone(), requests, carry_in, want_carry).run_to_end()
    }
}
