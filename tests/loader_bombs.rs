//! Hand-made hostile model files: counts and lengths near 2^60 and 2^64 in GGUF and
//! safetensors headers, absurd sizes in `config.json`, a header whose parse would take
//! gigabytes. Each is a clear error naming the file, the field and the value, returned
//! within a second with a bounded amount of memory.
//!
//! How memory is checked: see `tests/bounded` (a counting allocator of the whole process;
//! each load runs on a fresh thread, and the heap's growth while it runs is bounded). Every
//! test holds `bounded::serial()`, so no other test's allocations are counted in a bound.

mod bounded;
mod model_util;
mod mtp_common;

use model_util::{temp_dir, write_gguf, write_hf, Meta, Tiny};
use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::model::{
    ConfigError, GgufFile, LoadOptions, ModelConfig, ModelError, ModelLevers,
    SafetensorsCheckpoint, TargetModel,
};
use specdraft::speculative::{MtpHead, MtpQuantization};
use specdraft::Error;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Heap any of these loads may use beyond what they started with.
const MEMORY_BOUND: isize = 1 << 20;

/// Each must be refused within a second (they take microseconds).
fn bounded<T: Send + 'static>(load: impl FnOnce() -> T + Send + 'static) -> T {
    bounded::bounded(MEMORY_BOUND, Duration::from_secs(1), load)
}

fn gguf_err(path: &Path) -> ModelError {
    let path = path.to_path_buf();
    match bounded(move || GgufFile::open(&path).map(|_| ())) {
        Ok(()) => panic!("a hostile file parsed"),
        Err(e) => e,
    }
}

fn assert_out_of_range(err: &ModelError, file: &Path, want_field: &str, want_value: u64) {
    match err {
        ModelError::OutOfRange {
            path, field, value, ..
        } => {
            assert_eq!(path, &file.display().to_string());
            assert!(field.contains(want_field), "field {field:?} in {err}");
            assert_eq!(value, &want_value.to_string(), "{err}");
        }
        other => panic!("expected an out-of-range error, got {other}"),
    }
}

/// GGUF v3 header bytes: magic, version, tensor count, metadata count.
fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(n_tensors.to_le_bytes());
    b.extend(n_kv.to_le_bytes());
    b
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

const NEAR_2_60: u64 = (1 << 60) + 12345;

#[test]
fn heap_a_load_allocates_on_a_thread_it_starts_counts_against_its_bound() {
    let _serial = bounded::serial();
    // A loader that hands its work to a helper thread, as a kernel pool's workers would.
    const SIZE: usize = 8 << 20;
    let helper = || std::thread::spawn(|| vec![1u8; SIZE].len()).join().unwrap();
    let (len, grew) = bounded::measure(Duration::from_secs(10), helper);
    assert_eq!(len, SIZE);
    // The helper's buffer, give or take a little bookkeeping: the count is the whole
    // process's, so another test's thread may allocate or free a few bytes meanwhile.
    let slack = 64 << 10;
    assert!(
        (SIZE as isize - slack..SIZE as isize + slack).contains(&grew),
        "the heap grew by {grew} bytes"
    );
    let over = std::panic::catch_unwind(|| bounded(helper)).expect_err("the bound held");
    let message = over
        .downcast_ref::<String>()
        .expect("a formatted panic message");
    assert!(
        message.starts_with("the load's heap grew by") && message.ends_with("(bound 1048576)"),
        "{message}"
    );
}

#[test]
fn gguf_string_lengths_near_2_60_are_refused() {
    let _serial = bounded::serial();
    let dir = temp_dir("bomb-gguf-string");
    // A key whose length field says 2^60.
    let mut b = header(0, 1);
    b.extend(NEAR_2_60.to_le_bytes());
    b.extend([b'a'; 64]);
    let path = write(&dir, "key.gguf", &b);
    assert_out_of_range(
        &gguf_err(&path),
        &path,
        "the length of a metadata key",
        NEAR_2_60,
    );
    // A string value whose length field says 2^60.
    let mut b = header(0, 1);
    put_str(&mut b, "general.name");
    b.extend(8u32.to_le_bytes());
    b.extend(NEAR_2_60.to_le_bytes());
    b.extend([b'a'; 64]);
    let path = write(&dir, "value.gguf", &b);
    let err = gguf_err(&path);
    assert_out_of_range(&err, &path, "the value of \"general.name\"", NEAR_2_60);
    // A tensor name whose length field says 2^60.
    let mut b = header(1, 0);
    b.extend(NEAR_2_60.to_le_bytes());
    b.extend([0u8; 40]);
    let path = write(&dir, "tensor-name.gguf", &b);
    assert_out_of_range(
        &gguf_err(&path),
        &path,
        "the length of a tensor name",
        NEAR_2_60,
    );
}

