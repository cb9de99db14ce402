//! `Eagle3Head` drafting trees beside a tiny seeded target (four Llama layers, CPU
//! backend), with a reduced draft vocabulary: the conformance checker accepts its trees
//! (settled through `after_verify_tree`, the captured rows read where a chain reads them,
//! a batch's trees each the one its sequence grows alone),
//! greedy output through the engine with trees equals plain greedy output, and nothing
//! leaks.

mod drafter_fixtures;
#[allow(unused_imports)] // the helpers re-export a GGUF writer this test does not use
mod model_util;

use drafter_fixtures::{eagle3_beside, eagle3_target_shape};
use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::engine::{DraftPolicyKind, DraftShape, GenerateRequest, SpecEngine};
use specdraft::speculative::conformance::{check_proposer_on, CheckOptions};
use specdraft::speculative::DraftProposer;
use std::sync::Arc;

#[test]
fn eagle3_trees_pass_the_conformance_check() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let (_model, head) = eagle3_beside(&gpu, "tree_conformance");
    head.set_grow_trees(true);
    assert!(head.grows_trees());
    let options = CheckOptions {
        label: "Eagle3Head trees".into(),
        vocab_size: eagle3_target_shape().vocab,
        hidden_size: eagle3_target_shape().hidden,
        num_drafts: 6,
        steps: 10,
        ..CheckOptions::default()
    };
    let report = check_proposer_on(&*head, gpu.clone(), &options);
    assert!(report.is_ok(), "{report}");
    for check in ["propose_tree", "propose_tree_batch", "after_verify_tree"] {
        assert!(
            report.checks_run.iter().any(|c| c == check),
            "{check} not run: {:?}",
            report.checks_run
        );
    }
    assert_eq!(head.kv_blocks().0, head.kv_blocks().1, "blocks left taken");
}

#[test]
fn eagle3_trees_in_the_engine_keep_greedy_output_and_free_everything() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let (model, head) = eagle3_beside(&gpu, "tree_engine");
    head.set_grow_trees(true);
    let prompts: Vec<Vec<u32>> = vec![
        vec![1, 5, 17, 33, 4, 90, 12, 12, 7, 64, 5, 17, 33],
        vec![3, 22, 45, 8, 8, 61, 70, 9, 95, 40],
    ];
    let requests = || -> Vec<GenerateRequest> {
        prompts
            .iter()
            .map(|p| GenerateRequest::new(p.clone(), 24).ignore_eos())
            .collect()
    };
    let tokens = |g: specdraft::engine::Generation| -> Vec<Vec<u32>> {
        g.results
            .into_iter()
            .map(|r| {
                assert!(r.error.is_none(), "{:?}", r.error);
                r.tokens
            })
            .collect()
    };
    let plain = SpecEngine::new(model.clone(), None, 0).unwrap();
    let base = tokens(plain.generate(requests()));
    let engine = SpecEngine::new(
        model.clone(),
        Some(head.clone() as Arc<dyn DraftProposer>),
        5,
    )
    .unwrap()
    .with_draft_policy(DraftPolicyKind::Fixed)
    .with_draft_shape(DraftShape::Tree);
    assert!(engine.drafts_trees(), "the head grows trees when asked");
    let g = engine.generate(requests());
    assert!(g.metrics.drafted > 0);
    assert_eq!(
        tokens(g),
        base,
        "greedy output with trees differs from plain"
    );
    drop((engine, plain));
    assert_eq!(head.kv_blocks().0, head.kv_blocks().1, "blocks left taken");
    drop((head, model));
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}
