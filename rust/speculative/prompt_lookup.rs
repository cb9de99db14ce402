//! `PromptLookup`: n-gram drafting from the prompt and everything generated so far.
//!
//! The proposer keeps each sequence's token history on the host. It learns the prompt in
//! `prefill_drafter`, each verified token from `propose`'s `last_token` (placed at
//! `position`, so proposing twice from the same point is idempotent), and the accepted
//! drafts in `after_verify`. To draft, it takes the longest suffix of the history (from
//! `max_ngram` down to `min_ngram` tokens) that occurred earlier, picks the most recent
//! earlier occurrence, and proposes the tokens that followed it: one draft for each token
//! the occurrence matches (counting back past `max_ngram` while the tokens before both
//! still agree), up to `num_drafts`, so a long repeated passage is drafted in full while a
//! two-token coincidence risks only two verify rows.
//!
//! The history lives in an n-gram index (`index::NgramIndex`) updated as tokens arrive and as a
//! re-propose takes them back, so a lookup costs the same at any history length.
//!
//! As a tree proposer (`propose_tree`) it drafts several matches: the continuations of the
//! most recent earlier occurrences of that suffix (up to [`TREE_OCCURRENCES`]), each as long
//! as its own occurrence matches, merged where they share a prefix into one tree rooted at
//! the last token. The first branch is exactly `propose`'s chain and the others take what
//! is left of the node budget, so the tree accepts at least what the chain would. It tells
//! the engine it grows trees only when built [`PromptLookup::with_trees`]: see there for
//! why chains stay the default.
//!
//! It allocates no device memory, so its state needs no freeing beyond being dropped.

mod index;

use super::{bitmask_allows, DraftProposer, DraftTree, ProposerError, ProposerState};
use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig};
use crate::Result;
use index::NgramIndex;

/// Per-sequence history of [`PromptLookup`].
#[derive(Debug, Clone)]
pub struct PromptLookupState {
    history: NgramIndex,
    /// The drafts of the last propose, until `after_verify` says how many were kept.
    pub pending: Vec<u32>,
    /// The parent of each of `pending` when the last propose was a tree (empty for a chain).
    pending_parents: Vec<Option<usize>>,
}

impl PromptLookupState {
    /// Prompt and verified tokens, in sequence order.
    pub fn history(&self) -> &[u32] {
        self.history.tokens()
    }
}

crate::impl_proposer_state!(PromptLookupState);

/// N-gram lookup over the prompt and the output so far.
#[derive(Debug, Clone)]
pub struct PromptLookup {
    min_ngram: usize,
    max_ngram: usize,
    trees: bool,
}

/// Suffixes of 2 to 4 tokens. A single-token match drafts on almost every step, and on
/// text that does not repeat those drafts are mostly rejected while their verify rows still
/// cost time: on SmolLM2 with the built-in prompts (`specdraft bench`, one command, CPU),
/// min 1 gave a 1.13x speedup (0.82x on open questions), min 2 gave 1.41x (1.53x on
/// input-grounded prompts, 1.23x on open questions). Those figures were measured while
/// every match drafted `num_drafts` (4) tokens, before the draft length followed the match
/// length.
pub const DEFAULT_MIN_NGRAM: usize = 2;
/// See [`DEFAULT_MIN_NGRAM`].
pub const DEFAULT_MAX_NGRAM: usize = 4;

/// Earlier occurrences of the matched suffix a tree drafts from, most recent first.
pub const TREE_OCCURRENCES: usize = 8;

/// Matched tokens counted, at least, for [`match_confidence`].
pub const CONFIDENCE_MATCH: usize = 8;

/// The confidence `propose_batch` reports for each draft continuing a match of `matched`
/// tokens: `matched / (matched + 1)`. A lookup's drafts are not random, so this is no
/// probability; it is below one and grows with the match so that the engine's calibration
/// (acceptance measured by draft position and reported confidence) learns how often drafts
/// from short matches are accepted on the running text, and drops them where they would not
/// pay for their verify rows (a two-token coincidence in open-ended text).
pub fn match_confidence(matched: usize) -> f32 {
    let m = matched as f32;
    m / (m + 1.0)
}

impl Default for PromptLookup {
    fn default() -> Self {
        PromptLookup {
            min_ngram: DEFAULT_MIN_NGRAM,
            max_ngram: DEFAULT_MAX_NGRAM,
            trees: false,
        }
    }
}

fn state_of<'s>(
    state: &'s mut dyn ProposerState,
    method: &'static str,
) -> Result<&'s mut PromptLookupState> {
    state
        .as_any_mut()
        .downcast_mut::<PromptLookupState>()
        .ok_or_else(|| {
            ProposerError::WrongState {
                method,
                expected: "PromptLookupState",
            }
            .into()
        })
}

fn check_vocab(method: &'static str, tokens: &[u32], vocab_size: usize) -> Result<()> {
    match tokens.iter().find(|&&t| t as usize >= vocab_size) {
        Some(&t) => Err(ProposerError::TokenOutOfVocab {
            method,
            token: t as u64,
            vocab_size,
        }
        .into()),
        None => Ok(()),
    }
}

