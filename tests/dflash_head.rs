//! `DFlashHead` on the CPU backend beside a tiny seeded target (four Llama layers): random
//! checkpoints in z-lab's layout (GQA 4:1, two draft layers, a mask token) pass the
//! conformance check, leave greedy output through the engine unchanged while drafting, are
//! refused with errors naming what is wrong (nothing leaks), and behave as the protocol
//! says around the captured rows (a repeated propose, a missing stack, the block size).
//! Their drafts and logits are checked against an independent numpy model in
//! `tests/python/test_dflash_head.py`.

mod dflash_common;
#[allow(unused_imports)] // the helpers re-export a GGUF writer this test does not use
mod model_util;

use dflash_common::*;
use model_util::*;
use specdraft::backend::quant::BlockFormat;
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::engine::{DraftPolicyKind, GenerateRequest, SpecEngine};
use specdraft::model::ForwardContext;
use specdraft::speculative::conformance::{check_proposer_on, CheckOptions};
use specdraft::speculative::{DFlashHead, DFlashState, DraftProposer};
use std::sync::Arc;

#[test]
fn the_head_passes_the_conformance_check() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = target(&gpu, "conformance");
    for (g, vocab) in [(4, None), (8, Some(40))] {
        let dir = Ckpt {
            block_size: g,
            ..Ckpt::default()
        }
        .write(&format!("conformance{g}"));
        let head = load(&dir, &model, vocab).unwrap();
        assert_eq!(head.block_gamma(), Some(g));
        assert_eq!(head.target_layer_ids(), TAPS.to_vec());
        let options = CheckOptions {
            label: "DFlashHead".into(),
            vocab_size: VOCAB,
            hidden_size: H,
            num_drafts: g - 1,
            steps: 10,
            ..CheckOptions::default()
        };
        let report = check_proposer_on(&head, gpu.clone(), &options);
        assert!(report.is_ok(), "{report}");
        assert!(
            report.checks_run.iter().any(|c| c == "grammar mask"),
            "{:?}",
            report.checks_run
        );
        assert_eq!(head.kv_blocks().0, head.kv_blocks().1, "blocks left taken");
    }
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

#[test]
fn greedy_output_through_the_engine_is_plain_greedy_output() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = target(&gpu, "engine");
    let prompts: Vec<Vec<u32>> = [9usize, 23, 3]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..n)
                .map(|k| ((i * 11 + k * 5 + k * k) % 90 + 3) as u32)
                .collect()
        })
        .collect();
    let requests = || {
        prompts
            .iter()
            .map(|p| GenerateRequest::new(p.clone(), 20).ignore_eos())
            .collect::<Vec<_>>()
    };
    let plain = SpecEngine::new(model.clone(), None, 0).unwrap();
    let want: Vec<Vec<u32>> = plain
        .generate(requests())
        .results
        .into_iter()
        .map(|r| r.tokens)
        .collect();
    drop(plain);
    for g in [4, 8] {
        let dir = Ckpt {
            block_size: g,
            ..Ckpt::default()
        }
        .write(&format!("engine{g}"));
        let head = Arc::new(load(&dir, &model, None).unwrap());
        let engine = SpecEngine::new(
            model.clone(),
            Some(head.clone() as Arc<dyn DraftProposer>),
            2,
        )
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed);
        assert_eq!(
            engine.num_drafts(),
            g - 1,
            "block_gamma sets the draft count"
        );
        let out = engine.generate(requests());
        for (i, r) in out.results.iter().enumerate() {
            assert!(r.error.is_none(), "request {i}: {:?}", r.error);
            assert_eq!(r.tokens, want[i], "request {i}, block {g}");
        }
        assert!(out.metrics.drafted > 0, "the head drafted nothing");
        drop(engine);
        assert_eq!(head.kv_blocks().0, head.kv_blocks().1, "blocks left taken");
    }
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

