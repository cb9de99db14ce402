//! The loader fuzz targets (`fuzz/src/targets.rs`) outside libFuzzer: every input that once
//! broke a target is replayed, the seed corpora are checked to be files the loaders accept,
//! and a short mutation smoke with a fixed seed runs every target (what CI runs; the long,
//! coverage-guided runs are `scripts/fuzz.sh TARGET SECONDS`).
//!
//! `tests/fuzz_inputs/<target>/` holds inputs that crashed, hung or over-allocated a target,
//! minimized and named after what they broke: those the fuzzers find, and hand-made ones
//! (`fuzz/regression_inputs.py`) that reached a dangerous path before the loaders checked
//! sizes (dims whose product overflows, a hidden size of 2^40 that asked for terabytes).
//! Each must now return within the time limit with a bounded heap (see `tests/bounded`), with
//! the outcome [`EXPECTED`] gives it: refused with a given message, or loaded. A target's
//! folder that is missing or empty fails the test, as does an input without an expected
//! outcome. Like every test of a binary that bounds the heap, each test here holds
//! `bounded::serial()`, so they run one at a time.
//!
//! The seeds are the tiny checkpoints the other tests write; when `SPECDRAFT_FUZZ_SEEDS`
//! names a folder, they are saved there as `<target>/<name>` for the fuzz script.

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

