//! Verification of a draft tree by walking it: lossless sampling by recursive rejection
//! sampling over the tree (SpecInfer, Miao et al. 2024; multi-draft speculative sampling),
//! and greedy decoding under a grammar. A pure function on host f32 rows, as
//! [`verify_tree_greedy`](super::verify_tree_greedy) is, with the same row layout: row 0
//! for the last verified token, row `1 + i` for node `i`.
//!
//! The walk starts at the last verified token. At a node, `p` is the target's distribution
//! of its row ([`target_probs`](fn@super::target_probs): temperature, top-k, top-p, masked
//! by the grammar state after the walked path). Its children are tried in node order, each as a one-hot draft:
//! child `x` is accepted with probability `p(x) / sum(p)`; on rejection `p(x) := 0` (the
//! residual `norm(max(0, p - q))` of a one-hot `q`) and the next child is tried. An
//! accepted child's token is emitted and the walk goes on from it; when every child is
//! rejected, the emitted token is drawn from the residual and the walk stops. A node
//! without children ends the walk with a token drawn from its own row (the bonus token).
//!
//! Invariants:
//! - Lossless: for any tree that does not depend on the walk's random draws, each emitted
//!   token is distributed exactly as plain sampling from `p` at its position. Child `k` is
//!   emitted with probability `prod_{j<k} (1 - p_j(x_j)) * p_k(x_k) = p(x_k)` (each
//!   rejection renormalises what is left), and the residual draw gives every untried token
//!   its `p(y)`; the next token is then drawn from the accepted child's row, which is the
//!   target's distribution after that path.
//! - Node probabilities (`DraftTree::probs`) never enter acceptance. A probability per node
//!   gives `q` on the node's own token only, while the residual needs the whole of `q`; and
//!   `min(1, p(x) / q(x))` is lossless only for a node drawn from `q`, which tree proposers
//!   do not do (they pick top-k children, lookups, suffix branches). For a node picked
//!   deterministically, one-hot `q` is its exact draft distribution, and accepting
//!   `sum p(x)` over distinct children is the most any lossless rule can accept.
//! - A sibling repeating a rejected token is always rejected (`p(x)` is 0 by then), so its
//!   subtree is never walked; no draw divides by a zero mass: a residual left with no mass
//!   (only by rounding) falls back to the node's `p`, as the chain verifier does.
//! - Grammar: the walked path is the emitted tokens, so the matcher only advances, with
//!   each emitted token, and needs no fork or rollback; every row is masked by the state
//!   after exactly its own path, and no emitted token is one the grammar forbade. Nodes the
//!   grammar forbids have `p(x) = 0` and are rejected like any other.
//! - Greedy parameters: a child is accepted when it is the masked argmax of its parent's
//!   row, the first such sibling in node order (the greedy verifier's choice of the deeper
//!   of equal siblings would need the grammar forked per branch); the emitted tokens are
//!   exactly plain masked greedy decoding, and `rng` is not drawn.

use super::draw::{positive_sum, sample_excluding};
use super::verify::grammar_mask;
use super::verify_tree::check_tree_rows;
use super::{argmax, target_probs, GrammarMatcher, SamplingParams, TreeVerdict};
use crate::speculative::{bitmask_words, DraftTree};
use crate::Result;
use rand::rngs::SmallRng;
use rand::Rng;

