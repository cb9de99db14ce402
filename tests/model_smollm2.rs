//! The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against an independent numpy
//! forward (`tests/python/smollm2_reference.py`, built on the `gguf` package's dequantizer).
//!
//! Slow and needs the model file plus Python with `numpy`, `gguf` and `tokenizers`, so it is
//! ignored by default; CI runs it with `cargo test --release --test model_smollm2 -- --ignored`.
//! The file is found through `$SPECDRAFT_SMOLLM2_GGUF`, else fetched by `specdraft.models`.

use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::model::{LoadOptions, TargetModel};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

fn model_path() -> PathBuf {
    if let Ok(p) = std::env::var("SPECDRAFT_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    let out = Command::new(python())
        .args([
            "-c",
            "from specdraft.models import fetch_default_model; print(fetch_default_model())",
        ])
        .env("PYTHONPATH", concat!(env!("CARGO_MANIFEST_DIR"), "/python"))
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "fetching the model failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

#[test]
#[ignore = "slow: needs the SmolLM2 GGUF and numpy/gguf/tokenizers"]
fn smollm2_logits_match_the_numpy_reference() {
    let path = model_path();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/smollm2_reference.py"
    );
    let out = Command::new(python())
        .arg(script)
        .arg(&path)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "reference failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let tokens: Vec<u32> = r["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let positions: Vec<usize> = r["positions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();

    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let opts = LoadOptions {
        max_rows: 64,
        max_seq_len: Some(256),
        kv_blocks: Some(32),
    };
    let model = TargetModel::load(&path, gpu.clone(), opts).unwrap();
    let c = model.config().clone();
    assert_eq!(
        (
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads
        ),
        (576, 30, 9, 3)
    );
    assert_eq!(
        (c.intermediate_size, c.vocab_size, c.tie_word_embeddings),
        (1536, 49152, true)
    );
    let mut seq = model.new_sequence();
    let fwd = model.forward(&mut [&mut seq], &[&tokens]).unwrap();
    let logits: Vec<f32> = gpu
        .download(fwd.logits, tokens.len() * c.vocab_size)
        .unwrap();
    for (i, &p) in positions.iter().enumerate() {
        let want: Vec<f32> = r["logits"][i]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let got = &logits[p * c.vocab_size..(p + 1) * c.vocab_size];
        let argmax = |v: &[f32]| {
            v.iter()
                .enumerate()
                .fold(0, |b, (j, x)| if *x > v[b] { j } else { b })
        };
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        eprintln!(
            "position {p}: max |diff| {diff:.4}, logit scale {scale:.2}, argmax {} vs {}",
            argmax(got),
            argmax(&want)
        );
        assert_eq!(
            argmax(got),
            argmax(&want),
            "position {p}: the top token differs"
        );
        assert!(
            diff < 0.05 * scale,
            "position {p}: max diff {diff} against logit scale {scale}"
        );
    }
    model.free_sequence(&mut seq).unwrap();
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0);
}
