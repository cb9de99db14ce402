//! The target model's layer capture on the CPU backend: the hidden after each named decoder
//! layer, for every row, side by side in the order named. Checked against the independent
//! f32 reference forward, against the model's own final hidden (the last layer's output),
//! across chunked forwards, and for refused ids; a forward that names no layer allocates
//! nothing for capture.

#[allow(unused_imports)] // the helpers re-export a GGUF writer this test does not use
mod model_util;

use half::bf16;
use model_util::*;
use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend, GpuBackendExt};
use specdraft::model::{KvSequence, LoadOptions, LogitRows, TargetModel};
use std::sync::Arc;

const PROMPT: [u32; 21] = [
    1, 5, 17, 33, 4, 90, 12, 12, 7, 64, 3, 22, 45, 8, 8, 61, 70, 2, 9, 95, 40,
];

fn tiny() -> Tiny {
    Tiny {
        layers: 3,
        ..Tiny::default()
    }
}

fn load(tag: &str, max_rows: usize) -> (TargetModel, Tensors, Arc<dyn GpuBackend>) {
    let t = tiny();
    let dir = temp_dir(&format!("model_capture_{tag}"));
    let tensors = t.tensors(8);
    write_hf(&dir, &t, &tensors);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let opts = LoadOptions {
        max_rows,
        max_seq_len: Some(128),
        kv_blocks: Some(16),
    };
    (
        TargetModel::load(&dir, gpu.clone(), opts).unwrap(),
        tensors,
        gpu,
    )
}

fn bits(gpu: &Arc<dyn GpuBackend>, p: DevicePtr, n: usize) -> Vec<u16> {
    let v: Vec<bf16> = gpu.download(p, n).unwrap();
    v.into_iter().map(bf16::to_bits).collect()
}

/// The capture of `layers` over `tokens` on a fresh sequence, in chunks of `chunk` rows:
/// one row of bits per token.
fn capture(model: &TargetModel, tokens: &[u32], layers: &[usize], chunk: usize) -> Vec<Vec<u16>> {
    let width = layers.len() * model.config().hidden_size;
    let mut seq = model.new_sequence();
    let mut rows = Vec::new();
    for c in tokens.chunks(chunk) {
        let out = model
            .forward_capturing(&mut [&mut seq], &[c], LogitRows::LastPerSequence, layers)
            .unwrap();
        let all = bits(model.gpu(), out.hidden_stack.unwrap(), out.rows * width);
        rows.extend(all.chunks(width).map(<[u16]>::to_vec));
    }
    model.free_sequence(&mut seq).unwrap();
    rows
}

fn tags(gpu: &Arc<dyn GpuBackend>) -> Vec<String> {
    gpu.ledger()
        .live_report()
        .into_iter()
        .map(|a| a.tag)
        .collect()
}

#[test]
fn each_named_layer_is_its_output_side_by_side_in_the_order_named() {
    let t = tiny();
    let (model, tensors, gpu) = load("layers", 64);
    let h = t.hidden;
    let (_, want) = reference_forward(&t, &tensors, &PROMPT);
    let got = capture(&model, &PROMPT, &[2, 0], 64);
    assert_eq!(got.len(), PROMPT.len());
    let scale = want
        .iter()
        .flatten()
        .flatten()
        .fold(0f32, |m, v| m.max(v.abs()));
    for (p, row) in got.iter().enumerate() {
        for (j, layer) in [2, 0].into_iter().enumerate() {
            let g: Vec<f32> = row[j * h..(j + 1) * h]
                .iter()
                .map(|&b| bf16::from_bits(b).to_f32())
                .collect();
            let d = max_abs_diff(&g, &want[p][layer]);
            assert!(
                d < 0.03 * scale,
                "position {p} layer {layer}: max diff {d} (scale {scale})"
            );
        }
    }
    // The last layer's output is the final hidden before the norm, bit for bit.
    let mut seq = model.new_sequence();
    let out = model
        .forward_with(&mut [&mut seq], &[&PROMPT], LogitRows::All)
        .unwrap();
    let hiddens = bits(&gpu, out.hiddens, PROMPT.len() * h);
    for (p, row) in got.iter().enumerate() {
        assert_eq!(row[..h], hiddens[p * h..(p + 1) * h], "position {p}");
    }
    model.free_sequence(&mut seq).unwrap();
    // The other order swaps the columns; a layer alone is its column.
    let swapped = capture(&model, &PROMPT, &[0, 2], 64);
    let middle = capture(&model, &PROMPT, &[1], 64);
    for p in 0..PROMPT.len() {
        assert_eq!(swapped[p][..h], got[p][h..], "position {p}");
        assert_eq!(swapped[p][h..], got[p][..h], "position {p}");
        let d = max_abs_diff(
            &middle[p]
                .iter()
                .map(|&b| bf16::from_bits(b).to_f32())
                .collect::<Vec<_>>(),
            &want[p][1],
        );
        assert!(d < 0.03 * scale, "position {p} layer 1: {d}");
    }
}

