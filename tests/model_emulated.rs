//! The target model on the CUDA kernels, run on the CPU through the device emulation
//! (feature `cuda-emu`): the same checkpoint must give the CPU reference's logits through
//! a batched prefill, batched decode, trim and replay.
//!
//! `cargo test --features cuda-emu --test model_emulated`

mod model_util;

use model_util::*;
use specdraft::backend::{CpuBackend, EmuBackend, GpuBackend};
use specdraft::model::LoadOptions;
use std::path::Path;
use std::sync::Arc;

fn run(path: &Path, gpu: Arc<dyn GpuBackend>) -> Vec<Vec<f32>> {
    let opts = LoadOptions {
        max_rows: 24,
        max_seq_len: Some(48),
        kv_blocks: Some(8),
    };
    let schedule = Schedule {
        prefill: [&[1, 5, 17, 33, 4], &[2, 9]],
        decode: [&[11, 12], &[13]],
        trim_to: 6,
        replay: [&[30, 31], &[32]],
    };
    schedule_logits(path, gpu, opts, &schedule)
}

#[test]
fn emulated_cuda_kernels_reproduce_the_cpu_forward() {
    // One layer keeps the emulation (a host thread per CUDA thread) to seconds.
    let tiny = Tiny {
        layers: 1,
        ..Tiny::default()
    };
    let tensors = tiny.tensors(11);
    let dir = temp_dir("emu");
    let gguf = dir.join("tiny.gguf");
    write_tiny_gguf(&gguf, &tiny, &tensors, GgType::F32);
    // The GGUF path: q/k stored permuted, interleaved RoPE (the HF pairing is the default
    // of the kernel tests). Every emulated row costs seconds, so the steps are short.
    let path = gguf.as_path();
    let want = run(path, Arc::new(CpuBackend::new()));
    let got = run(path, Arc::new(EmuBackend::new()));
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = max_abs_diff(g, w);
        assert!(
            d < 0.02 * scale,
            "{}: step {step}: max diff {d} (scale {scale})",
            path.display()
        );
        for (rg, rw) in g.chunks(tiny.vocab).zip(w.chunks(tiny.vocab)) {
            let argmax = |r: &[f32]| {
                r.iter()
                    .enumerate()
                    .fold(0, |b, (j, x)| if *x > r[b] { j } else { b })
            };
            assert_eq!(argmax(rg), argmax(rw), "{}: step {step}", path.display());
        }
    }
}
