//! `NgramIndex`: a token history with a hashed table of its n-grams, updated as tokens arrive
//! and as they are taken back, so finding the most recent earlier occurrence of the
//! history's suffix costs the same at any history length.
//!
//! Invariants: for each width `n` in `min_ngram ..= max_ngram`, every n-gram of the history
//! that is followed by at least one token is in the table of width `n`, reachable from its
//! hash through a chain of follower positions in decreasing order (newest first); `pop`
//! undoes exactly what the matching `push` did, so the index of a history is the same
//! whatever pushes and pops led to it. Hash collisions cost a step along the chain, never a
//! wrong answer: every candidate is compared token by token.

use rustc_hash::{FxHashMap, FxHasher};
use std::hash::Hasher;

/// Marks the end of a chain.
const NONE: usize = usize::MAX;

/// A history of tokens and the n-grams in it, for widths `min_ngram ..= max_ngram`.
#[derive(Debug, Clone)]
pub(crate) struct NgramIndex {
    min_ngram: usize,
    max_ngram: usize,
    tokens: Vec<u32>,
    /// One table per width (`n - min_ngram`): the hash of an n-gram to the newest position
    /// `f` such that `tokens[f - n..f]` is that n-gram (the position of its follower).
    heads: Vec<FxHashMap<u64, usize>>,
    /// `prev[f * widths + (n - min_ngram)]`: the follower position that `heads` held for the
    /// same hash before `f` was pushed (`NONE` when there was none). It is both the chain
    /// to older occurrences and what `pop` restores.
    prev: Vec<usize>,
}

impl NgramIndex {
    /// An empty index over widths `min_ngram ..= max_ngram` (the caller checks `1 <= min <=
    /// max`).
    pub(crate) fn new(min_ngram: usize, max_ngram: usize) -> Self {
        NgramIndex {
            min_ngram,
            max_ngram,
            tokens: Vec::new(),
            heads: vec![FxHashMap::default(); max_ngram - min_ngram + 1],
            prev: Vec::new(),
        }
    }

    fn widths(&self) -> usize {
        self.max_ngram - self.min_ngram + 1
    }

    /// The tokens, in order.
    pub(crate) fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Appends `token`: the n-grams that end just before it now have a follower.
    pub(crate) fn push(&mut self, token: u32) {
        let f = self.tokens.len();
        let (min, widths) = (self.min_ngram, self.widths());
        self.prev.resize((f + 1) * widths, NONE);
        for_each_hash(&self.tokens, f, min, self.max_ngram, |n, h| {
            let slot = n - min;
            self.prev[f * widths + slot] = self.heads[slot].insert(h, f).unwrap_or(NONE);
        });
        self.tokens.push(token);
    }

    /// Removes the newest token, restoring the tables to what they were before its push.
    pub(crate) fn pop(&mut self) -> Option<u32> {
        let f = self.tokens.len().checked_sub(1)?;
        let (min, widths) = (self.min_ngram, self.widths());
        for_each_hash(&self.tokens, f, min, self.max_ngram, |n, h| {
            let slot = n - min;
            match self.prev[f * widths + slot] {
                NONE => self.heads[slot].remove(&h),
                older => self.heads[slot].insert(h, older),
            };
        });
        self.prev.truncate(f * widths);
        self.tokens.pop()
    }

    /// Keeps the first `len` tokens.
    pub(crate) fn truncate(&mut self, len: usize) {
        while self.tokens.len() > len {
            self.pop();
        }
    }

    /// Empties the index, keeping its allocations.
    pub(crate) fn clear(&mut self) {
        self.tokens.clear();
        self.prev.clear();
        for table in &mut self.heads {
            table.clear();
        }
    }

    /// The start of the most recent earlier occurrence of the history's last `n` tokens
    /// that is followed by at least one token, if any.
    fn most_recent(&self, n: usize, hash: u64) -> Option<usize> {
        let len = self.tokens.len();
        let suffix = &self.tokens[len - n..];
        let slot = n - self.min_ngram;
        let mut f = *self.heads[slot].get(&hash)?;
        while f != NONE {
            if &self.tokens[f - n..f] == suffix {
                return Some(f - n);
            }
            f = self.prev[f * self.widths() + slot];
        }
        None
    }

    /// The starts of the earlier occurrences of the history's last `n` tokens (`min_ngram
    /// <= n <= max_ngram`, `n` below the history's length) that are followed by at least one
    /// token, most recent first, at most `limit` of them.
    pub(crate) fn occurrences(&self, n: usize, limit: usize) -> Vec<usize> {
        let len = self.tokens.len();
        let mut hash = None;
        for_each_hash(&self.tokens, len, n, n, |_, h| hash = Some(h));
        let (Some(hash), true) = (hash, (self.min_ngram..=self.max_ngram).contains(&n)) else {
            return Vec::new();
        };
        let suffix = &self.tokens[len - n..];
        let slot = n - self.min_ngram;
        let mut found = Vec::new();
        let mut f = self.heads[slot].get(&hash).copied().unwrap_or(NONE);
        while f != NONE && found.len() < limit {
            if &self.tokens[f - n..f] == suffix {
                found.push(f - n);
            }
            f = self.prev[f * self.widths() + slot];
        }
        found
    }

    /// The longest suffix of the history (`max_ngram` down to `min_ngram` tokens) that
    /// occurred earlier, as `(start of its most recent earlier occurrence, n)`.
    pub(crate) fn longest_match(&self) -> Option<(usize, usize)> {
        let len = self.tokens.len();
        // An earlier occurrence needs a follower, so it ends before the last token.
        let widest = self.max_ngram.min(len.saturating_sub(1));
        let mut found = None;
        // Widths come shortest first, so the last hit is the longest.
        for_each_hash(&self.tokens, len, self.min_ngram, widest, |n, h| {
            if let Some(start) = self.most_recent(n, h) {
                found = Some((start, n));
            }
        });
        found
    }
}

/// Calls `f(n, hash)` for each width `n` in `min ..= max` (and `<= end`) of the n-gram
/// `tokens[end - n..end]`. The hash reads the tokens backwards from `end`, so all widths
/// cost one pass.
fn for_each_hash(
    tokens: &[u32],
    end: usize,
    min: usize,
    max: usize,
    mut f: impl FnMut(usize, u64),
) {
    let mut hasher = FxHasher::default();
    for n in 1..=max.min(end) {
        hasher.write_u32(tokens[end - n]);
        if n >= min {
            f(n, hasher.finish());
        }
    }
}
