//! The target model on the CPU backend: loaded from a real safetensors checkpoint and a real
//! GGUF file written by the test, checked against an independent f32 reference, and the
//! paged-KV contracts (prefill == step by step, trim, batching, all-or-nothing, no leaks).

mod model_util;

use model_util::*;
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::model::{
    ForwardOutput, KvSequence, LoadOptions, LogitRows, ModelError, TargetModel,
};
use specdraft::Error;
use std::sync::Arc;

fn cpu() -> Arc<dyn GpuBackend> {
    Arc::new(CpuBackend::new())
}

fn opts() -> LoadOptions {
    LoadOptions {
        max_rows: 64,
        max_seq_len: Some(128),
        kv_blocks: Some(24),
    }
}

fn load_tiny(tag: &str, tiny: &Tiny, seed: u64) -> (TargetModel, Tensors, Arc<dyn GpuBackend>) {
    let dir = temp_dir(tag);
    let tensors = tiny.tensors(seed);
    write_hf(&dir, tiny, &tensors);
    let gpu = cpu();
    let model = TargetModel::load(&dir, gpu.clone(), opts()).unwrap();
    (model, tensors, gpu)
}

fn rows_of(model: &TargetModel, out: &ForwardOutput) -> Vec<Vec<f32>> {
    let v = model.config().vocab_size;
    let all: Vec<f32> = model.gpu().download(out.logits, out.rows * v).unwrap();
    all.chunks(v).map(|c| c.to_vec()).collect()
}

fn forward1(model: &TargetModel, seq: &mut KvSequence, toks: &[u32]) -> Vec<Vec<f32>> {
    let out = model.forward(&mut [seq], &[toks]).unwrap();
    rows_of(model, &out)
}

const PROMPT: [u32; 21] = [
    1, 5, 17, 33, 4, 90, 12, 12, 7, 64, 3, 22, 45, 8, 8, 61, 70, 2, 9, 95, 40,
];

#[test]
fn the_model_can_be_shared_across_threads() {
    fn shared<T: Send + Sync>() {}
    shared::<TargetModel>();
    shared::<KvSequence>();
}

#[test]
fn safetensors_model_matches_the_f32_reference() {
    let tiny = Tiny::default();
    let (model, tensors, gpu) = load_tiny("ref", &tiny, 1);
    let mut seq = model.new_sequence();
    let got = forward1(&model, &mut seq, &PROMPT);
    let want = reference_logits(&tiny, &tensors, &PROMPT);
    let scale = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
    for (p, (g, w)) in got.iter().zip(&want).enumerate() {
        let d = max_abs_diff(g, w);
        assert!(
            d < 0.03 * scale,
            "position {p}: max diff {d} (logit scale {scale})"
        );
    }
    assert_eq!(seq.len(), PROMPT.len());
    // The hidden rows are the residual stream before the final norm: norming them with the
    // final norm and applying the head gives the logits.
    let out = model.forward(&mut [&mut seq], &[&[3, 4]]).unwrap();
    let h = gpu.download_bf16(out.hiddens, 2 * tiny.hidden).unwrap();
    let logits: Vec<f32> = gpu.download(out.logits, 2 * tiny.vocab).unwrap();
    let find = |n: &str| &tensors.iter().find(|t| t.0 == n).unwrap().2;
    let (norm, head) = (find("model.norm.weight"), find("lm_head.weight"));
    for r in 0..2 {
        let x = &h[r * tiny.hidden..(r + 1) * tiny.hidden];
        let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + tiny.eps).sqrt();
        let normed: Vec<f32> = x.iter().zip(norm).map(|(v, w)| v * inv * w).collect();
        let want: Vec<f32> = head
            .chunks(tiny.hidden)
            .map(|row| row.iter().zip(&normed).map(|(a, b)| a * b).sum())
            .collect();
        let d = max_abs_diff(&want, &logits[r * tiny.vocab..(r + 1) * tiny.vocab]);
        assert!(
            d < 0.02 * scale,
            "row {r}: logits from the hiddens differ by {d}"
        );
    }
    model.free_sequence(&mut seq).unwrap();
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

