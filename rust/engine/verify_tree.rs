//! Greedy verification of a draft tree against the target's logits: a pure function on host
//! f32 rows, tested against a brute force over every root-to-leaf path.
//!
//! The verify forward runs one row for the last verified token (row 0) and one per node
//! (row `1 + i` for node `i`), each node's row attending to the prefix and its ancestors
//! (the attention's tree mask), so row `1 + i` holds the target's logits after the path to
//! node `i`.
//!
//! Invariants:
//! - The accepted path is the longest root-to-node path whose every node's token equals the
//!   argmax of its parent's row (row 0 for a child of the last verified token); among paths
//!   of that length, the one whose nodes come first in node order (siblings with the same
//!   token are both explored, since their subtrees differ).
//! - The emitted tokens are the path's tokens, then the argmax of the row of the path's last
//!   node (of row 0 for an empty path): exactly what plain greedy decoding would emit.

use super::verify::argmax;
use super::EngineError;
use crate::speculative::DraftTree;
use crate::Result;

/// The outcome of verifying one sequence's draft tree greedily.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeVerdict {
    /// The accepted nodes, from a child of the last verified token down.
    pub path: Vec<usize>,
    /// The path's tokens, then the target's own pick after it (unless the grammar allowed
    /// no token there).
    pub tokens: Vec<u32>,
    /// The grammar allowed no token after the emitted ones: the sequence cannot go on.
    pub grammar_exhausted: bool,
}

/// Verifies `tree` greedily against `rows` (row 0 for the last verified token, then one
/// per node, so `rows.len() == tree.len() + 1`, all of one vocabulary). `tree` must be well
/// formed (see [`DraftTree::fault`]).
pub fn verify_tree_greedy(rows: &[&[f32]], tree: &DraftTree) -> Result<TreeVerdict> {
    check_tree_rows(rows, tree)?;
    let picks: Vec<u32> = rows
        .iter()
        .map(|r| argmax(r, None).unwrap_or(u32::MAX))
        .collect();
    Ok(longest_path(&picks, tree))
}

/// [`verify_tree_greedy`] from each row's pick instead of its logits: `picks[j]` is the
/// argmax of row `j`, `u32::MAX` where the row has none (as the `argmax` kernel writes), so
/// `picks.len() == tree.len() + 1`; `tree` must be well formed over `vocab`.
pub fn verify_tree_picks(picks: &[u32], tree: &DraftTree, vocab: usize) -> Result<TreeVerdict> {
    if picks.len() != tree.len() + 1 {
        return Err(tree_rows_error(format!(
            "{} picks for {} nodes (need nodes + 1)",
            picks.len(),
            tree.len()
        )));
    }
    if let Some(fault) = tree.fault(tree.len(), vocab) {
        return Err(tree_rows_error(format!("a tree with {fault}")));
    }
    Ok(longest_path(picks, tree))
}

/// The greedy verdict of a well-formed `tree` from `picks` (one a row, `tree.len() + 1`,
/// checked by the caller): its longest path whose every node is its row's pick, then the
/// pick after it.
fn longest_path(picks: &[u32], tree: &DraftTree) -> TreeVerdict {
    // depth[i]: the longest accepted path below node i, itself included, and its next node.
    // Children come after their parents, so one pass from the last node up fills them.
    let mut depth = vec![0usize; tree.len()];
    let mut next: Vec<Option<usize>> = vec![None; tree.len()];
    // The same for the last verified token (index `tree.len()` here).
    let (mut root_depth, mut root_next) = (0usize, None);
    for i in (0..tree.len()).rev() {
        depth[i] += 1;
        let mine = depth[i];
        let (parent_depth, parent_next, pick) = match tree.parents[i] {
            Some(p) => (&mut depth[p], &mut next[p], picks[1 + p]),
            None => (&mut root_depth, &mut root_next, picks[0]),
        };
        // Visiting siblings from the last, `>=` leaves the first of equal depths. A node's
        // token is below the vocabulary, so never the `u32::MAX` of a row without a pick.
        if pick == tree.tokens[i] && mine >= *parent_depth {
            *parent_depth = mine;
            *parent_next = Some(i);
        }
    }
    let mut verdict = TreeVerdict {
        path: Vec::new(),
        tokens: Vec::new(),
        grammar_exhausted: false,
    };
    let mut at = root_next;
    while let Some(i) = at {
        verdict.path.push(i);
        verdict.tokens.push(tree.tokens[i]);
        at = next[i];
    }
    let last_row = verdict.path.last().map_or(0, |&i| 1 + i);
    verdict
        .tokens
        .extend(Some(picks[last_row]).filter(|&p| p != u32::MAX));
    verdict
}

fn tree_rows_error(message: String) -> crate::Error {
    EngineError::InvalidArgument {
        what: "verify_tree rows",
        message,
    }
    .into()
}

