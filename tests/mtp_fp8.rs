//! `MtpQuantization::Fp8` heads: their projections are stored as FP8 E4M3 bytes (about half
//! the memory of BF16, measured by the allocation ledger), they pass the protocol's
//! conformance, and they draft bit for bit what a BF16 head drafts on the same weights
//! rounded to the FP8 grid (the head's earlier storage, BF16 copies of the rounded values).
//!
//! An FP8 checkpoint (E4M3 projections with `weight_scale_inv`) loads as stored and drafts
//! bit for bit like the BF16 values it holds.
//!
//! The rounding used for those comparisons is written here from the format's definition: one
//! power-of-two scale per tensor, `2^ceil(log2(amax / 448))`, and each value the nearest
//! E4M3 value (ties to the even code) times the scale, found by searching every code.

mod mtp_common;

use half::bf16;
use mtp_common::{scratch_dir, write_checkpoint, Fixture, HIDDEN, VOCAB};
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, Linear, ModelConfig, ModelLevers};
use specdraft::speculative::conformance::{check_proposer_on, CheckOptions};
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization};
use std::path::Path;
use std::sync::Arc;

/// E4M3 magnitudes of the codes 0..=0x7e (the positive finite ones), from the bit fields.
fn e4m3_magnitudes() -> Vec<f64> {
    (0u8..=0x7e)
        .map(|c| {
            let (e, m) = (i32::from(c >> 3), f64::from(c & 7));
            if e == 0 {
                m / 8.0 * 2f64.powi(-6)
            } else {
                (1.0 + m / 8.0) * 2f64.powi(e - 7)
            }
        })
        .collect()
}

/// `w` as E4M3 codes under one power-of-two tensor scale: `(codes, scale)`.
fn encode(w: &[f32]) -> (Vec<u8>, f64) {
    let grid = e4m3_magnitudes();
    let amax = w.iter().fold(0f64, |m, x| m.max(f64::from(x.abs())));
    let scale = 2f64.powi((amax / 448.0).log2().ceil() as i32);
    let codes = w
        .iter()
        .map(|&x| {
            let a = f64::from(x.abs()) / scale;
            let mut best = 0usize;
            for c in 1..grid.len() {
                let (d, db) = ((grid[c] - a).abs(), (grid[best] - a).abs());
                if d < db || (d == db && c % 2 == 0) {
                    best = c;
                }
            }
            let sign = if x < 0.0 && best != 0 { 0x80 } else { 0 };
            best as u8 | sign
        })
        .collect();
    (codes, scale)
}

/// `w` rounded to the E4M3 grid under one power-of-two tensor scale.
fn round_to_grid(w: &[f32]) -> Vec<f32> {
    let grid = e4m3_magnitudes();
    let (codes, scale) = encode(w);
    let value = |c: u8| grid[usize::from(c & 0x7f)] * if c & 0x80 != 0 { -1.0 } else { 1.0 };
    codes.iter().map(|&c| (value(c) * scale) as f32).collect()
}

/// How [`write_copy`] stores the projections.
#[derive(Clone, Copy, PartialEq)]
enum Projections {
    /// BF16 values on the FP8 grid.
    RoundedBf16,
    /// E4M3 bytes with f32 `weight_scale_inv` per 128 x 128 block, as DeepSeek-V3 ships.
    Fp8,
}

/// Copies the checkpoint in `from` to `to` with every projection rounded to the FP8 grid.
fn write_rounded_copy(from: &Path, to: &Path) {
    write_copy(from, to, Projections::RoundedBf16);
}

