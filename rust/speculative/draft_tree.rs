//! `DraftTree`: what `propose_tree` returns, a tree of draft tokens rooted at the last
//! verified token, and the one check of its shape that the adapter for Python proposers
//! and the conformance checker share.
//!
//! Invariants of a well-formed tree (what [`DraftTree::fault`] checks):
//! - `parents` has one entry per token; `probs`, when given, one per token too.
//! - A node's parent comes before it (`parents[i] < i`), so the nodes are in an order in
//!   which every ancestor precedes its descendants and a verify row can attend to the rows
//!   before it only.
//! - At most `budget` nodes; every token inside the vocabulary; every probability in
//!   `[0, 1]`.
//!
//! A chain is the tree whose node `i` has parent `i - 1`: what the protocol's default
//! `propose_tree` returns from `propose`.

use std::fmt;

/// Draft tokens as a tree: node `i` is `tokens[i]`, a child of node `parents[i]`, or of the
/// last verified token when `parents[i]` is `None`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DraftTree {
    /// The draft token of each node.
    pub tokens: Vec<u32>,
    /// Each node's parent (an earlier node), `None` for a child of the last verified token.
    pub parents: Vec<Option<usize>>,
    /// Each node's draft probability, when the proposer knows it.
    pub probs: Option<Vec<f32>>,
}

/// How a tree breaks its contract.
#[derive(Clone, Debug, PartialEq)]
pub enum TreeFault {
    /// `parents` (or `probs`) does not have one entry per token.
    Lengths {
        /// Which list.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The number of tokens.
        tokens: usize,
    },
    /// More nodes than the budget.
    OverBudget {
        /// Nodes returned.
        nodes: usize,
        /// The budget asked for.
        budget: usize,
    },
    /// A parent that does not come before its child.
    ParentNotBefore {
        /// The node.
        node: usize,
        /// Its parent.
        parent: usize,
    },
    /// A token outside the vocabulary.
    OutOfVocab {
        /// The node.
        node: usize,
        /// Its token.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A probability outside `[0, 1]` (or not a number).
    BadProb {
        /// The node.
        node: usize,
        /// Its probability.
        prob: f32,
    },
}

impl fmt::Display for TreeFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            TreeFault::Lengths { what, len, tokens } => {
                write!(f, "{len} {what} for {tokens} tokens")
            }
            TreeFault::OverBudget { nodes, budget } => {
                write!(f, "{nodes} nodes, over the budget of {budget}")
            }
            TreeFault::ParentNotBefore { node, parent } => write!(
                f,
                "node {node}'s parent {parent}, which does not come before it"
            ),
            TreeFault::OutOfVocab { node, token, vocab } => write!(
                f,
                "node {node}'s token id {token}, outside the vocabulary of {vocab}"
            ),
            TreeFault::BadProb { node, prob } => {
                write!(f, "node {node}'s probability {prob}, outside [0, 1]")
            }
        }
    }
}

impl DraftTree {
    /// The chain `tokens[0] -> tokens[1] -> ...` (each node the child of the one before).
    pub fn chain(tokens: Vec<u32>) -> Self {
        let parents = (0..tokens.len()).map(|i| i.checked_sub(1)).collect();
        DraftTree {
            tokens,
            parents,
            probs: None,
        }
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the tree has no node.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The first way the tree breaks its contract for `budget` nodes over `vocab` tokens.
    pub fn fault(&self, budget: usize, vocab: usize) -> Option<TreeFault> {
        let tokens = self.tokens.len();
        if self.parents.len() != tokens {
            return Some(TreeFault::Lengths {
                what: "parents",
                len: self.parents.len(),
                tokens,
            });
        }
        if let Some(p) = self.probs.as_ref().filter(|p| p.len() != tokens) {
            return Some(TreeFault::Lengths {
                what: "probabilities",
                len: p.len(),
                tokens,
            });
        }
        if tokens > budget {
            return Some(TreeFault::OverBudget {
                nodes: tokens,
                budget,
            });
        }
        for (node, parent) in self.parents.iter().enumerate() {
            if let Some(parent) = parent.filter(|&p| p >= node) {
                return Some(TreeFault::ParentNotBefore { node, parent });
            }
        }
        if let Some((node, &token)) = self
            .tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Some(TreeFault::OutOfVocab { node, token, vocab });
        }
        if let Some((node, &prob)) = self
            .probs
            .iter()
            .flatten()
            .enumerate()
            .find(|(_, p)| !(0.0..=1.0).contains(*p))
        {
            return Some(TreeFault::BadProb { node, prob });
        }
        None
    }

    /// The depth of each node (1 for a child of the last verified token). Requires a
    /// well-formed tree.
    pub fn depths(&self) -> Vec<usize> {
        let mut depths: Vec<usize> = Vec::with_capacity(self.len());
        for parent in &self.parents {
            depths.push(parent.map_or(1, |p| depths[p] + 1));
        }
        depths
    }

    /// How many tokens of `truth` (the target's continuation after the last verified
    /// token) the tree's best path matches: the longest root-to-node path whose every
    /// token equals `truth` at its depth. Requires a well-formed tree.
    pub fn accepted_len(&self, truth: &[u32]) -> usize {
        self.accepted_path(truth).len()
    }