#[test]
fn gguf_array_counts_near_2_60_are_refused() {
    let _serial = bounded::serial();
    let dir = temp_dir("bomb-gguf-array");
    for (inner, name) in [(0u32, "u8"), (8, "string"), (9, "array")] {
        let mut b = header(0, 1);
        put_str(&mut b, "tokenizer.ggml.tokens");
        b.extend(9u32.to_le_bytes());
        b.extend(inner.to_le_bytes());
        b.extend(NEAR_2_60.to_le_bytes());
        b.extend([0u8; 64]);
        let path = write(&dir, &format!("{name}.gguf"), &b);
        let err = gguf_err(&path);
        assert_out_of_range(&err, &path, "array \"tokenizer.ggml.tokens\"", NEAR_2_60);
    }
}

#[test]
fn gguf_tensor_and_metadata_counts_near_2_60_are_refused() {
    let _serial = bounded::serial();
    let dir = temp_dir("bomb-gguf-counts");
    let mut b = header(NEAR_2_60, 0);
    b.extend([0u8; 256]);
    let path = write(&dir, "tensors.gguf", &b);
    assert_out_of_range(&gguf_err(&path), &path, "the tensor count", NEAR_2_60);
    let mut b = header(0, NEAR_2_60);
    b.extend([0u8; 256]);
    let path = write(&dir, "metadata.gguf", &b);
    assert_out_of_range(&gguf_err(&path), &path, "the metadata count", NEAR_2_60);
    // The same through the model loader, which leaks nothing either.
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let loader_gpu = gpu.clone();
    let err = bounded(move || {
        let opts = LoadOptions {
            max_rows: 4,
            max_seq_len: Some(64),
            kv_blocks: Some(4),
        };
        TargetModel::load(&path, loader_gpu, opts).map(|_| ())
    });
    match err {
        Err(Error::Model(e)) => assert!(e.to_string().contains("the metadata count"), "{e}"),
        other => panic!("expected a model error, got {other:?}"),
    }
    assert_eq!(gpu.ledger().live_count(), 0);
}

