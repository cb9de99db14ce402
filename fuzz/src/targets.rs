//! One function per loader, each taking the bytes of a hostile file. Whatever the bytes,
//! a target must return: no panic, no abort, no hang, no device memory left allocated, no
//! allocation beyond the harness's cap. libFuzzer drives them (`fuzz_targets/`), and the
//! crate's regression tests replay every input that once broke one (`tests/fuzz_regressions`).
//!
//! Each returns its [`Outcome`]: whether the input loaded, or the message of what refused it.
//!
//! Past the parser, each target goes as far as a real load would: tensors are converted,
//! configs validated, models and MTP heads built on the CPU backend, so a header that parses
//! but lies is exercised too.

use specdraft::backend::{CpuBackend, GpuBackend, RopeStyle};
use specdraft::model::{
    GgufFile, LoadOptions, ModelConfig, ModelLevers, NameScheme, SafetensorsCheckpoint,
    TargetModel, TensorSource,
};
use specdraft::speculative::{MtpHead, MtpQuantization};
use std::fmt::Display;
use std::sync::Arc;

/// Tensors up to this many elements are converted to BF16 (bigger ones only in a model load,
/// whose shape checks come first).
const CONVERT_LIMIT: usize = 1 << 16;

/// Small model limits, so that a load costs what the file holds and no more.
fn load_options() -> LoadOptions {
    LoadOptions {
        max_rows: 4,
        max_seq_len: Some(32),
        kv_blocks: Some(4),
    }
}

/// Converts every small tensor of `src`, as a load would.
fn convert_tensors(src: &dyn TensorSource) {
    for name in src.names() {
        if let Ok(Some(t)) = src.tensor(&name) {
            if t.numel() <= CONVERT_LIMIT {
                let _ = t.to_bf16(&name, src.path());
            }
        }
    }
}

/// Runs `build` on a fresh CPU backend, checks that nothing is left allocated after, and
/// returns what refused the load, if anything did.
fn on_cpu<T, E: Display>(build: impl FnOnce(Arc<dyn GpuBackend>) -> Result<T, E>) -> Outcome {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let outcome = build(gpu.clone()).map(drop).map_err(|e| e.to_string());
    let live = gpu.ledger().live_count();
    assert_eq!(live, 0, "a load left {live} device allocations behind");
    outcome
}

/// The message of a refusal.
fn refused(e: impl Display) -> String {
    e.to_string()
}

/// A GGUF file: header, metadata, tensor table, tensors, model config, and the model.
pub fn gguf(data: &[u8]) -> Outcome {
    let file = GgufFile::from_bytes("fuzz.gguf", data.to_vec()).map_err(refused)?;
    convert_tensors(&file);
    let config = file.model_config().map_err(refused)?;
    on_cpu(|gpu| {
        let scheme = NameScheme::Gguf;
        TargetModel::from_source(
            gpu,
            config,
            &file,
            scheme,
            RopeStyle::Interleaved,
            load_options(),
        )
    })
}

/// A safetensors file: header length, JSON header, offsets, tensors.
pub fn safetensors(data: &[u8]) -> Outcome {
    let file =
        SafetensorsCheckpoint::from_bytes("fuzz.safetensors", data.to_vec()).map_err(refused)?;
    convert_tensors(&file);
    Ok(())
}

/// The text of a `config.json`.
pub fn config_json(data: &[u8]) -> Outcome {
    let text = std::str::from_utf8(data).map_err(|e| format!("config.json: {e}"))?;
    let config = ModelConfig::from_json_str(text).map_err(refused)?;
    // A config that exists is consistent.
    config.validate().expect("a parsed config validates");
    let _ = (config.q_size(), config.kv_size());
    Ok(())
}

/// A checkpoint folder packed in one input: the length of `config.json` (8 bytes, little
/// endian), `config.json`, then one safetensors file. Loaded as a target model and as an
/// MTP head, which reads NVFP4 codes and scales where the checkpoint has them; the target
/// model's refusal comes first in the outcome, but the head is loaded either way.
pub fn checkpoint(data: &[u8]) -> Outcome {
    let (config, weights) = unpack_checkpoint(data)
        .ok_or("the input is shorter than the config.json length it starts with")?;
    let config = std::str::from_utf8(config).map_err(|e| format!("config.json: {e}"))?;
    let config = ModelConfig::from_json_str(config).map_err(refused)?;
    let file = SafetensorsCheckpoint::from_bytes("fuzz/model.safetensors", weights.to_vec())
        .map_err(refused)?;
    let target = match config.moe {
        None => on_cpu(|gpu| {
            let scheme = NameScheme::HuggingFace;
            let c = config.clone();
            TargetModel::from_source(gpu, c, &file, scheme, RopeStyle::Half, load_options())
        }),
        Some(_) => Ok(()),
    };
    let head = on_cpu(|gpu| {
        let quant = MtpQuantization::Bf16;
        MtpHead::from_source(
            &file,
            &config,
            (1, 1),
            gpu,
            quant,
            0,
            32,
            4,
            &ModelLevers::default(),
        )
    });
    target.and(head)
}

/// Splits a [`checkpoint`] input into `config.json` and the safetensors file.
pub fn unpack_checkpoint(data: &[u8]) -> Option<(&[u8], &[u8])> {
    let n = u64::from_le_bytes(data.get(..8)?.try_into().ok()?);
    let n = usize::try_from(n).ok()?;
    let rest = &data[8..];
    (n <= rest.len()).then(|| rest.split_at(n))
}

/// Packs `config.json` and a safetensors file into one [`checkpoint`] input.
pub fn pack_checkpoint(config: &[u8], weights: &[u8]) -> Vec<u8> {
    let mut out = (config.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(config);
    out.extend_from_slice(weights);
    out
}

/// What a target made of its input: `Ok` when it loaded all the way, else the message of the
/// first refusal (the regression tests check it against the refusal each input is kept for).
pub type Outcome = Result<(), String>;

/// A fuzz target: one input, checked inside.
pub type Target = fn(&[u8]) -> Outcome;

/// Every target by name.
pub const TARGETS: [(&str, Target); 4] = [
    ("gguf", gguf),
    ("safetensors", safetensors),
    ("config_json", config_json),
    ("checkpoint", checkpoint),
];