#[test]
fn qwen2_biases_and_qwen3_qk_norm_match_the_reference() {
    for family in ["qwen2", "qwen3"] {
        let tiny = Tiny {
            family,
            tied: true,
            ..Tiny::default()
        };
        let (model, tensors, gpu) = load_tiny(family, &tiny, 7);
        assert_eq!(model.config().attention_bias, family == "qwen2");
        assert_eq!(model.config().qk_norm, family == "qwen3");
        let mut seq = model.new_sequence();
        let got = forward1(&model, &mut seq, &PROMPT);
        let want = reference_logits(&tiny, &tensors, &PROMPT);
        let scale = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        for (p, (g, w)) in got.iter().zip(&want).enumerate() {
            let d = max_abs_diff(g, w);
            assert!(
                d < 0.03 * scale,
                "{family} position {p}: max diff {d} (scale {scale})"
            );
        }
        model.free_sequence(&mut seq).unwrap();
        drop(model);
        assert_eq!(gpu.ledger().live_count(), 0);
    }
}

#[test]
fn prefill_at_once_equals_one_token_at_a_time_and_trim_replays_exactly() {
    let tiny = Tiny {
        tied: true,
        ..Tiny::default()
    };
    let (model, _, gpu) = load_tiny("kv", &tiny, 2);
    let mut a = model.new_sequence();
    let at_once = forward1(&model, &mut a, &PROMPT);
    let mut b = model.new_sequence();
    let mut stepwise = Vec::new();
    for t in PROMPT {
        stepwise.extend(forward1(&model, &mut b, &[t]));
    }
    assert_eq!(a.len(), b.len());
    assert_eq!(a.blocks().len(), 2, "21 rows take two blocks of 16");
    for (p, (x, y)) in at_once.iter().zip(&stepwise).enumerate() {
        assert!(
            max_abs_diff(x, y) < 0.05,
            "position {p}: {}",
            max_abs_diff(x, y)
        );
    }
    // Verify-shaped step: [last, drafts..], then reject the drafts and replay other ones.
    let free_before = model.kv_pool().num_free();
    let first = forward1(
        &model,
        &mut a,
        &[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
    );
    assert_eq!(a.len(), 33);
    assert_eq!(model.kv_pool().num_free(), free_before - 1);
    model.trim(&mut a, 22).unwrap();
    assert_eq!(a.len(), 22);
    assert_eq!(a.blocks().len(), 2, "trim returns the emptied third block");
    assert_eq!(model.kv_pool().num_free(), free_before);
    let again = forward1(&model, &mut a, &[12, 13, 14]);
    for (i, row) in again.iter().enumerate() {
        assert_eq!(row, &first[i + 1], "row {i} after trim and replay");
    }
    let err = model.trim(&mut a, 99).unwrap_err();
    assert!(err.to_string().contains("cannot trim"), "{err}");
    model.free_sequence(&mut a).unwrap();
    model.free_sequence(&mut b).unwrap();
    assert_eq!(model.kv_pool().num_free(), 24);
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn a_batch_of_sequences_equals_each_alone() {
    let tiny = Tiny::default();
    let (model, _, gpu) = load_tiny("batch", &tiny, 3);
    let (p1, p2) = (&PROMPT[..13], &PROMPT[4..21]);
    let mut s1 = model.new_sequence();
    let mut s2 = model.new_sequence();
    let alone1 = forward1(&model, &mut s1, p1);
    let alone2 = forward1(&model, &mut s2, p2);
    let d1 = forward1(&model, &mut s1, &[7, 8]);
    let d2 = forward1(&model, &mut s2, &[9]);
    let (mut t1, mut t2) = (model.new_sequence(), model.new_sequence());
    let out = model.forward(&mut [&mut t1, &mut t2], &[p1, p2]).unwrap();
    assert_eq!(out.row_offsets, vec![0, 13, 30]);
    let rows = rows_of(&model, &out);
    for (i, r) in alone1.iter().chain(&alone2).enumerate() {
        assert!(max_abs_diff(r, &rows[i]) < 1e-5, "prefill row {i}");
    }
    let out = model
        .forward(&mut [&mut t1, &mut t2], &[&[7, 8], &[9]])
        .unwrap();
    let rows = rows_of(&model, &out);
    assert_eq!(out.rows, 3);
    for (i, r) in d1.iter().chain(&d2).enumerate() {
        assert!(max_abs_diff(r, &rows[i]) < 1e-5, "decode row {i}");
    }
    assert_eq!((t1.len(), t2.len()), (15, 18));
    // A sequence with nothing to add this step rides along unchanged.
    let out = model
        .forward(&mut [&mut t1, &mut t2], &[&[4], &[]])
        .unwrap();
    assert_eq!((out.rows, out.row_offsets.clone()), (1, vec![0, 1, 1]));
    assert_eq!((t1.len(), t2.len()), (16, 18));
    for s in [&mut s1, &mut s2, &mut t1, &mut t2] {
        model.free_sequence(s).unwrap();
    }
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn last_row_logits_equal_those_rows_of_a_full_forward() {
    let tiny = Tiny::default();
    let (model, _, gpu) = load_tiny("lastrow", &tiny, 6);
    let (p1, p2) = (&PROMPT[..9], &PROMPT[9..]);
    let (mut a1, mut a2) = (model.new_sequence(), model.new_sequence());
    let full = model.forward(&mut [&mut a1, &mut a2], &[p1, p2]).unwrap();
    assert_eq!(full.logits_rows, full.rows);
    let full_rows = rows_of(&model, &full);
    let full_hidden = gpu
        .download_bf16(full.hiddens, full.rows * tiny.hidden)
        .unwrap();
    let (mut b1, mut b2) = (model.new_sequence(), model.new_sequence());
    let last = model
        .forward_with(
            &mut [&mut b1, &mut b2],
            &[p1, p2],
            LogitRows::LastPerSequence,
        )
        .unwrap();
    assert_eq!((last.rows, last.logits_rows), (21, 2));
    let (mut c1, mut c2) = (model.new_sequence(), model.new_sequence());
    let err = model
        .forward_with(
            &mut [&mut c1, &mut c2],
            &[p1, &[]],
            LogitRows::LastPerSequence,
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("sequence 1 has no tokens"),
        "{err}"
    );
    assert_eq!((c1.len(), c2.len()), (0, 0));
    let v = tiny.vocab;
    let got: Vec<f32> = gpu.download(last.logits, 2 * v).unwrap();
    assert_eq!(&got[..v], &full_rows[8][..]);
    assert_eq!(&got[v..], &full_rows[20][..]);
    let hidden = gpu
        .download_bf16(last.hiddens, last.rows * tiny.hidden)
        .unwrap();
    assert_eq!(hidden, full_hidden, "every row's hidden is still returned");
    for s in [&mut a1, &mut a2, &mut b1, &mut b2] {
        model.free_sequence(s).unwrap();
    }
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn forward_errors_change_nothing() {
    let tiny = Tiny::default();
    let (model, _, gpu) = load_tiny("errors", &tiny, 4);
    let mut a = model.new_sequence();
    let mut b = model.new_sequence();
    forward1(&model, &mut a, &PROMPT[..5]);
    let free = model.kv_pool().num_free();
    let bad_id = model
        .forward(&mut [&mut a, &mut b], &[&[1, 2], &[3, 96]])
        .unwrap_err();
    assert!(bad_id.to_string().contains("token id 96"), "{bad_id}");
    let err = model.forward(&mut [&mut a, &mut b], &[&[1]]).unwrap_err();
    assert!(
        matches!(err, Error::Model(ModelError::InvalidInput { .. })),
        "{err}"
    );
    let err = model
        .forward(&mut [&mut a], &[&vec![1u32; 65]])
        .unwrap_err();
    assert!(err.to_string().contains("split"), "{err}");
    // Exhaust the pool: 17 of its 24 blocks are taken by 5 + 120 + 120 rows, 4 more by 60.
    let mut others: Vec<KvSequence> = (0..3).map(|_| model.new_sequence()).collect();
    let long = vec![5u32; 60];
    for s in others.iter_mut().take(2) {
        for _ in 0..2 {
            model.forward(&mut [s], &[&long]).unwrap();
        }
    }
    let err = model
        .forward(&mut [&mut others[0]], &[&long[..9]])
        .unwrap_err();
    assert!(err.to_string().contains("max_seq_len 128"), "{err}");
    model.forward(&mut [&mut others[2]], &[&long]).unwrap();
    let err = model
        .forward(&mut [&mut others[2], &mut b], &[&long[..40], &long[..20]])
        .unwrap_err();
    assert!(err.to_string().contains("exhausted"), "{err}");
    assert_eq!((a.len(), b.len(), others[2].len()), (5, 0, 60));
    assert_eq!(model.kv_pool().num_free(), free - 20);
    // A sequence of another model is refused.
    let (other_model, _, _) = load_tiny("errors-other", &tiny, 4);
    let mut foreign = other_model.new_sequence();
    assert!(model.forward(&mut [&mut foreign], &[&[1]]).is_err());
    for s in others.iter_mut().chain([&mut a, &mut b]) {
        model.free_sequence(s).unwrap();
    }
    assert_eq!(model.kv_pool().num_free(), 24);
    let mut model = model;
    model.free().unwrap();
    assert_eq!(gpu.ledger().live_count(), 0);
    assert!(
        model.forward(&mut [&mut a], &[&[1]]).is_err(),
        "a freed model refuses to run"
    );
}

#[test]
fn gguf_with_permuted_qk_matches_the_safetensors_model() {
    let tiny = Tiny::default();
    let tensors = tiny.tensors(5);
    let dir = temp_dir("gguf");
    write_hf(&dir, &tiny, &tensors);
    let path = dir.join("tiny.gguf");
    write_tiny_gguf(&path, &tiny, &tensors, GgType::F16);
    let gpu = cpu();
    let hf = TargetModel::load(&dir, gpu.clone(), opts()).unwrap();
    let gg = TargetModel::load(&path, gpu.clone(), opts()).unwrap();
    assert_eq!(gg.config().num_key_value_heads, 2);
    assert!(!gg.config().tie_word_embeddings);
    assert_eq!(gg.config().eos_token_ids, vec![2]);
    let (mut a, mut b) = (hf.new_sequence(), gg.new_sequence());
    let x = forward1(&hf, &mut a, &PROMPT);
    let y = forward1(&gg, &mut b, &PROMPT);
    for (p, (u, v)) in x.iter().zip(&y).enumerate() {
        // BF16 values survive F16 storage exactly, so only summation order differs.
        assert!(
            max_abs_diff(u, v) < 0.05,
            "position {p}: {}",
            max_abs_diff(u, v)
        );
    }
    // Q8_0 storage: close to the reference, not equal.
    let q8 = dir.join("tiny-q8.gguf");
    write_tiny_gguf(&q8, &tiny, &tensors, GgType::Q8_0);
    let gq = TargetModel::load(&q8, gpu.clone(), opts()).unwrap();
    let mut c = gq.new_sequence();
    let z = forward1(&gq, &mut c, &PROMPT);
    let want = reference_logits(&tiny, &tensors, &PROMPT);
    let scale = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
    for (p, (u, w)) in z.iter().zip(&want).enumerate() {
        assert!(
            max_abs_diff(u, w) < 0.1 * scale,
            "q8 position {p}: {}",
            max_abs_diff(u, w)
        );
    }
    drop((hf, gg, gq));
    assert_eq!(gpu.ledger().live_count(), 0);
}
