//! A regression fixture for the decoder layer: the target model's logits and hidden rows
//! (Llama/SmolLM2-like, Qwen2 with q/k/v biases, Qwen3 with q/k norm and tied embeddings,
//! Llama with adjacent-pair RoPE) and the MTP head's drafts, confidences and logits (the
//! DeepSeek-V3, MiMo and Qwen3-Next layouts, both MoE layouts, NVFP4 and FP8 projections,
//! the postnorm and exact-KV levers), on the CPU backend, compared bit for bit with
//! `tests/fixtures/decoder_target.json` and `decoder_mtp.json`.
//!
//! What it proves: a change to how the layer is written (not what it computes) leaves
//! every output bit where it was. It is not a correctness reference; those are
//! `model_target.rs` (an f32 reference forward), `mtp_reference.rs` (numpy) and
//! `model_smollm2.rs`. A change meant to alter the numbers (a new kernel order, a different
//! rounding) regenerates the file, after the independent references pass, with
//! `SPECDRAFT_BLESS_FIXTURES=1 cargo test --test decoder_fixture`, and says so.
//!
//! The values depend on the CPU kernels' fixed operation order and on the platform's `sin`,
//! `cos` and `exp`; the file was written on x86_64 Linux.

#[allow(unused_imports)]
mod model_util;
mod mtp_common;

use model_util::{write_hf, Tiny};
use mtp_common::{scratch_dir, write_checkpoint_with, HIDDEN, VOCAB};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt, RopeStyle};
use specdraft::memory::BufferArena;
use specdraft::model::{
    ForwardContext, LoadOptions, LogitRows, ModelConfig, ModelLevers, NameScheme,
    SafetensorsCheckpoint, TargetModel,
};
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization, ProposerState};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

/// Every recorded output, by `case/what`: the element type and the little-endian bytes.
#[derive(Default)]
struct Record(BTreeMap<String, (&'static str, Vec<u8>)>);

impl Record {
    fn f32s(&mut self, key: String, v: &[f32]) {
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.0.insert(key, ("f32", bytes));
    }

    fn u32s(&mut self, key: String, v: &[u32]) {
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.0.insert(key, ("u32", bytes));
    }

    fn bf16s(&mut self, key: String, v: &[half::bf16]) {
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.0.insert(key, ("bf16", bytes));
    }

    fn to_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for (k, (dtype, bytes)) in &self.0 {
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            m.insert(k.clone(), serde_json::json!({"dtype": dtype, "hex": hex}));
        }
        serde_json::Value::Object(m)
    }
}

/// The fixture file of one test (`target` or `mtp`), so the two tests never share a file.
fn fixture_path(scope: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/decoder_{scope}.json"))
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex digit"))
        .collect()
}

/// The element at `i` of `bytes` read as `dtype`, for messages.
fn element(dtype: &str, bytes: &[u8], i: usize) -> String {
    match dtype {
        "bf16" => {
            let b = [bytes[2 * i], bytes[2 * i + 1]];
            format!("{}", half::bf16::from_le_bytes(b))
        }
        "u32" => format!(
            "{}",
            u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap())
        ),
        _ => format!(
            "{}",
            f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap())
        ),
    }
}

/// Compares `got` with the stored fixture (or writes it under `SPECDRAFT_BLESS_FIXTURES`).
fn check_against_fixture(got: &Record, scope: &str) {
    let path = fixture_path(scope);
    if std::env::var_os("SPECDRAFT_BLESS_FIXTURES").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let text = serde_json::to_string_pretty(&got.to_json()).unwrap();
        std::fs::write(&path, text + "\n").unwrap();
        return;
    }
    let stored: serde_json::Map<String, serde_json::Value> = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_else(|| {
            panic!(
                "cannot read {}; write it with SPECDRAFT_BLESS_FIXTURES=1",
                path.display()
            )
        });
    let want: BTreeMap<&String, &serde_json::Value> = stored.iter().collect();
    let got_keys: Vec<&String> = got.0.keys().collect();
    let want_keys: Vec<&String> = want.keys().copied().collect();
    assert_eq!(
        got_keys, want_keys,
        "the recorded outputs are not the stored ones"
    );
    let mut differ = Vec::new();
    for (key, (dtype, bytes)) in &got.0 {
        let w = want[key];
        assert_eq!(w["dtype"], *dtype, "{key}: element type");
        let wb = unhex(w["hex"].as_str().unwrap());
        if wb != *bytes {
            let size = if *dtype == "bf16" { 2 } else { 4 };
            let n = bytes.len().min(wb.len()) / size;
            let first =
                (0..n).find(|&i| bytes[i * size..(i + 1) * size] != wb[i * size..(i + 1) * size]);
            differ.push(match first {
                Some(i) => format!(
                    "{key}: element {i} is {}, the fixture has {}",
                    element(dtype, bytes, i),
                    element(dtype, &wb, i)
                ),
                None => format!("{key}: {} bytes, the fixture has {}", bytes.len(), wb.len()),
            });
        }
    }
    assert!(differ.is_empty(), "outputs changed:\n{}", differ.join("\n"));
}

