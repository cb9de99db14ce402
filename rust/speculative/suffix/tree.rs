//! Choosing a draft tree in a [`SuffixTrie`] (SuffixDecoding's speculation tree): from the
//! matched suffix, grow the continuations most likely to be reached, best first.
//!
//! A node's probability of being reached is the product of `count(child) / count(parent)`
//! along its path from the match, the same estimate a chain uses. Growing best first (the
//! frontier in a max-heap by that probability) until the budget is spent or the next node
//! would be reached with probability under `min_token_prob` gives the tree of at most
//! `budget` nodes with the highest sum of reach probabilities: a child is never more likely
//! than its parent, so every node's ancestors are taken before it. A match of `L` tokens
//! grows at most `floor(L * max_spec_factor)` deep, as a chain does. Among the matched
//! suffix's lengths, the tree with the highest score wins, the longest match on ties.
//!
//! Invariants: parents precede their children; every node's token passes `keep` (so a
//! node the caller cannot use takes its subtree with it); the same trie and match give the
//! same tree (ties in probability go to the node found first, children in trie order).

use super::draft::{best_over_matches, drafts_allowed, ChainLimits};
use super::trie::{Cursor, SuffixTrie};
use std::collections::BinaryHeap;

/// A draft tree and what it is worth.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct TreeDraft {
    pub(crate) tokens: Vec<u32>,
    /// Each node's parent node, `None` for a child of the matched suffix.
    pub(crate) parents: Vec<Option<usize>>,
    /// Each node's `count(node) / count(parent)`: its probability given its parent.
    pub(crate) step_probs: Vec<f64>,
    /// The sum of the nodes' probabilities of being reached.
    pub(crate) score: f64,
}

/// A node the tree may take next.
struct Candidate {
    reach: f64,
    step: f64,
    node: u32,
    parent: Option<usize>,
    depth: usize,
    /// Found order, so equal probabilities come out first found first.
    order: usize,
}

crate::speculative::draft_tree::order_by_reach!(Candidate);

/// The best tree of at most `budget` nodes over every suffix of the match at `cursor`.
pub(crate) fn best_tree(
    trie: &mut SuffixTrie,
    cursor: Cursor,
    limits: &ChainLimits,
    budget: usize,
    keep: &dyn Fn(u32) -> bool,
) -> TreeDraft {
    best_over_matches(
        trie,
        cursor,
        limits,
        budget,
        |trie, node, match_len, limits| grow(trie, node, match_len, limits, budget, keep),
        |t| t.score,
    )
}

