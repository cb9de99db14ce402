//! The engine and `MtpHead` on a real GPU (feature `cuda`): greedy speculative output equals
//! plain greedy output with PromptLookup on the target model and with `MtpHead` (dense and
//! MoE layouts) on a table target, `MtpHead`'s logits and drafts match the CPU reference
//! (tolerances in `mtp_backends/mod.rs`), and the GPU ledger is back at zero after each.
//!
//! Every test here needs a GPU, so all are ignored in a plain `cargo test` (reported as
//! ignored, never as passed); `tests/gpu/run.sh` runs them with `--ignored` on a machine
//! with one, where a missing device is a failure.

#[allow(unused_imports)] // the helpers re-export a GGUF writer this test does not use
mod model_util;
mod mtp_backends;
mod mtp_common;

use model_util::*;
use specdraft::backend::{CudaBackend, GpuBackend};
use specdraft::engine::{GenerateRequest, SpecEngine};
use specdraft::model::{LoadOptions, TargetModel};
use specdraft::speculative::{DraftProposer, MtpQuantization, PromptLookup};
use std::sync::Arc;

fn cuda() -> Arc<dyn GpuBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Arc::new(b),
        Err(e) => panic!("this test needs a CUDA GPU (tests/gpu/run.sh runs it on one): {e}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU; tests/gpu/run.sh runs it"]
fn prompt_lookup_on_the_target_model_keeps_greedy_output_on_the_gpu() {
    let gpu = cuda();
    let dir = temp_dir("engine_cuda");
    let tiny = Tiny::default();
    write_hf(&dir, &tiny, &tiny.tensors(5));
    let opts = LoadOptions {
        max_rows: 64,
        max_seq_len: Some(128),
        kv_blocks: Some(64),
    };
    let model = Arc::new(TargetModel::load(&dir, gpu.clone(), opts).unwrap());
    let prompts: Vec<Vec<u32>> = vec![
        vec![1, 5, 17, 33, 4, 90, 12, 12, 7, 64, 5, 17, 33],
        vec![11, 12, 13, 11, 12, 13, 11, 12],
    ];
    let run = |p: Option<Arc<dyn DraftProposer>>| {
        let engine = SpecEngine::new(model.clone(), p, 4).unwrap();
        let requests = prompts
            .iter()
            .map(|p| GenerateRequest::new(p.clone(), 24).ignore_eos())
            .collect();
        let g = engine.generate(requests);
        let tokens: Vec<Vec<u32>> = g
            .results
            .into_iter()
            .map(|r| {
                assert!(r.error.is_none(), "{:?}", r.error);
                r.tokens
            })
            .collect();
        (tokens, g.metrics.drafted)
    };
    let (plain, _) = run(None);
    let (spec, drafted) = run(Some(Arc::new(PromptLookup::default())));
    assert_eq!(spec, plain);
    assert!(drafted > 0, "the repetitive prompts gave no drafts");
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

#[test]
#[ignore = "needs a CUDA GPU; tests/gpu/run.sh runs it"]
fn mtp_head_on_the_gpu_matches_the_cpu() {
    for (layout, moe) in mtp_backends::LAYOUTS {
        mtp_backends::compare_with_cpu(
            cuda(),
            layout,
            moe,
            MtpQuantization::Bf16,
            mtp_backends::GPU_LOGIT_RTOL,
        );
    }
    mtp_backends::compare_with_cpu(
        cuda(),
        "deepseek_v3",
        false,
        MtpQuantization::Nvfp4,
        mtp_backends::GPU_LOGIT_RTOL,
    );
    mtp_backends::compare_with_cpu(
        cuda(),
        "mimo",
        false,
        MtpQuantization::Fp8,
        mtp_backends::GPU_LOGIT_RTOL,
    );
}

#[test]
#[ignore = "needs a CUDA GPU; tests/gpu/run.sh runs it"]
fn mtp_head_in_the_engine_on_the_gpu_keeps_greedy_output() {
    for (layout, moe) in mtp_backends::LAYOUTS {
        for trees in [false, true] {
            mtp_backends::engine_keeps_greedy_output(cuda(), layout, moe, trees);
        }
    }
}
