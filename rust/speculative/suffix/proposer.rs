//! `SuffixDecoding`: its options, its shared outputs and the `DraftProposer` methods (the
//! per-sequence state is `state`'s).

use super::draft::{best_chain, Chain, ChainLimits};
use super::options::{invalid, SuffixDecodingOptions};
use super::shared::{SharedOutputs, SharedTreeStats};
use super::state::{state_of, SuffixState};
use super::tree::{best_tree, TreeDraft};
use super::trie::{SuffixTrie, MAX_NODES};
use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig};
use crate::speculative::{bitmask_allows, DraftProposer, DraftTree, ProposerError, ProposerState};
use crate::Result;
use std::sync::{Mutex, MutexGuard};

/// Drafting from suffix trees over the sequence's own prompt and output and over the
/// outputs of earlier sequences (see the module documentation).
#[derive(Debug)]
pub struct SuffixDecoding {
    options: SuffixDecodingOptions,
    shared: Mutex<SharedOutputs>,
    trees: bool,
}

impl Default for SuffixDecoding {
    fn default() -> Self {
        let options = SuffixDecodingOptions::default();
        SuffixDecoding {
            shared: Mutex::new(SharedOutputs::new(
                options.max_depth,
                options.max_tree_nodes,
            )),
            options,
            trees: false,
        }
    }
}

impl SuffixDecoding {
    /// A proposer with `options`, checked: each out-of-range option is an error naming it.
    pub fn new(options: SuffixDecodingOptions) -> std::result::Result<Self, ProposerError> {
        let o = options;
        o.check()?;
        Ok(SuffixDecoding {
            shared: Mutex::new(SharedOutputs::new(o.max_depth, o.max_tree_nodes)),
            options,
            trees: false,
        })
    }

    /// The same proposer, telling the engine (`grows_trees`) that it drafts trees when `on`:
    /// the continuations of its matched suffix most likely to be reached, best first, as
    /// SuffixDecoding's speculation trees (see `tree`).
    pub fn with_trees(mut self, on: bool) -> Self {
        self.trees = on;
        self
    }

    /// Whether it tells the engine it grows trees (see [`SuffixDecoding::with_trees`]).
    pub fn trees(&self) -> bool {
        self.trees
    }

    /// The options it was built with.
    pub fn options(&self) -> SuffixDecodingOptions {
        self.options
    }

    /// What the shared tree of earlier outputs holds now.
    pub fn shared_tree(&self) -> Result<SharedTreeStats> {
        Ok(self.lock("shared_tree")?.stats())
    }

    /// Adds `output` to the shared tree as if a sequence had just produced it (to seed the
    /// tree with text expected again). Evicts the oldest outputs beyond the bound.
    pub fn remember_output(&self, output: &[u32]) -> Result<()> {
        self.lock("remember_output")?.insert(output);
        Ok(())
    }

