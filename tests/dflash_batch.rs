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
use model_util::Rng;
use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend, GpuBackendExt};
use specdraft::model::ForwardContext;
use specdraft::speculative::conformance::{check_proposer_on, CheckOptions};
use specdraft::speculative::{DFlashHead, DraftProposer, ProposerState};
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

fn batch_states(states: &mut [Box<dyn ProposerState>]) -> Vec<&mut dyn ProposerState> {
    states
        .iter_mut()
        .map(|b| -> &mut dyn ProposerState { &mut **b })
        .collect()
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
    let mut single: Vec<Box<dyn ProposerState>> = Vec::new();
    let mut batched: Vec<Box<dyn ProposerState>> = Vec::new();
    let prompt = [5, 9, 7];
    for (s, &p) in prompt.iter().enumerate() {
        for states in [&mut single, &mut batched] {
            let mut st = head.alloc_state(gpu.as_ref()).unwrap();
            let pctx = ForwardContext {
                target_hidden_stack: Some(row(s, 0)),
                ..ctx.clone()
            };
            head.prefill_drafter(&tokens[s][..p], hidden, &mut *st, &pctx, 0)
                .unwrap();
            states.push(st);
        }
    }
    let mut pos: Vec<usize> = prompt.to_vec();
    // Where each sequence's rows start: its last propose (or its last prompt token).
    let mut start: Vec<usize> = prompt.iter().map(|p| p - 1).collect();
    let (mut drafted, mut judged) = (0, 0);
    for step in 0..10 {
        // Declined steps (0 drafts) keep their rows aside for the next drafting one.
        let n = [3, 0, 2, 0, 0, 1, 3][step % 7];
        let mut want = Vec::new();
        let mut want_conf = Vec::new();
        for s in 0..SEQS {
            let d = head
                .propose(
                    tokens[s][pos[s]],
                    hidden,
                    pos[s],
                    n,
                    &mut *single[s],
                    &ctx,
                    0,
                    None,
                    None,
                    Some(row(s, start[s])),
                )
                .unwrap();
            let probs: Vec<f64> = (0..d.len())
                .map(|j| softmax_at(&head.last_logits(gpu.as_ref(), j).unwrap(), d[j]))
                .collect();
            want.push(d);
            want_conf.push(probs);
        }
        let stacks: Vec<DevicePtr> = (0..SEQS).map(|s| row(s, start[s])).collect();
        let bctx = ForwardContext {
            target_hidden_stacks: Some(&stacks),
            ..ctx.clone()
        };
        let last: Vec<u32> = (0..SEQS).map(|s| tokens[s][pos[s]]).collect();
        let mut conf = Vec::new();
        let got = head
            .propose_batch(
                &last,
                &[hidden; SEQS],
                &pos,
                n,
                &mut batch_states(&mut batched),
                &bctx,
                0,
                Some(&mut conf),
            )
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
        for s in 0..SEQS {
            // Sequences accept different counts, so their rows start at different points.
            let a = (step + s) % (want[s].len() + 1);
            head.after_verify(a, &mut *single[s], 0).unwrap();
            head.after_verify(a, &mut *batched[s], 0).unwrap();
            start[s] = pos[s];
            pos[s] += a + 1;
        }
    }
    assert!(drafted > 20 && judged == drafted, "{drafted} drafts");

    // Without the captured rows, one entry short, or wider than the head batches: refused.
    let last: Vec<u32> = (0..SEQS).map(|s| tokens[s][pos[s]]).collect();
    let err = head
        .propose_batch(
            &last,
            &[hidden; SEQS],
            &pos,
            2,
            &mut batch_states(&mut batched),
            &ctx,
            0,
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("needs the target's captured layers"), "{err}");
    let short = [row(0, start[0]), row(1, start[1])];
    let bctx = ForwardContext {
        target_hidden_stacks: Some(&short),
        ..ctx.clone()
    };
    let err = head
        .propose_batch(
            &last,
            &[hidden; SEQS],
            &pos,
            2,
            &mut batch_states(&mut batched),
            &bctx,
            0,
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("2 captured row sets"), "{err}");
    let wide = head.propose_batch_max(model.buffers(), model.config()) + 1;
    let mut extra: Vec<Box<dyn ProposerState>> = (0..wide)
        .map(|_| head.alloc_state(gpu.as_ref()).unwrap())
        .collect();
    let stacks = vec![row(0, 0); wide];
    let bctx = ForwardContext {
        target_hidden_stacks: Some(&stacks),
        ..ctx.clone()
    };
    let err = head
        .propose_batch(
            &vec![1; wide],
            &vec![hidden; wide],
            &vec![1; wide],
            2,
            &mut batch_states(&mut extra),
            &bctx,
            0,
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("propose_batch_max is"), "{err}");

    for st in single
        .iter_mut()
        .chain(batched.iter_mut())
        .chain(extra.iter_mut())
    {
        head.free_state(gpu.as_ref(), &mut **st).unwrap();
    }
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