/// Copies the checkpoint in `from` to `to` with every projection on the FP8 grid, stored as
/// `how` says.
fn write_copy(from: &Path, to: &Path, how: Projections) {
    std::fs::copy(from.join("config.json"), to.join("config.json")).unwrap();
    let bytes = std::fs::read(from.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors = Vec::new();
    for (name, view) in st.tensors() {
        let is_projection = name.ends_with("_proj.weight") || name == "mtp.fc.weight";
        let is_lm_head = name.contains("shared_head.head") || name == "lm_head.weight";
        let mut data = view.data().to_vec();
        let dtype = view.dtype();
        if is_projection && !is_lm_head {
            let values: Vec<f32> = data
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect();
            if how == Projections::Fp8 {
                let (codes, scale) = encode(&values);
                let (o, i) = (view.shape()[0], view.shape()[1]);
                let grid = vec![o.div_ceil(128), i.div_ceil(128)];
                let scales: Vec<u8> = (0..grid[0] * grid[1])
                    .flat_map(|_| (scale as f32).to_le_bytes())
                    .collect();
                let scale_name = name.replace(".weight", ".weight_scale_inv");
                tensors.push((scale_name, safetensors::Dtype::F32, grid, scales));
                tensors.push((name, safetensors::Dtype::F8_E4M3, vec![o, i], codes));
                continue;
            }
            data = round_to_grid(&values)
                .iter()
                .flat_map(|&v| {
                    let b = bf16::from_f32(v);
                    // Every rounded value is e4m3 * 2^k: exact in BF16.
                    assert_eq!(b.to_f32(), v);
                    b.to_le_bytes()
                })
                .collect();
        }
        tensors.push((name, dtype, view.shape().to_vec(), data));
    }
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &to.join("model.safetensors")).unwrap();
}

fn load_on(gpu: &Arc<dyn GpuBackend>, dir: &Path, quant: MtpQuantization) -> MtpHead {
    let levers = ModelLevers::default();
    MtpHead::from_checkpoint(dir, gpu.clone(), quant, 0, 512, 256, &levers).unwrap()
}

fn load(dir: &Path, quant: MtpQuantization) -> (Arc<dyn GpuBackend>, MtpHead) {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let head = load_on(&gpu, dir, quant);
    (gpu, head)
}

#[test]
fn fp8_projections_take_about_half_the_bytes_of_bf16() {
    let dir = scratch_dir("mtp_fp8_bytes");
    write_checkpoint(&dir, "deepseek_v3", 3);
    let (gpu_bf16, bf16_head) = load(&dir, MtpQuantization::Bf16);
    let (gpu_fp8, fp8_head) = load(&dir, MtpQuantization::Fp8);
    let projections = bf16_head.weights().projections();
    let bf16_bytes: usize = projections
        .iter()
        .map(|(_, w)| 2 * w.dims().0 * w.dims().1)
        .sum();
    for (name, w) in fp8_head.weights().projections() {
        assert!(matches!(w, Linear::Fp8(_)), "{name} is {w:?}");
    }
    // Everything else (embedding, LM head, caches, scratch) is the same in both heads.
    let (b, f) = (
        gpu_bf16.ledger().live_bytes(),
        gpu_fp8.ledger().live_bytes(),
    );
    let fp8_bytes = f as f64 - (b - bf16_bytes) as f64;
    let ratio = fp8_bytes / bf16_bytes as f64;
    assert!(
        (0.5..0.52).contains(&ratio),
        "FP8 projections take {fp8_bytes} bytes, {ratio:.3} of BF16's {bf16_bytes}"
    );
    assert!(fp8_head.bytes_per_draft() < bf16_head.bytes_per_draft());
    drop((bf16_head, fp8_head));
    assert_eq!(gpu_bf16.ledger().live_count(), 0);
    assert_eq!(gpu_fp8.ledger().live_count(), 0);
}

