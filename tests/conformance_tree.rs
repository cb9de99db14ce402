//! `propose_tree`: its default is `propose`'s chain, a proposer's own tree passes
//! `check_proposer`, and `check_proposer` names each way a tree can be malformed.

mod conformance_common;

use conformance_common::assert_reported;
use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig, ModelLevers};
use specdraft::speculative::conformance::{check_proposer, CheckOptions, ConformanceReport};
use specdraft::speculative::{
    bitmask_allows, DraftProposer, DraftTree, PromptLookup, ProposerState, SuffixDecoding,
};
use specdraft::Result;
use std::sync::Arc;

/// How a test tree proposer shapes its tree; it drafts as PromptLookup otherwise.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Shape {
    /// Two roots, a child of the second and its grandchild.
    Good,
    /// A node that is its own parent (the edge of "parent before child").
    OwnParent,
    /// One node more than the budget.
    OverBudget,
    /// A token outside the vocabulary.
    OutOfVocab,
    /// A probability above 1.
    BadProb,
    /// Fewer parents than tokens.
    ShortParents,
    /// The last node ignores the grammar mask.
    IgnoresMask,
}

struct TreeDrafter {
    inner: PromptLookup,
    shape: Shape,
}

impl DraftProposer for TreeDrafter {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        self.inner.alloc_state(gpu)
    }

    fn propose(
        &self,
        last_token: u32,
        h: DevicePtr,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        e: Option<DevicePtr>,
        mask: Option<&[i32]>,
        stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        self.inner.propose(
            last_token, h, position, num_drafts, state, ctx, stream, e, mask, stack,
        )
    }

    fn after_verify(&self, n: usize, state: &mut dyn ProposerState, stream: u64) -> Result<()> {
        self.inner.after_verify(n, state, stream)
    }

    fn prefill_drafter(
        &self,
        prompt: &[u32],
        hiddens: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<usize> {
        self.inner
            .prefill_drafter(prompt, hiddens, state, ctx, stream)
    }

    fn propose_tree(
        &self,
        last_token: u32,
        _h: DevicePtr,
        _position: usize,
        budget: usize,
        _state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        _stream: u64,
        _e: Option<DevicePtr>,
        mask: Option<&[i32]>,
        _stack: Option<DevicePtr>,
    ) -> Result<DraftTree> {
        let vocab = ctx.config.vocab_size as u32;
        // IgnoresMask takes for its last node a token the mask forbids; every other node
        // is the next allowed id after the one before it.
        let allowed = |t: u32| mask.is_none_or(|m| bitmask_allows(m, t));
        let next = |from: u32, want: bool| {
            (1..vocab)
                .map(|k| (from + k) % vocab)
                .find(|&t| allowed(t) == want)
        };
        // Two roots, a child under the second and a grandchild under that.
        let shape: [Option<usize>; 4] = [None, None, Some(1), Some(2)];
        let mut tree = DraftTree::default();
        let mut from = last_token;
        for (i, &parent) in shape.iter().enumerate().take(budget) {
            let forbidden =
                self.shape == Shape::IgnoresMask && mask.is_some() && i + 1 == budget.min(4);
            let Some(t) = next(from, !forbidden) else {
                break;
            };
            tree.tokens.push(t);
            tree.parents.push(parent);
            from = t;
        }
        tree.probs = Some(vec![0.5; tree.len()]);
        let last = tree.len().saturating_sub(1);
        match self.shape {
            Shape::Good | Shape::IgnoresMask => {}
            Shape::OwnParent => tree.parents[last] = Some(last),
            Shape::OverBudget => {
                while tree.len() <= budget {
                    tree.tokens.push(0);
                    tree.parents.push(None);
                    tree.probs.as_mut().unwrap().push(0.1);
                }
            }
            Shape::OutOfVocab => tree.tokens[last] = vocab,
            Shape::BadProb => tree.probs.as_mut().unwrap()[last] = 1.5,
            Shape::ShortParents => {
                tree.parents.pop();
            }
        }
        Ok(tree)
    }
}