/// Checks that `rows` fit `tree` (one row for the last verified token, then one per node,
/// all of one vocabulary) and that `tree` is well formed over that vocabulary.
pub(super) fn check_tree_rows(rows: &[&[f32]], tree: &DraftTree) -> Result<()> {
    if rows.len() != tree.len() + 1 {
        return Err(tree_rows_error(format!(
            "{} logits rows for {} nodes (need nodes + 1)",
            rows.len(),
            tree.len()
        )));
    }
    let vocab = rows[0].len();
    if let Some(j) = rows.iter().position(|r| r.len() != vocab) {
        return Err(tree_rows_error(format!(
            "row {j} has {} logits, row 0 has {vocab}",
            rows[j].len()
        )));
    }
    if let Some(fault) = tree.fault(tree.len(), vocab) {
        return Err(tree_rows_error(format!("a tree with {fault}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{verify_tree_greedy, verify_tree_picks, TreeVerdict};
    use crate::backend::argmax;
    use crate::speculative::DraftTree;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    fn pick(row: &[f32]) -> u32 {
        // The first of equal maxima, as `argmax` chooses.
        let mut best = 0;
        for (t, &x) in row.iter().enumerate() {
            if x > row[best] {
                best = t;
            }
        }
        best as u32
    }

    /// Every root-to-node path checked against the target one row at a time; the longest
    /// fully accepted one wins, the first in node order among equals.
    fn brute_force(rows: &[Vec<f32>], tree: &DraftTree) -> TreeVerdict {
        let n = tree.len();
        let mut best: Vec<usize> = Vec::new();
        let path_to = |mut i: usize| {
            let mut path = vec![i];
            while let Some(p) = tree.parents[i] {
                path.push(p);
                i = p;
            }
            path.reverse();
            path
        };
        let mut paths: Vec<Vec<usize>> = (0..n).map(path_to).collect();
        // Node order of the paths, compared node by node.
        paths.sort();
        for path in paths {
            let mut row = 0;
            let accepted = path.iter().all(|&i| {
                let ok = pick(&rows[row]) == tree.tokens[i];
                row = 1 + i;
                ok
            });
            if accepted && path.len() > best.len() {
                best = path;
            }
        }
        let last_row = best.last().map_or(0, |&i| 1 + i);
        let mut tokens: Vec<u32> = best.iter().map(|&i| tree.tokens[i]).collect();
        tokens.push(pick(&rows[last_row]));
        TreeVerdict {
            path: best,
            tokens,
            grammar_exhausted: false,
        }
    }

    #[test]
    fn random_trees_match_the_brute_force() {
        let mut r = SmallRng::seed_from_u64(7);
        let vocab = 4;
        let mut deep = 0;
        for case in 0..3000 {
            // Up to the largest budget the engine asks for; a small vocabulary, so siblings
            // share tokens and many drafts are accepted.
            let n = if case % 10 == 0 {
                64
            } else {
                r.random_range(0..=16)
            };
            let parents: Vec<Option<usize>> = (0..n)
                .map(|i| {
                    let p = r.random_range(0..=i);
                    (p < i).then_some(p)
                })
                .collect();
            let tokens = (0..n).map(|_| r.random_range(0..vocab as u32)).collect();
            let tree = DraftTree {
                tokens,
                parents,
                probs: None,
            };
            let rows: Vec<Vec<f32>> = (0..=n)
                .map(|_| (0..vocab).map(|_| r.random_range(-1.0..1.0)).collect())
                .collect();
            let refs: Vec<&[f32]> = rows.iter().map(|v| &v[..]).collect();
            let got = verify_tree_greedy(&refs, &tree).unwrap();
            assert_eq!(got, brute_force(&rows, &tree), "case {case}: {tree:?}");
            let picks: Vec<u32> = refs.iter().map(|r| argmax(r, None).unwrap()).collect();
            let from_picks = verify_tree_picks(&picks, &tree, vocab).unwrap();
            assert_eq!(from_picks, got, "case {case}: from the picks");
            deep += usize::from(got.path.len() >= 3);
        }
        // The comparison covered long accepted paths, not only rejections.
        assert!(deep > 50, "{deep} cases accepted 3 nodes or more");
    }

    #[test]
    fn the_deeper_of_two_equal_siblings_wins() {
        // Nodes 0 and 1 both draft 2 after the last token; only node 1's child is accepted.
        let tree = DraftTree {
            tokens: vec![2, 2, 3, 1],
            parents: vec![None, None, Some(0), Some(1)],
            probs: None,
        };
        let one_hot =
            |t: usize| -> Vec<f32> { (0..4).map(|i| if i == t { 1.0 } else { 0.0 }).collect() };
        let rows = [one_hot(2), one_hot(0), one_hot(1), one_hot(0), one_hot(3)];
        let refs: Vec<&[f32]> = rows.iter().map(|v| &v[..]).collect();
        let v = verify_tree_greedy(&refs, &tree).unwrap();
        assert_eq!(v.path, [1, 3]);
        assert_eq!(v.tokens, [2, 1, 3]);
    }

    #[test]
    fn rows_that_do_not_fit_the_tree_are_refused() {
        let tree = DraftTree::chain(vec![1, 2]);
        let row = [0.0f32; 4];
        let err = verify_tree_greedy(&[&row, &row], &tree).unwrap_err();
        assert!(
            err.to_string().contains("2 logits rows for 2 nodes"),
            "{err}"
        );
        let err = verify_tree_greedy(&[&row[..]; 4], &tree).unwrap_err();
        assert!(
            err.to_string().contains("4 logits rows for 2 nodes"),
            "{err}"
        );
        let short = [0.0f32; 3];
        let err = verify_tree_greedy(&[&row, &short, &row], &tree).unwrap_err();
        assert!(err.to_string().contains("row 1 has 3 logits"), "{err}");
        let err = verify_tree_picks(&[0, 1], &tree, 4).unwrap_err();
        assert!(err.to_string().contains("2 picks for 2 nodes"), "{err}");
        // A node's token outside the vocabulary: refused on both paths.
        let outside = DraftTree::chain(vec![1, 9]);
        for err in [
            verify_tree_picks(&[1, 9, 0], &outside, 4).unwrap_err(),
            verify_tree_greedy(&[&row[..]; 3], &outside).unwrap_err(),
        ] {
            assert!(err.to_string().contains("a tree with"), "{err}");
        }
    }
}
