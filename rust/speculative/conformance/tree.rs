//! The tree check: `propose_tree` returns a well-formed tree (each parent before its child,
//! at most `budget` nodes, tokens inside the vocabulary, probabilities in `[0, 1]`), and
//! every node obeys the grammar mask when one is given. The simulated verify accepts the
//! tree's longest path that matches the continuation, and `after_verify` is told its length
//! (`after_verify_tree` the path itself when the tree branches). The batched check asks the
//! twins for trees through `propose_tree_batch`, which must grow what `propose_tree` grew for
//! the originals at the same point.

use super::batch::call_group;
use super::driver::Checker;
use super::guard::guarded;
use super::synthetic::Sequence;
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
        if !settle_tree(checker, seq, &tree, mask.as_deref(), "propose_tree") {
            return;
        }
    }
}

/// Asks every live twin pair for a tree: the original through `propose_tree`, the twins a
/// group of at most `width` at a time through `propose_tree_batch`, whose trees must equal
/// the originals'. Both advance along their trees' accepted paths. A proposer that does
/// not batch trees (`Ok(None)`) is not checked further.
pub(super) fn check_tree_batch(
    checker: &mut Checker<'_>,
    twins: &mut [(Sequence, Sequence)],
    width: usize,
) {
    let (p, budget) = (checker.proposer, checker.options.num_drafts);
    let live: Vec<usize> = (0..twins.len())
        .filter(|&i| twins[i].0.state.is_some() && twins[i].1.state.is_some())
        .collect();
    let mut per_seq: Vec<Option<DraftTree>> = vec![None; twins.len()];
    for &i in &live {
        let (a, _) = &mut twins[i];
        if let Some(tree) = propose_tree(checker, a, None) {
            if settle_tree(checker, a, &tree, None, "propose_tree") {
                per_seq[i] = Some(tree);
            }
        }
    }
    let live: Vec<usize> = live.into_iter().filter(|&i| per_seq[i].is_some()).collect();
    for group in live.chunks(width.min(live.len().max(1))) {
        let result = call_group(checker, twins, group, |report, x, states, ctx| {
            guarded(report, "propose_tree_batch", || {
                p.propose_tree_batch(&x.last, &x.hiddens, &x.positions, budget, states, ctx, 0)
            })
        });
        let trees = match result {
            Some(Some(trees)) if trees.len() == group.len() => trees,
            Some(None) => return,
            Some(Some(trees)) => {
                checker.report.violate(
                    "propose_tree_batch",
                    format!("returned {} trees, asked for {}", trees.len(), group.len()),
                    "return one tree per sequence, in order",
                );
                group.iter().for_each(|&i| checker.end(&mut twins[i].1));
                continue;
            }
            None => {
                group.iter().for_each(|&i| checker.end(&mut twins[i].1));
                continue;
            }
        };
        checker.report.ran("propose_tree_batch");
        for (&i, tree) in group.iter().zip(&trees) {
            if Some(tree) != per_seq[i].as_ref() {
                checker.report.violate(
                    "propose_tree_batch vs propose_tree",
                    format!("sequence {i}: propose_tree_batch grew {tree:?}, propose_tree grew {:?}", per_seq[i]),
                    "propose_tree_batch must return exactly what per-sequence propose_tree returns (or Ok(None) if unsupported)",
                );
            }
            settle_tree(checker, &mut twins[i].1, tree, None, "propose_tree_batch");
        }
    }
}

/// Checks `tree` (what `method` returned for `seq`, under `mask` if any) and advances `seq`
/// along its accepted path; false when the tree is malformed and `seq` was ended.
fn settle_tree(
    checker: &mut Checker<'_>,
    seq: &mut Sequence,
    tree: &DraftTree,
    mask: Option<&[i32]>,
    method: &str,
) -> bool {
    let (budget, vocab) = (checker.options.num_drafts, checker.options.vocab_size);
    if let Some(fault) = tree.fault(budget, vocab) {
        checker
            .report
            .violate(method, format!("returned a tree with {fault}"), FIX_SHAPE);
        checker.end(seq);
        return false;
    }
    if let Some(mask) = mask {
        if let Some((node, &bad)) = tree
            .tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| !bitmask_allows(mask, t))
        {
            checker.report.violate(
                &format!("{method}: grammar mask"),
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
    true
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
