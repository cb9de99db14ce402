//! `SuffixState`, one sequence's state under [`SuffixDecoding`](super::SuffixDecoding): its
//! history (prompt, then verified output), its own suffix tree over that history, and the
//! drafts of its last propose until `after_verify` says how many were kept.
//!
//! Invariant: `cursors` holds one cursor per history token, the tree's cursor just after
//! it, so that taking tokens back (`truncate`) needs no search.

use super::trie::{Cursor, SuffixTrie};
use crate::speculative::{ProposerError, ProposerState};
use crate::Result;

/// Per-sequence state of [`SuffixDecoding`](super::SuffixDecoding): the history and its own suffix tree.
#[derive(Debug, Clone)]
pub struct SuffixState {
    pub(super) tokens: Vec<u32>,
    /// Tokens of `tokens` that came with the prompt; the rest is the sequence's output.
    pub(super) prompt_len: usize,
    pub(super) trie: SuffixTrie,
    /// `cursors[i]`: the cursor of the first `i` tokens, so taking a token back needs no
    /// search.
    pub(super) cursors: Vec<Cursor>,
    pub(super) pending: Vec<u32>,
    /// The parents of the last propose's tree; empty when it drafted a chain.
    pub(super) pending_parents: Vec<Option<usize>>,
}

crate::impl_proposer_state!(SuffixState);

impl SuffixState {
    /// Prompt and verified tokens, in sequence order.
    pub fn history(&self) -> &[u32] {
        &self.tokens
    }

    /// Nodes of this sequence's own suffix tree.
    pub fn tree_nodes(&self) -> usize {
        self.trie.live_nodes()
    }

    /// Bytes held by this sequence's tree and history (capacities).
    pub fn tree_bytes(&self) -> usize {
        self.trie.memory_bytes()
            + self.tokens.capacity() * 4
            + self.cursors.capacity() * std::mem::size_of::<Cursor>()
    }

    /// The drafts of the last propose, until `after_verify` says how many were kept.
    pub fn pending(&self) -> &[u32] {
        &self.pending
    }

    pub(super) fn cursor(&self) -> Cursor {
        self.cursors.last().copied().unwrap_or(Cursor::START)
    }

    pub(super) fn push(&mut self, token: u32) {
        let next = self.trie.append(self.cursor(), token);
        self.cursors.push(next);
        self.tokens.push(token);
    }

    pub(super) fn truncate(&mut self, len: usize) {
        while self.tokens.len() > len {
            let (Some(t), Some(_)) = (self.tokens.pop(), self.cursors.pop()) else {
                break;
            };
            self.trie.pop(self.cursor(), t);
        }
        self.prompt_len = self.prompt_len.min(len);
    }

    pub(super) fn clear(&mut self) {
        self.tokens.clear();
        self.prompt_len = 0;
        self.trie.clear();
        self.cursors.clear();
        self.pending.clear();
        self.pending_parents.clear();
    }
}

pub(super) fn state_of<'s>(
    state: &'s mut dyn ProposerState,
    method: &'static str,
) -> Result<&'s mut SuffixState> {
    state
        .as_any_mut()
        .downcast_mut::<SuffixState>()
        .ok_or_else(|| {
            ProposerError::WrongState {
                method,
                expected: "SuffixState",
            }
            .into()
        })
}
