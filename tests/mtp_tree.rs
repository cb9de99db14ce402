//! The MTP head's dynamic draft trees: a tree is well formed and grown best first from the
//! head's own top choices (its first branch is `propose`'s chain); after a verify, the
//! head's KV holds the accepted path bit for bit as a chain drafting that path writes it,
//! wherever the tree's rows fall against the drafter's blocks; the conformance checker
//! accepts the trees; and every block and byte comes back.

mod mtp_common;

use mtp_common::*;
use specdraft::model::ModelLevers;
use specdraft::speculative::conformance::{check_proposer_on, CheckOptions};
use specdraft::speculative::mtp::TREE_TOP_K;
use specdraft::speculative::{DraftProposer, DraftTree, MtpQuantization, MtpState, ProposerState};

fn fixture(name: &str, levers: ModelLevers) -> Fixture {
    Fixture::new(name, "deepseek_v3", levers, MtpQuantization::Bf16)
}

fn keys(state: &mut dyn ProposerState) -> Vec<usize> {
    let st: &MtpState = state.as_any().downcast_ref().unwrap();
    st.pair_keys().to_vec()
}

/// Whether `node` is not the first child its parent was given.
fn second_choice(tree: &DraftTree, node: usize) -> bool {
    (0..node).any(|i| tree.parents[i] == tree.parents[node])
}

#[test]
fn the_reference_chain_writes_proposes_rows() {
    let f = fixture("tree_reference", ModelLevers::default());
    let head = f.head();
    let (mut a, mut b) = (f.state(), f.state());
    f.prefill(&mut *a, 8);
    f.prefill(&mut *b, 8);
    let drafts = f.propose(&mut *a, 8, 4);
    assert_eq!(drafts.len(), 4);
    let want_logits = head.last_logits(f.gpu.as_ref(), 0).unwrap();
    head.after_verify(4, &mut *a, 0).unwrap();
    let got_logits = head
        .write_chain_rows(
            f.gpu.as_ref(),
            &mut *b,
            f.tokens[8],
            f.hidden(7),
            8,
            &drafts[..3],
            0,
        )
        .unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got_logits), bits(&want_logits));
    assert_eq!(f.drafter_kv_rows(&mut *b), f.drafter_kv_rows(&mut *a));
    assert_eq!(keys(&mut *b), keys(&mut *a));
    for mut s in [a, b] {
        head.free_state(f.gpu.as_ref(), &mut *s).unwrap();
    }
    f.finish();
}

/// The `k` most probable ids of `logits` under a softmax, highest first (ties to the lower
/// id), with their probabilities.
fn top(logits: &[f32], k: usize) -> Vec<(u32, f64)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let mut ids: Vec<usize> = (0..logits.len()).collect();
    ids.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    ids.into_iter()
        .take(k)
        .map(|i| (i as u32, (logits[i] as f64 - max).exp() / z))
        .collect()
}

#[test]
fn a_tree_is_grown_best_first_from_the_heads_top_choices() {
    let f = fixture("tree_shape", ModelLevers::default());
    let head = f.head();
    let (mut t, mut r) = (f.state(), f.state());
    f.prefill(&mut *t, 10);
    f.prefill(&mut *r, 10);
    let budget = 9;
    let tree = f.propose_tree(&mut *t, 10, budget);
    assert_eq!(tree.fault(budget, VOCAB), None);
    assert_eq!(tree.len(), budget);
    assert!(!tree.is_chain(), "{tree:?}");
    let probs = tree
        .probs
        .clone()
        .expect("the head gives each node's probability");
    // Each node run (all but the last) offers its top children, which the head's chain
    // rows over the node's path give: the reference candidates, keyed by parent.
    let mut offered: Vec<(Option<usize>, u32, f64)> = Vec::new();
    let parents_run = std::iter::once(None).chain((0..budget - 1).map(Some));
    for parent in parents_run {
        let path = parent.map_or(Vec::new(), |n| path_to(&tree, n));
        let tokens: Vec<u32> = path.iter().map(|&n| tree.tokens[n]).collect();
        let reach: f64 = path.iter().map(|&n| f64::from(probs[n])).product();
        let logits = head
            .write_chain_rows(
                f.gpu.as_ref(),
                &mut *r,
                f.tokens[10],
                f.hidden(9),
                10,
                &tokens,
                0,
            )
            .unwrap();
        let want = top(&logits, TREE_TOP_K);
        let kids: Vec<usize> = (0..budget).filter(|&i| tree.parents[i] == parent).collect();
        // A node's children are the first of its top choices, in order.
        for (k, &c) in kids.iter().enumerate() {
            assert_eq!(tree.tokens[c], want[k].0, "child {k} of {parent:?}");
            let p = f64::from(probs[c]);
            assert!(
                (p - want[k].1).abs() <= 1e-5 * want[k].1,
                "{p} vs {}",
                want[k].1
            );
        }
        offered.extend(
            want.iter()
                .skip(kids.len())
                .map(|&(t, p)| (parent, t, reach * p)),
        );
    }
    // Best first: no candidate left out is more probable than a node taken.
    let reach = |n: usize| -> f64 {
        path_to(&tree, n)
            .iter()
            .map(|&m| f64::from(probs[m]))
            .product()
    };
    let worst_taken = (0..budget).map(reach).fold(f64::INFINITY, f64::min);
    for (parent, token, p) in offered {
        assert!(
            p <= worst_taken * (1.0 + 1e-5),
            "{token} under {parent:?} ({p}) beats a node taken ({worst_taken})"
        );
    }
    assert!(probs.iter().all(|&p| p > 0.0 && p <= 1.0), "{probs:?}");
    // A state freed with its tree unverified gives every block back (checked by finish).
    for mut s in [t, r] {
        head.free_state(f.gpu.as_ref(), &mut *s).unwrap();
    }
    f.finish();
}

