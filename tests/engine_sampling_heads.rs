//! Sampling stays lossless with the learned drafters: with a random `Eagle3Head`, a random
//! `DFlashHead` and a `Hybrid` of `SuffixDecoding` and the EAGLE-3 head drafting for a tiny
//! seeded target (four Llama layers, 16 tokens, CPU backend), the engine's three-token
//! generations follow the target's conditional distributions: the first token given the
//! prompt, the second given the first, and the third given both, separately after a first
//! draft accepted and after one rejected (both paths must be taken often enough to test).
//!
//! The expected distributions come from the target's logits for each context (a
//! teacher-forced forward of the prompt and that context) through the definitions of
//! temperature, top-k and top-p in `stats/mod.rs`, never from the engine's sampler; the
//! tallies and fits are `stats/paths.rs`'s, shared with `engine_sampling.rs`.

mod drafter_fixtures;
#[allow(unused_imports)] // the helpers re-export a GGUF writer this test does not use
mod model_util;
mod stats;

use model_util::{write_hf, Tiny};
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::engine::{DraftPolicyKind, GenerateRequest, SamplingParams, SpecEngine};
use specdraft::model::{LoadOptions, LogitRows, ModelLevers, TargetModel};
use specdraft::speculative::{
    DFlashHead, DraftProposer, Eagle3Head, Hybrid, HybridMember, SuffixDecoding,
    SuffixDecodingOptions,
};
use stats::paths::{check, fit, Path, Tables};
use std::collections::HashMap;
use std::sync::Arc;

const PROMPT: [u32; 8] = [1, 2, 3, 1, 2, 3, 1, 2];
/// The EAGLE-3 head's draft vocabulary: the target ids its draft ids stand for.
const DRAFT_VOCAB: [u32; 8] = [9, 13, 2, 6, 7, 14, 12, 5];
/// The DFlash head's weights: a random head on this target whose first draft is accepted
/// about a fifth of the time at temperature 0.7 (most seeds draft a token the target
/// rarely picks, which would leave the accepted path too few samples to test).
const DFLASH_SEED: u64 = 34;
/// Generations per sampling setting and proposer.
const RUNS: u64 = 3000;

fn tiny() -> Tiny {
    Tiny {
        layers: 4,
        vocab: 16,
        ..Tiny::default()
    }
}

fn target(gpu: &Arc<dyn GpuBackend>) -> Arc<TargetModel> {
    let t = tiny();
    let dir = model_util::temp_dir("sampling_heads_target");
    write_hf(&dir, &t, &t.tensors(23));
    let opts = LoadOptions {
        max_rows: 256,
        max_seq_len: Some(64),
        kv_blocks: Some(512),
    };
    Arc::new(TargetModel::load(&dir, gpu.clone(), opts).unwrap())
}

/// The proposers under test, by name.
fn proposers(model: &Arc<TargetModel>) -> Vec<(&'static str, Arc<dyn DraftProposer>)> {
    let t = tiny();
    let levers = ModelLevers::default();
    let eagle3 = |tag: &str| -> Arc<dyn DraftProposer> {
        let dir = drafter_fixtures::write_eagle3(tag, &t, &[1, 2, 3], &DRAFT_VOCAB);
        Arc::new(
            Eagle3Head::from_checkpoint_for_target(&dir, model.clone(), 64, 512, &levers).unwrap(),
        )
    };
    let dflash = drafter_fixtures::write_dflash("sampling", &t, &[1, 3], 4, DFLASH_SEED);
    let dflash =
        DFlashHead::from_checkpoint_for_target(&dflash, model.clone(), None, None, 64, 512)
            .unwrap();
    // Suffix decoding drafts from the sequence's own history only (no shared tree), so it
    // wins where the prompt repeats and leaves the other steps to the head.
    let suffix = SuffixDecoding::new(SuffixDecodingOptions {
        max_tree_nodes: 0,
        ..SuffixDecodingOptions::default()
    })
    .unwrap();
    let hybrid = Hybrid::new(
        vec![
            HybridMember::new("suffix", Arc::new(suffix)),
            HybridMember::new("eagle3", eagle3("hybrid")),
        ],
        Some(t.layers),
    )
    .unwrap();
    vec![
        ("Eagle3Head", eagle3("alone")),
        ("DFlashHead", Arc::new(dflash)),
        ("Hybrid", Arc::new(hybrid)),
    ]
}

/// The target's logits after the prompt and `context`, by a teacher-forced forward.
fn logits_after(model: &TargetModel, context: &[u32]) -> Vec<f32> {
    let full: Vec<u32> = PROMPT.iter().chain(context).copied().collect();
    let mut seq = model.new_sequence();
    let out = model
        .forward_with(&mut [&mut seq], &[&full], LogitRows::LastPerSequence)
        .unwrap();
    let v = model
        .gpu()
        .download::<f32>(out.logits, model.config().vocab_size)
        .unwrap();
    model.free_sequence(&mut seq).unwrap();
    v
}

fn generate(model: &Arc<TargetModel>, p: Arc<dyn DraftProposer>, s: SamplingParams) -> Tables {
    // Every step drafts the full count, so both draft paths are sampled often.
    let engine = SpecEngine::new(model.clone(), Some(p), 3)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed);
    let requests = (0..RUNS)
        .map(|seed| {
            GenerateRequest::new(PROMPT.to_vec(), 3)
                .ignore_eos()
                .with_sampling(SamplingParams { seed, ..s })
        })
        .collect();
    let mut t = Tables::new(tiny().vocab);
    for r in engine.generate(requests).results {
        assert!(r.error.is_none(), "{:?}", r.error);
        t.add(&r.tokens, Path::of(&r.metrics));
    }
    t
}

#[test]
fn sampled_generations_with_learned_drafters_follow_the_conditional_distributions() {
    stats::check_helpers();
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = target(&gpu);
    let mut cache: HashMap<Vec<u32>, Vec<f32>> = HashMap::new();
    let mut logits = |c: &[u32]| {
        cache
            .entry(c.to_vec())
            .or_insert_with(|| logits_after(&model, c))
            .clone()
    };
    let settings = [
        SamplingParams {
            temperature: 0.7,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        },
        SamplingParams {
            temperature: 1.3,
            top_k: 5,
            top_p: 0.9,
            seed: 0,
        },
    ];
    for (name, p) in proposers(&model) {
        for s in settings {
            let t = generate(&model, p.clone(), s);
            let what = |x: &str| format!("{name}, {s:?}: {x}");
            let (acc, rej) = (
                Tables::count(&t.third_after_accept),
                Tables::count(&t.third_after_reject),
            );
            // Both paths are taken, often enough for their own tests.
            assert!(
                acc >= RUNS / 30 && rej >= RUNS / 30,
                "{}",
                what(&format!("{acc} first drafts accepted, {rej} rejected"))
            );
            check(&what("first"), &fit(&mut logits, &s, &t.first), 2);
            check(&what("second"), &fit(&mut logits, &s, &t.second), 5);
            let accept = fit(&mut logits, &s, &t.third_after_accept);
            let reject = fit(&mut logits, &s, &t.third_after_reject);
            check(&what("third, first draft accepted"), &accept, 3);
            check(&what("third, first draft rejected"), &reject, 5);
            let undrafted = fit(&mut logits, &s, &t.third_undrafted);
            check(&what("third, nothing drafted"), &undrafted, 0);
        }
    }
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}
