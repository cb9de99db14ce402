//! `Eagle3Head` proposing a batch beside a tiny seeded target (four Llama layers, CPU
//! backend): `propose_batch` drafts exactly what per-sequence `propose` drafts from the same
//! captured rows (each sequence's from its entry of `ctx.target_hidden_stacks`), refuses a
//! batch without those rows or with the wrong number, passes the conformance check's batch
//! comparison, and through the engine at batch 3 keeps greedy output plain; nothing leaks.

mod drafter_fixtures;
#[allow(unused_imports)] // the helpers re-export a GGUF writer this test does not use
mod model_util;

use drafter_fixtures::{eagle3_beside, eagle3_target_shape as tiny};
use model_util::{greedy_fixed, Rng, Twins};
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::model::ForwardContext;
use specdraft::speculative::conformance::{check_proposer_on, CheckOptions};
use specdraft::speculative::DraftProposer;
use std::sync::Arc;

/// The layers the head fuses (EAGLE-3's ids: the hiddens entering them).
const AUX: [usize; 3] = [1, 2, 3];

#[test]
fn batched_drafts_are_the_per_sequence_drafts_from_each_sequences_rows() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let (model, head) = eagle3_beside(&gpu, "batch_direct");
    let (seqs, len, width) = (3, 48, AUX.len() * tiny().hidden);
    // Each sequence's own tokens and captured rows (row `q` computed at position `q`).
    let mut rng = Rng::new(7);
    let tokens: Vec<Vec<u32>> = (0..seqs)
        .map(|s| (0..len).map(|i| ((i * 7 + s * 13) % 90) as u32).collect())
        .collect();
    let values: Vec<f32> = (0..seqs * len * width)
        .map(|_| 2.0 * rng.next_f32() - 1.0)
        .collect();
    let stack = gpu.upload_bf16(&values, "stacks").unwrap();
    let row = |s: usize, q: usize| stack.offset((s * len + q) * width * 2);
    let hidden = gpu
        .alloc(tiny().hidden * 2, "unread target hidden")
        .unwrap();
    let ctx = ForwardContext::new(
        gpu.clone(),
        model.buffers().clone(),
        model.config().clone(),
        Default::default(),
    );
    let mut twins = Twins::new(&*head, ctx, hidden, tokens, &[5, 9, 7], &row);
    let mut drafted = 0;
    for step in 0..8 {
        let n = [3, 1, 4, 2][step % 4];
        let want = twins.one_by_one(n, &row, |_, _| {});
        let stacks = twins.stacks(&row);
        let got = twins
            .batch(n, Some(&stacks), None)
            .unwrap()
            .expect("Eagle3Head proposes in batches");
        assert_eq!(got, want, "step {step}");
        drafted += want.iter().map(Vec::len).sum::<usize>();
        // Sequences accept different counts, so their rows start at different points.
        twins.settle(step, &want);
    }
    assert!(drafted > 20, "only {drafted} drafts");

    // Without the captured rows, or with one entry too few: refused, naming what is wrong.
    let err = twins.batch(2, None, None).unwrap_err().to_string();
    assert!(err.contains("needs the target's captured layers"), "{err}");
    let short = &twins.stacks(&row)[..2];
    let err = twins.batch(2, Some(short), None).unwrap_err().to_string();
    assert!(err.contains("2 captured row sets"), "{err}");
    twins.free(gpu.as_ref());
    gpu.free(stack).unwrap();
    gpu.free(hidden).unwrap();
    assert_eq!(head.kv_blocks().0, head.kv_blocks().1, "blocks left taken");
    drop((head, model));
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

#[test]
fn the_conformance_check_compares_its_batches() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let (_model, head) = eagle3_beside(&gpu, "batch_conformance");
    let options = CheckOptions {
        label: "Eagle3Head".into(),
        vocab_size: tiny().vocab,
        hidden_size: tiny().hidden,
        num_drafts: 4,
        steps: 10,
        ..CheckOptions::default()
    };
    let report = check_proposer_on(&*head, gpu.clone(), &options);
    assert!(report.is_ok(), "{report}");
    assert!(
        report.checks_run.iter().any(|c| c == "propose_batch"),
        "{:?}",
        report.checks_run
    );
    assert_eq!(head.kv_blocks().0, head.kv_blocks().1, "blocks left taken");
}

#[test]
fn batched_in_the_engine_greedy_output_stays_plain() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let (model, head) = eagle3_beside(&gpu, "batch_engine");
    let prompts: Vec<Vec<u32>> = vec![
        vec![1, 5, 17, 33, 4, 90, 12, 12, 7, 64, 5, 17, 33],
        vec![3, 22, 45, 8, 8, 61, 70, 9, 95, 40],
        vec![60, 2, 2, 19, 44],
    ];
    let (plain, _, _) = greedy_fixed(&model, None, 0, 4, &prompts);
    let proposer = Some(head.clone() as Arc<dyn DraftProposer>);
    let (got, drafted, _) = greedy_fixed(&model, proposer, 3, 4, &prompts);
    assert!(drafted > 0);
    assert_eq!(got, plain, "greedy output with batched drafts differs");
    assert_eq!(head.kv_blocks().0, head.kv_blocks().1, "blocks left taken");
    drop((head, model));
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}