#[test]
fn fp8_head_drafts_what_a_bf16_head_drafts_on_fp8_rounded_weights() {
    for layout in ["deepseek_v3", "mimo", "qwen3_next"] {
        let dir = scratch_dir(&format!("mtp_fp8_equal_{layout}"));
        let rounded = scratch_dir(&format!("mtp_fp8_equal_{layout}_rounded"));
        write_checkpoint(&dir, layout, 5);
        write_rounded_copy(&dir, &rounded);
        let (gpu, fp8) = load(&dir, MtpQuantization::Fp8);
        let grid = load_on(&gpu, &rounded, MtpQuantization::Bf16);
        let config = ModelConfig::from_file(dir.join("config.json")).unwrap();
        let ctx = ForwardContext::new(
            gpu.clone(),
            Arc::new(BufferArena::empty(16)),
            Arc::new(config),
            ModelLevers::default(),
        );
        let hidden: Vec<f32> = (0..40 * HIDDEN)
            .map(|i| ((i * 7919) % 401) as f32 / 100.0 - 2.0)
            .collect();
        let hiddens = gpu.upload_bf16(&hidden, "test:hiddens").unwrap();
        let tokens: Vec<u32> = (0..40).map(|i| (i * 37 % VOCAB) as u32).collect();
        let run = |head: &MtpHead| {
            let mut st = head.alloc_state(gpu.as_ref()).unwrap();
            head.prefill_drafter(&tokens[..12], hiddens, &mut *st, &ctx, 0)
                .unwrap();
            let mut out = Vec::new();
            let mut pos = 12;
            for round in 0..4 {
                let h = hiddens.offset((pos - 1) * HIDDEN * 2);
                let d = head
                    .propose(tokens[pos], h, pos, 4, &mut *st, &ctx, 0, None, None, None)
                    .unwrap();
                let logits = head.last_logits(gpu.as_ref(), 0).unwrap();
                out.push((d, logits.iter().map(|v| v.to_bits()).collect::<Vec<_>>()));
                head.after_verify(round % 3, &mut *st, 0).unwrap();
                pos += round % 3 + 1;
            }
            head.free_state(gpu.as_ref(), &mut *st).unwrap();
            out
        };
        let drafted = run(&fp8);
        assert!(drafted.iter().all(|(d, _)| d.len() == 4), "{layout}");
        assert_eq!(drafted, run(&grid), "{layout}");
        drop((fp8, grid));
        gpu.free(hiddens).unwrap();
        assert_eq!(gpu.ledger().live_count(), 0, "{layout}");
    }
}

#[test]
fn an_fp8_checkpoint_loads_as_stored_and_drafts_like_its_bf16_values() {
    let dir = scratch_dir("mtp_fp8_ckpt");
    let (rounded, stored) = (
        scratch_dir("mtp_fp8_ckpt_rounded"),
        scratch_dir("mtp_fp8_ckpt_stored"),
    );
    write_checkpoint(&dir, "mimo", 7);
    write_rounded_copy(&dir, &rounded);
    write_copy(&dir, &stored, Projections::Fp8);
    let (gpu, fp8) = load(&stored, MtpQuantization::Bf16);
    for (name, w) in fp8.weights().projections() {
        assert!(matches!(w, Linear::Fp8(_)), "{name} is {w:?}");
    }
    let grid = load_on(&gpu, &rounded, MtpQuantization::Bf16);
    let f = Fixture::new(
        "fp8_ckpt_inputs",
        "mimo",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let hidden = f.gpu.download_bf16(f.hiddens, 20 * HIDDEN).unwrap();
    let hiddens = gpu.upload_bf16(&hidden, "test:hiddens").unwrap();
    let ctx = ForwardContext::new(
        gpu.clone(),
        Arc::new(BufferArena::empty(16)),
        Arc::new(ModelConfig::from_file(dir.join("config.json")).unwrap()),
        ModelLevers::default(),
    );
    let run = |head: &MtpHead| {
        let mut st = head.alloc_state(gpu.as_ref()).unwrap();
        head.prefill_drafter(&f.tokens[..10], hiddens, &mut *st, &ctx, 0)
            .unwrap();
        let h = hiddens.offset(9 * HIDDEN * 2);
        let d = head
            .propose(f.tokens[10], h, 10, 4, &mut *st, &ctx, 0, None, None, None)
            .unwrap();
        let logits = head.last_logits(gpu.as_ref(), 0).unwrap();
        head.free_state(gpu.as_ref(), &mut *st).unwrap();
        (d, logits.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
    };
    let got = run(&fp8);
    assert_eq!(got.0.len(), 4);
    assert_eq!(got, run(&grid));
    drop((fp8, grid));
    gpu.free(hiddens).unwrap();
    assert_eq!(gpu.ledger().live_count(), 0);
    f.finish();
}

#[test]
fn fp8_heads_pass_conformance() {
    for layout in ["deepseek_v3", "mimo"] {
        let f = Fixture::new(
            &format!("conf_fp8_{layout}"),
            layout,
            ModelLevers::default(),
            MtpQuantization::Fp8,
        );
        let options = CheckOptions {
            label: format!("MtpHead {layout} fp8"),
            vocab_size: VOCAB,
            hidden_size: HIDDEN,
            num_sequences: 3,
            num_drafts: 4,
            steps: 6,
            seed: 1,
        };
        let report = check_proposer_on(f.head(), f.gpu.clone(), &options);
        assert!(report.violations.is_empty(), "{layout}: {report:?}");
        f.finish();
    }
}
