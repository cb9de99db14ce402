//! Quantizing a float checkpoint at load (`load_with_weights`, Python's `load_model(weights=)`):
//! which tensors change format, what it costs in accuracy, and the errors for bad requests.

mod model_util;

use model_util::*;
use specdraft::backend::quant::BlockFormat;
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::model::{parse_weights_format, LoadOptions, TargetModel};
use std::sync::Arc;

fn opts() -> LoadOptions {
    LoadOptions {
        max_rows: 32,
        max_seq_len: Some(64),
        kv_blocks: Some(8),
    }
}

const PROMPT: [u32; 9] = [1, 5, 17, 33, 4, 90, 12, 7, 64];

fn logits(model: &TargetModel) -> Vec<f32> {
    let mut seq = model.new_sequence();
    let out = model.forward(&mut [&mut seq], &[&PROMPT]).unwrap();
    let v = model
        .gpu()
        .download(out.logits, PROMPT.len() * model.config().vocab_size)
        .unwrap();
    model.free_sequence(&mut seq).unwrap();
    v
}

#[test]
fn a_float_checkpoint_quantized_at_load_keeps_its_blocks_and_its_logits() {
    let tiny = Tiny {
        tied: true,
        ..Tiny::default()
    };
    let dir = temp_dir("quantized-load");
    write_hf(&dir, &tiny, &tiny.tensors(3));
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let plain = TargetModel::load(&dir, gpu.clone(), opts()).unwrap();
    let q8 =
        TargetModel::load_with_weights(&dir, gpu.clone(), opts(), Some(BlockFormat::Q8_0)).unwrap();
    // Every projection and the tied embedding are Q8_0 blocks: 34 bytes per 32 weights
    // instead of 64, and the norms stay as they were.
    let w = q8.weights();
    assert_eq!(w.embed.format_name(), "q8_0");
    for layer in &w.layers {
        for (name, p) in layer.projections() {
            assert_eq!(p.format_name(), "q8_0", "{name}");
        }
    }
    assert_eq!(plain.weights().embed.format_name(), "bf16");
    let (pb, qb) = (
        plain.weight_bytes_per_token() as f64,
        q8.weight_bytes_per_token() as f64,
    );
    assert!(qb < 0.56 * pb, "{qb} bytes a step, {pb} unquantized");
    // Q8_0 rounds each weight to within amax/254 of its block (0.4%), and each input row is
    // rounded as finely: the logits move by about a percent of their scale, not more.
    let (a, b) = (logits(&plain), logits(&q8));
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = max_abs_diff(&a, &b);
    assert!(diff < 0.03 * scale, "max diff {diff}, logit scale {scale}");
    assert!(diff > 0.0, "quantizing changed nothing");

    // K-quant blocks are 256 wide: this model's rows (64 or 128 wide) cannot be cut into
    // them, so its matrices stay BF16.
    let q4k =
        TargetModel::load_with_weights(&dir, gpu.clone(), opts(), Some(BlockFormat::Q4_K)).unwrap();
    assert!(q4k.weights().layers[0]
        .projections()
        .iter()
        .all(|(_, p)| p.format_name() == "bf16"));
    drop((plain, q8, q4k));
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn bad_weight_requests_are_clear_errors() {
    let err = parse_weights_format("q4_k_m").unwrap_err().to_string();
    assert!(
        err.contains("q4_k_m") && err.contains("q8_0") && err.contains("q6_k"),
        "{err}"
    );
    let tiny = Tiny::default();
    let tensors = tiny.tensors(1);
    let dir = temp_dir("quantized-load-errors");
    write_hf(&dir, &tiny, &tensors);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let Err(err) =
        TargetModel::load_with_weights(&dir, gpu.clone(), opts(), Some(BlockFormat::Q2_K))
    else {
        panic!("q2_k is not produced by the quantizers")
    };
    assert!(err.to_string().contains("q2_k"), "{err}");
    let gguf = dir.join("tiny.gguf");
    write_tiny_gguf(&gguf, &tiny, &tensors, GgType::F16);
    let Err(err) =
        TargetModel::load_with_weights(&gguf, gpu.clone(), opts(), Some(BlockFormat::Q8_0))
    else {
        panic!("a GGUF file keeps its formats")
    };
    assert!(err.to_string().contains("GGUF"), "{err}");
    assert_eq!(gpu.ledger().live_count(), 0);
}