    fn lock(&self, method: &'static str) -> Result<MutexGuard<'_, SharedOutputs>> {
        self.shared.lock().map_err(|_| {
            ProposerError::Failed {
                method: method.into(),
                message: "the shared suffix tree is unusable: a thread panicked while updating it"
                    .into(),
            }
            .into()
        })
    }

    /// Prompt tokens stored before each output in the shared tree: half the tree's depth,
    /// so a match that long still leaves room for as many drafts.
    pub fn prompt_context(&self) -> usize {
        self.options.max_depth / 2
    }

    /// Longest history a sequence may have: its tree's node ids must stay below the limit.
    fn max_history(&self) -> usize {
        MAX_NODES / self.options.max_depth
    }

    fn check_room(&self, method: &'static str, len: usize) -> Result<()> {
        if len > self.max_history() {
            return Err(invalid(
                method,
                format!("a history of {len} tokens is longer than the {} a suffix tree of depth {} indexes", self.max_history(), self.options.max_depth),
            )
            .into());
        }
        Ok(())
    }

    fn limits(&self, num_drafts: usize) -> ChainLimits {
        ChainLimits {
            num_drafts,
            max_spec_factor: f64::from(self.options.max_spec_factor),
            min_token_prob: f64::from(self.options.min_token_prob),
        }
    }

    fn new_state(&self) -> SuffixState {
        SuffixState {
            tokens: Vec::new(),
            prompt_len: 0,
            trie: SuffixTrie::new(self.options.max_depth),
            cursors: Vec::new(),
            pending: Vec::new(),
            pending_parents: Vec::new(),
        }
    }

    /// Records `last_token` at `position` (the propose's first job) and forgets what was
    /// pending.
    fn record<'s>(
        &self,
        method: &'static str,
        last_token: u32,
        position: usize,
        state: &'s mut dyn ProposerState,
        vocab_size: usize,
    ) -> Result<&'s mut SuffixState> {
        if last_token as usize >= vocab_size {
            return Err(ProposerError::TokenOutOfVocab {
                method,
                token: u64::from(last_token),
                vocab_size,
            }
            .into());
        }
        let st = state_of(state, method)?;
        // `position` is where `last_token` sits: anything at or after it is a leftover of an
        // earlier propose from this point.
        st.truncate(position);
        self.check_room(method, st.tokens.len() + 1)?;
        st.push(last_token);
        st.pending.clear();
        st.pending_parents.clear();
        Ok(st)
    }

    /// Records `last_token` at `position` and drafts a tree of at most `budget` nodes from
    /// the better of the sequence's own trie and the shared one (the shared one only when
    /// strictly better); every node's token is inside the vocabulary and allowed by `mask`.
    fn propose_tree_one(
        &self,
        last_token: u32,
        position: usize,
        budget: usize,
        state: &mut dyn ProposerState,
        vocab_size: usize,
        mask: Option<&[i32]>,
    ) -> Result<DraftTree> {
        let mut shared = self.lock("propose_tree")?;
        let st = self.record("propose_tree", last_token, position, state, vocab_size)?;
        // Outputs stored by a sequence of another model may hold ids beyond this vocabulary.
        let keep = |t: u32| (t as usize) < vocab_size && mask.is_none_or(|m| bitmask_allows(m, t));
        let limits = self.limits(budget);
        let cursor = st.cursor();
        let own = best_tree(&mut st.trie, cursor, &limits, budget, &keep);
        let theirs = if shared.trie.live_nodes() == 0 {
            TreeDraft::default()
        } else {
            let tail = st.tokens.len().saturating_sub(self.options.max_depth - 1);
            let at = shared.trie.longest_suffix(&st.tokens[tail..]);
            best_tree(&mut shared.trie, at, &limits, budget, &keep)
        };
        let tree = if theirs.score > own.score {
            theirs
        } else {
            own
        };
        st.pending.clone_from(&tree.tokens);
        st.pending_parents.clone_from(&tree.parents);
        Ok(DraftTree {
            tokens: tree.tokens,
            parents: tree.parents,
            probs: Some(tree.step_probs.iter().map(|&p| p as f32).collect()),
        })
    }

    /// Records `last_token` at `position` and drafts from the better of the sequence's own
    /// tree and the shared one (the shared one only when strictly better). Returns the drafts
    /// and each one's probability given those before it.
    #[allow(clippy::too_many_arguments)]
    fn propose_one(
        &self,
        last_token: u32,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        vocab_size: usize,
        mask: Option<&[i32]>,
        shared: &mut SharedOutputs,
    ) -> Result<(Vec<u32>, Vec<f32>)> {
        let st = self.record("propose", last_token, position, state, vocab_size)?;
        if num_drafts == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let limits = self.limits(num_drafts);
        let cursor = st.cursor();
        let own = best_chain(&mut st.trie, cursor, &limits);
        let theirs = if shared.trie.live_nodes() == 0 {
            Chain::default()
        } else {
            let tail = st.tokens.len().saturating_sub(self.options.max_depth - 1);
            let at = shared.trie.longest_suffix(&st.tokens[tail..]);
            best_chain(&mut shared.trie, at, &limits)
        };
        let chain: Chain = if theirs.score > own.score {
            theirs
        } else {
            own
        };
        // Outputs stored by a sequence of another model may hold ids beyond this vocabulary.
        let keep = chain
            .tokens
            .iter()
            .take_while(|&&t| {
                (t as usize) < vocab_size && mask.is_none_or(|m| bitmask_allows(m, t))
            })
            .count();
        st.pending = chain.tokens[..keep].to_vec();
        let probs = chain.step_probs[..keep].iter().map(|&p| p as f32).collect();
        Ok((st.pending.clone(), probs))
    }
}

