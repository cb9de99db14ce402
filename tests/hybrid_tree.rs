//! `Hybrid` drafting trees: it grows trees when a member does; the winner's tree is the
//! hybrid's, exactly what the member grows alone; after a verify every member keeps the path
//! of its own tree that the accepted tokens follow, so an `MtpHead` member's drafter KV equals
//! a lone head's bit for bit whether it won the step or drafted and lost; paths and trees
//! that break the protocol are refused by name; the conformance check passes; and through
//! the engine greedy output equals plain output, alone and in tree batches, with nothing
//! leaked.

mod engine_common;
mod mtp_common;

use engine_common::counted::Counted;
use mtp_common::*;
use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{DraftPolicyKind, SpecEngine};
use specdraft::model::{ForwardContext, ModelLevers};
use specdraft::speculative::conformance::{check_proposer_on, CheckOptions};
use specdraft::speculative::{
    DraftProposer, DraftTree, Hybrid, HybridMember, HybridState, MtpHead, MtpQuantization,
    ProposerState, SuffixDecoding,
};
use specdraft::Result;
use std::sync::atomic::Ordering;
use std::sync::Arc;

const BUDGET: usize = 8;

fn fixture(name: &str) -> Fixture {
    let f = Fixture::new(
        name,
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    f.head().set_grow_trees(true);
    f
}

/// A second head with the fixture's weights, growing trees where `trees`.
fn twin_head(f: &Fixture, name: &str, trees: bool) -> Arc<MtpHead> {
    let head = f.twin_head(&format!("{name}_{trees}"));
    head.set_grow_trees(trees);
    head
}

/// Every drafter KV row member `i` of the hybrid state `hs` holds, as raw BF16 bits.
fn member_kv_rows(
    head: &MtpHead,
    gpu: &dyn GpuBackend,
    hs: &mut dyn ProposerState,
    i: usize,
) -> Vec<Vec<u16>> {
    let st = hs.as_any_mut().downcast_mut::<HybridState>().unwrap();
    kv_rows(head, gpu, st.member(i).unwrap())
}

/// Asserts two sets of KV rows are equal, naming the first row that differs.
fn assert_same_rows(got: &[Vec<u16>], want: &[Vec<u16>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: rows held");
    let differs = (0..got.len()).find(|&r| got[r] != want[r]);
    assert_eq!(differs, None, "{what}: first row that differs");
}

fn hybrid_tree(
    hybrid: &Hybrid,
    f: &Fixture,
    hs: &mut dyn ProposerState,
    pos: usize,
) -> Result<DraftTree> {
    hybrid.propose_tree(
        f.tokens[pos],
        f.hidden(pos - 1),
        pos,
        BUDGET,
        hs,
        &f.ctx,
        0,
        None,
        None,
        None,
    )
}

/// The path to the deepest node with children off the tree's greedy branch (else the
/// deepest with children): a path a chain would not have drafted.
fn off_greedy_path(tree: &DraftTree) -> Vec<usize> {
    let second = |n: usize| (0..n).any(|i| tree.parents[i] == tree.parents[n]);
    let off = |n: usize| path_to(tree, n).iter().any(|&m| second(m));
    let node = (0..tree.len())
        .filter(|&n| tree.parents.contains(&Some(n)))
        .max_by_key(|&n| (off(n), path_to(tree, n).len()))
        .expect("a tree of 8 nodes runs some node");
    path_to(tree, node)
}

#[test]
fn a_winning_members_tree_is_the_hybrids_and_its_kv_keeps_the_accepted_path() {
    let f = fixture("hybrid_tree_win");
    let member = twin_head(&f, "hybrid_tree_win", true);
    let hybrid = Hybrid::new(vec![HybridMember::new("MtpHead", member.clone())], None).unwrap();
    assert!(hybrid.grows_trees());
    let gpu = f.gpu.as_ref();
    let (mut lone, mut hs) = (f.state(), hybrid.alloc_state_for(gpu, 400).unwrap());
    let start = 14;
    f.prefill(&mut *lone, start);
    hybrid
        .prefill_drafter(&f.tokens[..start], f.hiddens, &mut *hs, &f.ctx, 0)
        .unwrap();
    let (mut pos, mut off_greedy) = (start, 0);
    for round in 0..5 {
        let want = f.propose_tree(&mut *lone, pos, BUDGET);
        let got = hybrid_tree(&hybrid, &f, &mut *hs, pos).unwrap();
        assert_eq!(got, want, "round {round}");
        assert!(!got.is_chain(), "round {round}: {got:?}");
        let path = off_greedy_path(&got);
        // A path other than the first nodes: a chain's settling would keep other rows.
        off_greedy += usize::from(path.iter().enumerate().any(|(k, &n)| n != k));
        f.head().after_verify_tree(&path, &mut *lone, 0).unwrap();
        hybrid.after_verify_tree(&path, &mut *hs, 0).unwrap();
        let (got, want) = (
            member_kv_rows(&member, gpu, &mut *hs, 0),
            f.drafter_kv_rows(&mut *lone),
        );
        assert_same_rows(&got, &want, &format!("round {round}, path {path:?}"));
        pos += path.len() + 1;
    }
    assert!(off_greedy > 0, "no path left the tree's node order");
    f.head().free_state(gpu, &mut *lone).unwrap();
    hybrid.free_state(gpu, &mut *hs).unwrap();
    let (total, free) = member.kv_blocks();
    assert_eq!(total, free, "the member's drafter KV blocks still held");
    drop((hybrid, member));
    f.finish();
}

#[test]
fn a_member_whose_tree_lost_keeps_the_path_of_it_that_the_winner_got_accepted() {
    let f = fixture("hybrid_tree_lose");
    // The tree member never wins (it needs more nodes than the budget); the chain member,
    // the same weights growing no trees, drafts the tree's greedy branch and wins.
    let loser = twin_head(&f, "hybrid_tree_lose", true);
    let chain = twin_head(&f, "hybrid_tree_lose", false);
    let members = vec![
        HybridMember::new("trees", loser.clone()).with_min_drafts(BUDGET + 1),
        HybridMember::new("chain", chain.clone()),
    ];
    let hybrid = Hybrid::new(members, None).unwrap();
    let gpu = f.gpu.as_ref();
    let (mut lone, mut hs) = (f.state(), hybrid.alloc_state_for(gpu, 400).unwrap());
    let start = 15;
    f.prefill(&mut *lone, start);
    hybrid
        .prefill_drafter(&f.tokens[..start], f.hiddens, &mut *hs, &f.ctx, 0)
        .unwrap();
    let (mut pos, mut deepest) = (start, 0);
    for (round, planned) in [2usize, 1, 3, 0, 2, 3].into_iter().enumerate() {
        let tree = f.propose_tree(&mut *lone, pos, BUDGET);
        let got = hybrid_tree(&hybrid, &f, &mut *hs, pos).unwrap();
        assert!(got.is_chain(), "round {round}: the chain member wins");
        assert!(
            !tree.is_chain(),
            "round {round}: the tree member's tree branches"
        );
        // Along the greedy branch, as deep as the tree grew it, the tree and the chain
        // agree: the chain's first drafts follow a path of the tree.
        let greedy = tree.accepted_path(&got.tokens);
        assert!(!greedy.is_empty(), "round {round}: {tree:?} vs {got:?}");
        let accepted = planned.min(greedy.len());
        deepest = deepest.max(accepted);
        let path = greedy[..accepted].to_vec();
        f.head().after_verify_tree(&path, &mut *lone, 0).unwrap();
        hybrid.after_verify(accepted, &mut *hs, 0).unwrap();
        let (got, want) = (
            member_kv_rows(&loser, gpu, &mut *hs, 0),
            f.drafter_kv_rows(&mut *lone),
        );
        assert_same_rows(&got, &want, &format!("round {round}, path {path:?}"));
        pos += accepted + 1;
    }
    assert!(deepest >= 2, "no step accepted more than one node");
    f.head().free_state(gpu, &mut *lone).unwrap();
    hybrid.free_state(gpu, &mut *hs).unwrap();
    for head in [&loser, &chain] {
        let (total, free) = head.kv_blocks();
        assert_eq!(total, free, "a member's drafter KV blocks still held");
    }
    drop((hybrid, loser, chain));
    f.finish();
}

/// Drafts a tree whose second node names itself as its parent.
struct Malformed;

#[derive(Default)]
struct Nothing;
specdraft::impl_proposer_state!(Nothing);

#[allow(clippy::too_many_arguments)]
impl DraftProposer for Malformed {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(Nothing))
    }
    fn propose(
        &self,
        _last: u32,
        _h: DevicePtr,
        _pos: usize,
        _n: usize,
        _s: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _st: u64,
        _d: Option<DevicePtr>,
        _m: Option<&[i32]>,
        _k: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        Ok(Vec::new())
    }
    fn after_verify(&self, _a: usize, _s: &mut dyn ProposerState, _st: u64) -> Result<()> {
        Ok(())
    }
    fn propose_tree(
        &self,
        _last: u32,
        _h: DevicePtr,
        _pos: usize,
        _budget: usize,
        _s: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _st: u64,
        _d: Option<DevicePtr>,
        _m: Option<&[i32]>,
        _k: Option<DevicePtr>,
    ) -> Result<DraftTree> {
        Ok(DraftTree {
            tokens: vec![1, 2],
            parents: vec![None, Some(1)],
            probs: None,
        })
    }
    fn grows_trees(&self) -> bool {
        true
    }
}

