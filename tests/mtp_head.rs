//! `MtpHead`'s protocol contracts on tiny random checkpoints: conformance, batching, KV
//! bookkeeping, carrying KV between turns, the circuit runner, and MoE heads.

mod mtp_common;

use mtp_common::*;
use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend, GpuBackendExt};
use specdraft::model::{ModelConfig, ModelLevers};
use specdraft::speculative::conformance::{check_proposer_on, CheckOptions};
use specdraft::speculative::mtp::ReferenceDraftRunner;
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization, ProposerState};
use std::sync::Arc;

#[test]
fn conformance_passes_for_every_layout() {
    for (layout, levers) in [
        ("deepseek_v3", ModelLevers::default()),
        (
            "mimo",
            ModelLevers {
                mtp_chain_postnorm: true,
                ..Default::default()
            },
        ),
        (
            "qwen3_next",
            ModelLevers {
                mtp_target_postnorm: true,
                ..Default::default()
            },
        ),
    ] {
        let f = Fixture::new(
            &format!("conf_{layout}"),
            layout,
            levers,
            MtpQuantization::Bf16,
        );
        let options = CheckOptions {
            label: format!("MtpHead {layout}"),
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

#[test]
fn after_verify_keeps_the_accepted_rows_and_their_pair_keys() {
    let f = Fixture::new(
        "rows",
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let h = f.head();
    let mut st = f.state();
    let p = 20;
    assert_eq!(f.prefill(&mut *st, p), p - 1);
    assert_eq!(h.drafter_rows(&mut *st), p - 1);
    assert_eq!(h.last_pair_key(&mut *st), Some(p - 2));
    let drafts = f.propose(&mut *st, p, 4);
    assert_eq!(drafts.len(), 4);
    // Rows at positions p..p+3, pair keys p-1..p+2.
    assert_eq!(h.drafter_rows(&mut *st), p - 1 + 4);
    assert_eq!(h.last_pair_key(&mut *st), Some(p + 2));
    h.after_verify(2, &mut *st, 0).unwrap();
    // The verified token's row and the two accepted drafts' rows stay.
    assert_eq!(h.drafter_rows(&mut *st), p - 1 + 3);
    assert_eq!(h.last_pair_key(&mut *st), Some(p + 1));
    // Accepting more drafts than were proposed is an error naming both counts.
    let next = p + 3;
    f.propose(&mut *st, next, 2);
    let err = h.after_verify(3, &mut *st, 0).unwrap_err().to_string();
    assert!(
        err.contains("3 drafts accepted") && err.contains("drafted 2"),
        "{err}"
    );
    h.after_verify(0, &mut *st, 0).unwrap();
    assert_eq!(h.drafter_rows(&mut *st), p - 1 + 4);
    assert_eq!(h.last_pair_key(&mut *st), Some(next - 1));
    h.free_state(f.gpu.as_ref(), &mut *st).unwrap();
    f.finish();
}

#[test]
fn exact_kv_keeps_one_row_and_catchup_appends_the_accepted_ones() {
    let levers = ModelLevers {
        mtp_kv_exact: true,
        ..Default::default()
    };
    let f = Fixture::new("exact", "qwen3_next", levers, MtpQuantization::Bf16);
    let h = f.head();
    let mut st = f.state();
    let p = 16;
    f.prefill(&mut *st, p);
    let d = f.propose(&mut *st, p, 3);
    h.after_verify(2, &mut *st, 0).unwrap();
    assert_eq!(h.drafter_rows(&mut *st), p);
    assert_eq!(h.last_pair_key(&mut *st), Some(p - 1));
    let mut states: [&mut dyn ProposerState; 1] = [&mut *st];
    let written = h
        .catchup_batch(
            &[d[..2].to_vec()],
            &[vec![f.hidden(p), f.hidden(p + 1)]],
            &[p + 1],
            &mut states,
            &f.ctx,
            0,
        )
        .unwrap();
    assert_eq!(written, 2);
    assert_eq!(h.drafter_rows(&mut *st), p + 2);
    assert_eq!(h.last_pair_key(&mut *st), Some(p + 1));
    // Mismatched lengths are refused.
    let mut states: [&mut dyn ProposerState; 1] = [&mut *st];
    assert!(h
        .catchup_batch(&[vec![1]], &[vec![]], &[p + 3], &mut states, &f.ctx, 0)
        .is_err());
    h.free_state(f.gpu.as_ref(), &mut *st).unwrap();
    f.finish();
}

#[test]
fn propose_batch_equals_propose_and_reports_top1_probabilities() {
    let f = Fixture::new(
        "batch",
        "mimo",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let h = f.head();
    let prompts = [12usize, 20, 31];
    let mut singles = Vec::new();
    for &p in &prompts {
        let mut st = f.state();
        f.prefill(&mut *st, p);
        singles.push(f.propose(&mut *st, p, 4));
        h.free_state(f.gpu.as_ref(), &mut *st).unwrap();
    }
    let mut owned: Vec<Box<dyn ProposerState>> = prompts.iter().map(|_| f.state()).collect();
    for (st, &p) in owned.iter_mut().zip(&prompts) {
        f.prefill(&mut **st, p);
    }
    let last: Vec<u32> = prompts.iter().map(|&p| f.tokens[p]).collect();
    let hid: Vec<DevicePtr> = prompts.iter().map(|&p| f.hidden(p - 1)).collect();
    let mut conf = Vec::new();
    let batch = {
        let mut states: Vec<&mut dyn ProposerState> = owned
            .iter_mut()
            .map(|s| &mut **s as &mut dyn ProposerState)
            .collect();
        h.propose_batch(
            &last,
            &hid,
            &prompts,
            4,
            &mut states,
            &f.ctx,
            0,
            Some(&mut conf),
        )
        .unwrap()
        .expect("batching is supported")
    };
    assert_eq!(batch, singles);
    // The last draft's probability is the top softmax probability of the last logits row.
    for (i, c) in conf.iter().enumerate() {
        assert_eq!(c.len(), 4);
        let logits = h.last_logits(f.gpu.as_ref(), i).unwrap();
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let total: f32 = logits.iter().map(|l| (l - max).exp()).sum();
        assert!(
            (c[3] - 1.0 / total).abs() < 1e-5,
            "{} vs {}",
            c[3],
            1.0 / total
        );
        assert!(c.iter().all(|p| (0.0..=1.0).contains(p)));
    }
    for mut st in owned {
        h.free_state(f.gpu.as_ref(), &mut *st).unwrap();
    }
    f.finish();
}

#[test]
fn carried_kv_drafts_like_a_state_rebuilt_from_scratch() {
    let levers = ModelLevers {
        mtp_kv_exact: true,
        ..Default::default()
    };
    let f = Fixture::new("carry", "deepseek_v3", levers, MtpQuantization::Bf16);
    let h = f.head();
    let mut st = f.state();
    let mut pos = 18;
    f.prefill(&mut *st, pos);
    // The "target" accepts whatever the head drafted up to a scripted count.
    let mut tokens = f.tokens.clone();
    for round in 0..5 {
        let d = h
            .propose(
                tokens[pos],
                f.hidden(pos - 1),
                pos,
                3,
                &mut *st,
                &f.ctx,
                0,
                None,
                None,
                None,
            )
            .unwrap();
        let k = round % 4;
        h.after_verify(k, &mut *st, 0).unwrap();
        let hs: Vec<_> = (0..k).map(|i| f.hidden(pos + i)).collect();
        let mut states: [&mut dyn ProposerState; 1] = [&mut *st];
        h.catchup_batch(
            &[d[..k].to_vec()],
            &[hs],
            &[pos + 1],
            &mut states,
            &f.ctx,
            0,
        )
        .unwrap();
        tokens[pos + 1..pos + 1 + k].copy_from_slice(&d[..k]);
        pos += k + 1;
    }
    let (blocks, rows, key) = h.take_drafter_kv(&mut *st).expect("rows to carry");
    assert_eq!((rows, key), (pos - 1, Some(pos - 2)));
    assert_eq!(h.drafter_rows(&mut *st), 0);
    assert_eq!(h.last_pair_key(&mut *st), None);
    let mut carried = f.state();
    assert!(h.install_drafter_kv(&mut *carried, blocks, rows, key));
    let mut rebuilt = f.state();
    h.prefill_drafter(&tokens[..pos], f.hiddens, &mut *rebuilt, &f.ctx, 0)
        .unwrap();
    assert_eq!(h.drafter_rows(&mut *rebuilt), rows);
    assert_eq!(h.last_pair_key(&mut *rebuilt), key);
    let propose = |s: &mut dyn ProposerState| {
        h.propose(
            tokens[pos],
            f.hidden(pos - 1),
            pos,
            4,
            s,
            &f.ctx,
            0,
            None,
            None,
            None,
        )
        .unwrap()
    };
    let from_carried = propose(&mut *carried);
    assert_eq!(from_carried, propose(&mut *rebuilt));
    // The emptied state drafts like a fresh one.
    let mut fresh = f.state();
    assert_eq!(propose(&mut *st), propose(&mut *fresh));
    for mut s in [st, carried, rebuilt, fresh] {
        h.free_state(f.gpu.as_ref(), &mut *s).unwrap();
    }
    f.finish();
}

#[test]
fn reference_runner_drafts_what_the_head_drafts_from_the_binding_alone() {
    let levers = ModelLevers {
        mtp_chain_postnorm: true,
        ..Default::default()
    };
    let f = Fixture::new("circuit", "qwen3_next", levers, MtpQuantization::Nvfp4);
    let h = f.head();
    let binding = h.circuit_draft(&f.ctx.config, &levers).expect("a binding");
    assert_eq!(binding.kind, "mtp:qwen3_next+chain_postnorm");
    assert!(binding
        .weights
        .iter()
        .any(|s| s.name == "layer.self_attn.q_norm"));
    let run = |with_runner: bool| {
        h.set_circuit_draft(with_runner.then(|| Arc::new(ReferenceDraftRunner) as _));
        let mut st = f.state();
        let mut pos = 14;
        f.prefill(&mut *st, pos);
        let mut all = Vec::new();
        for round in 0..4 {
            let d = f.propose(&mut *st, pos, 3);
            let k = round % 3;
            h.after_verify(k, &mut *st, 0).unwrap();
            all.push((d, h.drafter_rows(&mut *st), h.last_pair_key(&mut *st)));
            pos += k + 1;
        }
        h.free_state(f.gpu.as_ref(), &mut *st).unwrap();
        all
    };
    let own = run(false);
    let circuit = run(true);
    h.set_circuit_draft(None);
    assert_eq!(own, circuit);
    f.finish();
}

#[test]
fn deferred_draft_token_and_its_embedding_are_left_on_the_device() {
    let f = Fixture::new(
        "deferred",
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let h = f.head();
    let mut st = f.state();
    f.prefill(&mut *st, 10);
    let target = f.gpu.alloc(HIDDEN * 2, "test:embed_target").unwrap();
    let d = h
        .propose(
            f.tokens[10],
            f.hidden(9),
            10,
            3,
            &mut *st,
            &f.ctx,
            0,
            Some(target),
            None,
            None,
        )
        .unwrap();
    let last = *d.last().unwrap();
    assert_eq!(h.read_deferred_draft_token(f.gpu.as_ref()).unwrap(), last);
    let row = f.gpu.download_bf16(target, HIDDEN).unwrap();
    let table = f
        .gpu
        .download_bf16(
            h.circuit_draft(&f.ctx.config, &f.ctx.levers)
                .unwrap()
                .weights[0]
                .ptr,
            VOCAB * HIDDEN,
        )
        .unwrap();
    assert_eq!(
        row,
        table[last as usize * HIDDEN..(last as usize + 1) * HIDDEN]
    );
    f.gpu.free(target).unwrap();
    h.free_state(f.gpu.as_ref(), &mut *st).unwrap();
    f.finish();
}

#[test]
fn moe_heads_pass_conformance_and_have_no_circuit_binding() {
    for layout in ["glm4_moe", "qwen3_next"] {
        let dir = scratch_dir(&format!("mtp_head_moe_{layout}"));
        write_checkpoint_with(&dir, layout, 5, true);
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let levers = ModelLevers::default();
        let head = MtpHead::from_checkpoint(
            &dir,
            gpu.clone(),
            MtpQuantization::Nvfp4,
            0,
            256,
            256,
            &levers,
        )
        .unwrap();
        let moe = head.weights().layer.moe().expect("a routed MLP");
        assert_eq!(
            moe.experts.len(),
            if layout == "qwen3_next" {
                QWEN_EXPERTS
            } else {
                GLM_EXPERTS
            }
        );
        if layout == "glm4_moe" {
            assert_eq!(
                (moe.n_group, moe.topk_group, moe.routed_scaling_factor),
                (2, 1, 2.5)
            );
        }
        let config = ModelConfig::from_file(dir.join("config.json")).unwrap();
        assert!(head.circuit_draft(&config, &levers).is_none());
        let options = CheckOptions {
            label: format!("MtpHead {layout} MoE"),
            vocab_size: VOCAB,
            hidden_size: HIDDEN,
            num_sequences: 2,
            num_drafts: 3,
            steps: 4,
            seed: 2,
        };
        let report = check_proposer_on(&head, gpu.clone(), &options);
        assert!(report.violations.is_empty(), "{layout}: {report:?}");
        drop(head);
        assert_eq!(gpu.ledger().live_count(), 0);
    }
}
