//! The loader fuzz targets (`fuzz/src/targets.rs`) outside libFuzzer: every input that once
//! broke a target is replayed, the seed corpora are checked to be files the loaders accept,
//! and a short mutation smoke with a fixed seed runs every target (what CI runs; the long,
//! coverage-guided runs are `scripts/fuzz.sh TARGET SECONDS`).
//!
//! `tests/fuzz_inputs/<target>/` holds inputs that crashed, hung or over-allocated a target,
//! minimized and named after what they broke: those the fuzzers find, and hand-made ones
//! that broke the loaders before they checked sizes (dims whose product overflows, a hidden
//! size of 2^40 that asked for terabytes).
//! Each must now return within the time limit with a bounded heap (see `tests/bounded`). The seeds are the tiny
//! checkpoints the other tests write; when `SPECDRAFT_FUZZ_SEEDS` names a folder, they are
//! saved there as `<target>/<name>` for the fuzz script.

mod bounded;
mod model_util;
mod mtp_common;
#[path = "../fuzz/src/mutate.rs"]
mod mutate;
#[path = "../fuzz/src/targets.rs"]
mod targets;

use model_util::{safetensors_bytes, temp_dir, write_tiny_gguf, GgType, Tiny};
use safetensors::tensor::{Dtype as StDtype, TensorView};
use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::model::{
    GgufFile, LoadOptions, ModelConfig, ModelLevers, SafetensorsCheckpoint, TargetModel,
    TensorSource, TensorType,
};
use specdraft::speculative::mtp::quantize_nvfp4;
use specdraft::speculative::{MtpHead, MtpQuantization};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Heap one input may take: tiny models are built from the inputs that parse.
const HEAP_BOUND: isize = 256 << 20;
/// Longest one input may take: a hang detector, generous for a loaded machine (inputs take
/// milliseconds).
const TIME_LIMIT: Duration = Duration::from_secs(10);
/// Mutated inputs per target in the smoke run.
const SMOKE_INPUTS: usize = 250;

#[test]
fn every_input_that_once_broke_a_target_now_returns_cleanly() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_inputs");
    for (name, target) in targets::TARGETS {
        let Ok(entries) = std::fs::read_dir(root.join(name)) else {
            continue;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            eprintln!("replaying {}", path.display());
            bounded::bounded(HEAP_BOUND, TIME_LIMIT, move || target(&data));
        }
    }
}

/// A model smaller than the tests' default, so that fuzzing runs many inputs a second.
fn small() -> Tiny {
    Tiny {
        hidden: 32,
        ffn: 64,
        layers: 1,
        heads: 2,
        kv_heads: 1,
        head_dim: 16,
        vocab: 32,
        ..Tiny::default()
    }
}

fn cpu() -> Arc<dyn GpuBackend> {
    Arc::new(CpuBackend::new())
}

fn head(dir: &Path) -> Result<MtpHead, specdraft::Error> {
    let levers = ModelLevers::default();
    MtpHead::from_checkpoint(dir, cpu(), MtpQuantization::Bf16, 0, 32, 4, &levers)
}