    /// The nodes of that path, root side first (at each depth the first child in node
    /// order whose token matches). Requires a well-formed tree.
    pub fn accepted_path(&self, truth: &[u32]) -> Vec<usize> {
        let mut path: Vec<usize> = Vec::new();
        while let Some(next) = (0..self.len()).find(|&i| {
            self.parents[i] == path.last().copied()
                && truth.get(path.len()) == Some(&self.tokens[i])
        }) {
            path.push(next);
        }
        path
    }

    /// Why `path` is not a root-side-first path of nodes of the tree of `len` nodes whose
    /// parents are `parents` (empty for a chain), as `after_verify_tree` must be given; `None`
    /// when it is one.
    pub fn path_fault(parents: &[Option<usize>], len: usize, path: &[usize]) -> Option<String> {
        path.iter().enumerate().find_map(|(k, &i)| {
            let want = k.checked_sub(1).map(|j| path[j]);
            if i >= len {
                Some(format!("node {i} of a tree of {len}"))
            } else if parents.get(i).copied().unwrap_or(i.checked_sub(1)) != want {
                Some(format!(
                    "node {i} is not a child of the path's node before it"
                ))
            } else {
                None
            }
        })
    }

    /// The nodes marked in `kept` (a set closed under parents: a kept node's parent is
    /// kept) as a tree of their own, in the same order, and the index here of each of its
    /// nodes. Requires a well-formed tree and one mark per node.
    pub(crate) fn keep(&self, kept: &[bool]) -> (DraftTree, Vec<usize>) {
        let nodes: Vec<usize> = (0..self.len()).filter(|&i| kept[i]).collect();
        let mut new_index = vec![usize::MAX; self.len()];
        for (k, &i) in nodes.iter().enumerate() {
            new_index[i] = k;
        }
        let tree = DraftTree {
            tokens: nodes.iter().map(|&i| self.tokens[i]).collect(),
            parents: nodes
                .iter()
                .map(|&i| self.parents[i].map(|p| new_index[p]))
                .collect(),
            probs: self
                .probs
                .as_ref()
                .map(|p| nodes.iter().map(|&i| p[i]).collect()),
        };
        (tree, nodes)
    }

    /// Whether node `i`'s parent is node `i - 1` for every node: the tree is a chain.
    pub fn is_chain(&self) -> bool {
        self.parents
            .iter()
            .enumerate()
            .all(|(i, &p)| p == i.checked_sub(1))
    }
}

/// Orders a best-first tree builder's candidate node, for its `BinaryHeap`: by `reach`
/// (the probability of reaching the node, greatest first), then by `order` (the one offered
/// first comes out first), so growth is deterministic. The type needs those two fields.
macro_rules! order_by_reach {
    ($ty:ty) => {
        impl PartialEq for $ty {
            fn eq(&self, other: &Self) -> bool {
                self.cmp(other) == ::std::cmp::Ordering::Equal
            }
        }

        impl Eq for $ty {}

        impl PartialOrd for $ty {
            fn partial_cmp(&self, other: &Self) -> Option<::std::cmp::Ordering> {
                Some(self.cmp(other))
            }
        }

        impl Ord for $ty {
            fn cmp(&self, other: &Self) -> ::std::cmp::Ordering {
                self.reach
                    .total_cmp(&other.reach)
                    .then_with(|| other.order.cmp(&self.order))
            }
        }
    };
}
pub(crate) use order_by_reach;

#[cfg(test)]
mod tests {
    use super::{DraftTree, TreeFault};

    #[test]
    fn a_chain_is_a_path_and_well_formed() {
        let t = DraftTree::chain(vec![5, 6, 7]);
        assert_eq!(t.parents, [None, Some(0), Some(1)]);
        assert_eq!(t.fault(3, 8), None);
        assert_eq!(t.depths(), [1, 2, 3]);
        assert_eq!(t.accepted_len(&[5, 6, 9]), 2);
    }

    #[test]
    fn the_best_path_takes_a_second_choice() {
        // 1 and 2 are siblings; 3 is under 2.
        let t = DraftTree {
            tokens: vec![1, 2, 3, 4],
            parents: vec![None, None, Some(1), Some(0)],
            probs: None,
        };
        assert_eq!(t.accepted_len(&[2, 3, 0]), 2);
        assert_eq!(t.accepted_len(&[1, 3]), 1);
        assert_eq!(t.accepted_len(&[9]), 0);
    }

    #[test]
    fn each_fault_is_named() {
        let ok = DraftTree {
            tokens: vec![1, 2],
            parents: vec![None, Some(0)],
            probs: Some(vec![0.5, 1.0]),
        };
        assert_eq!(ok.fault(2, 4), None);
        let mut t = ok.clone();
        t.parents = vec![None];
        assert!(matches!(
            t.fault(2, 4),
            Some(TreeFault::Lengths {
                what: "parents",
                len: 1,
                tokens: 2
            })
        ));
        assert_eq!(
            ok.fault(1, 4),
            Some(TreeFault::OverBudget {
                nodes: 2,
                budget: 1
            })
        );
        let mut t = ok.clone();
        t.parents = vec![None, Some(1)];
        assert_eq!(
            t.fault(2, 4),
            Some(TreeFault::ParentNotBefore { node: 1, parent: 1 })
        );
        assert_eq!(
            ok.fault(2, 2),
            Some(TreeFault::OutOfVocab {
                node: 1,
                token: 2,
                vocab: 2
            })
        );
        let mut t = ok.clone();
        t.probs = Some(vec![0.5, f32::NAN]);
        assert!(matches!(
            t.fault(2, 4),
            Some(TreeFault::BadProb { node: 1, .. })
        ));
    }
}