#[test]
fn bad_checkpoints_are_refused_naming_what_is_wrong() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = target(&gpu, "errors");
    let before = gpu.ledger().live_count();
    let cases: [(&str, Ckpt, &str); 5] = [
        (
            "missing",
            Ckpt {
                drop: &["layers.1.mlp.down_proj.weight"],
                ..Ckpt::default()
            },
            "layers.1.mlp.down_proj.weight",
        ),
        (
            "fc",
            Ckpt {
                fc_in: 3 * H,
                ..Ckpt::default()
            },
            "fc.weight",
        ),
        (
            "mask",
            Ckpt {
                edit: |c| c["dflash_config"]["mask_token_id"] = VOCAB.into(),
                ..Ckpt::default()
            },
            "dflash_config.mask_token_id\": is 96, outside the vocabulary of 96",
        ),
        (
            "layers",
            Ckpt {
                edit: |c| c["dflash_config"]["target_layer_ids"] = serde_json::json!([1, 4]),
                ..Ckpt::default()
            },
            "names layer 4, but the target has 4 layers",
        ),
        (
            "vocab",
            Ckpt {
                edit: |c| c["vocab_size"] = 200.into(),
                ..Ckpt::default()
            },
            "vocab_size\": is 200, but the target's is 96",
        ),
    ];
    for (tag, ckpt, says) in cases {
        let dir = ckpt.write(&format!("err_{tag}"));
        let err = load(&dir, &model, None).err().expect(tag).to_string();
        assert!(err.contains(says), "{tag}: {err}");
        assert_eq!(
            gpu.ledger().live_count(),
            before,
            "{tag}: a refused load leaked"
        );
    }
    let dir = Ckpt::default().write("err_fc_shape");
    let err = load(&dir, &model, Some(97)).err().unwrap().to_string();
    assert!(
        err.contains("draft_vocab=97: it must be in 1..=96"),
        "{err}"
    );
    assert_eq!(gpu.ledger().live_count(), before);
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn proposes_follow_the_captured_rows() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = target(&gpu, "rows");
    let dir = Ckpt::default().write("rows");
    let head = load(&dir, &model, None).unwrap();
    let width = TAPS.len() * H;
    let mut rng = Rng::new(3);
    let values: Vec<f32> = (0..40 * width).map(|_| 2.0 * rng.next_f32()).collect();
    let stack = gpu.upload_bf16(&values, "stack").unwrap();
    let row = |i: usize| stack.offset(i * width * 2);
    let mut ctx = ForwardContext::new(
        gpu.clone(),
        model.buffers().clone(),
        model.config().clone(),
        Default::default(),
    );
    let tokens: Vec<u32> = (0..40).map(|i| (i * 7 % 90) as u32).collect();
    let mut st = head.alloc_state_for(gpu.as_ref(), 64).unwrap();
    // No captured rows: refused, saying what is missing.
    let err = head
        .propose(5, stack, 10, 3, &mut *st, &ctx, 0, None, None, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("needs the target's captured layers"), "{err}");
    let err = head
        .prefill_drafter(&tokens[..10], stack, &mut *st, &ctx, 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("needs the target's captured layers"), "{err}");
    ctx.target_hidden_stack = Some(stack);
    assert_eq!(
        head.prefill_drafter(&tokens[..10], stack, &mut *st, &ctx, 0)
            .unwrap(),
        9
    );
    let rows = |st: &mut Box<dyn specdraft::speculative::ProposerState>| {
        st.as_any()
            .downcast_ref::<DFlashState>()
            .unwrap()
            .positions()
            .to_vec()
    };
    assert_eq!(rows(&mut st), (0..9).collect::<Vec<_>>());
    ctx.target_hidden_stack = None;
    // First propose at 10: one row (computed at 9); asking for more than γ - 1 gives γ - 1.
    let a = head
        .propose(
            tokens[10],
            stack,
            10,
            9,
            &mut *st,
            &ctx,
            0,
            None,
            None,
            Some(row(9)),
        )
        .unwrap();
    assert_eq!(a.len(), 3);
    assert_eq!(rows(&mut st), (0..10).collect::<Vec<_>>());
    // The same propose again (no after_verify between): the same drafts, the same rows.
    let b = head
        .propose(
            tokens[10],
            stack,
            10,
            3,
            &mut *st,
            &ctx,
            0,
            None,
            None,
            Some(row(9)),
        )
        .unwrap();
    assert_eq!(a, b);
    assert_eq!(rows(&mut st), (0..10).collect::<Vec<_>>());
    head.after_verify(2, &mut *st, 0).unwrap();
    // Two drafts accepted: the next propose is at 13 with the rows computed at 10, 11, 12.
    let c = head
        .propose(
            tokens[13],
            stack,
            13,
            2,
            &mut *st,
            &ctx,
            0,
            None,
            None,
            Some(row(10)),
        )
        .unwrap();
    assert_eq!(c.len(), 2);
    assert_eq!(rows(&mut st), (0..13).collect::<Vec<_>>());
    let err = head.after_verify(3, &mut *st, 0).unwrap_err().to_string();
    assert!(
        err.contains("num_accepted is 3, but the latest propose returned 2"),
        "{err}"
    );
    head.free_state(gpu.as_ref(), &mut *st).unwrap();
    assert_eq!(head.kv_blocks().0, head.kv_blocks().1);
    gpu.free(stack).unwrap();
    drop(head);
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

#[test]
fn projections_stored_as_q8_0_replace_the_bf16_ones() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = target(&gpu, "q8");
    let dir = Ckpt::default().write("q8");
    let bf16_tags = |gpu: &Arc<dyn GpuBackend>| {
        gpu.ledger()
            .live_report()
            .into_iter()
            .filter(|a| a.tag.ends_with("_proj.weight") || a.tag == "fc.weight")
            .count()
    };
    let before = bf16_tags(&gpu);
    let head = DFlashHead::from_checkpoint_for_target(
        &dir,
        model.clone(),
        None,
        Some(BlockFormat::Q8_0),
        128,
        64,
    )
    .unwrap();
    assert_eq!(head.projection_format(), "q8_0");
    // fc and the seven projections of two layers, each held once, as blocks.
    assert_eq!(bf16_tags(&gpu), before, "a BF16 projection is still held");
    let q8 = gpu
        .ledger()
        .live_report()
        .into_iter()
        .filter(|a| a.tag == "dflash:q8_0 weight")
        .count();
    assert_eq!(q8, 1 + 2 * 7);
    let options = CheckOptions {
        vocab_size: VOCAB,
        hidden_size: H,
        num_drafts: 3,
        ..CheckOptions::default()
    };
    let report = check_proposer_on(&head, gpu.clone(), &options);
    assert!(report.is_ok(), "{report}");
    drop(head);
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0);
}
