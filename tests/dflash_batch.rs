//! `DFlashHead` proposing a batch beside a tiny seeded target (four Llama layers, CPU
//! backend): `propose_batch` drafts exactly what per-sequence `propose` drafts from the same
//! captured rows (each sequence's from its entry of `ctx.target_hidden_stacks`), over rounds
//! where sequences accept different counts and some decline; its confidences are the
//! softmax probability of each draft under the block's logits; it refuses a batch without
//! those rows, with the wrong number of them or wider than its `propose_batch_max`; the
//! conformance check compares its batches; nothing leaks.

mod dflash_common;
#[allow(unused_imports)] // the helpers re-export a GGUF writer this test does not use
mod model_util;

use dflash_common::*;
use model_util::{Rng, Twins};
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::model::ForwardContext;
use specdraft::speculative::conformance::{check_proposer_on, CheckOptions};
use specdraft::speculative::{DFlashHead, DraftProposer};
use std::sync::Arc;

const SEQS: usize = 3;
const LEN: usize = 60;
const GAMMA: usize = 4;

/// The softmax probability of `token` under `logits`, in f64 from the logits alone.
fn softmax_at(logits: &[f32], token: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    (logits[token as usize] as f64 - max).exp() / sum
}

#[test]
fn batched_drafts_are_the_per_sequence_drafts_and_carry_their_probabilities() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = target(&gpu, "batch");
    let dir = Ckpt {
        block_size: GAMMA,
        ..Ckpt::default()
    }
    .write("batch");
    let head = load(&dir, &model, None).unwrap();
    assert!(head.propose_batch_max(model.buffers(), model.config()) >= SEQS);
    let width = TAPS.len() * H;
    let mut rng = Rng::new(11);
    let tokens: Vec<Vec<u32>> = (0..SEQS)
        .map(|s| (0..LEN).map(|i| ((i * 7 + s * 13) % 90) as u32).collect())
        .collect();
    let values: Vec<f32> = (0..SEQS * LEN * width)
        .map(|_| 2.0 * rng.next_f32() - 1.0)
        .collect();
    let stack = gpu.upload_bf16(&values, "stacks").unwrap();
    let row = |s: usize, q: usize| stack.offset((s * LEN + q) * width * 2);
    let hidden = gpu.alloc(H * 2, "unread target hidden").unwrap();
    let ctx = ForwardContext::new(
        gpu.clone(),
        model.buffers().clone(),
        model.config().clone(),
        Default::default(),
    );
    let mut twins = Twins::new(&head, ctx.clone(), hidden, tokens, &[5, 9, 7], &row);
    let (mut drafted, mut judged) = (0, 0);
    for step in 0..10 {
        // Declined steps (0 drafts) keep their rows aside for the next drafting one.
        let n = [3, 0, 2, 0, 0, 1, 3][step % 7];
        // The probability of each draft under the logits its block picked it from.
        let mut want_conf: Vec<Vec<f64>> = Vec::new();
        let want = twins.one_by_one(n, &row, |_, d| {
            let logits = |j| head.last_logits(gpu.as_ref(), j).unwrap();
            want_conf.push((0..d.len()).map(|j| softmax_at(&logits(j), d[j])).collect());
        });
        let stacks = twins.stacks(&row);
        let mut conf = Vec::new();
        let got = twins
            .batch(n, Some(&stacks), Some(&mut conf))
            .unwrap()
            .expect("DFlashHead proposes in batches");
        assert_eq!(got, want, "step {step}");
        assert_eq!(conf.len(), SEQS, "step {step}");
        for s in 0..SEQS {
            assert_eq!(conf[s].len(), want[s].len(), "step {step}, sequence {s}");
            for (c, w) in conf[s].iter().zip(&want_conf[s]) {
                assert!((*c as f64 - w).abs() < 1e-5, "step {step}: {c} vs {w}");
                judged += 1;
            }
        }
        drafted += want.iter().map(Vec::len).sum::<usize>();
        // Sequences accept different counts, so their rows start at different points.
        twins.settle(step, &want);
    }
    assert!(drafted > 20 && judged == drafted, "{drafted} drafts");

    // Without the captured rows, one entry short, or wider than the head batches: refused.
    let err = twins.batch(2, None, None).unwrap_err().to_string();
    assert!(err.contains("needs the target's captured layers"), "{err}");
    let short = &twins.stacks(&row)[..2];
    let err = twins.batch(2, Some(short), None).unwrap_err().to_string();
    assert!(err.contains("2 captured row sets"), "{err}");
    twins.free(gpu.as_ref());
    let wide = head.propose_batch_max(model.buffers(), model.config()) + 1;
    let tokens = vec![vec![1u32; 4]; wide];
    let mut extra = Twins::new(&head, ctx, hidden, tokens, &vec![1; wide], &|_, _| {
        row(0, 0)
    });
    let stacks = vec![row(0, 0); wide];
    let err = extra.batch(2, Some(&stacks), None).unwrap_err().to_string();
    assert!(err.contains("propose_batch_max is"), "{err}");
    extra.free(gpu.as_ref());
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
    let model = target(&gpu, "batch_conformance");
    let dir = Ckpt {
        block_size: 8,
        ..Ckpt::default()
    }
    .write("batch_conformance");
    let head: DFlashHead = load(&dir, &model, Some(40)).unwrap();
    let options = CheckOptions {
        label: "DFlashHead".into(),
        vocab_size: VOCAB,
        hidden_size: H,
        num_drafts: 7,
        steps: 10,
        ..CheckOptions::default()
    };
    let report = check_proposer_on(&head, gpu.clone(), &options);
    assert!(report.is_ok(), "{report}");
    assert!(
        report.checks_run.iter().any(|c| c == "propose_batch"),
        "{:?}",
        report.checks_run
    );
    assert_eq!(head.kv_blocks().0, head.kv_blocks().1, "blocks left taken");
}