#[test]
fn the_kept_path_holds_a_chains_rows_bit_for_bit() {
    let f = fixture("tree_kv", ModelLevers::default());
    let head = f.head();
    let mut second_branches = 0;
    // The verified row in the middle of a block, at its end, at a block's start, and a
    // tree that crosses into the next block.
    for start in [8usize, 16, 17, 14, 31] {
        let (mut t, mut c) = (f.state(), f.state());
        f.prefill(&mut *t, start);
        f.prefill(&mut *c, start);
        let tree = f.propose_tree(&mut *t, start, 8);
        let has_child = |n: usize| tree.parents.contains(&Some(n));
        // The deepest node that was run (it has children) off the greedy branch, else the
        // deepest that was run.
        let off = |n: usize| path_to(&tree, n).iter().any(|&m| second_choice(&tree, m));
        let depth = |n: usize| path_to(&tree, n).len();
        let node = (0..tree.len())
            .filter(|&n| has_child(n))
            .max_by_key(|&n| (off(n), depth(n)))
            .expect("a tree of 8 nodes runs some node");
        second_branches += usize::from(off(node));
        let path = path_to(&tree, node);
        head.after_verify_tree(&path, &mut *t, 0).unwrap();
        assert_eq!(
            head.drafter_rows(&mut *t),
            start + path.len(),
            "start {start}"
        );
        let tokens: Vec<u32> = path.iter().map(|&n| tree.tokens[n]).collect();
        head.write_chain_rows(
            f.gpu.as_ref(),
            &mut *c,
            f.tokens[start],
            f.hidden(start - 1),
            start,
            &tokens,
            0,
        )
        .unwrap();
        assert_eq!(keys(&mut *t), keys(&mut *c), "start {start}");
        let (got, want) = (f.drafter_kv_rows(&mut *t), f.drafter_kv_rows(&mut *c));
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "start {start}, path {path:?}: row {r} differs");
        }
        // Both states draft the same next chain from there.
        let next = start + path.len() + 1;
        let from_tree = f.propose(&mut *t, next, 3);
        let logits_tree = head.last_logits(f.gpu.as_ref(), 0).unwrap();
        let from_chain = f.propose(&mut *c, next, 3);
        assert_eq!(from_tree, from_chain, "start {start}");
        assert_eq!(head.last_logits(f.gpu.as_ref(), 0).unwrap(), logits_tree);
        for mut s in [t, c] {
            head.free_state(f.gpu.as_ref(), &mut *s).unwrap();
        }
    }
    assert!(
        second_branches >= 3,
        "only {second_branches} paths left the greedy branch"
    );
    f.finish();
}

#[test]
fn the_rows_kept_follow_the_chain_rule() {
    for exact in [false, true] {
        let levers = ModelLevers {
            mtp_kv_exact: exact,
            ..ModelLevers::default()
        };
        let f = fixture(&format!("tree_rule_{exact}"), levers);
        let head = f.head();
        let mut s = f.state();
        f.prefill(&mut *s, 12);
        // Nothing accepted: the verified row alone stays.
        let tree = f.propose_tree(&mut *s, 12, 6);
        assert!(!tree.is_chain());
        head.after_verify_tree(&[], &mut *s, 0).unwrap();
        assert_eq!(head.drafter_rows(&mut *s), 12);
        // A path to a leaf keeps the rows of the nodes that were run: all but the leaf.
        let tree = f.propose_tree(&mut *s, 13, 6);
        let leaf = (0..tree.len())
            .rev()
            .find(|&n| tree.parents[n].is_some() && !tree.parents.contains(&Some(n)))
            .expect("a leaf below a root child");
        let path = path_to(&tree, leaf);
        head.after_verify_tree(&path, &mut *s, 0).unwrap();
        let kept = if exact { 0 } else { path.len() - 1 };
        assert_eq!(head.drafter_rows(&mut *s), 13 + kept, "exact {exact}");
        let pos = 13 + path.len() + 1;
        // A tree of one node is a chain, settled by after_verify: its one node was not
        // run, so the verified row alone is added.
        let before = head.drafter_rows(&mut *s);
        let tree = f.propose_tree(&mut *s, pos, 1);
        assert!(tree.is_chain() && tree.len() == 1);
        head.after_verify(1, &mut *s, 0).unwrap();
        assert_eq!(head.drafter_rows(&mut *s), before + 1);
        // A path that is not one is refused, and the tree's blocks still come back.
        let tree = f.propose_tree(&mut *s, pos + 1, 6);
        let orphan = (0..tree.len())
            .find(|&n| tree.parents[n].is_some())
            .unwrap();
        let err = head.after_verify_tree(&[orphan], &mut *s, 0).unwrap_err();
        assert!(err.to_string().contains("not a child"), "{err}");
        head.free_state(f.gpu.as_ref(), &mut *s).unwrap();
        f.finish();
    }
}

#[test]
fn conformance_passes_with_trees() {
    let f = fixture("tree_conformance", ModelLevers::default());
    f.head().set_grow_trees(true);
    assert!(f.head().grows_trees());
    let options = CheckOptions {
        label: "mtp trees".into(),
        vocab_size: VOCAB,
        hidden_size: HIDDEN,
        num_sequences: 3,
        num_drafts: 6,
        steps: 8,
        seed: 4,
    };
    let report = check_proposer_on(f.head(), f.gpu.clone(), &options);
    assert!(report.violations.is_empty(), "{report:?}");
    assert!(report.checks_run.iter().any(|c| c == "propose_tree"));
    assert!(report.checks_run.iter().any(|c| c == "propose_tree_batch"));
    f.finish();
}