/// The tree grown best first from `node`, a match of `match_len` tokens.
fn grow(
    trie: &SuffixTrie,
    node: u32,
    match_len: usize,
    limits: &ChainLimits,
    budget: usize,
    keep: &dyn Fn(u32) -> bool,
) -> TreeDraft {
    let mut tree = TreeDraft::default();
    let max_depth = drafts_allowed(match_len, limits);
    let mut frontier = BinaryHeap::new();
    let mut found = 0;
    let mut offer = |frontier: &mut BinaryHeap<Candidate>, at: u32, reach: f64, parent, depth| {
        let total = f64::from(trie.count(at));
        for child in trie.children(at) {
            let step = f64::from(trie.count(child)) / total;
            // A child reached less often than the threshold can never be taken.
            if reach * step >= limits.min_token_prob && keep(trie.token(child)) {
                frontier.push(Candidate {
                    reach: reach * step,
                    step,
                    node: child,
                    parent,
                    depth,
                    order: found,
                });
                found += 1;
            }
        }
    };
    if max_depth == 0 || budget == 0 {
        return tree;
    }
    offer(&mut frontier, node, 1.0, None, 1);
    while tree.tokens.len() < budget {
        let Some(c) = frontier.pop() else {
            break;
        };
        let index = tree.tokens.len();
        tree.tokens.push(trie.token(c.node));
        tree.parents.push(c.parent);
        tree.step_probs.push(c.step);
        tree.score += c.reach;
        if c.depth < max_depth {
            offer(&mut frontier, c.node, c.reach, Some(index), c.depth + 1);
        }
    }
    tree
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(num_drafts: usize, min_token_prob: f64) -> ChainLimits {
        ChainLimits {
            num_drafts,
            max_spec_factor: 1.0,
            min_token_prob,
        }
    }

    /// A trie over `stream`, and the cursor of its end.
    fn trie_of(stream: &[u32], max_depth: usize) -> (SuffixTrie, Cursor) {
        let mut trie = SuffixTrie::new(max_depth);
        let mut cursor = Cursor::START;
        for &t in stream {
            cursor = trie.append(cursor, t);
        }
        (trie, cursor)
    }

    /// "1 2" six times, each after a token of its own: three times "3 4", twice "5 6", and
    /// once at the end; so only the match "1 2" has continuations, 3 with probability 3/6
    /// and 5 with 2/6, each followed by its pair for sure.
    fn branching() -> (SuffixTrie, Cursor) {
        let mut stream = Vec::new();
        for (k, pair) in [[3, 4], [5, 6], [3, 4], [5, 6], [3, 4]].iter().enumerate() {
            stream.extend([20 + k as u32, 1, 2, pair[0], pair[1]]);
        }
        stream.extend([25, 1, 2]);
        trie_of(&stream, 8)
    }

    #[test]
    fn a_tree_takes_the_second_continuation_as_a_branch() {
        let (mut trie, cursor) = branching();
        let t = best_tree(&mut trie, cursor, &limits(4, 0.1), 4, &|_| true);
        assert_eq!(t.tokens, vec![3, 4, 5, 6]);
        assert_eq!(t.parents, vec![None, Some(0), None, Some(2)]);
        assert_eq!(t.step_probs, vec![0.5, 1.0, 2.0 / 6.0, 1.0]);
        assert!((t.score - (0.5 + 0.5 + 2.0 / 6.0 + 2.0 / 6.0)).abs() < 1e-12);
    }

    #[test]
    fn the_budget_the_threshold_and_keep_bound_the_tree() {
        let (mut trie, cursor) = branching();
        let t = best_tree(&mut trie, cursor, &limits(4, 0.1), 3, &|_| true);
        assert_eq!(t.tokens, vec![3, 4, 5]);
        let t = best_tree(&mut trie, cursor, &limits(4, 0.4), 4, &|_| true);
        assert_eq!(t.tokens, vec![3, 4], "5 is reached with 1/3 only");
        // A match of 2 tokens drafts at most 2 deep, however many drafts are allowed.
        let t = best_tree(&mut trie, cursor, &limits(9, 0.0), 9, &|_| true);
        assert_eq!(t.tokens, vec![3, 4, 5, 6]);
        // A token the caller refuses takes its subtree with it.
        let t = best_tree(&mut trie, cursor, &limits(4, 0.1), 4, &|tok| tok != 3);
        assert_eq!(t.tokens, vec![5, 6]);
        assert_eq!(t.parents, vec![None, Some(0)]);
    }

    #[test]
    fn parents_precede_children_and_depth_follows_the_match() {
        let stream: Vec<u32> = (0..60).map(|i| [7, 8, 9, 7, 8, 10][i % 6]).collect();
        let (mut trie, cursor) = trie_of(&stream, 6);
        for budget in 0..8 {
            let t = best_tree(&mut trie, cursor, &limits(3, 0.0), budget, &|_| true);
            assert!(t.tokens.len() <= budget);
            for (i, p) in t.parents.iter().enumerate() {
                assert!(p.is_none_or(|p| p < i), "node {i} parent {p:?}");
            }
            let depth = |mut i: usize| {
                let mut d = 1;
                while let Some(p) = t.parents[i] {
                    i = p;
                    d += 1;
                }
                d
            };
            assert!((0..t.tokens.len()).all(|i| depth(i) <= 3), "{t:?}");
        }
    }
}