/// `(target, name, bytes)` for every seed, each checked to load as its target's loader
/// would load it (built once: the tests share the scratch folders).
fn seeds() -> &'static [(&'static str, String, Vec<u8>)] {
    static SEEDS: OnceLock<Vec<(&'static str, String, Vec<u8>)>> = OnceLock::new();
    SEEDS.get_or_init(build_seeds)
}

fn build_seeds() -> Vec<(&'static str, String, Vec<u8>)> {
    let mut out = Vec::new();
    let tiny = small();
    let tensors = tiny.tensors(5);
    let dir = temp_dir("fuzz-seed-gguf");
    for (ty, ty_name) in [
        (GgType::F32, "f32"),
        (GgType::F16, "f16"),
        (GgType::Q8_0, "q8_0"),
    ] {
        let path = dir.join(format!("tiny-{ty_name}.gguf"));
        write_tiny_gguf(&path, &tiny, &tensors, ty);
        let file = GgufFile::open(&path).unwrap();
        assert_eq!(file.model_config().unwrap().hidden_size, tiny.hidden);
        let opts = LoadOptions {
            max_rows: 4,
            max_seq_len: Some(32),
            kv_blocks: Some(4),
        };
        TargetModel::load(&path, cpu(), opts).unwrap();
        out.push((
            "gguf",
            format!("tiny-{ty_name}.gguf"),
            std::fs::read(&path).unwrap(),
        ));
    }
    let config = tiny.config_json();
    ModelConfig::from_json_str(&config).unwrap();
    out.push((
        "config_json",
        "tiny.json".into(),
        config.clone().into_bytes(),
    ));
    for (f32_dtype, dtype) in [(false, "bf16"), (true, "f32")] {
        let bytes = safetensors_bytes(&tensors, f32_dtype);
        let file = SafetensorsCheckpoint::from_bytes("seed", bytes.clone()).unwrap();
        assert_eq!(file.names().len(), tensors.len());
        let packed = targets::pack_checkpoint(config.as_bytes(), &bytes);
        out.push(("safetensors", format!("tiny-{dtype}.safetensors"), bytes));
        out.push(("checkpoint", format!("tiny-{dtype}"), packed));
    }
    let layouts = [
        ("deepseek_v3", false),
        ("mimo", false),
        ("qwen3_next", false),
        ("glm4_moe", true),
    ];
    for (layout, moe) in layouts {
        let dir = mtp_common::scratch_dir(&format!("fuzz-seed-{layout}"));
        mtp_common::write_checkpoint_with(&dir, layout, 7, moe);
        assert!(head(&dir).is_ok(), "{layout}");
        let config = std::fs::read(dir.join("config.json")).unwrap();
        let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
        let packed = targets::pack_checkpoint(&config, &weights);
        out.push(("config_json", format!("{layout}.json"), config.clone()));
        out.push(("checkpoint", format!("mtp-{layout}"), packed));
        if layout == "deepseek_v3" {
            out.push((
                "checkpoint",
                "mtp-deepseek_v3-nvfp4".into(),
                nvfp4_seed(&dir),
            ));
        }
    }
    out
}

/// The checkpoint in `dir` with its MTP module's projections in NVFP4 (ModelOpt layout:
/// codes, FP8 block scales, an f32 global scale), packed as a `checkpoint` input.
fn nvfp4_seed(dir: &Path) -> Vec<u8> {
    let prefix = format!("model.layers.{}.", mtp_common::MAIN_LAYERS);
    let src = SafetensorsCheckpoint::open_dir(dir).unwrap();
    let mut out: BTreeMap<String, (StDtype, Vec<usize>, Vec<u8>)> = BTreeMap::new();
    for name in src.names() {
        let t = src.require(&name).unwrap();
        let quantize = name.starts_with(&prefix)
            && name.ends_with("proj.weight")
            && t.shape.len() == 2
            && t.shape[1] % 16 == 0;
        if !quantize {
            assert_eq!(t.dtype, TensorType::Bf16, "{name}");
            out.insert(name, (StDtype::BF16, t.shape.clone(), t.data.to_vec()));
            continue;
        }
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let values: Vec<f32> = t
            .to_bf16(&name, "seed")
            .unwrap()
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let q = quantize_nvfp4(&values, rows, cols).unwrap();
        let base = name.trim_end_matches(".weight");
        out.insert(name.clone(), (StDtype::U8, vec![rows, cols / 2], q.codes));
        let scales = (StDtype::F8_E4M3, vec![rows, cols / 16], q.scales);
        out.insert(format!("{base}.weight_scale"), scales);
        let global = q.global_scale.to_le_bytes().to_vec();
        out.insert(
            format!("{base}.weight_scale_2"),
            (StDtype::F32, vec![], global),
        );
    }
    let views: Vec<(String, TensorView<'_>)> = out
        .iter()
        .map(|(n, (dtype, shape, bytes))| {
            (
                n.clone(),
                TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    let weights = safetensors::serialize(views, None).unwrap();
    let qdir = mtp_common::scratch_dir("fuzz-seed-deepseek-nvfp4");
    let config = std::fs::read(dir.join("config.json")).unwrap();
    std::fs::write(qdir.join("config.json"), &config).unwrap();
    std::fs::write(qdir.join("model.safetensors"), &weights).unwrap();
    let eh = format!("{prefix}eh_proj.weight");
    let quantized = SafetensorsCheckpoint::open_dir(&qdir)
        .unwrap()
        .require(&eh)
        .unwrap()
        .dtype;
    assert_eq!(quantized, TensorType::U8, "the seed carries NVFP4 codes");
    assert!(head(&qdir).is_ok(), "the NVFP4 checkpoint loads");
    targets::pack_checkpoint(&config, &weights)
}

#[test]
fn seeds_are_inputs_the_loaders_accept() {
    let seeds = seeds();
    for (target, _) in targets::TARGETS {
        assert!(seeds.iter().any(|s| s.0 == target), "no seed for {target}");
    }
    let Ok(root) = std::env::var("SPECDRAFT_FUZZ_SEEDS") else {
        return;
    };
    for (target, name, bytes) in seeds {
        let dir = PathBuf::from(&root).join(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

#[test]
fn every_target_survives_a_mutation_smoke_from_a_fixed_seed() {
    let seeds = seeds();
    let failed_dir = temp_dir("fuzz-smoke");
    for (name, target) in targets::TARGETS {
        let mine: Vec<Vec<u8>> = seeds
            .iter()
            .filter(|s| s.0 == name)
            .map(|s| s.2.clone())
            .collect();
        let mut mutator = mutate::Mutator::new(1);
        let mut slowest = (Duration::ZERO, 0);
        for k in 0..SMOKE_INPUTS {
            let seed = &mine[k % mine.len()];
            let input = mutator.mutate(seed, &mine);
            // Saved first: a failure names the input that caused it.
            let path = failed_dir.join(format!("{name}-{k}"));
            std::fs::write(&path, &input).unwrap();
            let len = input.len();
            let start = Instant::now();
            bounded::bounded(HEAP_BOUND, TIME_LIMIT, move || target(&input));
            slowest = slowest.max((start.elapsed(), len));
            std::fs::remove_file(&path).unwrap();
        }
        eprintln!(
            "fuzz smoke: {name} executions={SMOKE_INPUTS} failing_inputs=0 slowest={} us wall, {} bytes",
            slowest.0.as_micros(),
            slowest.1
        );
    }
}