/// What each regression input must come to: refused with a message holding this text, or
/// loaded. An input that reached a dangerous path but now loads quietly would no longer
/// exercise the check it is kept for.
enum Expect {
    Refused(&'static str),
    Loads,
}
use Expect::{Loads, Refused};

/// `(target, file, outcome)` for every file under `tests/fuzz_inputs/` (the hand-made ones
/// are written by `fuzz/regression_inputs.py`; a file without an entry fails the test, which
/// then prints its outcome).
const EXPECTED: &[(&str, &str, Expect)] = &[
    // GGUF: every count and length is checked against the bytes left before a loop or an
    // allocation trusts it; shapes, offsets and the alignment before a range is placed.
    (
        "gguf",
        "tensor-count-2^60",
        Refused("the tensor count is 1152921504606846976"),
    ),
    (
        "gguf",
        "metadata-count-2^60",
        Refused("the metadata count is 1152921504606846976"),
    ),
    (
        "gguf",
        "key-length-2^60",
        Refused("the length of a metadata key at byte 24 is 1152921504606846976"),
    ),
    (
        "gguf",
        "string-value-length-2^60",
        Refused("the value of \"general.name\" at byte 48 is 1152921504606846976"),
    ),
    (
        "gguf",
        "tensor-name-length-2^60",
        Refused("the length of a tensor name at byte 24 is 1152921504606846976"),
    ),
    (
        "gguf",
        "array-count-2^60",
        Refused("the length of array \"tokenizer.ggml.tokens\" is 1152921504606846976"),
    ),
    (
        "gguf",
        "arrays-nested-5-deep",
        Refused("the nesting of arrays in \"general.nested\" is 5"),
    ),
    (
        "gguf",
        "value-type-13",
        Refused("the type of \"general.name\" is 13, out of range"),
    ),
    (
        "gguf",
        "dims-count-5",
        Refused("the dims count of tensor \"blk.0.attn_q.weight\" is 5"),
    ),
    (
        "gguf",
        "dims-product-overflows-2^64",
        Refused("its element count overflows 64 bits"),
    ),
    (
        "gguf",
        "f32-bytes-2^62-past-the-end",
        Refused("needs bytes 96..4611686018427437380 but the file has 160"),
    ),
    (
        "gguf",
        "data-offset-2^40-past-the-end",
        Refused("needs bytes 1099511627872..1099511627904 but the file has 160"),
    ),
    (
        "gguf",
        "data-offset-8-not-aligned",
        Refused("the data offset of tensor \"blk.0.attn_q.weight\" is 8"),
    ),
    (
        "gguf",
        "alignment-48",
        Refused("\"general.alignment\" is UInt(48), out of range"),
    ),
    (
        "gguf",
        "alignment-2^62",
        Refused("\"general.alignment\" is UInt(4611686018427387904), out of range"),
    ),
    (
        "gguf",
        "q8_0-33-elements-not-whole-blocks",
        Refused("33 elements of type Q8_0 are not a whole number of blocks"),
    ),
    (
        "gguf",
        "version-4",
        Refused("the version is 4, out of range"),
    ),
    (
        "gguf",
        "ends-inside-the-version",
        Refused("the file ends at byte 6 while reading the version"),
    ),
    (
        "gguf",
        "key-twice",
        Refused("metadata key \"general.name\" appears twice"),
    ),
    // GGUF metadata goes through the configuration's limits, and tensors through its shapes.
    (
        "gguf",
        "embedding-length-2^40",
        Refused("\"hidden_size\": is 1099511627776, above the largest accepted"),
    ),
    (
        "gguf",
        "head-count-0",
        Refused("\"num_attention_heads\": must be greater than zero"),
    ),
    (
        "gguf",
        "eos-token-id-2^32+2",
        Refused("\"tokenizer.ggml.eos_token_id\" is 4294967298, not a u32 token id"),
    ),
    (
        "gguf",
        "token-embd-rows-against-vocab",
        Refused("\"token_embd.weight\" in fuzz.gguf has shape [8, 16], expected [16, 16]"),
    ),
    // safetensors: the header length before the header is read; the crate's checks of
    // offsets, shapes and JSON after.
    (
        "safetensors",
        "header-length-2^40",
        Refused("the header length is 1099511627776, out of range"),
    ),
    (
        "safetensors",
        "header-length-2^64-1",
        Refused("the header length is 18446744073709551615, out of range"),
    ),
    (
        "safetensors",
        "header-length-past-the-end",
        Refused("the header length is 4096, out of range: the file holds 58 bytes after it"),
    ),
    (
        "safetensors",
        "too-short-for-the-header-length",
        Refused("the file is 5 bytes, too short for the header length"),
    ),
    (
        "safetensors",
        "offsets-2^40-past-the-end",
        Refused("tensor \"a\" in fuzz.safetensors is truncated: it needs bytes 0..1099511627776"),
    ),
    (
        "safetensors",
        "shape-product-overflows-2^64",
        Refused("overflow computing buffer size from shape"),
    ),
    (
        "safetensors",
        "offsets-overlap",
        Refused("invalid offset for tensor `b`"),
    ),
    (
        "safetensors",
        "offsets-reversed",
        Refused("invalid offset for tensor `a`"),
    ),
    (
        "safetensors",
        "shape-against-offsets",
        Refused("invalid shape, data type, or offset for tensor"),
    ),
    ("safetensors", "zero-element-tensor", Loads),
    (
        "safetensors",
        "f4-odd-element-count",
        Refused("does not end up at a byte boundary"),
    ),
    (
        "safetensors",
        "dim-2^64",
        Refused("invalid type: floating point `1.8446744073709552e+19`, expected usize"),
    ),
    (
        "safetensors",
        "header-not-utf8",
        Refused("invalid UTF-8 in header"),
    ),
    (
        "safetensors",
        "header-nested-200-deep",
        Refused("invalid JSON in header: recursion limit exceeded"),
    ),
    // config.json: every size within the limits, every count a non-negative integer.
    (
        "config_json",
        "hidden-size-2^40",
        Refused("\"hidden_size\": is 1099511627776, above the largest accepted"),
    ),
    (
        "config_json",
        "vocab-size-2^64-1",
        Refused("\"vocab_size\": is 18446744073709551615, above the largest accepted"),
    ),
    (
        "config_json",
        "max-position-embeddings-2^64-1",
        Refused("\"max_position_embeddings\": is 18446744073709551615, above the largest"),
    ),
    (
        "config_json",
        "num-hidden-layers-negative",
        Refused("\"num_hidden_layers\": expected a non-negative integer, found -1"),
    ),
    (
        "config_json",
        "intermediate-size-1e300",
        Refused("\"intermediate_size\": expected a non-negative integer, found 1e+300"),
    ),
    (
        "config_json",
        "num-attention-heads-0",
        Refused("\"num_attention_heads\": must be greater than zero"),
    ),
    (
        "config_json",
        "num-key-value-heads-0",
        Refused("\"num_key_value_heads\": must be greater than zero"),
    ),
    (
        "config_json",
        "heads-3-over-kv-heads-2",
        Refused("2 does not divide num_attention_heads 3"),
    ),
    (
        "config_json",
        "head-dim-odd",
        Refused("\"head_dim\": 7 is odd"),
    ),
    (
        "config_json",
        "rope-theta-1e39-is-inf-in-f32",
        Refused("\"rope_theta\": is inf; it must be positive and finite"),
    ),
    (
        "config_json",
        "rms-norm-eps-negative",
        Refused("\"rms_norm_eps\": is -1; it must be positive and finite"),
    ),
    (
        "config_json",
        "rope-scaling-factor-0",
        Refused("\"rope_scaling.factor\": is 0; it must be positive and finite"),
    ),
    (
        "config_json",
        "eos-token-id-2^32+2",
        Refused("\"eos_token_id\": expected a u32 token id, found 4294967298"),
    ),
    (
        "config_json",
        "experts-2^40",
        Refused("\"num_experts\": is 1099511627776, above the largest accepted"),
    ),
    (
        "config_json",
        "experts-per-token-9-of-8",
        Refused("\"num_experts_per_tok\": is 9, not in 1..=8"),
    ),
    (
        "config_json",
        "mtp-layers-2^20",
        Refused("\"num_nextn_predict_layers\": is 1048576, above the largest accepted"),
    ),
    (
        "config_json",
        "nested-200-deep",
        Refused("not a JSON object: recursion limit exceeded"),
    ),
    (
        "config_json",
        "top-level-array",
        Refused("the top level is not an object"),
    ),
    (
        "config_json",
        "not-utf8",
        Refused("config.json: invalid utf-8"),
    ),
    (
        "config_json",
        "model-type-unknown",
        Refused("unknown model_type \"gpt-j\""),
    ),
    // A checkpoint: its config's limits before anything is sized from them, then each
    // tensor's shape and type against the config before it is read.
    (
        "checkpoint",
        "hidden-size-2^40",
        Refused("\"hidden_size\": is 1099511627776, above the largest accepted"),
    ),
    (
        "checkpoint",
        "vocab-size-2^40",
        Refused("\"vocab_size\": is 1099511627776, above the largest accepted"),
    ),
    (
        "checkpoint",
        "intermediate-size-2^40",
        Refused("\"intermediate_size\": is 1099511627776, above the largest accepted"),
    ),
    (
        "checkpoint",
        "num-hidden-layers-2^20",
        Refused("\"num_hidden_layers\": is 1048576, above the largest accepted"),
    ),
    (
        "checkpoint",
        "experts-2^40",
        Refused("\"num_experts\": is 1099511627776, above the largest accepted"),
    ),
    (
        "checkpoint",
        "heads-0",
        Refused("\"num_attention_heads\": must be greater than zero"),
    ),
    (
        "checkpoint",
        "vocab-size-64-against-16-embedding-rows",
        Refused("\"model.embed_tokens.weight\" in fuzz/model.safetensors has shape [16, 16]"),
    ),
    (
        "checkpoint",
        "down-proj-shape-transposed",
        Refused("down_proj.weight\" in fuzz/model.safetensors has shape [32, 16]"),
    ),
    (
        "checkpoint",
        "norm-weight-f64",
        Refused("\"model.norm.weight\" in fuzz/model.safetensors has type F64, which is not"),
    ),
];

/// The files of a target's regression folder, sorted; a missing or empty folder fails the
/// test, since replaying nothing would check nothing.
fn regression_inputs(dir: &Path) -> Vec<PathBuf> {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| {
        panic!(
            "cannot list the regression inputs in {}: {e}",
            dir.display()
        )
    });
    let mut paths: Vec<PathBuf> = entries.map(|e| e.unwrap().path()).collect();
    paths.sort();
    assert!(
        !paths.is_empty(),
        "{} holds no regression inputs",
        dir.display()
    );
    paths
}

