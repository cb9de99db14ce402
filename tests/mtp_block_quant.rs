//! `MtpQuantization::Block`: a head whose projections are quantized at load to a GGUF block
//! format (`quant="q8_0"`). Its projections are the block quantizer's output, repacked for the
//! CPU kernels, and the BF16 copies are freed; it passes the protocol checks and drafts close
//! to the BF16 head; beside a target whose LM head is itself in blocks it reads a prefix of
//! that LM head in place, which must end on a row-group boundary; bad names are refused.

#[allow(unused_imports)] // the GGUF writer is not used here
mod model_util;
mod mtp_common;

use model_util::{temp_dir, write_hf, Tiny};
use mtp_common::*;
use specdraft::backend::quant::{BlockFormat, PackedWeight, GROUP_ROWS};
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::model::{Linear, LoadOptions, ModelLevers, TargetModel};
use specdraft::speculative::conformance::{check_proposer_on, CheckOptions};
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization};
use std::sync::Arc;

const Q8_0: MtpQuantization = MtpQuantization::Block(BlockFormat::Q8_0);

#[test]
fn q8_0_projections_are_the_quantizers_blocks_and_the_bf16_copies_are_freed() {
    let bf16 = Fixture::new(
        "block_bf16",
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let q8 = Fixture::new("block_q8", "deepseek_v3", ModelLevers::default(), Q8_0);
    assert_eq!(q8.head().projection_format(), "q8_0");
    assert_eq!(bf16.head().projection_format(), "bf16");
    let pairs = bf16
        .head()
        .weights()
        .projections()
        .into_iter()
        .zip(q8.head().weights().projections());
    let mut count = 0;
    for ((name, dense), (_, packed)) in pairs {
        let (Linear::Dense(d), Linear::Packed(p)) = (dense, packed) else {
            panic!("{name}: {dense:?} and {packed:?}");
        };
        let (out_f, in_f) = (d.shape[0], d.shape[1]);
        assert_eq!(
            (p.format, p.out_features, p.in_features),
            (BlockFormat::Q8_0, out_f, in_f)
        );
        // The very bytes the block quantizer and the packer make of the BF16 values.
        let values: Vec<f32> = bf16.gpu.download_bf16(d.ptr, out_f * in_f).unwrap();
        let want = PackedWeight::from_f32(BlockFormat::Q8_0, out_f, in_f, &values).unwrap();
        let got: Vec<u8> = q8.gpu.download(p.blocks, want.bytes().len()).unwrap();
        assert_eq!(got, want.bytes(), "{name}");
        count += 1;
    }
    assert_eq!(count, 8, "eh_proj, q, k, v, o, gate, up, down");
    // No BF16 projection stays allocated: the head's own weights left are the norms.
    for a in q8.gpu.ledger().live_report() {
        assert!(
            !a.tag.ends_with("proj.weight"),
            "a BF16 projection is still held: {a:?}"
        );
    }
    // A Q8_0 block holds 32 weights in 34 bytes, against BF16's 64.
    let saved = bf16.gpu.ledger().live_bytes() - q8.gpu.ledger().live_bytes();
    let proj_bytes: usize = bf16
        .head()
        .weights()
        .projections()
        .iter()
        .map(|(_, l)| l.nbytes())
        .sum();
    assert_eq!(saved, proj_bytes - proj_bytes / 64 * 34);
    bf16.finish();
    q8.finish();
}

#[test]
fn a_q8_0_head_passes_the_protocol_checks_and_drafts_close_to_the_bf16_head() {
    let bf16 = Fixture::new(
        "block_close_bf16",
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let q8 = Fixture::new(
        "block_close_q8",
        "deepseek_v3",
        ModelLevers::default(),
        Q8_0,
    );
    let options = CheckOptions {
        label: "MtpHead q8_0".into(),
        vocab_size: VOCAB,
        hidden_size: HIDDEN,
        num_sequences: 3,
        num_drafts: 4,
        steps: 6,
        seed: 1,
    };
    let report = check_proposer_on(q8.head(), q8.gpu.clone(), &options);
    assert!(report.violations.is_empty(), "{report:?}");
    // Same checkpoint, prompt and hiddens: the first draft's logits differ only by the
    // weights' and activations' 8-bit rounding (each under 1/254 of its block's largest
    // value), a few percent of their spread.
    let (mut a, mut b) = (bf16.state(), q8.state());
    bf16.prefill(&mut *a, 12);
    q8.prefill(&mut *b, 12);
    bf16.propose(&mut *a, 12, 1);
    q8.propose(&mut *b, 12, 1);
    let la = bf16.head().last_logits(bf16.gpu.as_ref(), 0).unwrap();
    let lb = q8.head().last_logits(q8.gpu.as_ref(), 0).unwrap();
    let spread = la.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = la
        .iter()
        .zip(&lb)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(worst > 0.0, "the Q8_0 head computed with BF16 weights");
    assert!(worst < 0.05 * spread, "worst {worst}, spread {spread}");
    bf16.head().free_state(bf16.gpu.as_ref(), &mut *a).unwrap();
    q8.head().free_state(q8.gpu.as_ref(), &mut *b).unwrap();
    bf16.finish();
    q8.finish();
}

fn q8_target(gpu: &Arc<dyn GpuBackend>) -> Arc<TargetModel> {
    let tiny = Tiny {
        hidden: HIDDEN,
        vocab: VOCAB,
        tied: true,
        ..Tiny::default()
    };
    let dir = temp_dir("mtp-block-target");
    write_hf(&dir, &tiny, &tiny.tensors(7));
    let opts = LoadOptions {
        max_rows: 32,
        max_seq_len: Some(128),
        kv_blocks: Some(16),
    };
    let model = TargetModel::load_with_weights(&dir, gpu.clone(), opts, Some(BlockFormat::Q8_0))
        .expect("load the tiny target as Q8_0");
    Arc::new(model)
}

#[test]
fn beside_a_block_lm_head_the_draft_vocabulary_is_a_prefix_read_in_place() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = q8_target(&gpu);
    assert!(matches!(model.weights().embed, Linear::Packed(_)));
    let dir = write_checkpoint(&scratch_dir("mtp-block-prefix"), "deepseek_v3", 5);
    let levers = ModelLevers::default();
    let beside = |vocab: u32| {
        MtpHead::from_checkpoint_for_target(&dir, model.clone(), Q8_0, vocab, 128, 16, &levers)
    };
    let rows = 6 * GROUP_ROWS;
    let before = gpu.ledger().live_report();
    let (full, part) = (beside(0).unwrap(), beside(rows as u32).unwrap());
    assert_eq!(
        (full.draft_vocab_size(), part.draft_vocab_size()),
        (VOCAB, rows)
    );
    assert_eq!(part.lm_head_format(), "q8_0");
    // Neither head copied the LM head: what they allocated is their own (the module's
    // layer, and the caches, scratch and re-stored projections tagged "mtp:").
    let own = format!("model.layers.{MAIN_LAYERS}.");
    for a in gpu.ledger().live_report() {
        let head_own = a.tag.starts_with("mtp:") || a.tag.starts_with(&own);
        assert!(before.contains(&a) || head_own, "{a:?}");
        let bf16_proj = !before.contains(&a) && a.tag.ends_with("proj.weight");
        assert!(!bf16_proj, "a BF16 projection is still held: {a:?}");
    }
    // The prefix is the same matrix: its logits are the first rows of the full head's.
    let ctx = specdraft::model::ForwardContext::new(
        gpu.clone(),
        model.buffers().clone(),
        model.config().clone(),
        levers,
    );
    let hiddens: Vec<f32> = (0..16 * HIDDEN)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    let hiddens = gpu.upload_bf16(&hiddens, "test:hiddens").unwrap();
    let tokens: Vec<u32> = (0..16).map(|i| (i * 13 % VOCAB) as u32).collect();
    let mut logits = Vec::new();
    for head in [&full, &part] {
        let mut st = head.alloc_state_for(gpu.as_ref(), 64).unwrap();
        head.prefill_drafter(&tokens[..8], hiddens, &mut *st, &ctx, 0)
            .unwrap();
        let h = hiddens.offset(7 * HIDDEN * 2);
        head.propose(tokens[8], h, 8, 1, &mut *st, &ctx, 0, None, None, None)
            .unwrap();
        logits.push(head.last_logits(gpu.as_ref(), 0).unwrap());
        head.free_state(gpu.as_ref(), &mut *st).unwrap();
    }
    assert_eq!(logits[1], logits[0][..rows]);
    // A prefix that splits a row group is not a matrix of the repacked layout.
    let err = beside(rows as u32 + 2).err().expect("refused").to_string();
    assert!(err.contains(&format!("multiple of {GROUP_ROWS}")), "{err}");
    drop((full, part, model));
    gpu.free(hiddens).unwrap();
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

#[test]
fn quantization_names_parse_and_bad_ones_are_refused_listing_the_known() {
    for (name, want) in [
        ("bf16", MtpQuantization::Bf16),
        ("FP8", MtpQuantization::Fp8),
        ("nvfp4", MtpQuantization::Nvfp4),
        ("q8_0", Q8_0),
        ("Q4_K", MtpQuantization::Block(BlockFormat::Q4_K)),
    ] {
        let q = MtpQuantization::parse(name).unwrap();
        assert_eq!(q, want, "{name}");
        assert_eq!(MtpQuantization::parse(q.name()).unwrap(), q);
    }
    for bad in ["int4", "q2_k", "f16", ""] {
        let err = MtpQuantization::parse(bad).expect_err(bad).to_string();
        assert!(
            err.contains(&format!("{bad:?}")) && err.contains("q8_0"),
            "{err}"
        );
        assert!(
            !err.contains("q2_k,"),
            "a format without a quantizer is offered: {err}"
        );
    }
    let cpu = CpuBackend::new();
    assert_eq!(MtpQuantization::default_for(&cpu), Q8_0);
}