/// Verifies `tree` against `rows` (see the module documentation) with `params`, drawing from
/// `rng` when sampling, and advances `grammar` with every emitted token.
pub fn verify_tree_sampled(
    rows: &[&[f32]],
    tree: &DraftTree,
    params: &SamplingParams,
    rng: &mut SmallRng,
    mut grammar: Option<&mut dyn GrammarMatcher>,
) -> Result<TreeVerdict> {
    check_tree_rows(rows, tree)?;
    let n = tree.len();
    // children[i]: node i's children in node order; children[n]: the last token's.
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); n + 1];
    for (i, p) in tree.parents.iter().enumerate() {
        children[p.unwrap_or(n)].push(i);
    }
    let mut mask = vec![0i32; bitmask_words(rows[0].len())];
    let mut verdict = TreeVerdict {
        path: Vec::new(),
        tokens: Vec::new(),
        grammar_exhausted: false,
    };
    let mut at = n;
    loop {
        let row = rows[if at == n { 0 } else { 1 + at }];
        let row_mask = grammar_mask(grammar.as_deref_mut(), &mut mask)?;
        let kids = &children[at];
        let step = if params.is_greedy() {
            argmax(row, row_mask).map(|pick| {
                let child = kids.iter().copied().find(|&c| tree.tokens[c] == pick);
                (child, pick)
            })
        } else {
            target_probs(row, params, row_mask).map(|p| walk_children(p, kids, tree, rng))
        };
        let Some((child, token)) = step else {
            verdict.grammar_exhausted = true;
            return Ok(verdict);
        };
        if let Some(g) = grammar.as_deref_mut() {
            g.advance(token)?;
        }
        verdict.tokens.push(token);
        match child {
            Some(c) => {
                verdict.path.push(c);
                at = c;
            }
            None => return Ok(verdict),
        }
    }
}

/// Tries `kids` in turn against `p` (one-hot drafts, residual after each rejection):
/// the accepted child and its token, or no child and a token drawn from the residual.
fn walk_children(
    p: Vec<f32>,
    kids: &[usize],
    tree: &DraftTree,
    rng: &mut SmallRng,
) -> (Option<usize>, u32) {
    let mut rejected: Vec<u32> = Vec::with_capacity(kids.len());
    let mut mass = positive_sum(&p);
    for &c in kids {
        let x = tree.tokens[c];
        let px = if rejected.contains(&x) {
            0.0
        } else {
            f64::from(p.get(x as usize).copied().unwrap_or(0.0))
        };
        if px <= 0.0 {
            continue;
        }
        if rng.random::<f64>() * mass < px {
            return (Some(c), x);
        }
        rejected.push(x);
        mass -= px;
    }
    (None, sample_excluding(&p, &rejected, rng))
}

#[cfg(test)]
mod tests {
    use super::verify_tree_sampled;
    use crate::engine::SamplingParams;
    use crate::speculative::DraftTree;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    #[test]
    fn a_sibling_repeating_a_rejected_token_is_never_accepted() {
        // Nodes 0 and 1 both draft token 1, which the target gives half its mass; node 2
        // drafts 3. Once node 0 is rejected, token 1 has no mass left: node 1 never wins,
        // and a walk that emits 1 does so through node 0.
        let tree = DraftTree {
            tokens: vec![1, 1, 3],
            parents: vec![None, None, None],
            probs: None,
        };
        let rows: Vec<Vec<f32>> = (0..4).map(|_| vec![0.0, 1.1, 0.0, 0.0]).collect();
        let refs: Vec<&[f32]> = rows.iter().map(|r| &r[..]).collect();
        let params = SamplingParams::sampled(1.0, 0);
        let mut through = [0usize; 3];
        for seed in 0..400 {
            let mut rng = SmallRng::seed_from_u64(seed);
            let v = verify_tree_sampled(&refs, &tree, &params, &mut rng, None).unwrap();
            if let Some(&node) = v.path.first() {
                through[node] += 1;
            } else {
                assert_ne!(v.tokens, [1], "seed {seed}: token 1 from the residual");
            }
        }
        assert_eq!(through[1], 0, "{through:?}");
        assert!(through[0] > 100 && through[2] > 20, "{through:?}");
    }

    #[test]
    fn greedy_walks_the_first_sibling_the_argmax_names() {
        let tree = DraftTree {
            tokens: vec![0, 2, 2, 1],
            parents: vec![None, None, None, Some(2)],
            probs: None,
        };
        let one_hot = |t: usize| -> Vec<f32> { (0..3).map(|i| f32::from(i == t)).collect() };
        let rows = [one_hot(2), one_hot(0), one_hot(1), one_hot(0), one_hot(2)];
        let refs: Vec<&[f32]> = rows.iter().map(|v| &v[..]).collect();
        let mut rng = SmallRng::seed_from_u64(0);
        let v =
            verify_tree_sampled(&refs, &tree, &SamplingParams::greedy(), &mut rng, None).unwrap();
        // Node 1 is the first child drafting 2; its row picks 1, which it has no child for.
        assert_eq!((v.path, v.tokens), (vec![1], vec![2, 1]));
    }
}