#[test]
fn every_input_that_once_broke_a_target_now_returns_cleanly() {
    let _serial = bounded::serial();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_inputs");
    // Every input is replayed before failing, so one run lists every outcome that differs.
    let mut wrong = Vec::new();
    for (name, target) in targets::TARGETS {
        for path in regression_inputs(&root.join(name)) {
            let file = path.file_name().unwrap().to_str().unwrap().to_string();
            let expect = EXPECTED
                .iter()
                .find(|e| e.0 == name && e.1 == file)
                .map(|e| &e.2);
            let data = std::fs::read(&path).unwrap();
            eprintln!("replaying {}", path.display());
            let outcome = bounded::bounded(HEAP_BOUND, TIME_LIMIT, move || target(&data));
            match (expect, &outcome) {
                (Some(Refused(text)), Err(message)) if message.contains(text) => {}
                (Some(Loads), Ok(())) => {}
                (None, _) => wrong.push(format!("{name}/{file} (no entry): {outcome:?}")),
                (Some(_), _) => wrong.push(format!("{name}/{file}: {outcome:?}")),
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "outcomes not as expected:\n{}",
        wrong.join("\n")
    );
    let missing: Vec<String> = EXPECTED
        .iter()
        .filter(|e| !root.join(e.0).join(e.1).is_file())
        .map(|e| format!("{}/{}", e.0, e.1))
        .collect();
    assert!(
        missing.is_empty(),
        "EXPECTED names inputs that are not there: {missing:?}"
    );
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
    let _serial = bounded::serial();
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
    let _serial = bounded::serial();
    let seeds = seeds();
    let failed_dir = temp_dir("fuzz-smoke");
    for (name, target) in targets::TARGETS {
        let mine: Vec<Vec<u8>> = seeds
            .iter()
            .filter(|s| s.0 == name)
            .map(|s| s.2.clone())
            .collect();
        assert!(!mine.is_empty(), "no seed for {name}: nothing to mutate");
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
            // A mutated input may load or be refused; returning is what is checked.
            let _ = bounded::bounded(HEAP_BOUND, TIME_LIMIT, move || target(&input));
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