fn check(shape: Shape) -> ConformanceReport {
    let p = TreeDrafter {
        inner: PromptLookup::default(),
        shape,
    };
    check_proposer(
        &p,
        &CheckOptions {
            label: format!("{shape:?}"),
            ..CheckOptions::default()
        },
    )
}

#[test]
fn a_real_tree_passes_and_is_checked() {
    let report = check(Shape::Good);
    assert!(report.is_ok(), "{report}");
    assert!(report.checks_run.iter().any(|c| c == "propose_tree"));
}

#[test]
fn the_built_in_tree_proposers_pass_every_check() {
    let proposers: [(&str, Box<dyn DraftProposer>); 2] = [
        (
            "prompt lookup trees",
            Box::new(PromptLookup::default().with_trees(true)),
        ),
        (
            "suffix trees",
            Box::new(SuffixDecoding::default().with_trees(true)),
        ),
    ];
    for (label, p) in proposers {
        assert!(p.grows_trees(), "{label}");
        let report = check_proposer(
            &*p,
            &CheckOptions {
                label: label.into(),
                ..CheckOptions::default()
            },
        );
        assert!(report.is_ok(), "{report}");
        assert!(report.checks_run.iter().any(|c| c == "propose_tree"));
    }
}

#[test]
fn the_default_tree_is_proposes_chain() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let config = ModelConfig::tiny(64);
    let slots = specdraft::model::layers::arena_slots(&config);
    let arena = BufferArena::new(&*gpu, "arena", &slots, 16).unwrap();
    let ctx = ForwardContext::new(
        gpu.clone(),
        Arc::new(arena),
        Arc::new(config),
        ModelLevers::default(),
    );
    let p = PromptLookup::default();
    let prompt = [1u32, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1];
    let h = DevicePtr(0);
    let mut a = p.alloc_state(&*gpu).unwrap();
    let mut b = p.alloc_state(&*gpu).unwrap();
    for s in [&mut a, &mut b] {
        p.prefill_drafter(&prompt, h, &mut **s, &ctx, 0).unwrap();
    }
    let chain = p
        .propose(2, h, 11, 4, &mut *a, &ctx, 0, None, None, None)
        .unwrap();
    let tree = p
        .propose_tree(2, h, 11, 4, &mut *b, &ctx, 0, None, None, None)
        .unwrap();
    assert_eq!(chain, [3, 4, 5, 1]);
    assert_eq!(tree.tokens, chain);
    assert_eq!(tree.parents, [None, Some(0), Some(1), Some(2)]);
    assert_eq!(tree.probs, None);
}

#[test]
fn a_parent_not_before_its_child_is_named() {
    assert_reported(
        &check(Shape::OwnParent),
        "propose_tree",
        "which does not come before it",
    );
}

#[test]
fn a_tree_over_budget_is_named() {
    assert_reported(
        &check(Shape::OverBudget),
        "propose_tree",
        "5 nodes, over the budget of 4",
    );
}

#[test]
fn a_token_outside_the_vocabulary_is_named() {
    assert_reported(
        &check(Shape::OutOfVocab),
        "propose_tree",
        "outside the vocabulary of 64",
    );
}

#[test]
fn a_probability_outside_0_1_is_named() {
    assert_reported(
        &check(Shape::BadProb),
        "propose_tree",
        "probability 1.5, outside [0, 1]",
    );
}

#[test]
fn parents_not_one_per_token_are_named() {
    assert_reported(&check(Shape::ShortParents), "propose_tree", "parents for");
}

#[test]
fn a_node_the_grammar_forbids_is_named() {
    assert_reported(
        &check(Shape::IgnoresMask),
        "propose_tree: grammar mask",
        "which the grammar_bitmask forbids",
    );
}
