//! The tree check: `propose_tree` returns a well-formed tree (each parent before its child,
//! at most `budget` nodes, tokens inside the vocabulary, probabilities in `[0, 1]`), and
//! every node obeys the grammar mask when one is given. The simulated verify accepts the
//! tree's longest path that matches the continuation, and `after_verify` is told its length
//! (`after_verify_tree` the path itself when the tree branches).

use super::driver::{guarded, Checker, Sequence};
use crate::speculative::{bitmask_allows, DraftTree};
use rand::rngs::SmallRng;

const FIX_SHAPE: &str = "return at most budget nodes, each parent an earlier node (or none for a child of the last verified token), tokens below ctx.config.vocab_size and probabilities in [0, 1], one per node";

/// Proposes two trees for `seq` (the second under a probe mask), checks them and advances
/// the sequence along the accepted path.
pub(super) fn check_trees(checker: &mut Checker<'_>, seq: &mut Sequence, rng: &mut SmallRng) {
    checker.report.ran("propose_tree");
    for masked in [false, true] {
        let mask = masked.then(|| checker.probe_mask(seq, rng));
        let Some(tree) = propose_tree(checker, seq, mask.as_deref()) else {
            return;
        };
        let (budget, vocab) = (checker.options.num_drafts, checker.options.vocab_size);
        if let Some(fault) = tree.fault(budget, vocab) {
            checker.report.violate(
                "propose_tree",
                format!("returned a tree with {fault}"),
                FIX_SHAPE,
            );
            checker.end(seq);
            return;
        }
        if let Some(mask) = &mask {
            if let Some((node, &bad)) = tree
                .tokens
                .iter()
                .enumerate()
                .find(|(_, &t)| !bitmask_allows(mask, t))
            {
                checker.report.violate(
                    "propose_tree: grammar mask",
                    format!("node {node} drafted token {bad}, which the grammar_bitmask forbids"),
                    "draft under every node only tokens whose bit in grammar_bitmask is set",
                );
            }
        }
        let path = tree.accepted_path(&seq.truth[seq.pos + 1..]);
        if tree.is_chain() {
            checker.advance(seq, path.len());
        } else {
            checker.advance_tree(seq, &path);
        }
    }
}

fn propose_tree(
    checker: &mut Checker<'_>,
    seq: &mut Sequence,
    mask: Option<&[i32]>,
) -> Option<DraftTree> {
    let (p, ctx, budget) = (checker.proposer, &checker.ctx, checker.options.num_drafts);
    let (last, pos, hidden) = (seq.truth[seq.pos], seq.pos, checker.hidden_for(seq));
    let stack = checker.stack_for(seq);
    let state = seq.state.as_mut()?;
    let tree = guarded(&mut checker.report, "propose_tree", || {
        p.propose_tree(
            last,
            hidden,
            pos,
            budget,
            &mut **state,
            ctx,
            0,
            None,
            mask,
            stack,
        )
    });
    if tree.is_none() {
        checker.end(seq);
    }
    tree
}