#[test]
fn chunked_forwards_capture_what_one_forward_does() {
    let (model, _, _) = load("chunks", 64);
    let whole = capture(&model, &PROMPT, &[1, 2, 0], 64);
    for chunk in [1, 5, 8] {
        assert_eq!(
            capture(&model, &PROMPT, &[1, 2, 0], chunk),
            whole,
            "chunks of {chunk}"
        );
    }
    // Two sequences in one forward: each sequence's rows are its own capture.
    let (a, b) = (&PROMPT[..9], &PROMPT[9..]);
    let (mut s1, mut s2) = (model.new_sequence(), model.new_sequence());
    let out = model
        .forward_capturing(&mut [&mut s1, &mut s2], &[a, b], LogitRows::All, &[1, 2, 0])
        .unwrap();
    let w = 3 * model.config().hidden_size;
    let both = bits(model.gpu(), out.hidden_stack.unwrap(), out.rows * w);
    let rows: Vec<Vec<u16>> = both.chunks(w).map(<[u16]>::to_vec).collect();
    assert_eq!(rows[..9], whole[..9]);
    assert_eq!(rows[9..], capture(&model, b, &[1, 2, 0], 64)[..]);
    model.free_sequence(&mut s1).unwrap();
    model.free_sequence(&mut s2).unwrap();
}

#[test]
fn bad_layer_ids_are_refused_before_anything_changes() {
    let (model, _, _) = load("bad", 64);
    let free = model.kv_pool().num_free();
    let mut seq: KvSequence = model.new_sequence();
    for (layers, says) in [
        (
            vec![3],
            "layer id 3 is out of range: the model has 3 decoder layers",
        ),
        (
            vec![0, 2, 0],
            "layer id 0 is named twice (the model has 3 decoder layers)",
        ),
    ] {
        let err = model
            .forward_capturing(&mut [&mut seq], &[&PROMPT], LogitRows::All, &layers)
            .unwrap_err();
        assert!(err.to_string().contains(says), "{err}");
        assert_eq!(seq.len(), 0);
        assert_eq!(model.kv_pool().num_free(), free);
    }
}

#[test]
fn a_forward_that_names_no_layer_allocates_nothing_for_capture() {
    let (model, _, gpu) = load("none", 64);
    let before = gpu.ledger().live_count();
    let mut seq = model.new_sequence();
    let out = model.forward(&mut [&mut seq], &[&PROMPT]).unwrap();
    assert_eq!(out.hidden_stack, None);
    assert_eq!(gpu.ledger().live_count(), before);
    assert!(
        !tags(&gpu).iter().any(|t| t.contains("stack")),
        "{:?}",
        tags(&gpu)
    );
    // The first forward that names layers allocates the buffer, once; more layers regrow it.
    model.trim(&mut seq, 0).unwrap();
    model
        .forward_capturing(&mut [&mut seq], &[&PROMPT], LogitRows::All, &[1])
        .unwrap();
    assert_eq!(gpu.ledger().live_count(), before + 1);
    model.trim(&mut seq, 0).unwrap();
    model
        .forward_capturing(&mut [&mut seq], &[&PROMPT], LogitRows::All, &[1, 0])
        .unwrap();
    assert_eq!(gpu.ledger().live_count(), before + 1);
    let n = tags(&gpu)
        .iter()
        .filter(|t| *t == "target_hidden_stack")
        .count();
    assert_eq!(n, 1);
    model.free_sequence(&mut seq).unwrap();
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0);
}
