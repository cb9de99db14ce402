//! The MTP head against an independent numpy implementation of its equations
//! (`tests/python/mtp_reference.py`), per checkpoint layout, over several propose/verify
//! rounds with KV history.
//!
//! Each case writes a tiny random checkpoint with the real tensor names, drives the head
//! (prefill, propose, simulated verify, `after_verify`, and `catchup_batch` under
//! `mtp_kv_exact`), records every draft and the logits behind it, and hands the record to
//! the numpy reference, which recomputes everything from the checkpoint and fails on any
//! draft that differs or any logit outside the stated BF16 tolerance. It needs `python3`
//! with numpy (set `PYTHON` to choose the interpreter).

#[allow(dead_code)]
#[path = "../benches/common/default_model.rs"]
mod default_model;
mod mtp_common;

use default_model::python;

use mtp_common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig, ModelLevers};
use specdraft::speculative::mtp::quantize_nvfp4;
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

fn run_reference(args: &[&str]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/mtp_reference.py");
    let out = Command::new(python())
        .arg(&script)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} {}: {e}", python(), script.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "numpy reference disagrees:\n{text}");
}

struct Case {
    name: &'static str,
    layout: &'static str,
    moe: bool,
    levers: ModelLevers,
    quant: MtpQuantization,
    mtp_vocab_size: u32,
}

fn drive(case: &Case) {
    let dir = scratch_dir(&format!("mtp_ref_{}", case.name));
    write_checkpoint_with(&dir, case.layout, 7, case.moe);
    let cpu = Arc::new(CpuBackend::new());
    let gpu: Arc<dyn GpuBackend> = cpu.clone();
    let head = MtpHead::from_checkpoint(
        &dir,
        gpu.clone(),
        case.quant,
        case.mtp_vocab_size,
        256,
        64,
        &case.levers,
    )
    .expect("load head");
    let config = ModelConfig::from_file(dir.join("config.json")).unwrap();
    let ctx = ForwardContext::new(
        gpu.clone(),
        Arc::new(BufferArena::empty(16)),
        Arc::new(config),
        case.levers,
    );
    let mut rng = SmallRng::seed_from_u64(11);
    let total = 64;
    let hidden_vals: Vec<f32> = (0..total * HIDDEN)
        .map(|_| half::bf16::from_f32(rng.random_range(-2.0..2.0)).to_f32())
        .collect();
    let hiddens = gpu.upload_bf16(&hidden_vals, "test:hiddens").unwrap();
    let hidden_at = |p: usize| hiddens.offset(p * HIDDEN * 2);
    let prompt_len = 20;
    let mut tokens: Vec<u32> = (0..prompt_len)
        .map(|_| rng.random_range(0..VOCAB as u32))
        .collect();
    let mut state = head.alloc_state_for(gpu.as_ref(), 200).unwrap();
    let written = head
        .prefill_drafter(&tokens, hiddens, &mut *state, &ctx, 0)
        .unwrap();
    assert_eq!(written, prompt_len - 1);
    // The first generated token, picked by the target from the hidden at prompt_len - 1.
    tokens.push(rng.random_range(0..VOCAB as u32));
    let mut rounds = Vec::new();
    let n = 3;
    let vd = head.draft_vocab_size();
    for r in 0..6 {
        let pos = tokens.len() - 1;
        let last = tokens[pos];
        let mask: Option<Vec<i32>> = (r == 2).then(|| {
            (0..VOCAB.div_ceil(32))
                .map(|_| rng.random::<u32>() as i32)
                .collect()
        });
        let mut logits = Vec::new();
        let mut drafts = Vec::new();
        for j in 1..=n {
            let d = head
                .propose(
                    last,
                    hidden_at(pos - 1),
                    pos,
                    j,
                    &mut *state,
                    &ctx,
                    0,
                    None,
                    mask.as_deref(),
                    None,
                )
                .unwrap();
            assert_eq!(d.len(), j, "round {r}: a draft stopped early");
            assert_eq!(
                d[..j - 1],
                drafts[..],
                "round {r}: re-proposing changed earlier drafts"
            );
            logits.push(head.last_logits(gpu.as_ref(), 0).unwrap());
            drafts = d;
        }
        let k = r % (n + 1);
        let mut bonus = rng.random_range(0..VOCAB as u32);
        if k < n && bonus == drafts[k] {
            bonus = (bonus + 1) % VOCAB as u32;
        }
        head.after_verify(k, &mut *state, 0).unwrap();
        if case.levers.mtp_kv_exact {
            let hs: Vec<_> = (0..k).map(|i| hidden_at(pos + i)).collect();
            let mut states: [&mut dyn specdraft::speculative::ProposerState; 1] = [&mut *state];
            let w = head
                .catchup_batch(
                    &[drafts[..k].to_vec()],
                    &[hs],
                    &[pos + 1],
                    &mut states,
                    &ctx,
                    0,
                )
                .unwrap();
            assert_eq!(w, k);
        }
        tokens.extend_from_slice(&drafts[..k]);
        tokens.push(bonus);
        rounds.push(serde_json::json!({
            "position": pos, "last_token": last, "num_drafts": n, "mask": mask,
            "drafts": drafts, "accepted": k, "logits": logits,
        }));
        assert_eq!(logits[0].len(), vd);
    }
    let hidden_file = dir.join("hiddens.f32");
    let bytes: Vec<u8> = hidden_vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&hidden_file, bytes).unwrap();
    let scenario = serde_json::json!({
        "checkpoint": dir, "layout": case.layout,
        "levers": {
            "mtp_kv_exact": case.levers.mtp_kv_exact,
            "mtp_target_postnorm": case.levers.mtp_target_postnorm,
            "mtp_chain_postnorm": case.levers.mtp_chain_postnorm,
        },
        "quant": case.quant.name(),
        "mtp_vocab_size": case.mtp_vocab_size,
        "hiddens": hidden_file, "hidden_rows": total, "prompt_len": prompt_len,
        "tokens": tokens, "rounds": rounds,
    });
    let path = dir.join("scenario.json");
    std::fs::write(&path, scenario.to_string()).unwrap();
    head.free_state(gpu.as_ref(), &mut *state).unwrap();
    assert_eq!(
        head.kv_blocks().0,
        head.kv_blocks().1,
        "blocks left in the pool"
    );
    drop(head);
    gpu.free(hiddens).unwrap();
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
    run_reference(&["head", path.to_str().unwrap()]);
}