fn one_tensor(dims: &[u64], ggml_type: u32) -> Vec<u8> {
    let mut b = header(1, 0);
    put_str(&mut b, "blk.0.attn_q.weight");
    b.extend((dims.len() as u32).to_le_bytes());
    for d in dims {
        b.extend(d.to_le_bytes());
    }
    b.extend(ggml_type.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.resize(b.len().div_ceil(32) * 32 + 64, 0);
    b
}

#[test]
fn gguf_tensor_dims_near_2_60_are_refused() {
    let _serial = bounded::serial();
    let dir = temp_dir("bomb-gguf-dims");
    // The element count overflows 64 bits.
    let path = write(&dir, "overflow.gguf", &one_tensor(&[NEAR_2_60, 16], 0));
    match gguf_err(&path) {
        ModelError::OutOfRange { field, value, .. } => {
            assert!(field.contains("the shape of tensor \"blk.0.attn_q.weight\""));
            assert!(value.contains(&NEAR_2_60.to_string()), "{value}");
        }
        other => panic!("expected an out-of-range shape, got {other}"),
    }
    // The count fits, its F32 bytes (2^62) do not fit the file.
    let path = write(&dir, "huge.gguf", &one_tensor(&[NEAR_2_60], 0));
    match gguf_err(&path) {
        ModelError::Truncated {
            tensor,
            end,
            path: p,
            ..
        } => {
            assert_eq!(tensor, "blk.0.attn_q.weight");
            assert_eq!(p, path.display().to_string());
            assert!(end as u64 > NEAR_2_60 * 4, "{end}");
        }
        other => panic!("expected a truncated tensor, got {other}"),
    }
    // More dims than GGUF has.
    let path = write(&dir, "dims.gguf", &one_tensor(&[1; 5], 0));
    assert_out_of_range(&gguf_err(&path), &path, "the dims count", 5);
}

#[test]
fn a_gguf_header_that_would_take_gigabytes_in_memory_is_refused() {
    let _serial = bounded::serial();
    // 16 Mi one-byte elements: a 16 MiB file whose values would take 512 MiB as parsed.
    let dir = temp_dir("bomb-gguf-amplify");
    let n: u64 = 16 << 20;
    let mut b = header(0, 1);
    put_str(&mut b, "tokenizer.ggml.token_type");
    b.extend(9u32.to_le_bytes());
    b.extend(0u32.to_le_bytes());
    b.extend(n.to_le_bytes());
    b.resize(b.len() + n as usize, 1);
    let path = write(&dir, "amplify.gguf", &b);
    match gguf_err(&path) {
        ModelError::OutOfRange { field, reason, .. } => {
            assert!(field.contains("size in memory"), "{field}");
            assert!(reason.contains("at most 268435456 bytes"), "{reason}");
        }
        other => panic!("expected the memory limit, got {other}"),
    }
}

#[test]
fn gguf_alignment_and_offsets_are_checked() {
    let _serial = bounded::serial();
    let dir = temp_dir("bomb-gguf-align");
    let mut b = header(0, 1);
    put_str(&mut b, "general.alignment");
    b.extend(10u32.to_le_bytes());
    b.extend(48u64.to_le_bytes());
    let path = write(&dir, "align.gguf", &b);
    match gguf_err(&path) {
        ModelError::OutOfRange { field, value, .. } => {
            assert!(
                field.contains("general.alignment") && value.contains("48"),
                "{value}"
            );
        }
        other => panic!("expected an out-of-range alignment, got {other}"),
    }
    // Offset 8 is not a multiple of the default alignment (32). The offset field follows
    // the header (24 bytes), the name (8 + 19), the dims count (4), one dim (8), the type (4).
    let mut b = one_tensor(&[32], 0);
    let offset_at = 24 + 8 + "blk.0.attn_q.weight".len() + 4 + 8 + 4;
    b[offset_at..offset_at + 8].copy_from_slice(&8u64.to_le_bytes());
    let path = write(&dir, "offset.gguf", &b);
    assert_out_of_range(&gguf_err(&path), &path, "the data offset", 8);
}

#[test]
fn safetensors_header_lengths_near_2_64_are_refused() {
    let _serial = bounded::serial();
    let dir = temp_dir("bomb-st");
    for (name, n) in [
        ("max", u64::MAX),
        ("wrap", u64::MAX - 7),
        ("2-63", 1u64 << 63),
    ] {
        let sub = dir.join(name);
        std::fs::create_dir_all(&sub).unwrap();
        let mut b = n.to_le_bytes().to_vec();
        b.extend(br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#);
        let path = write(&sub, "model.safetensors", &b);
        let err = bounded(move || SafetensorsCheckpoint::open_dir(&sub).map(|_| ()));
        assert_out_of_range(&err.unwrap_err(), &path, "the header length", n);
    }
    // A length the file could hold but beyond safetensors' 100 MB limit.
    let mut b = 200_000_000u64.to_le_bytes().to_vec();
    b.extend([b' '; 64]);
    let sub = dir.join("limit");
    std::fs::create_dir_all(&sub).unwrap();
    let path = write(&sub, "model.safetensors", &b);
    let err = bounded(move || SafetensorsCheckpoint::open_dir(&sub).map(|_| ()));
    assert_out_of_range(&err.unwrap_err(), &path, "the header length", 200_000_000);
}

fn config_err(path: PathBuf) -> ConfigError {
    bounded(move || ModelConfig::from_file(&path).map(|_| ())).unwrap_err()
}

#[test]
fn absurd_config_sizes_are_refused_naming_file_key_and_value() {
    let _serial = bounded::serial();
    let dir = temp_dir("bomb-config");
    let tiny = Tiny::default();
    let json = tiny.config_json();
    for (key, from, to) in [
        (
            "hidden_size",
            "\"hidden_size\": 64",
            "\"hidden_size\": 1099511627776",
        ),
        (
            "vocab_size",
            "\"vocab_size\": 96",
            "\"vocab_size\": 1152921504606846976",
        ),
        (
            "num_hidden_layers",
            "\"num_hidden_layers\": 2",
            "\"num_hidden_layers\": 1000000",
        ),
        (
            "max_position_embeddings",
            "\"max_position_embeddings\": 256",
            "\"max_position_embeddings\": 18446744073709551615",
        ),
    ] {
        assert!(json.contains(from), "{json}");
        let path = write(
            &dir,
            &format!("{key}.json"),
            json.replace(from, to).as_bytes(),
        );
        let err = config_err(path.clone());
        let text = err.to_string();
        let value = to.rsplit(' ').next().unwrap();
        match &err {
            ConfigError::InFile { path: p, source } => {
                assert_eq!(p, &path.display().to_string());
                assert!(
                    matches!(&**source, ConfigError::BadValue { key: k, .. } if k == key),
                    "{source:?}"
                );
            }
            other => panic!("expected an error naming the file, got {other:?}"),
        }
        assert!(
            text.contains(value) && text.contains("above the largest"),
            "{text}"
        );
    }
    // An eos id beyond u32 is refused rather than truncated.
    let path = write(
        &dir,
        "eos.json",
        json.replace("\"eos_token_id\": 2", "\"eos_token_id\": 4294967298")
            .as_bytes(),
    );
    assert!(config_err(path).to_string().contains("4294967298"));
    // A file larger than any configuration is not read.
    let path = dir.join("big.json");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(1 << 40).unwrap();
    match config_err(path) {
        ConfigError::TooLarge { size, .. } => assert_eq!(size, 1 << 40),
        other => panic!("expected TooLarge, got {other}"),
    }
}

#[test]
fn a_checkpoint_with_an_absurd_config_fails_before_allocating() {
    let _serial = bounded::serial();
    let dir = temp_dir("bomb-config-model");
    let tiny = Tiny::default();
    write_hf(&dir, &tiny, &tiny.tensors(1));
    let json = tiny
        .config_json()
        .replace("\"hidden_size\": 64", "\"hidden_size\": 1099511627776");
    std::fs::write(dir.join("config.json"), json).unwrap();
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let loader_gpu = gpu.clone();
    let err =
        bounded(move || TargetModel::load(&dir, loader_gpu, LoadOptions::default()).map(|_| ()))
            .unwrap_err();
    assert!(err.to_string().contains("1099511627776"), "{err}");
    assert_eq!(gpu.ledger().live_count(), 0);
    // GGUF metadata goes through the same limits.
    let dir = temp_dir("bomb-gguf-config");
    let meta = [
        ("general.architecture", Meta::Str("llama".into())),
        ("llama.embedding_length", Meta::U32(u32::MAX)),
        ("llama.attention.head_count", Meta::U32(4)),
        ("llama.feed_forward_length", Meta::U32(128)),
        ("llama.block_count", Meta::U32(2)),
        ("llama.vocab_size", Meta::U32(96)),
    ];
    let path = dir.join("wide.gguf");
    write_gguf(&path, &meta, &[]);
    let err = GgufFile::open(&path).unwrap().model_config().unwrap_err();
    assert!(err.to_string().contains("hidden_size") && err.to_string().contains("4294967295"));
}

#[test]
fn an_mtp_checkpoint_with_groups_that_do_not_split_its_experts_is_refused() {
    let _serial = bounded::serial();
    let dir = mtp_common::scratch_dir("bomb-mtp-groups");
    mtp_common::write_checkpoint_with(&dir, "glm4_moe", 3, true);
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    config["n_group"] = serde_json::json!(3);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let err = MtpHead::from_checkpoint(
        &dir,
        gpu.clone(),
        MtpQuantization::Bf16,
        0,
        64,
        8,
        &ModelLevers::default(),
    )
    .err()
    .expect("a bad n_group loaded");
    let text = err.to_string();
    assert!(text.contains("config.json") && text.contains("n_group") && text.contains("is 3"));
    assert_eq!(gpu.ledger().live_count(), 0);
}
