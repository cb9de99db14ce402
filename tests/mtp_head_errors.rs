//! `MtpHead` on bad input and under memory pressure: clear errors naming the problem, and
//! nothing leaked (ledger and block pool back to empty).

mod mtp_common;

use mtp_common::*;
use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::model::ModelLevers;
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization};
use std::sync::Arc;

#[test]
fn errors_name_the_problem_and_leak_nothing() {
    let f = Fixture::new(
        "errors",
        "mimo",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let h = f.head();
    let mut st = f.state();
    f.prefill(&mut *st, 12);
    let err = h
        .propose(
            VOCAB as u32,
            f.hidden(11),
            12,
            3,
            &mut *st,
            &f.ctx,
            0,
            None,
            None,
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains(&format!("token id {VOCAB}")), "{err}");
    let err = h
        .propose(
            1,
            f.hidden(11),
            12,
            3,
            &mut *st,
            &f.ctx,
            0,
            None,
            Some(&[0i32]),
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("grammar_bitmask has 1 words"), "{err}");
    // A mask that allows nothing ends the drafts, not the sequence.
    let none = vec![0i32; VOCAB.div_ceil(32)];
    let d = h
        .propose(
            1,
            f.hidden(11),
            12,
            3,
            &mut *st,
            &f.ctx,
            0,
            None,
            Some(&none),
            None,
        )
        .unwrap();
    assert!(d.is_empty());
    // A catch-up whose lists disagree in length names each.
    let err = h
        .catchup_batch(
            &[vec![1, 2]],
            &[vec![f.hidden(12), f.hidden(13)]],
            &[13, 14],
            &mut [&mut *st],
            &f.ctx,
            0,
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("catchup_batch") && err.contains("2 first positions"),
        "{err}"
    );
    // A state of another head is refused.
    let other = Fixture::new(
        "errors_other",
        "mimo",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let mut foreign = other.state();
    let err = h.after_verify(0, &mut *foreign, 0).unwrap_err().to_string();
    assert!(err.contains("another MtpHead"), "{err}");
    other
        .head()
        .free_state(other.gpu.as_ref(), &mut *foreign)
        .unwrap();
    other.finish();
    h.free_state(f.gpu.as_ref(), &mut *st).unwrap();
    assert!(
        h.free_state(f.gpu.as_ref(), &mut *st).is_err(),
        "double free_state must be refused"
    );
    f.finish();
}

#[test]
fn a_budget_caps_the_rows_and_drafting_stops_at_it() {
    let f = Fixture::new(
        "budget",
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let h = f.head();
    // Budget 1 token plus 64 rows of draft slack, rounded up to whole blocks: 5 x 16 rows.
    let mut st = h.alloc_state_for(f.gpu.as_ref(), 1).unwrap();
    assert_eq!(
        h.prefill_drafter(&f.tokens[..100], f.hiddens, &mut *st, &f.ctx, 0)
            .unwrap(),
        80
    );
    assert_eq!(h.last_pair_key(&mut *st), Some(79));
    let d = f.propose(&mut *st, 100, 4);
    assert!(d.is_empty(), "no room left, so no drafts: {d:?}");
    h.free_state(f.gpu.as_ref(), &mut *st).unwrap();
    f.finish();
}

#[test]
fn missing_module_lists_what_the_checkpoint_holds() {
    let dir = scratch_dir("mtp_head_missing");
    write_checkpoint(&dir, "deepseek_v3", 1);
    // Declare more main layers, so model.layers.1.* is no longer the MTP module.
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        cfg.replace("\"num_hidden_layers\":1", "\"num_hidden_layers\":2"),
    )
    .unwrap();
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let err = MtpHead::from_checkpoint(
        &dir,
        gpu.clone(),
        MtpQuantization::Bf16,
        0,
        64,
        64,
        &ModelLevers::default(),
    )
    .err()
    .expect("no module")
    .to_string();
    for needle in [
        "no MTP module",
        "model.layers.2.eh_proj.weight",
        "mtp.fc.weight",
        "model.layers.1.*",
    ] {
        assert!(err.contains(needle), "{needle:?} not in {err}");
    }
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn running_out_of_memory_anywhere_in_loading_leaks_nothing() {
    let dir = scratch_dir("mtp_head_oom");
    write_checkpoint(&dir, "qwen3_next", 4);
    let levers = ModelLevers::default();
    let load = |gpu: Arc<dyn GpuBackend>| {
        MtpHead::from_checkpoint(&dir, gpu, MtpQuantization::Nvfp4, 0, 64, 64, &levers)
    };
    let full: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let head = load(full.clone()).unwrap();
    let total = full.ledger().live_bytes();
    drop(head);
    assert_eq!(full.ledger().live_count(), 0);
    // Limits that fail during the weight load and inside `new` (caches, scratch, re-quantized
    // projections) alike.
    for step in 0..24 {
        let limit = total * step / 24;
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::with_memory_limit(limit));
        let err = load(gpu.clone()).err().expect("cannot fit").to_string();
        assert!(err.contains("out of device memory"), "limit {limit}: {err}");
        assert_eq!(
            gpu.ledger().live_count(),
            0,
            "limit {limit}: {:?}",
            gpu.ledger().live_report()
        );
    }
}
