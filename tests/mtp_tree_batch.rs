//! The MTP head's trees in batches: `propose_tree_batch` grows, for every sequence, the tree
//! `propose_tree` grows for it alone (tokens, parents and probabilities), and after the
//! verify each sequence's drafter KV holds its accepted path bit for bit as the lone tree's
//! state does; bad batches are refused by name, and every block and byte comes back.

mod mtp_common;

use mtp_common::*;
use specdraft::model::ModelLevers;
use specdraft::speculative::mtp::MTP_MAX_BATCH;
use specdraft::speculative::{DraftProposer, DraftTree, MtpQuantization, ProposerState};

fn fixture(name: &str) -> Fixture {
    Fixture::new(
        name,
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    )
}

fn batch(
    f: &Fixture,
    starts: &[usize],
    budget: usize,
    states: &mut [Box<dyn ProposerState>],
) -> specdraft::Result<Option<Vec<DraftTree>>> {
    let last: Vec<u32> = starts.iter().map(|&p| f.tokens[p]).collect();
    let hiddens: Vec<_> = starts.iter().map(|&p| f.hidden(p - 1)).collect();
    let mut refs: Vec<&mut dyn ProposerState> = states
        .iter_mut()
        .map(|s| -> &mut dyn ProposerState { &mut **s })
        .collect();
    f.head()
        .propose_tree_batch(&last, &hiddens, starts, budget, &mut refs, &f.ctx, 0)
}

#[test]
fn a_batch_grows_each_sequences_lone_tree_and_keeps_its_path() {
    let f = fixture("tree_batch");
    let head = f.head();
    // The verified rows fall mid-block, at a block's end and at a block's start.
    let mut starts = vec![8usize, 15, 16, 30];
    let mut batched: Vec<_> = starts.iter().map(|_| f.state()).collect();
    let mut alone: Vec<_> = starts.iter().map(|_| f.state()).collect();
    for (i, &p) in starts.iter().enumerate() {
        f.prefill(&mut *batched[i], p);
        f.prefill(&mut *alone[i], p);
    }
    let mut branched = 0;
    for round in 0..3 {
        let budget = [8, 5, 8][round];
        let trees = batch(&f, &starts, budget, &mut batched).unwrap().unwrap();
        assert_eq!(trees.len(), starts.len());
        for (i, tree) in trees.iter().enumerate() {
            let want = f.propose_tree(&mut *alone[i], starts[i], budget);
            assert_eq!(tree, &want, "round {round}, sequence {i}");
            assert!(tree.len() <= budget);
            branched += usize::from(!tree.is_chain());
            // Accept a different path in each sequence: the deepest node under the
            // root's `i % 2`-th child, so some paths leave the greedy branch.
            let roots: Vec<usize> = (0..tree.len())
                .filter(|&n| tree.parents[n].is_none())
                .collect();
            let root = roots[(i % 2).min(roots.len() - 1)];
            let node = (0..tree.len())
                .filter(|&n| path_to(tree, n)[0] == root)
                .max_by_key(|&n| path_to(tree, n).len())
                .unwrap();
            let path = path_to(tree, node);
            head.after_verify_tree(&path, &mut *batched[i], 0).unwrap();
            head.after_verify_tree(&path, &mut *alone[i], 0).unwrap();
            let (got, want) = (
                f.drafter_kv_rows(&mut *batched[i]),
                f.drafter_kv_rows(&mut *alone[i]),
            );
            assert_eq!(got.len(), want.len(), "round {round}, sequence {i}");
            for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "round {round}, sequence {i}: drafter row {r} differs");
            }
            starts[i] += path.len() + 1;
        }
    }
    assert!(branched >= 6, "only {branched} of 12 trees branched");
    for mut s in batched.into_iter().chain(alone) {
        head.free_state(f.gpu.as_ref(), &mut *s).unwrap();
    }
    f.finish();
}

#[test]
fn a_batch_without_drafts_or_with_bad_sizes_is_answered_or_refused_by_name() {
    let f = fixture("tree_batch_bad");
    let head = f.head();
    let mut states: Vec<_> = (0..2).map(|_| f.state()).collect();
    for s in states.iter_mut() {
        f.prefill(&mut **s, 10);
    }
    // A budget of 0 drafts nothing, as propose_tree's chain of none.
    let trees = batch(&f, &[10, 10], 0, &mut states).unwrap().unwrap();
    assert!(trees.iter().all(|t| t.is_empty()));
    for s in states.iter_mut() {
        head.after_verify(0, &mut **s, 0).unwrap();
    }
    // One position for two sequences.
    let mut refs: Vec<&mut dyn ProposerState> = states
        .iter_mut()
        .map(|s| -> &mut dyn ProposerState { &mut **s })
        .collect();
    let err = head
        .propose_tree_batch(
            &[f.tokens[11], f.tokens[11]],
            &[f.hidden(10), f.hidden(10)],
            &[11],
            4,
            &mut refs,
            &f.ctx,
            0,
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("propose_tree_batch") && err.contains("positions"),
        "{err}"
    );
    // Wider than the head batches.
    let n = MTP_MAX_BATCH + 1;
    let mut wide: Vec<_> = (0..n).map(|_| f.state()).collect();
    let err = batch(&f, &vec![11; n], 4, &mut wide)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("propose_tree_batch") && err.contains(&MTP_MAX_BATCH.to_string()),
        "{err}"
    );
    for mut s in states.into_iter().chain(wide) {
        head.free_state(f.gpu.as_ref(), &mut *s).unwrap();
    }
    f.finish();
}

#[test]
fn a_one_node_tree_is_proposes_one_draft_chain_alone_and_in_a_batch() {
    let f = fixture("tree_one_node");
    let head = f.head();
    let mut states: Vec<_> = (0..3).map(|_| f.state()).collect();
    for s in states.iter_mut() {
        f.prefill(&mut **s, 12);
    }
    let chain = f.propose(&mut *states[0], 12, 1);
    assert_eq!(chain.len(), 1);
    head.after_verify(0, &mut *states[0], 0).unwrap();
    let tree = f.propose_tree(&mut *states[1], 12, 1);
    assert_eq!(tree, DraftTree::chain(chain.clone()));
    head.after_verify(0, &mut *states[1], 0).unwrap();
    let trees = batch(&f, &[12], 1, &mut states[2..]).unwrap().unwrap();
    assert_eq!(trees, [DraftTree::chain(chain)]);
    head.after_verify(0, &mut *states[2], 0).unwrap();
    for mut s in states {
        head.free_state(f.gpu.as_ref(), &mut *s).unwrap();
    }
    f.finish();
}
