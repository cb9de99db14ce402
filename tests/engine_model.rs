//! The engine on the real target model (a tiny seeded Llama written as a safetensors
//! checkpoint, CPU backend): speculative greedy output equals plain greedy output token for
//! token for every proposer, batched equals alone, and nothing leaks.

mod engine_common;
#[allow(unused_imports)] // the helpers re-export a GGUF writer this test does not use
mod model_util;

use engine_common::RandomDrafter;
use model_util::*;
use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::engine::{GenerateRequest, SamplingParams, SpecEngine};
use specdraft::model::{LoadOptions, TargetModel};
use specdraft::speculative::{DraftProposer, PromptLookup};
use std::sync::Arc;

fn load(gpu: &Arc<dyn GpuBackend>, tag: &str, max_rows: usize) -> Arc<TargetModel> {
    let dir = temp_dir(&format!("engine_model_{tag}_{max_rows}"));
    let tiny = Tiny::default();
    write_hf(&dir, &tiny, &tiny.tensors(5));
    let opts = LoadOptions {
        max_rows,
        max_seq_len: Some(128),
        kv_blocks: Some(64),
    };
    Arc::new(TargetModel::load(&dir, gpu.clone(), opts).unwrap())
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 5, 17, 33, 4, 90, 12, 12, 7, 64, 5, 17, 33],
        vec![3, 22, 45, 8, 8, 61, 70, 9, 95, 40],
        vec![11, 12, 13, 11, 12, 13, 11, 12],
    ]
}

fn generate(
    model: &Arc<TargetModel>,
    p: Option<Arc<dyn DraftProposer>>,
    prompts: &[Vec<u32>],
    sampling: SamplingParams,
) -> Vec<Vec<u32>> {
    let engine = SpecEngine::new(model.clone(), p, 4).unwrap();
    let reqs = prompts
        .iter()
        .map(|p| {
            GenerateRequest::new(p.clone(), 24)
                .ignore_eos()
                .with_sampling(sampling)
        })
        .collect();
    engine
        .generate(reqs)
        .results
        .into_iter()
        .map(|r| {
            assert!(r.error.is_none(), "{:?}", r.error);
            assert_eq!(r.tokens.len(), 24);
            r.tokens
        })
        .collect()
}

#[test]
fn greedy_speculative_equals_plain_greedy_on_the_real_model() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = load(&gpu, "greedy", 64);
    let base = generate(&model, None, &prompts(), SamplingParams::greedy());
    let proposers: Vec<Arc<dyn DraftProposer>> = vec![
        Arc::new(PromptLookup::default()),
        Arc::new(RandomDrafter { seed: 1, vocab: 96 }),
    ];
    for p in proposers {
        assert_eq!(
            generate(
                &model,
                Some(p.clone()),
                &prompts(),
                SamplingParams::greedy()
            ),
            base
        );
        // Each alone equals all together.
        for (i, prompt) in prompts().iter().enumerate() {
            let alone = generate(
                &model,
                Some(p.clone()),
                std::slice::from_ref(prompt),
                SamplingParams::greedy(),
            );
            assert_eq!(alone[0], base[i]);
        }
    }
    // A row limit that splits prefills and verifies changes nothing.
    let narrow = load(&gpu, "greedy", 5);
    assert_eq!(
        generate(
            &narrow,
            Some(Arc::new(PromptLookup::default())),
            &prompts(),
            SamplingParams::greedy()
        ),
        base
    );
    drop((model, narrow));
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn sampled_generation_is_reproducible_and_batch_independent() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = load(&gpu, "sampled", 64);
    let s = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 0,
        seed: 42,
    };
    let p: Arc<dyn DraftProposer> = Arc::new(PromptLookup::default());
    let together = generate(&model, Some(p.clone()), &prompts(), s);
    assert_eq!(generate(&model, Some(p.clone()), &prompts(), s), together);
    let alone = generate(&model, Some(p), &prompts()[1..2], s);
    assert_eq!(alone[0], together[1]);
}