#[test]
fn deepseek_layout_matches_numpy() {
    drive(&Case {
        name: "deepseek",
        layout: "deepseek_v3",
        moe: false,
        levers: ModelLevers::default(),
        quant: MtpQuantization::Bf16,
        mtp_vocab_size: 0,
    });
}

#[test]
fn glm_layout_with_exact_kv_and_postnorm_levers_matches_numpy() {
    drive(&Case {
        name: "glm",
        layout: "glm4_moe",
        moe: false,
        levers: ModelLevers {
            mtp_kv_exact: true,
            mtp_target_postnorm: true,
            mtp_chain_postnorm: true,
            ..Default::default()
        },
        quant: MtpQuantization::Bf16,
        mtp_vocab_size: 0,
    });
}

#[test]
fn mimo_layout_matches_numpy() {
    drive(&Case {
        name: "mimo",
        layout: "mimo",
        moe: false,
        levers: ModelLevers::default(),
        quant: MtpQuantization::Bf16,
        mtp_vocab_size: 72,
    });
}

#[test]
fn qwen3_next_layout_matches_numpy() {
    drive(&Case {
        name: "qwen3_next",
        layout: "qwen3_next",
        moe: false,
        levers: ModelLevers {
            mtp_kv_exact: true,
            ..Default::default()
        },
        quant: MtpQuantization::Bf16,
        mtp_vocab_size: 0,
    });
}

#[test]
fn nvfp4_projections_match_numpy_on_dequantized_weights() {
    drive(&Case {
        name: "nvfp4",
        layout: "mimo",
        moe: false,
        levers: ModelLevers::default(),
        quant: MtpQuantization::Nvfp4,
        mtp_vocab_size: 0,
    });
}

#[test]
fn fp8_projections_match_numpy_on_the_fp8_grid() {
    drive(&Case {
        name: "fp8",
        layout: "mimo",
        moe: false,
        levers: ModelLevers::default(),
        quant: MtpQuantization::Fp8,
        mtp_vocab_size: 0,
    });
}

#[test]
fn glm_moe_layer_matches_numpy() {
    drive(&Case {
        name: "glm_moe",
        layout: "glm4_moe",
        moe: true,
        levers: ModelLevers::default(),
        quant: MtpQuantization::Bf16,
        mtp_vocab_size: 0,
    });
}

