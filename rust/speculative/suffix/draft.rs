//! Choosing a draft chain in a [`SuffixTrie`]: for every length of the matched suffix, follow
//! the most frequent continuation while its empirical probability stays above a threshold,
//! and keep the chain with the highest expected number of accepted tokens.
//!
//! A match of `L` tokens may draft at most `floor(L * max_spec_factor)` tokens (and at most
//! `num_drafts`): a short match is weak evidence, so it risks few verify rows. Along the
//! chain, the probability of reaching draft `k` is the product of `count(child) /
//! count(parent)` over the steps so far; the chain stops before the first draft whose
//! probability falls below `min_token_prob`. A chain's score is the sum of those
//! probabilities (the expected accepted count if the counts were the truth). The longest
//! match wins ties.

use super::trie::{Cursor, SuffixTrie, ROOT};

/// How long a chain may grow.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ChainLimits {
    pub(crate) num_drafts: usize,
    pub(crate) max_spec_factor: f64,
    pub(crate) min_token_prob: f64,
}

/// A draft chain and what it is worth.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Chain {
    pub(crate) tokens: Vec<u32>,
    /// For each draft, `count(child) / count(parent)` at its step: its probability given the
    /// drafts before it.
    pub(crate) step_probs: Vec<f64>,
    /// The sum of each draft's probability of being reached.
    pub(crate) score: f64,
    /// Tokens of the matched suffix it continues.
    pub(crate) match_len: usize,
}

/// Drafts at most `floor(match_len * max_spec_factor)` (and `num_drafts`) tokens.
pub(crate) fn drafts_allowed(match_len: usize, limits: &ChainLimits) -> usize {
    let by_match = (match_len as f64 * limits.max_spec_factor).floor();
    // A float beyond usize saturates in the cast, which min then caps.
    (by_match as usize).min(limits.num_drafts)
}

/// The most frequent continuation of `node` (a match of `match_len` tokens).
fn follow(trie: &mut SuffixTrie, node: u32, match_len: usize, limits: &ChainLimits) -> Chain {
    let mut chain = Chain {
        match_len,
        ..Chain::default()
    };
    let allowed = drafts_allowed(match_len, limits);
    let (mut at, mut reach) = (node, 1.0f64);
    while chain.tokens.len() < allowed {
        let Some(next) = trie.best_child(at) else {
            break;
        };
        let step = f64::from(trie.count(next)) / f64::from(trie.count(at));
        reach *= step;
        if reach < limits.min_token_prob {
            break;
        }
        chain.tokens.push(trie.token(next));
        chain.step_probs.push(step);
        chain.score += reach;
        at = next;
    }
    chain
}

/// The best chain over every suffix of the match at `cursor` (`cursor` and its links).
pub(crate) fn best_chain(trie: &mut SuffixTrie, cursor: Cursor, limits: &ChainLimits) -> Chain {
    best_over_matches(trie, cursor, limits, usize::MAX, follow, |c| c.score)
}

/// The best of `draft(trie, node, match_len, limits)` over every suffix of the match at
/// `cursor`, longest first, by `score`; the default draft when none scores above 0.
///
/// A draft must score at most `min(drafts_allowed(match_len), cap)`: a chain's score is at
/// most its length, and a tree's at most its depth (the nodes of one depth are disjoint
/// continuations, so their probabilities of being reached sum to at most 1). Shorter
/// matches allow no deeper drafts, so once that bound cannot beat the best, the search
/// stops.
pub(crate) fn best_over_matches<D: Default>(
    trie: &mut SuffixTrie,
    cursor: Cursor,
    limits: &ChainLimits,
    cap: usize,
    mut draft: impl FnMut(&mut SuffixTrie, u32, usize, &ChainLimits) -> D,
    score: impl Fn(&D) -> f64,
) -> D {
    let mut best = D::default();
    let (mut node, mut depth) = (cursor.node, cursor.depth);
    while node != ROOT && depth > 0 {
        if drafts_allowed(depth, limits).min(cap) as f64 <= score(&best) {
            break;
        }
        let d = draft(trie, node, depth, limits);
        if score(&d) > score(&best) {
            best = d;
        }
        node = trie.link(node);
        depth -= 1;
    }
    best
}