const PROMPT: [u32; 21] = [
    1, 5, 17, 33, 4, 90, 12, 12, 7, 64, 3, 22, 45, 8, 8, 61, 70, 2, 9, 95, 40,
];

/// Prefill, two decode steps, then one forward carrying a 4-row verify of one sequence and
/// the prefill of another: logits of every row and the hidden rows of the last forward.
fn record_target(rec: &mut Record, name: &str, tiny: &Tiny, seed: u64, style: RopeStyle) {
    let dir = scratch_dir(&format!("decoder_fixture_{name}"));
    write_hf(&dir, tiny, &tiny.tensors(seed));
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let (config, src) = SafetensorsCheckpoint::open_with_config(&dir).unwrap();
    let opts = LoadOptions {
        max_rows: 64,
        max_seq_len: Some(128),
        kv_blocks: Some(24),
    };
    let model = TargetModel::from_source(
        gpu.clone(),
        config,
        &src,
        NameScheme::HuggingFace,
        style,
        opts,
    )
    .unwrap();
    let v = tiny.vocab;
    let logits = |out: &specdraft::model::ForwardOutput| -> Vec<f32> {
        gpu.download(out.logits, out.logits_rows * v).unwrap()
    };
    let mut a = model.new_sequence();
    let out = model.forward(&mut [&mut a], &[&PROMPT]).unwrap();
    rec.f32s(format!("target/{name}/prefill_logits"), &logits(&out));
    for (i, tok) in [7u32, 81].into_iter().enumerate() {
        let out = model.forward(&mut [&mut a], &[&[tok]]).unwrap();
        rec.f32s(format!("target/{name}/decode{i}_logits"), &logits(&out));
    }
    let mut b = model.new_sequence();
    let out = model
        .forward(&mut [&mut a, &mut b], &[&[3, 1, 4, 1], &PROMPT[..9]])
        .unwrap();
    rec.f32s(format!("target/{name}/batch_logits"), &logits(&out));
    let hidden: Vec<half::bf16> = gpu.download(out.hiddens, out.rows * tiny.hidden).unwrap();
    rec.bf16s(format!("target/{name}/batch_hiddens"), &hidden);
    model.trim(&mut a, PROMPT.len() + 2).unwrap();
    let out = model
        .forward_with(
            &mut [&mut a, &mut b],
            &[&[5, 9], &[11]],
            LogitRows::LastPerSequence,
        )
        .unwrap();
    rec.f32s(
        format!("target/{name}/last_per_sequence_logits"),
        &logits(&out),
    );
    model.free_sequence(&mut a).unwrap();
    model.free_sequence(&mut b).unwrap();
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn target_outputs_are_bit_identical_to_the_fixture() {
    let mut rec = Record::default();
    let llama = Tiny::default();
    record_target(&mut rec, "llama", &llama, 1, RopeStyle::Half);
    record_target(
        &mut rec,
        "llama_interleaved",
        &llama,
        2,
        RopeStyle::Interleaved,
    );
    let qwen2 = Tiny {
        family: "qwen2",
        ..Tiny::default()
    };
    record_target(&mut rec, "qwen2", &qwen2, 3, RopeStyle::Half);
    let qwen3 = Tiny {
        family: "qwen3",
        tied: true,
        ..Tiny::default()
    };
    record_target(&mut rec, "qwen3_tied", &qwen3, 4, RopeStyle::Half);
    check_against_fixture(&rec, "target");
}

struct MtpCase {
    name: &'static str,
    layout: &'static str,
    moe: bool,
    levers: ModelLevers,
    quant: MtpQuantization,
}

/// Two sequences: three single proposes of one (1, 2, 3 drafts, each with its logits),
/// a verify accepting two (with catch-up under `mtp_kv_exact`), then a batched propose of
/// both with confidences and the logits of both rows.
fn record_mtp(rec: &mut Record, case: &MtpCase) {
    let name = case.name;
    let dir = scratch_dir(&format!("decoder_fixture_mtp_{name}"));
    write_checkpoint_with(&dir, case.layout, 5, case.moe);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let head =
        MtpHead::from_checkpoint(&dir, gpu.clone(), case.quant, 0, 256, 64, &case.levers).unwrap();
    let config = ModelConfig::from_file(dir.join("config.json")).unwrap();
    let ctx = ForwardContext::new(
        gpu.clone(),
        Arc::new(BufferArena::empty(16)),
        Arc::new(config),
        case.levers,
    );
    let mut rng = SmallRng::seed_from_u64(13);
    let total = 48;
    let values: Vec<f32> = (0..total * HIDDEN)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let hiddens = gpu.upload_bf16(&values, "test:hiddens").unwrap();
    let hidden = |p: usize| hiddens.offset(p * HIDDEN * 2);
    let tokens: Vec<u32> = (0..total)
        .map(|_| rng.random_range(0..VOCAB as u32))
        .collect();
    let mut a = head.alloc_state_for(gpu.as_ref(), 200).unwrap();
    let mut b = head.alloc_state_for(gpu.as_ref(), 200).unwrap();
    head.prefill_drafter(&tokens[..20], hiddens, &mut *a, &ctx, 0)
        .unwrap();
    head.prefill_drafter(&tokens[24..40], hidden(24), &mut *b, &ctx, 0)
        .unwrap();
    let mut drafts = Vec::new();
    for n in 1..=3 {
        drafts = head
            .propose(
                tokens[20],
                hidden(19),
                20,
                n,
                &mut *a,
                &ctx,
                0,
                None,
                None,
                None,
            )
            .unwrap();
        rec.u32s(format!("mtp/{name}/propose{n}_drafts"), &drafts);
        let logits = head.last_logits(gpu.as_ref(), 0).unwrap();
        rec.f32s(format!("mtp/{name}/propose{n}_logits"), &logits);
    }
    head.after_verify(2, &mut *a, 0).unwrap();
    if case.levers.mtp_kv_exact {
        let mut states: [&mut dyn ProposerState; 1] = [&mut *a];
        head.catchup_batch(
            &[drafts[..2].to_vec()],
            &[vec![hidden(20), hidden(21)]],
            &[21],
            &mut states,
            &ctx,
            0,
        )
        .unwrap();
    }
    let mut conf = Vec::new();
    let mut states: [&mut dyn ProposerState; 2] = [&mut *a, &mut *b];
    let batch = head
        .propose_batch(
            &[tokens[23], tokens[40]],
            &[hidden(22), hidden(39)],
            &[23, 16],
            3,
            &mut states,
            &ctx,
            0,
            Some(&mut conf),
        )
        .unwrap()
        .expect("the head drafts in batches");
    for (s, (d, c)) in batch.iter().zip(&conf).enumerate() {
        rec.u32s(format!("mtp/{name}/batch_drafts{s}"), d);
        rec.f32s(format!("mtp/{name}/batch_conf{s}"), c);
        let logits = head.last_logits(gpu.as_ref(), s).unwrap();
        rec.f32s(format!("mtp/{name}/batch_logits{s}"), &logits);
    }
    head.free_state(gpu.as_ref(), &mut *a).unwrap();
    head.free_state(gpu.as_ref(), &mut *b).unwrap();
    drop(head);
    gpu.free(hiddens).unwrap();
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn mtp_outputs_are_bit_identical_to_the_fixture() {
    let plain = ModelLevers::default();
    let cases = [
        MtpCase {
            name: "deepseek_v3",
            layout: "deepseek_v3",
            moe: false,
            levers: plain,
            quant: MtpQuantization::Bf16,
        },
        MtpCase {
            name: "mimo_chain_postnorm",
            layout: "mimo",
            moe: false,
            levers: ModelLevers {
                mtp_chain_postnorm: true,
                ..plain
            },
            quant: MtpQuantization::Bf16,
        },
        MtpCase {
            name: "qwen3_next_target_postnorm_exact_kv",
            layout: "qwen3_next",
            moe: false,
            levers: ModelLevers {
                mtp_target_postnorm: true,
                mtp_kv_exact: true,
                ..plain
            },
            quant: MtpQuantization::Bf16,
        },
        MtpCase {
            name: "glm_moe",
            layout: "glm4_moe",
            moe: true,
            levers: plain,
            quant: MtpQuantization::Bf16,
        },
        MtpCase {
            name: "qwen3_next_moe",
            layout: "qwen3_next",
            moe: true,
            levers: plain,
            quant: MtpQuantization::Bf16,
        },
        MtpCase {
            name: "mimo_nvfp4",
            layout: "mimo",
            moe: false,
            levers: plain,
            quant: MtpQuantization::Nvfp4,
        },
        MtpCase {
            name: "deepseek_v3_fp8",
            layout: "deepseek_v3",
            moe: false,
            levers: plain,
            quant: MtpQuantization::Fp8,
        },
    ];
    let mut rec = Record::default();
    for case in &cases {
        record_mtp(&mut rec, case);
    }
    check_against_fixture(&rec, "mtp");
}