impl PromptLookup {
    /// Matches suffixes of `min_ngram ..= max_ngram` tokens (both at least 1).
    pub fn new(min_ngram: usize, max_ngram: usize) -> std::result::Result<Self, ProposerError> {
        if min_ngram == 0 || max_ngram < min_ngram {
            return Err(ProposerError::InvalidArgument {
                method: "PromptLookup::new",
                message: format!("need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}"),
            });
        }
        Ok(PromptLookup {
            min_ngram,
            max_ngram,
            trees: false,
        })
    }

    /// The same proposer, telling the engine (`grows_trees`) that it drafts trees when `on`.
    ///
    /// Off by default, because on SmolLM2 (CPU, greedy, the bench prompts, 4 drafts, one
    /// command, alternating rounds) trees did not pay: at one sequence a time they ran at
    /// 1.00x the chain's speed on grounded prompts and 1.03x on open ones (mean acceptance
    /// length 2.67 against 2.66: long matches fill the budget with the chain), and at
    /// `max_batch` 4 at 0.96x and 0.91x (their extra nodes are verify rows, and a tree is
    /// proposed per sequence, without `propose_batch`'s confidences for the policy to cut).
    pub fn with_trees(mut self, on: bool) -> Self {
        self.trees = on;
        self
    }

    /// Whether it tells the engine it grows trees (see [`PromptLookup::with_trees`]).
    pub fn trees(&self) -> bool {
        self.trees
    }

    /// Shortest suffix it matches.
    pub fn min_ngram(&self) -> usize {
        self.min_ngram
    }

    /// Longest suffix it matches.
    pub fn max_ngram(&self) -> usize {
        self.max_ngram
    }

    /// The drafts for `history` without any state: what `propose` drafts for a sequence
    /// whose history this is.
    pub fn lookup(&self, history: &[u32], num_drafts: usize, mask: Option<&[i32]>) -> Vec<u32> {
        let mut index = NgramIndex::new(self.min_ngram, self.max_ngram);
        for &t in history {
            index.push(t);
        }
        Self::draft(&index, num_drafts, mask)
    }

    /// The continuation of the most recent earlier occurrence of the history's longest
    /// matching suffix: as many tokens as the occurrence matches (at most `num_drafts`),
    /// cut before the first token `mask` forbids.
    fn draft(index: &NgramIndex, num_drafts: usize, mask: Option<&[i32]>) -> Vec<u32> {
        Self::draft_matched(index, num_drafts, mask).0
    }

    /// [`Self::draft`]'s drafts and the tokens the occurrence matches (counted up to
    /// `num_drafts` or [`CONFIDENCE_MATCH`], whichever is more, so the count does not
    /// depend on how many drafts a step asked for below that).
    fn draft_matched(
        index: &NgramIndex,
        num_drafts: usize,
        mask: Option<&[i32]>,
    ) -> (Vec<u32>, usize) {
        let Some((start, n)) = index.longest_match() else {
            return (Vec::new(), 0);
        };
        Self::continuation(index, start, n, num_drafts, mask)
    }

    /// The drafts following the occurrence of the history's last `n` tokens at `start`,
    /// and the tokens it matches (see [`Self::draft_matched`]).
    fn continuation(
        index: &NgramIndex,
        start: usize,
        n: usize,
        num_drafts: usize,
        mask: Option<&[i32]>,
    ) -> (Vec<u32>, usize) {
        let tokens = index.tokens();
        let len = tokens.len();
        // Count the match back past the n-gram while the tokens before the occurrence and
        // before the suffix agree.
        let matched = n
            + (1..=start)
                .take(num_drafts.max(CONFIDENCE_MATCH).saturating_sub(n))
                .take_while(|&back| tokens[start - back] == tokens[len - n - back])
                .count();
        let from = start + n;
        let to = (from + matched.min(num_drafts)).min(len);
        let drafts = tokens[from..to]
            .iter()
            .copied()
            .take_while(|&t| mask.is_none_or(|m| bitmask_allows(m, t)))
            .collect();
        (drafts, matched)
    }

    /// The tree of the continuations of the history's longest matching suffix (see the
    /// module docs), at most `budget` nodes.
    fn draft_tree(index: &NgramIndex, budget: usize, mask: Option<&[i32]>) -> DraftTree {
        let mut tree = DraftTree::default();
        let Some((_, n)) = index.longest_match() else {
            return tree;
        };
        for start in index.occurrences(n, TREE_OCCURRENCES) {
            if tree.len() >= budget {
                break;
            }
            let (branch, _) = Self::continuation(index, start, n, budget, mask);
            let mut at = None;
            for t in branch {
                let child = (0..tree.len()).find(|&i| tree.parents[i] == at && tree.tokens[i] == t);
                at = match child {
                    Some(i) => Some(i),
                    None if tree.len() < budget => {
                        tree.tokens.push(t);
                        tree.parents.push(at);
                        Some(tree.len() - 1)
                    }
                    None => break,
                };
            }
        }
        tree
    }

