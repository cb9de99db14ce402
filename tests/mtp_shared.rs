//! `MtpHead::from_checkpoint_for_target`: a head loaded beside a target reads the target's
//! embedding, final norm and LM head where the target keeps them (no copy in the ledger),
//! with a separate LM head or a tied one; it keeps the target's memory alive; a head made
//! for another hidden size or vocabulary is refused naming both values.

#[allow(unused_imports)] // the GGUF writer is not used here
mod model_util;
mod mtp_common;

use model_util::{temp_dir, write_hf, Tiny};
use mtp_common::{scratch_dir, write_checkpoint, HIDDEN, VOCAB};
use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend};
use specdraft::model::{Linear, LoadOptions, ModelLevers, TargetModel};
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization};
use std::sync::Arc;

fn target(gpu: &Arc<dyn GpuBackend>, tiny: Tiny, tag: &str) -> Arc<TargetModel> {
    let dir = temp_dir(tag);
    write_hf(&dir, &tiny, &tiny.tensors(7));
    let opts = LoadOptions {
        max_rows: 32,
        max_seq_len: Some(128),
        kv_blocks: Some(16),
    };
    Arc::new(TargetModel::load(&dir, gpu.clone(), opts).expect("load the tiny target"))
}

fn beside(dir: &std::path::Path, target: &Arc<TargetModel>) -> specdraft::Result<MtpHead> {
    let levers = ModelLevers::default();
    MtpHead::from_checkpoint_for_target(
        dir,
        target.clone(),
        MtpQuantization::Bf16,
        0,
        128,
        16,
        &levers,
    )
}

#[test]
fn a_head_beside_its_target_reads_the_targets_embedding_and_lm_head_in_place() {
    for tied in [false, true] {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let tiny = Tiny {
            hidden: HIDDEN,
            vocab: VOCAB,
            tied,
            ..Tiny::default()
        };
        let model = target(&gpu, tiny, &format!("mtp-shared-{tied}"));
        let before = gpu.ledger().live_report();
        let dir = write_checkpoint(
            &scratch_dir(&format!("mtp-shared-head-{tied}")),
            "deepseek_v3",
            5,
        );
        let head = beside(&dir, &model).expect("load beside the target");
        assert!(head.shares_target());
        let binding = head
            .circuit_draft(model.config(), &ModelLevers::default())
            .expect("a dense head has a binding");
        let slot = |name: &str| -> DevicePtr {
            binding
                .weights
                .iter()
                .find(|w| w.name == name)
                .expect(name)
                .ptr
        };
        let w = model.weights();
        let Linear::Dense(embed) = &w.embed else {
            panic!(
                "a BF16 checkpoint loads a dense embedding, not {:?}",
                w.embed
            )
        };
        let lm_head = match &w.lm_head {
            None => embed.ptr,
            Some(Linear::Dense(d)) => d.ptr,
            Some(other) => panic!("a BF16 checkpoint loads a dense LM head, not {other:?}"),
        };
        assert_eq!(slot("embed_tokens"), embed.ptr, "tied {tied}");
        assert_eq!(slot("target_final_norm"), w.final_norm.ptr, "tied {tied}");
        assert_eq!(slot("lm_head"), lm_head, "tied {tied}");
        // The file holds the target's tensors too: none of them is loaded a second time.
        let new: Vec<_> = gpu
            .ledger()
            .live_report()
            .into_iter()
            .filter(|a| !before.contains(a))
            .collect();
        let shared_names = [
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.norm.weight",
        ];
        for a in &new {
            assert!(!shared_names.contains(&a.tag.as_str()), "a copy: {a:?}");
        }
        assert!(
            new.iter().any(|a| a.tag.starts_with("model.layers.1.")),
            "{new:?}"
        );
        // The head holds the target: dropping the caller's handle frees nothing.
        let kept = Arc::downgrade(&model);
        drop(model);
        assert!(kept.upgrade().is_some());
        drop(head);
        assert!(kept.upgrade().is_none());
        assert_eq!(
            gpu.ledger().live_count(),
            0,
            "{:?}",
            gpu.ledger().live_report()
        );
    }
}

#[test]
fn a_head_for_another_hidden_size_or_vocabulary_is_refused_naming_both() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let dir = write_checkpoint(&scratch_dir("mtp-shared-mismatch"), "deepseek_v3", 5);
    let other_vocab = Tiny {
        hidden: HIDDEN,
        vocab: VOCAB + 8,
        ..Tiny::default()
    };
    let other_hidden = Tiny {
        hidden: HIDDEN / 2,
        heads: 2,
        kv_heads: 1,
        vocab: VOCAB,
        ..Tiny::default()
    };
    let cases = [
        (other_vocab, "vocab_size", VOCAB, VOCAB + 8),
        (other_hidden, "hidden_size", HIDDEN, HIDDEN / 2),
    ];
    for (tiny, key, mine, theirs) in cases {
        let model = target(&gpu, tiny, &format!("mtp-shared-{key}"));
        let before = gpu.ledger().live_count();
        let err = beside(&dir, &model)
            .err()
            .expect("a mismatched head is refused")
            .to_string();
        assert!(err.contains("config.json") && err.contains(key), "{err}");
        assert!(
            err.contains(&format!("is {mine}, but the target's is {theirs}")),
            "{err}"
        );
        assert_eq!(
            gpu.ledger().live_count(),
            before,
            "a refused head leaves nothing"
        );
    }
    assert_eq!(gpu.ledger().live_count(), 0);
}
