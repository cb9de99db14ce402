//! `SharedOutputs`: the outputs of finished sequences in one [`SuffixTrie`], oldest evicted
//! first when the trie outgrows its bound.
//!
//! Invariant: after every `insert`, the trie holds at most `max_nodes` nodes and the stored
//! outputs at most `max_nodes` tokens (a single output longer than that keeps only the part
//! that fits); the trie holds exactly the stored outputs.

use super::trie::{Cursor, SuffixTrie};
use std::collections::VecDeque;

/// The outputs of finished sequences, bounded.
#[derive(Debug)]
pub(crate) struct SharedOutputs {
    pub(crate) trie: SuffixTrie,
    /// Oldest first.
    outputs: VecDeque<Vec<u32>>,
    stored_tokens: usize,
    max_nodes: usize,
}

/// What the shared tree holds now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharedTreeStats {
    /// Outputs kept.
    pub outputs: usize,
    /// Their tokens.
    pub tokens: usize,
    /// Trie nodes (the root excluded).
    pub nodes: usize,
    /// Bytes held by the trie and the stored outputs (capacities).
    pub bytes: usize,
}

impl SharedOutputs {
    pub(crate) fn new(max_depth: usize, max_nodes: usize) -> Self {
        SharedOutputs {
            trie: SuffixTrie::new(max_depth),
            outputs: VecDeque::new(),
            stored_tokens: 0,
            max_nodes,
        }
    }

    fn over_bound(&self) -> bool {
        self.trie.live_nodes() > self.max_nodes || self.stored_tokens > self.max_nodes
    }

    /// Stores `output`, evicting the oldest outputs while over the bound.
    pub(crate) fn insert(&mut self, output: &[u32]) {
        if self.max_nodes == 0 {
            return;
        }
        let mut kept: Vec<u32> = Vec::with_capacity(output.len());
        let mut cursor = Cursor::START;
        for &t in output {
            let before = cursor;
            cursor = self.trie.append(cursor, t);
            kept.push(t);
            self.stored_tokens += 1;
            while self.over_bound() && !self.outputs.is_empty() {
                self.evict_oldest();
            }
            if self.over_bound() {
                // This output alone outgrows the bound: keep what fitted before this token.
                kept.pop();
                self.trie.pop(before, t);
                self.stored_tokens -= 1;
                break;
            }
        }
        if !kept.is_empty() {
            self.outputs.push_back(kept);
        }
    }

    fn evict_oldest(&mut self) {
        let Some(output) = self.outputs.pop_front() else {
            return;
        };
        for end in (0..output.len()).rev() {
            let before = self.trie.cursor_of(&output[..end]);
            self.trie.pop(before, output[end]);
        }
        self.stored_tokens -= output.len();
    }

    pub(crate) fn stats(&self) -> SharedTreeStats {
        SharedTreeStats {
            outputs: self.outputs.len(),
            tokens: self.stored_tokens,
            nodes: self.trie.live_nodes(),
            bytes: self.trie.memory_bytes()
                + self.outputs.capacity() * std::mem::size_of::<Vec<u32>>()
                + self.outputs.iter().map(|o| o.capacity() * 4).sum::<usize>(),
        }
    }
}