#[test]
fn qwen3_next_moe_layer_matches_numpy() {
    drive(&Case {
        name: "qwen3_next_moe",
        layout: "qwen3_next",
        moe: true,
        levers: ModelLevers::default(),
        quant: MtpQuantization::Bf16,
        mtp_vocab_size: 0,
    });
}

#[test]
fn rust_and_python_nvfp4_quantizers_agree_bit_for_bit() {
    let dir = scratch_dir("mtp_ref_quantize");
    let mut rng = SmallRng::seed_from_u64(5);
    let (rows, cols) = (24, 64);
    let mut w: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0f32..1.0).powi(3) * 4.0)
        .collect();
    // Exact ties and a zero block, the cases rounding rules decide.
    w[..16].fill(0.0);
    w[16] = 1.0;
    let q = quantize_nvfp4(&w, rows, cols).unwrap();
    let f32s: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(dir.join("w.f32"), f32s).unwrap();
    std::fs::write(dir.join("codes.u8"), &q.codes).unwrap();
    std::fs::write(dir.join("scales.u8"), &q.scales).unwrap();
    let g = q.global_scale.to_le_bytes();
    std::fs::write(dir.join("global.f32"), g).unwrap();
    run_reference(&[
        "quantize",
        dir.to_str().unwrap(),
        &rows.to_string(),
        &cols.to_string(),
    ]);
}

/// A checkpoint converted by `specdraft quantize --nvfp4` (the Python converter) loads with
/// its NVFP4 projections and LM head as stored, and drafts exactly like the BF16 checkpoint
/// quantized by the Rust quantizer at load.
#[test]
fn python_converted_checkpoint_drafts_like_rust_quantization_at_load() {
    let bf16_dir = scratch_dir("mtp_ref_convert_in");
    write_checkpoint_with(&bf16_dir, "glm4_moe", 13, true);
    let nvfp4_dir = scratch_dir("mtp_ref_convert_out");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/specdraft/quantize.py");
    let out = Command::new(python())
        .arg(&script)
        .args([
            "--nvfp4",
            bf16_dir.to_str().unwrap(),
            nvfp4_dir.to_str().unwrap(),
        ])
        .output()
        .expect("run the converter");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let levers = ModelLevers::default();
    let load = |dir: &Path, quant| {
        MtpHead::from_checkpoint(dir, gpu.clone(), quant, 0, 128, 64, &levers).unwrap()
    };
    let converted = load(&nvfp4_dir, MtpQuantization::Bf16);
    let at_load = load(&bf16_dir, MtpQuantization::Nvfp4);
    assert!(converted
        .weights()
        .projections()
        .iter()
        .all(|(_, w)| matches!(w, specdraft::model::Linear::Nvfp4(_))));
    let config = ModelConfig::from_file(bf16_dir.join("config.json")).unwrap();
    let ctx = ForwardContext::new(
        gpu.clone(),
        Arc::new(BufferArena::empty(16)),
        Arc::new(config),
        levers,
    );
    let mut rng = SmallRng::seed_from_u64(3);
    let vals: Vec<f32> = (0..40 * HIDDEN)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let hiddens = gpu.upload_bf16(&vals, "test:hiddens").unwrap();
    let tokens: Vec<u32> = (0..40).map(|_| rng.random_range(0..VOCAB as u32)).collect();
    let mut runs = Vec::new();
    for head in [&converted, &at_load] {
        let mut st = head.alloc_state_for(gpu.as_ref(), 64).unwrap();
        head.prefill_drafter(&tokens[..12], hiddens, &mut *st, &ctx, 0)
            .unwrap();
        let mut got = Vec::new();
        let mut pos = 12;
        for r in 0..4 {
            let d = head
                .propose(
                    tokens[pos],
                    hiddens.offset((pos - 1) * HIDDEN * 2),
                    pos,
                    3,
                    &mut *st,
                    &ctx,
                    0,
                    None,
                    None,
                    None,
                )
                .unwrap();
            got.push((d, head.last_logits(gpu.as_ref(), 0).unwrap()));
            head.after_verify(r % 2, &mut *st, 0).unwrap();
            pos += r % 2 + 1;
        }
        head.free_state(gpu.as_ref(), &mut *st).unwrap();
        runs.push(got);
    }
    assert_eq!(runs[0], runs[1]);
    drop((converted, at_load));
    gpu.free(hiddens).unwrap();
    assert_eq!(gpu.ledger().live_count(), 0);
}
