//! Loader errors: cut-short files, missing tensors, wrong shapes, unsupported types and bad
//! headers are errors that name the tensor and the file, and a failed load leaks nothing.

mod model_util;

use model_util::*;
use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::model::{GgufFile, LoadOptions, ModelError, TargetModel, TensorSource};
use specdraft::Error;
use std::path::Path;
use std::sync::Arc;

fn try_load(path: &Path) -> (Result<TargetModel, Error>, Arc<dyn GpuBackend>) {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let opts = LoadOptions {
        max_rows: 8,
        max_seq_len: Some(64),
        kv_blocks: Some(8),
    };
    (TargetModel::load(path, gpu.clone(), opts), gpu)
}

fn load_err(path: &Path) -> ModelError {
    let (r, gpu) = try_load(path);
    let err = match r {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e,
    };
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "a failed load leaked: {:?}",
        gpu.ledger().live_report()
    );
    match err {
        Error::Model(m) => m,
        other => panic!("expected a model error, got {other}"),
    }
}

fn without(tensors: &Tensors, name: &str) -> Tensors {
    tensors.iter().filter(|t| t.0 != name).cloned().collect()
}

#[test]
fn truncated_safetensors_names_the_first_missing_tensor() {
    let tiny = Tiny::default();
    let tensors = tiny.tensors(1);
    let dir = temp_dir("trunc-st");
    write_hf(&dir, &tiny, &tensors);
    let file = dir.join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 100]).unwrap();
    let err = load_err(&dir);
    // The second file holds the tail of the list, F32: the last tensor is cut.
    let last = &tensors.last().unwrap().0;
    match &err {
        ModelError::Truncated { tensor, .. } => assert_eq!(tensor, last),
        other => panic!("expected Truncated, got {other}"),
    }
    assert!(
        err.to_string().contains(last.as_str()) && err.to_string().contains("00002"),
        "{err}"
    );
}

#[test]
fn missing_and_misshapen_tensors_are_named() {
    let tiny = Tiny::default();
    let tensors = tiny.tensors(1);
    let dir = temp_dir("missing");
    write_hf(
        &dir,
        &tiny,
        &without(&tensors, "model.layers.1.mlp.up_proj.weight"),
    );
    let err = load_err(&dir);
    assert_eq!(
        err,
        ModelError::MissingTensor {
            path: dir.display().to_string(),
            tensor: "model.layers.1.mlp.up_proj.weight".into()
        }
    );

    let dir = temp_dir("shape");
    let mut bad = tensors.clone();
    let k = bad
        .iter_mut()
        .find(|t| t.0 == "model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    k.1 = vec![16, 128];
    write_hf(&dir, &tiny, &bad);
    let err = load_err(&dir);
    match &err {
        ModelError::ShapeMismatch {
            tensor,
            expected,
            found,
            ..
        } => {
            assert_eq!(tensor, "model.layers.0.self_attn.k_proj.weight");
            assert_eq!(
                (expected.as_slice(), found.as_slice()),
                (&[32, 64][..], &[16, 128][..])
            );
        }
        other => panic!("expected ShapeMismatch, got {other}"),
    }

    // An untied model without its head.
    let dir = temp_dir("nohead");
    write_hf(&dir, &tiny, &without(&tensors, "lm_head.weight"));
    assert!(
        matches!(load_err(&dir), ModelError::MissingTensor { tensor, .. } if tensor == "lm_head.weight")
    );
}

#[test]
fn a_folder_without_config_or_weights_is_a_clear_error() {
    let dir = temp_dir("noconfig");
    let (r, _) = try_load(&dir);
    let err = r.err().expect("an empty folder loaded");
    assert!(matches!(err, Error::Config(_)), "{err}");
    assert!(err.to_string().contains("config.json"), "{err}");
    std::fs::write(dir.join("config.json"), Tiny::default().config_json()).unwrap();
    let err = load_err(&dir);
    assert!(err.to_string().contains("no *.safetensors"), "{err}");
    let (r, _) = try_load(&dir.join("nope.gguf"));
    assert!(r.err().unwrap().to_string().contains("no such file"));
}

#[test]
fn gguf_errors_name_the_tensor() {
    let tiny = Tiny::default();
    let tensors = tiny.tensors(2);
    let dir = temp_dir("gguf-err");
    let good = dir.join("good.gguf");
    write_tiny_gguf(&good, &tiny, &tensors, GgType::F16);
    let parsed = GgufFile::open(&good).unwrap();
    assert_eq!(parsed.architecture(), Some("llama"));
    let embd = parsed.tensor("token_embd.weight").unwrap().unwrap();
    assert_eq!(
        embd.shape,
        vec![96, 64],
        "dims are reported outermost first"
    );
    assert_eq!(parsed.names().len(), tensors.len());

    let bytes = std::fs::read(&good).unwrap();
    let cut = dir.join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 64]).unwrap();
    match load_err(&cut) {
        ModelError::Truncated { tensor, .. } => assert_eq!(tensor, "output.weight"),
        other => panic!("expected Truncated, got {other}"),
    }
    let header_only = dir.join("header.gguf");
    std::fs::write(&header_only, &bytes[..40]).unwrap();
    assert!(
        matches!(load_err(&header_only), ModelError::OutOfRange { field, .. } if field == "the tensor count")
    );
    let mut wrong = bytes.clone();
    wrong[..4].copy_from_slice(b"GGML");
    let wrong_path = dir.join("wrong.gguf");
    std::fs::write(&wrong_path, &wrong).unwrap();
    assert!(load_err(&wrong_path).to_string().contains("magic"));

    // A ggml type this crate does not know (IQ2_XXS is ggml type 16) loads as a header but is
    // refused, by name, when converted.
    let meta = [("general.architecture", Meta::Str("llama".into()))];
    let iq = dir.join("iq2.gguf");
    write_gguf(
        &iq,
        &meta,
        &[("blk.0.ffn_up.weight".into(), vec![1, 256], 16, vec![])],
    );
    let f = GgufFile::open(&iq).unwrap();
    let err = f.read_bf16("blk.0.ffn_up.weight", &[1, 256]).unwrap_err();
    assert!(
        matches!(&err, ModelError::UnsupportedType { tensor, dtype, .. } if tensor == "blk.0.ffn_up.weight" && dtype == "ggml type 16"),
        "{err}"
    );

    // A K-quant (Q6_K, ggml type 14) dequantizes: a zero block is zeros.
    let q6 = dir.join("q6k.gguf");
    write_gguf(
        &q6,
        &meta,
        &[(
            "blk.0.ffn_up.weight".into(),
            vec![1, 256],
            14,
            vec![0u8; 210],
        )],
    );
    let f = GgufFile::open(&q6).unwrap();
    let v = f.read_bf16("blk.0.ffn_up.weight", &[1, 256]).unwrap();
    assert!(v.iter().all(|x| x.to_f32() == 0.0) && v.len() == 256);

    // Missing metadata is named too.
    let bare = dir.join("bare.gguf");
    write_gguf(&bare, &meta, &[]);
    let (r, _) = try_load(&bare);
    assert!(r
        .err()
        .unwrap()
        .to_string()
        .contains("llama.embedding_length"));
}
