//! The target model on the CUDA kernels, run on the CPU through the device emulation
//! (feature `cuda-emu`): the same checkpoint must give the CPU reference's logits through
//! a batched prefill, batched decode, trim and replay.
//!
//! `cargo test --features cuda-emu --test model_emulated`

mod model_util;

use model_util::*;
use specdraft::backend::{CpuBackend, EmuBackend, GpuBackend, GpuBackendExt};
use specdraft::model::{LoadOptions, LogitRows, TargetModel};
use std::path::Path;
use std::sync::Arc;

fn run(path: &Path, gpu: Arc<dyn GpuBackend>) -> Vec<Vec<f32>> {
    let opts = LoadOptions {
        max_rows: 24,
        max_seq_len: Some(48),
        kv_blocks: Some(8),
    };
    let model = TargetModel::load(path, gpu.clone(), opts).unwrap();
    let v = model.config().vocab_size;
    let logits = |out: &specdraft::model::ForwardOutput| -> Vec<f32> {
        gpu.download(out.logits, out.logits_rows * v).unwrap()
    };
    let (mut a, mut b) = (model.new_sequence(), model.new_sequence());
    let mut rows = Vec::new();
    let prompt_a: &[u32] = &[1, 5, 17, 33, 4];
    let prompt_b: &[u32] = &[2, 9];
    rows.push(logits(
        &model
            .forward(&mut [&mut a, &mut b], &[prompt_a, prompt_b])
            .unwrap(),
    ));
    rows.push(logits(
        &model
            .forward(&mut [&mut a, &mut b], &[&[11, 12], &[13]])
            .unwrap(),
    ));
    model.trim(&mut a, 6).unwrap();
    let out = model
        .forward_with(
            &mut [&mut a, &mut b],
            &[&[30, 31], &[32]],
            LogitRows::LastPerSequence,
        )
        .unwrap();
    rows.push(logits(&out));
    model.free_sequence(&mut a).unwrap();
    model.free_sequence(&mut b).unwrap();
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
    rows
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