    fn new_state(&self) -> PromptLookupState {
        PromptLookupState {
            history: NgramIndex::new(self.min_ngram, self.max_ngram),
            pending: Vec::new(),
            pending_parents: Vec::new(),
        }
    }

    /// Records `last_token` at `position` and drafts; returns the drafts and the tokens
    /// their occurrence matches.
    fn propose_one(
        &self,
        last_token: u32,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        vocab_size: usize,
        mask: Option<&[i32]>,
    ) -> Result<(Vec<u32>, usize)> {
        check_vocab("propose", &[last_token], vocab_size)?;
        let st = state_of(state, "propose")?;
        // `position` is where `last_token` sits in the sequence: anything at or after it
        // is a leftover of an earlier propose from this point.
        st.history.truncate(position);
        st.history.push(last_token);
        if num_drafts == 0 {
            st.pending.clear();
            st.pending_parents.clear();
            return Ok((Vec::new(), 0));
        }
        let (drafts, matched) = Self::draft_matched(&st.history, num_drafts, mask);
        st.pending.clone_from(&drafts);
        st.pending_parents.clear();
        Ok((drafts, matched))
    }
}

impl DraftProposer for PromptLookup {
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
        self.propose_one(
            last_token,
            position,
            num_drafts,
            state,
            ctx.config.vocab_size,
            grammar_bitmask,
        )
        .map(|(drafts, _)| drafts)
    }

    fn after_verify(
        &self,
        num_accepted: usize,
        state: &mut dyn ProposerState,
        _stream: u64,
    ) -> Result<()> {
        let st = state_of(state, "after_verify")?;
        if num_accepted > st.pending.len() {
            return Err(ProposerError::InvalidArgument {
                method: "after_verify",
                message: format!(
                    "{num_accepted} accepted, but only {} drafts were proposed",
                    st.pending.len()
                ),
            }
            .into());
        }
        if st
            .pending_parents
            .iter()
            .enumerate()
            .take(num_accepted)
            .any(|(i, &p)| p != i.checked_sub(1))
        {
            return Err(ProposerError::InvalidArgument {
                method: "after_verify",
                message: format!(
                    "{num_accepted} accepted of a tree that branches before them: after_verify_tree names the path"
                ),
            }
            .into());
        }
        st.pending_parents.clear();
        for t in std::mem::take(&mut st.pending)
            .into_iter()
            .take(num_accepted)
        {
            st.history.push(t);
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
        check_vocab("propose_tree", &[last_token], ctx.config.vocab_size)?;
        let st = state_of(state, "propose_tree")?;
        st.history.truncate(position);
        st.history.push(last_token);
        let tree = Self::draft_tree(&st.history, budget, grammar_bitmask);
        st.pending.clone_from(&tree.tokens);
        st.pending_parents.clone_from(&tree.parents);
        Ok(tree)
    }

    fn after_verify_tree(
        &self,
        path: &[usize],
        state: &mut dyn ProposerState,
        _stream: u64,
    ) -> Result<()> {
        let st = state_of(state, "after_verify_tree")?;
        let fault = DraftTree::path_fault(&st.pending_parents, st.pending.len(), path);
        if let Some(message) = fault {
            return Err(ProposerError::InvalidArgument {
                method: "after_verify_tree",
                message: format!("path {path:?}: {message}"),
            }
            .into());
        }
        let pending = std::mem::take(&mut st.pending);
        st.pending_parents.clear();
        for &i in path {
            st.history.push(pending[i]);
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
        check_vocab("prefill_drafter", prompt_tokens, ctx.config.vocab_size)?;
        let st = state_of(state, "prefill_drafter")?;
        st.history.clear();
        for &t in prompt_tokens {
            st.history.push(t);
        }
        st.pending.clear();
        st.pending_parents.clear();
        // Host-side history only: no drafter KV rows are written.
        Ok(0)
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
            return Err(ProposerError::InvalidArgument {
                method: "propose_batch",
                message: format!(
                    "slices differ in length: {n} last_tokens, {} target_hiddens, {} positions, {} states",
                    target_hiddens.len(),
                    positions.len(),
                    states.len()
                ),
            }
            .into());
        }
        let mut drafts = Vec::with_capacity(n);
        let mut confs = Vec::with_capacity(n);
        for i in 0..n {
            let (d, matched) = self.propose_one(
                last_tokens[i],
                positions[i],
                num_drafts,
                &mut *states[i],
                ctx.config.vocab_size,
                None,
            )?;
            confs.push(vec![match_confidence(matched); d.len()]);
            drafts.push(d);
        }
        if let Some(conf) = out_conf {
            *conf = confs;
        }
        Ok(Some(drafts))
    }

    fn propose_batch_max(&self, _buffers: &BufferArena, _config: &ModelConfig) -> usize {
        // Host-only work per sequence: no scratch limits the width.
        usize::MAX
    }
}