#[test]
fn paths_and_trees_that_break_the_protocol_are_refused_by_name() {
    let f = fixture("hybrid_tree_errors");
    let member = twin_head(&f, "hybrid_tree_errors", true);
    let hybrid = Hybrid::new(vec![HybridMember::new("MtpHead", member.clone())], None).unwrap();
    let gpu = f.gpu.as_ref();
    let mut hs = hybrid.alloc_state_for(gpu, 400).unwrap();
    hybrid
        .prefill_drafter(&f.tokens[..12], f.hiddens, &mut *hs, &f.ctx, 0)
        .unwrap();
    let tree = hybrid_tree(&hybrid, &f, &mut *hs, 12).unwrap();
    assert!(!tree.is_chain());
    // A branching tree is not settled by a count.
    let err = hybrid.after_verify(1, &mut *hs, 0).unwrap_err().to_string();
    assert!(err.contains("after_verify_tree"), "{err}");
    // Nor by a path that is not one of its paths.
    let orphan = (0..tree.len())
        .find(|&n| tree.parents[n].is_some())
        .unwrap();
    let tree = hybrid_tree(&hybrid, &f, &mut *hs, 12).unwrap();
    let err = hybrid
        .after_verify_tree(&[orphan], &mut *hs, 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a path of the tree"), "{err}");
    // A step settled, and the next one with the tree's first node.
    let tree2 = hybrid_tree(&hybrid, &f, &mut *hs, 12).unwrap();
    assert_eq!(tree2, tree);
    hybrid.after_verify_tree(&[0], &mut *hs, 0).unwrap();
    let err = hybrid
        .after_verify_tree(&[0], &mut *hs, 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no propose is waiting"), "{err}");
    hybrid.free_state(gpu, &mut *hs).unwrap();
    // A member's malformed tree fails the call, naming the member.
    let bad = Hybrid::new(
        vec![HybridMember::new("Malformed", Arc::new(Malformed))],
        None,
    )
    .unwrap();
    let mut bs = bad.alloc_state_for(gpu, 400).unwrap();
    bad.prefill_drafter(&f.tokens[..12], f.hiddens, &mut *bs, &f.ctx, 0)
        .unwrap();
    let err = hybrid_tree(&bad, &f, &mut *bs, 12).unwrap_err().to_string();
    assert!(err.contains("Malformed") && err.contains("parent"), "{err}");
    bad.free_state(gpu, &mut *bs).unwrap();
    drop((hybrid, member));
    f.finish();
}

#[test]
fn conformance_passes_with_growing_members() {
    let f = fixture("hybrid_tree_conformance");
    let member = twin_head(&f, "hybrid_tree_conformance", true);
    let members = vec![
        HybridMember::new(
            "SuffixDecoding",
            Arc::new(SuffixDecoding::default().with_trees(true)),
        ),
        HybridMember::new("MtpHead", member.clone()),
    ];
    let hybrid = Hybrid::new(members, None).unwrap();
    let options = CheckOptions {
        label: "Hybrid trees".into(),
        vocab_size: VOCAB,
        hidden_size: HIDDEN,
        num_sequences: 3,
        num_drafts: 6,
        steps: 8,
        seed: 4,
    };
    let report = check_proposer_on(&hybrid, f.gpu.clone(), &options);
    assert!(report.violations.is_empty(), "{report:?}");
    for check in ["propose_tree", "propose_tree_batch"] {
        assert!(report.checks_run.iter().any(|c| c == check), "{check}");
    }
    drop((hybrid, member));
    f.finish();
}

#[test]
fn through_the_engine_greedy_output_is_plain_output_alone_and_in_tree_batches() {
    let dir = scratch_dir("hybrid_tree_engine");
    write_checkpoint(&dir, "deepseek_v3", 5);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let head = Arc::new(
        MtpHead::from_checkpoint(
            &dir,
            gpu.clone(),
            MtpQuantization::Bf16,
            0,
            512,
            256,
            &ModelLevers::default(),
        )
        .unwrap(),
    );
    head.set_grow_trees(true);
    let target = Arc::new(TableTarget::new(gpu.clone(), VOCAB, 512, 64, 2, 0.1).unwrap());
    let prompts = vec![
        vec![1, 2, 3, 4, 5, 1, 2, 3],
        vec![50, 60, 70, 80, 50, 60],
        vec![33, 34, 35, 36, 37],
        vec![9; 6],
    ];
    let base = engine_common::baseline(&target, &prompts, 24);
    for batches in [true, false] {
        let counted = Arc::new(Counted::new(head.clone(), batches));
        let members = vec![
            HybridMember::new(
                "SuffixDecoding",
                Arc::new(SuffixDecoding::default().with_trees(true)),
            ),
            HybridMember::new("MtpHead", counted.clone()),
        ];
        let hybrid = Arc::new(Hybrid::new(members, None).unwrap());
        let engine = SpecEngine::new(target.clone(), Some(hybrid), 5)
            .unwrap()
            .with_draft_policy(DraftPolicyKind::Fixed);
        assert!(engine.drafts_trees());
        let g = engine.generate(engine_common::requests(&prompts, 24));
        assert!(g.metrics.drafted > 0);
        for (i, r) in g.results.iter().enumerate() {
            assert!(r.error.is_none(), "{:?}", r.error);
            assert_eq!(r.tokens, base[i], "batches {batches}, prompt {i}");
        }
        let load = |c: &std::sync::atomic::AtomicUsize| c.load(Ordering::Relaxed);
        let (b, lone, settled) = (
            load(&counted.tree_batches),
            load(&counted.lone_trees),
            load(&counted.branch_settles),
        );
        if batches {
            assert!(b > 0 && lone == 0, "{b} tree batches, {lone} lone trees");
        } else {
            assert!(b == 0 && lone > 0, "{b} tree batches, {lone} lone trees");
        }
        assert!(settled > 0, "no tree of the head's branched");
        assert_eq!(target.live_sequences(), 0);
    }
    drop(target);
    let (total, free) = head.kv_blocks();
    assert_eq!(total, free, "drafter KV blocks still held");
    drop(head);
    assert_eq!(gpu.ledger().live_count(), 0);
}
