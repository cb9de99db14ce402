//! The target model on a real GPU (feature `cuda`): a tiny checkpoint gives the CPU
//! reference's logits through prefill, batched decode, trim and replay, and SmolLM2 (its file
//! at `$SPECDRAFT_SMOLLM2_GGUF`) picks the CPU's top tokens.
//!
//! Every test here needs a GPU, so all are ignored in a plain `cargo test` (reported as
//! ignored, never as passed); `tests/gpu/run.sh` runs them with `--ignored` on a machine
//! with one, where a missing device or file is a failure.

mod model_util;

use model_util::*;
use specdraft::backend::{CpuBackend, CudaBackend, GpuBackend};
use specdraft::model::LoadOptions;
use std::path::Path;
use std::sync::Arc;

fn cuda() -> Arc<dyn GpuBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Arc::new(b),
        Err(e) => panic!("this test needs a CUDA GPU (tests/gpu/run.sh runs it on one): {e}"),
    }
}

/// Logits of a fixed schedule of forwards: batched prefill, batched decode, trim, replay.
fn run(path: &Path, gpu: Arc<dyn GpuBackend>, prompt: &[u32]) -> Vec<Vec<f32>> {
    let opts = LoadOptions {
        max_rows: 128,
        max_seq_len: Some(256),
        kv_blocks: Some(32),
    };
    let schedule = Schedule {
        prefill: [prompt, &prompt[..prompt.len() / 2]],
        decode: [&[11, 12, 13], &[14]],
        trim_to: prompt.len() + 1,
        replay: [&[15, 16], &[17]],
    };
    schedule_logits(path, gpu, opts, &schedule)
}

fn argmax(r: &[f32]) -> usize {
    r.iter()
        .enumerate()
        .fold(0, |b, (j, x)| if *x > r[b] { j } else { b })
}

fn compare(path: &Path, vocab: usize, prompt: &[u32], tolerance: f32, gpu: Arc<dyn GpuBackend>) {
    let want = run(path, Arc::new(CpuBackend::new()), prompt);
    let got = run(path, gpu, prompt);
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = max_abs_diff(g, w);
        assert!(
            d < tolerance * scale,
            "step {step}: max diff {d} (scale {scale})"
        );
        let agree = g
            .chunks(vocab)
            .zip(w.chunks(vocab))
            .filter(|(a, b)| argmax(a) == argmax(b))
            .count();
        assert!(
            agree * 10 >= 9 * g.len() / vocab,
            "step {step}: top tokens differ"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU; tests/gpu/run.sh runs it"]
fn tiny_model_on_the_gpu_matches_the_cpu() {
    let gpu = cuda();
    let tiny = Tiny::default();
    let tensors = tiny.tensors(21);
    let dir = temp_dir("cuda");
    write_hf(&dir, &tiny, &tensors);
    let gguf = dir.join("tiny.gguf");
    write_tiny_gguf(&gguf, &tiny, &tensors, GgType::Q8_0);
    let prompt: Vec<u32> = (0..37).map(|i| (i * 7 + 3) % 96).collect();
    compare(&dir, tiny.vocab, &prompt, 0.02, gpu.clone());
    compare(&gguf, tiny.vocab, &prompt, 0.02, gpu);
}

#[test]
#[ignore = "needs a CUDA GPU and $SPECDRAFT_SMOLLM2_GGUF"]
fn smollm2_on_the_gpu_matches_the_cpu() {
    let path = std::env::var("SPECDRAFT_SMOLLM2_GGUF")
        .expect("set SPECDRAFT_SMOLLM2_GGUF to SmolLM2's GGUF file to run this test");
    let gpu = cuda();
    let prompt = [
        504, 3575, 282, 4649, 314, 7042, 28, 284, 260, 3575, 282, 7158, 314,
    ];
    compare(Path::new(&path), 49152, &prompt, 0.03, gpu);
}
