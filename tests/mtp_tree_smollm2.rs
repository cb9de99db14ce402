//! The shipped `smollm2-mtp` and `smollm2-eagle3` heads drafting trees on the real default
//! model (SmolLM2-135M-Instruct, Q4_1, the heads' projections in Q8_0 as on the CPU by
//! default): greedy output with trees equals plain greedy output and the chain's, and the
//! acceptance length and speed of trees against chains at the same verify rows (the tree's
//! node budget is the chain's draft count) are printed.
//!
//! Slow (the 135M model on the CPU backend, four prompts thirteen times), so ignored by
//! default: `cargo test --release --test mtp_tree_smollm2 -- --ignored --nocapture`. The
//! model file is found as `tests/model_smollm2.rs` finds it.

use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::engine::{
    DraftPolicyKind, DraftShape, GenerateRequest, Metrics, SamplingParams, SpecEngine,
};
use specdraft::model::{LoadOptions, ModelLevers, TargetModel};
use specdraft::speculative::{DraftProposer, Eagle3Head, MtpHead, MtpQuantization};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

#[allow(dead_code)]
#[path = "../benches/common/default_model.rs"]
mod default_model;

const NEW_TOKENS: usize = 64;

/// The chat-templated prompts of `tests/python/test_draft_heads.py` (open questions, so
/// nothing to copy from the prompt), as SmolLM2's tokenizer encodes them.
fn prompts() -> Vec<Vec<u32>> {
    let system = [
        1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
        407, 19712, 8182, 2, 198, 1, 4093, 198,
    ];
    let end = [2, 198, 1, 520, 9531, 198];
    let users: [&[u32]; 4] = [
        &[
            36971, 281, 253, 1443, 8545, 1701, 260, 6376, 314, 4461, 981, 260, 1194, 284, 2382,
            418, 21822, 30,
        ],
        &[
            1780, 359, 1296, 1123, 6223, 327, 9286, 2458, 979, 1891, 418, 253, 10917, 511, 1194, 47,
        ],
        &[
            37964, 638, 253, 19018, 1806, 28, 429, 260, 7622, 781, 288, 260, 14296, 30,
        ],
        &[
            19161, 253, 1890, 1977, 563, 253, 2644, 617, 17542, 288, 7234, 30,
        ],
    ];
    users
        .iter()
        .map(|u| [&system[..], u, &end[..]].concat())
        .collect()
}

fn run(
    model: &Arc<TargetModel>,
    proposer: Option<Arc<dyn DraftProposer>>,
    shape: DraftShape,
    drafts: usize,
) -> (Vec<Vec<u32>>, Metrics, f64) {
    let engine = SpecEngine::new(model.clone(), proposer, drafts)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed)
        .with_draft_shape(shape);
    let mut out = Vec::new();
    let mut total = Metrics::default();
    let t = Instant::now();
    // One prompt at a time: batch 1, as the goal is stated.
    for p in prompts() {
        let g = engine.generate(vec![GenerateRequest::new(p, NEW_TOKENS)
            .ignore_eos()
            .with_sampling(SamplingParams::greedy())]);
        let r = g.results.into_iter().next().unwrap();
        assert!(r.error.is_none(), "{:?}", r.error);
        out.push(r.tokens);
        total.verify_steps += g.metrics.verify_steps;
        total.decode_tokens += g.metrics.decode_tokens;
        total.drafted += g.metrics.drafted;
        total.accepted += g.metrics.accepted;
    }
    let secs = t.elapsed().as_secs_f64();
    let tok_s = (prompts().len() * NEW_TOKENS) as f64 / secs;
    (out, total, tok_s)
}

#[test]
#[ignore = "slow: the real model on the CPU backend"]
fn smollm2_mtp_trees_keep_greedy_output_and_accept_longer_paths() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let path = default_model::fetched_model_path();
    let opts = LoadOptions {
        max_rows: 64,
        max_seq_len: Some(256),
        kv_blocks: Some(64),
    };
    let model = Arc::new(TargetModel::load(&path, gpu.clone(), opts).unwrap());
    let heads = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/specdraft/heads");
    let q8 = MtpQuantization::parse("q8_0").unwrap();
    let levers = ModelLevers::default();
    let mtp = Arc::new(
        MtpHead::from_checkpoint_for_target(
            heads.join("smollm2-mtp"),
            model.clone(),
            q8,
            0,
            256,
            64,
            &levers,
        )
        .unwrap(),
    );
    let eagle3 = Arc::new(
        Eagle3Head::from_checkpoint_for_target_quantized(
            heads.join("smollm2-eagle3"),
            model.clone(),
            q8,
            256,
            64,
            &levers,
        )
        .unwrap(),
    );
    let (base, _, plain_tok_s) = run(&model, None, DraftShape::Chain, 0);
    println!("plain: {plain_tok_s:.1} tok/s");
    type Switch = Box<dyn Fn(bool)>;
    let (m, e) = (mtp.clone(), eagle3.clone());
    let cases: [(&str, Arc<dyn DraftProposer>, Switch); 2] = [
        (
            "smollm2-mtp",
            mtp.clone(),
            Box::new(move |on| m.set_grow_trees(on)),
        ),
        (
            "smollm2-eagle3",
            eagle3.clone(),
            Box::new(move |on| e.set_grow_trees(on)),
        ),
    ];
    for (name, head, grow) in cases {
        for drafts in [3, 5, 8] {
            grow(false);
            let (chain, c, chain_tok_s) =
                run(&model, Some(head.clone()), DraftShape::Chain, drafts);
            grow(true);
            let (tree, t, tree_tok_s) = run(&model, Some(head.clone()), DraftShape::Tree, drafts);
            assert_eq!(
                chain, base,
                "{name}, {drafts} drafts: chain output differs from plain"
            );
            assert_eq!(
                tree, base,
                "{name}, {drafts} drafts: tree output differs from plain"
            );
            let (ca, ta) = (c.mean_acceptance_length(), t.mean_acceptance_length());
            println!(
                "{name}, {drafts} rows: chain acceptance {ca:.3} ({} steps) {chain_tok_s:.1} tok/s; \
                 tree acceptance {ta:.3} ({} steps) {tree_tok_s:.1} tok/s; ratio {:.3}",
                c.verify_steps,
                t.verify_steps,
                ta / ca
            );
            assert!(
                t.accepted > 0,
                "{name}, {drafts} drafts: no tree node accepted"
            );
        }
    }
    drop((mtp, eagle3));
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}