impl DraftProposer for SuffixDecoding {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(self.new_state()))
    }

    fn propose(
        &self,
        last_token: u32,
        _target_hidden: DevicePtr,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        _stream: u64,
        _draft_embed_target: Option<DevicePtr>,
        grammar_bitmask: Option<&[i32]>,
        _target_hidden_stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        let mut shared = self.lock("propose")?;
        let (drafts, _) = self.propose_one(
            last_token,
            position,
            num_drafts,
            state,
            ctx.config.vocab_size,
            grammar_bitmask,
            &mut shared,
        )?;
        Ok(drafts)
    }

    fn after_verify(
        &self,
        num_accepted: usize,
        state: &mut dyn ProposerState,
        _stream: u64,
    ) -> Result<()> {
        let st = state_of(state, "after_verify")?;
        if num_accepted > st.pending.len() {
            return Err(invalid(
                "after_verify",
                format!(
                    "{num_accepted} accepted, but only {} drafts were proposed",
                    st.pending.len()
                ),
            )
            .into());
        }
        self.check_room("after_verify", st.tokens.len() + num_accepted)?;
        for t in std::mem::take(&mut st.pending)
            .into_iter()
            .take(num_accepted)
        {
            st.push(t);
        }
        Ok(())
    }

    fn grows_trees(&self) -> bool {
        self.trees
    }

    fn propose_tree(
        &self,
        last_token: u32,
        _target_hidden: DevicePtr,
        position: usize,
        budget: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        _stream: u64,
        _draft_embed_target: Option<DevicePtr>,
        grammar_bitmask: Option<&[i32]>,
        _target_hidden_stack: Option<DevicePtr>,
    ) -> Result<DraftTree> {
        self.propose_tree_one(
            last_token,
            position,
            budget,
            state,
            ctx.config.vocab_size,
            grammar_bitmask,
        )
    }

    fn after_verify_tree(
        &self,
        path: &[usize],
        state: &mut dyn ProposerState,
        _stream: u64,
    ) -> Result<()> {
        let st = state_of(state, "after_verify_tree")?;
        if let Some(message) = DraftTree::path_fault(&st.pending_parents, st.pending.len(), path) {
            return Err(invalid("after_verify_tree", format!("path {path:?}: {message}")).into());
        }
        self.check_room("after_verify_tree", st.tokens.len() + path.len())?;
        let pending = std::mem::take(&mut st.pending);
        st.pending_parents.clear();
        for &i in path {
            st.push(pending[i]);
        }
        Ok(())
    }

    fn prefill_drafter(
        &self,
        prompt_tokens: &[u32],
        _hiddens: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        _stream: u64,
    ) -> Result<usize> {
        let vocab_size = ctx.config.vocab_size;
        if let Some(&t) = prompt_tokens.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(ProposerError::TokenOutOfVocab {
                method: "prefill_drafter",
                token: u64::from(t),
                vocab_size,
            }
            .into());
        }
        self.check_room("prefill_drafter", prompt_tokens.len())?;
        let st = state_of(state, "prefill_drafter")?;
        st.clear();
        for &t in prompt_tokens {
            st.push(t);
        }
        st.prompt_len = prompt_tokens.len();
        // Host-side trees only: no drafter KV rows are written.
        Ok(0)
    }

    fn free_state(&self, _gpu: &dyn GpuBackend, state: &mut dyn ProposerState) -> Result<()> {
        let st = state_of(state, "free_state")?;
        // The sequence's output joins the shared tree only now, when it is final: while a
        // sequence runs, the drafts of every other sequence depend on nothing but finished
        // ones, so proposing twice from the same point gives the same drafts. The prompt's
        // last tokens go in before it, so the same prompt again matches at length from its
        // first generated token instead of from a one-token match.
        if st.tokens.len() > st.prompt_len {
            let from = st.prompt_len.saturating_sub(self.prompt_context());
            self.lock("free_state")?.insert(&st.tokens[from..]);
        }
        st.clear();
        Ok(())
    }

    fn propose_batch(
        &self,
        last_tokens: &[u32],
        target_hiddens: &[DevicePtr],
        positions: &[usize],
        num_drafts: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        _stream: u64,
        out_conf: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        let n = last_tokens.len();
        if target_hiddens.len() != n || positions.len() != n || states.len() != n {
            return Err(invalid(
                "propose_batch",
                format!(
                    "slices differ in length: {n} last_tokens, {} target_hiddens, {} positions, {} states",
                    target_hiddens.len(),
                    positions.len(),
                    states.len()
                ),
            )
            .into());
        }
        let mut shared = self.lock("propose_batch")?;
        let mut drafts = Vec::with_capacity(n);
        let mut confs = Vec::with_capacity(n);
        for i in 0..n {
            let (d, c) = self.propose_one(
                last_tokens[i],
                positions[i],
                num_drafts,
                &mut *states[i],
                ctx.config.vocab_size,
                None,
                &mut shared,
            )?;
            drafts.push(d);
            confs.push(c);
        }
        if let Some(out) = out_conf {
            *out = confs;
        }
        Ok(Some(drafts))
    }

    fn propose_batch_max(&self, _buffers: &BufferArena, _config: &ModelConfig) -> usize {
        // Host-only work per sequence: no scratch limits the width.
        usize::MAX
    }
}
