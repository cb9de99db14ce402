//! The adaptive policy cuts a draft tree's unsure nodes before its verify, as it cuts a
//! chain's doubted tail: a sibling the proposer reports at 5% goes (its rows are not paid
//! for) while the sure branch beside it is verified, and the proposer is told the accepted
//! path in its own node indices. The fixed policy verifies the whole tree. Greedy output
//! is the target's own either way.

mod engine_common;

use engine_common::*;
use specdraft::backend::DevicePtr;
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{
    CostCurve, CostCurves, DraftPolicyKind, FixedCost, GenerateRequest, Generation, SpecEngine,
};
use specdraft::model::ForwardContext;
use specdraft::speculative::{DelegatingProposer, DraftProposer, DraftTree, ProposerState};
use specdraft::Result;
use std::sync::{Arc, Mutex};

const VOCAB: u32 = 48;

/// The oracle's continuation under a wrong first sibling: node 0 a wrong token reported
/// at 0.05, node 1 the right one at 0.9, and the rest of the continuation under node 1,
/// each at 0.9. Records every accepted path it is told.
struct Forked {
    oracle: Arc<Oracle>,
    /// The probability the right nodes are reported at (0.9, or as unsure as the sibling).
    sure: f32,
    paths: Mutex<Vec<Vec<usize>>>,
}

#[allow(clippy::too_many_arguments)]
impl DelegatingProposer for Forked {
    fn inner(&self) -> &dyn DraftProposer {
        self.oracle.as_ref()
    }
    fn grows_trees(&self) -> bool {
        true
    }
    fn propose_tree(
        &self,
        last: u32,
        h: DevicePtr,
        position: usize,
        budget: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        d: Option<DevicePtr>,
        mask: Option<&[i32]>,
        stack: Option<DevicePtr>,
    ) -> Result<DraftTree> {
        let n = budget.saturating_sub(1);
        let chain = self
            .oracle
            .propose(last, h, position, n, state, ctx, stream, d, mask, stack)?;
        if chain.is_empty() {
            return Ok(DraftTree::default());
        }
        let mut tokens = vec![(chain[0] + 1) % VOCAB];
        tokens.extend(&chain);
        let parents = (0..tokens.len())
            .map(|i| i.checked_sub(1).filter(|&p| p > 0))
            .collect();
        let mut probs = vec![0.05];
        probs.extend(std::iter::repeat_n(self.sure, chain.len()));
        Ok(DraftTree {
            tokens,
            parents,
            probs: Some(probs),
        })
    }
    fn after_verify_tree(&self, path: &[usize], s: &mut dyn ProposerState, st: u64) -> Result<()> {
        self.paths.lock().unwrap().push(path.to_vec());
        // The path runs down the continuation (nodes 1, 2, ...): that many of the oracle's
        // drafts were accepted.
        self.oracle.after_verify(path.len(), s, st)
    }
}

#[test]
fn an_unsure_sibling_is_cut_and_the_proposer_told_its_own_path() {
    let gpu = cpu();
    let target = table(&gpu);
    let mut cut = [0u64; 2];
    for (k, policy) in [DraftPolicyKind::Adaptive, DraftPolicyKind::Fixed]
        .into_iter()
        .enumerate()
    {
        let (forked, g) = run(&target, 0.9, policy);
        let paths = forked.paths.lock().unwrap();
        assert!(paths.len() > 10, "{policy:?}: {} tree steps", paths.len());
        // Every path runs down the continuation, counted in the proposer's own nodes.
        for p in paths.iter() {
            let down: Vec<usize> = (1..=p.len()).collect();
            assert_eq!(*p, down, "{policy:?}");
        }
        // Every verified node but a sibling is right: what was verified and not accepted
        // is the siblings sent.
        cut[k] = g.metrics.drafted - g.metrics.accepted;
        assert!(g.metrics.accepted > 0);
    }
    // The fixed policy sends every sibling; the adaptive one cuts them once the verify
    // costs are known (the cold start's first steps send them).
    assert!(cut[1] > 10, "fixed: {} siblings verified", cut[1]);
    assert!(cut[0] <= 2, "adaptive: {} siblings verified", cut[0]);
}

/// One costs where a node pays when it brings more than about a fifth of a token (one row
/// 1 s, each more 0.25 s): two prompts through [`Forked`], its right nodes reported at
/// `sure`, under `policy`, checking greedy output.
fn run(target: &Arc<TableTarget>, sure: f32, policy: DraftPolicyKind) -> (Arc<Forked>, Generation) {
    let prompts = vec![vec![10, 3, 1, 4, 1, 5], vec![20, 2, 7, 1, 8]];
    let want = baseline(target, &prompts, 48);
    let cost = Arc::new(FixedCost(CostCurves {
        verify: CostCurve::from_points([(1, 1.0), (2, 1.25)]),
        draft: CostCurve::from_points([(0, 0.0)]),
    }));
    let forked = Arc::new(Forked {
        oracle: Arc::new(Oracle {
            target: target.clone(),
            fail: None,
        }),
        sure,
        paths: Mutex::new(Vec::new()),
    });
    let engine = SpecEngine::new(target.clone(), Some(forked.clone()), 4)
        .unwrap()
        .with_cost_model(cost)
        .with_draft_policy(policy);
    assert!(engine.drafts_trees());
    let requests = prompts
        .iter()
        .map(|p| GenerateRequest::new(p.clone(), 48))
        .collect();
    let g = engine.generate(requests);
    for (r, w) in g.results.iter().zip(&want) {
        assert!(r.error.is_none(), "{:?}", r.error);
        assert_eq!(&r.tokens, w, "{policy:?}");
    }
    (forked, g)
}

#[test]
fn a_tree_cut_to_nothing_is_verified_as_no_drafts_and_settled_as_a_tree() {
    let gpu = cpu();
    let target = table(&gpu);
    // Every node reported at 5%: once the costs are known nothing is sent, yet every tree
    // step is settled through after_verify_tree, with an empty path.
    let (forked, g) = run(&target, 0.05, DraftPolicyKind::Adaptive);
    let paths = forked.paths.lock().unwrap();
    let empty = paths.iter().filter(|p| p.is_empty()).count();
    assert!(empty > 5, "{empty} empty paths of {}", paths.len());
    assert!(
        g.metrics.drafted < 10,
        "{} drafts verified",
        g.metrics.drafted
    );
}
