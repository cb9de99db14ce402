//! The CUDA kernels of `cuda/`, run on the CPU through the emulated device model, against
//! the CPU reference: every op, sizes that are not multiples of the block size, aliasing
//! where an op allows it, and the same errors for bad arguments. Two injected faults prove
//! that the comparison catches a missing barrier and a thread that never runs. Blocks run
//! shuffled and overlapping (the emulator's default), so a kernel whose blocks depend on
//! one another's order fails here too (`EmuBackend`'s own tests plant one).
//!
//! Tolerances are stated in `kernel_cases/mod.rs`.

#[path = "kernel_cases/mod.rs"]
mod kernel_cases;

use kernel_cases as k;
use specdraft::backend::{
    Dtype, EmuBackend, EmuFault, GpuBackend, GpuBackendExt, PagedAttentionArgs, RopeStyle,
};

fn check(dut: &EmuBackend, result: Result<(), String>) {
    if let Err(e) = result {
        panic!("{e}");
    }
    assert_eq!(
        dut.ledger().live_count(),
        0,
        "leaked: {:?}",
        dut.ledger().live_report()
    );
}

#[test]
fn embedding_matches_reference() {
    let dut = EmuBackend::new();
    for (rows, hidden, vocab) in [(1, 1, 5), (3, 33, 100), (7, 577, 50)] {
        check(&dut, k::embedding(&dut, rows, hidden, vocab, 11));
    }
}

#[test]
fn rms_norm_matches_reference() {
    let dut = EmuBackend::new();
    for (rows, dim) in [(1, 1), (3, 33), (7, 577), (2, 256)] {
        check(&dut, k::rms_norm(&dut, rows, dim, 21, false));
    }
    check(&dut, k::rms_norm(&dut, 3, 577, 22, true));
}

#[test]
fn add_silu_mul_and_sigmoid_mul_match_reference() {
    let dut = EmuBackend::new();
    for n in [1, 33, 577, 1000] {
        check(&dut, k::add_silu(&dut, n, 31));
    }
}

#[test]
fn linear_matches_reference() {
    let dut = EmuBackend::new();
    // in_features 64 takes the 16-byte vector path, 33 and 577 the scalar one; out_features
    // not a multiple of the 8 features of a block; rows across the 4-row tiles.
    for (rows, inf, outf) in [(1, 64, 9), (3, 33, 17), (7, 577, 5), (5, 128, 8)] {
        check(
            &dut,
            k::linear(&dut, rows, inf, outf, Dtype::Bf16, false, 41),
        );
        check(&dut, k::linear(&dut, rows, inf, outf, Dtype::F32, true, 42));
    }
}

#[test]
fn linear_nvfp4_matches_reference() {
    let dut = EmuBackend::new();
    for (rows, inf, outf) in [(1, 16, 3), (3, 48, 9), (7, 576, 5)] {
        check(
            &dut,
            k::linear_nvfp4(&dut, rows, inf, outf, Dtype::Bf16, false, 51),
        );
        check(
            &dut,
            k::linear_nvfp4(&dut, rows, inf, outf, Dtype::F32, true, 52),
        );
    }
}

#[test]
fn linear_fp8_matches_reference() {
    let dut = EmuBackend::new();
    // Sizes that cross the 128 x 128 scale blocks in both directions, and ones inside one.
    for (rows, inf, outf) in [(1, 7, 3), (3, 130, 9), (7, 300, 131), (5, 256, 8)] {
        check(
            &dut,
            k::linear_fp8(&dut, rows, inf, outf, Dtype::Bf16, false, 55),
        );
        check(
            &dut,
            k::linear_fp8(&dut, rows, inf, outf, Dtype::F32, true, 56),
        );
    }
}

#[test]
fn rope_matches_reference() {
    let dut = EmuBackend::new();
    for style in [RopeStyle::Half, RopeStyle::Interleaved] {
        check(&dut, k::rope(&dut, 1, 1, 2, 2, style, 61));
        check(&dut, k::rope(&dut, 3, 9, 64, 64, style, 62));
        check(&dut, k::rope(&dut, 7, 3, 80, 32, style, 63));
    }
}

#[test]
fn kv_write_matches_reference() {
    let dut = EmuBackend::new();
    for (rows, kv_heads, head_dim, slots) in [(1, 1, 1, 4), (3, 3, 64, 40), (7, 2, 33, 7)] {
        check(&dut, k::kv_write(&dut, rows, kv_heads, head_dim, slots, 71));
    }
}

#[test]
fn kv_copy_matches_reference() {
    let dut = EmuBackend::new();
    // First children all the way (each copy writes the row the one before read), a path
    // that skips siblings, an empty path, and rows wider than the block's threads.
    for (kv_heads, head_dim, block_size, prefix, path) in [
        (1, 4, 4, 2, &[1, 2, 3, 4][..]),
        (3, 64, 16, 13, &[1, 4, 5, 9][..]),
        (2, 33, 8, 0, &[][..]),
        (5, 64, 16, 30, &[2, 3, 40][..]),
    ] {
        check(
            &dut,
            k::kv_copy(&dut, kv_heads, head_dim, block_size, prefix, path, 73),
        );
    }
}

#[test]
fn paged_attention_matches_reference() {
    let dut = EmuBackend::new();
    // Decode (one query per sequence) and prefill-like causal rows; 9 heads on 3 KV heads;
    // contexts that cross block boundaries, shorter than one warp's share, and empty.
    check(
        &dut,
        k::paged_attention(&dut, &[1, 17, 40], 1, 9, 3, 64, 16, 81),
    );
    check(&dut, k::paged_attention(&dut, &[5, 33], 5, 4, 2, 33, 8, 82));
    check(&dut, k::paged_attention(&dut, &[70], 3, 2, 1, 128, 16, 83));
    check(&dut, k::paged_attention(&dut, &[3], 1, 1, 1, 256, 1, 84));
}

#[test]
fn mla_attention_matches_reference() {
    let dut = EmuBackend::new();
    // Odd sizes across block boundaries, and DeepSeek-V3's latent sizes.
    check(
        &dut,
        k::mla_attention(&dut, &[1, 17, 40], 3, (3, 10, 6, 4, 5, 4), 91),
    );
    check(
        &dut,
        k::mla_attention(&dut, &[33], 2, (2, 512, 128, 64, 128, 16), 92),
    );
}

#[test]
fn paged_attention_under_a_tree_mask_matches_reference() {
    let dut = EmuBackend::new();
    check(&dut, k::paged_attention_tree(&dut, 85));
}

/// A block drafter's rows (DFlash): every row of a block attends to the whole context and
/// the whole block, so a row's context length runs past its own position. Blocks of 8 rows
/// after 37 context rows, 4 with no context, 16 after 130 (GQA 3:1, SmolLM2's 64-wide
/// heads), against the CPU reference (which `cpu_attention.rs` holds to an f64 attention).
fn non_causal_blocks(dut: &dyn GpuBackend, seed: u64) -> Result<(), String> {
    let (heads, kv_heads, head_dim, block_size) = (9, 3, 64, 16);
    let blocks = [(37usize, 8usize), (0, 4), (130, 16)];
    let max_blocks = blocks
        .iter()
        .map(|&(c, g)| (c + g).div_ceil(block_size))
        .max()
        .unwrap_or(1);
    let num_blocks = blocks.len() * max_blocks + 2;
    // Each sequence's blocks in reverse order, so the table is not the identity.
    let table: Vec<u32> = (0..blocks.len() * max_blocks)
        .map(|i| (num_blocks - 1 - i) as u32)
        .collect();
    let (mut row_seq, mut row_len) = (Vec::new(), Vec::new());
    for (s, &(c, g)) in blocks.iter().enumerate() {
        row_seq.extend(std::iter::repeat_n(s as u32, g));
        row_len.extend(std::iter::repeat_n((c + g) as u32, g));
    }
    let rows = row_seq.len();
    let width = kv_heads * head_dim;
    let q = k::uniform(seed, rows * heads * head_dim, -1.0, 1.0);
    let kc = k::uniform(seed + 1, num_blocks * block_size * width, -2.0, 2.0);
    let vc = k::uniform(seed + 2, num_blocks * block_size * width, -1.0, 1.0);
    let (got, want) = k::both(dut, |b| {
        let s = k::Scope::new(b);
        let o = s.out(Dtype::Bf16, rows * heads * head_dim)?;
        b.paged_attention(PagedAttentionArgs {
            out: o,
            q: s.bf16(&q)?,
            k_cache: s.bf16(&kc)?,
            v_cache: s.bf16(&vc)?,
            block_table: s.u32(&table)?,
            row_seq: s.u32(&row_seq)?,
            row_ctx_len: s.u32(&row_len)?,
            row_parent: None,
            rows,
            heads,
            kv_heads,
            head_dim,
            block_size,
            max_blocks_per_seq: max_blocks,
            scale: 1.0 / (head_dim as f32).sqrt(),
            stream: 0,
        })?;
        b.download_bf16(o, rows * heads * head_dim)
    })?;
    k::close(
        "non-causal paged_attention",
        &got,
        &want,
        k::BF16_RTOL,
        2e-3,
    )
}

#[test]
fn paged_attention_of_non_causal_blocks_matches_reference() {
    let dut = EmuBackend::new();
    check(&dut, non_causal_blocks(&dut, 85));
}

#[test]
fn argmax_matches_reference() {
    let dut = EmuBackend::new();
    for (rows, vocab) in [(1, 1), (3, 100), (2, 49152), (7, 33)] {
        check(&dut, k::argmax(&dut, rows, vocab, false, 91));
        check(&dut, k::argmax(&dut, rows, vocab, true, 92));
    }
}

#[test]
fn top_k_matches_reference() {
    let dut = EmuBackend::new();
    // One id; fewer ids than k; rows narrower than a block; the draft and target widths.
    for (rows, width, k) in [
        (1, 1, 4),
        (6, 3, 4),
        (6, 100, 1),
        (6, 8192, 4),
        (2, 49152, 8),
    ] {
        check(&dut, k::top_k(&dut, rows, width, k, false, 131));
        check(&dut, k::top_k(&dut, rows, width, k, true, 132));
    }
}

#[test]
fn pick_matches_reference() {
    let dut = EmuBackend::new();
    // One row; more rows than a block's threads; rows of one value; a wide row.
    for (rows, width) in [(1, 1), (300, 7), (9, 1), (4, 49152)] {
        check(&dut, k::pick(&dut, rows, width, 121));
    }
}

#[test]
fn softmax_matches_reference() {
    let dut = EmuBackend::new();
    for (rows, vocab) in [(1, 1), (3, 100), (2, 577)] {
        check(&dut, k::softmax(&dut, rows, vocab, 0.7, false, 101));
    }
    check(&dut, k::softmax(&dut, 3, 49152, 1.0, true, 102));
}

#[test]
fn copy_rows_matches_reference() {
    let dut = EmuBackend::new();
    // One row and one element; rows wider than a block's threads; a source wider than what
    // is copied; a destination with columns no part writes.
    for (rows, width, src_stride, parts, pad) in [
        (1, 1, 1, 1, 0),
        (3, 577, 577, 3, 0),
        (7, 33, 40, 2, 5),
        (2, 256, 256, 4, 1),
    ] {
        check(
            &dut,
            k::copy_rows(&dut, rows, width, src_stride, parts, pad, 111),
        );
    }
}

#[test]
fn bad_arguments_get_the_reference_errors() {
    let dut = EmuBackend::new();
    check(&dut, k::same_errors(&dut));
}

#[test]
fn a_missing_barrier_is_caught() {
    let dut = EmuBackend::with_fault(EmuFault::NoBarriers);
    // Each of these reduces across threads through shared memory or warp shuffles.
    let results = [
        k::rms_norm(&dut, 3, 577, 21, false),
        k::softmax(&dut, 2, 577, 1.0, false, 101),
        k::argmax(&dut, 3, 1000, false, 91),
        k::top_k(&dut, 6, 1000, 4, false, 131),
        k::paged_attention(&dut, &[1, 17, 40], 1, 9, 3, 64, 16, 81),
        k::paged_attention(&dut, &[5, 33], 5, 4, 2, 33, 8, 82),
    ];
    for r in results {
        assert!(
            r.is_err(),
            "the comparison missed a kernel run without barriers"
        );
    }
    assert_eq!(dut.ledger().live_count(), 0);
}

#[test]
fn a_thread_that_never_runs_is_caught() {
    let dut = EmuBackend::with_fault(EmuFault::DropLastThread);
    // Element-wise: element 255 of each 256 is never written and stays poisoned.
    assert!(k::add_silu(&dut, 577, 31).is_err());
    // One thread a row: row 255 of 300 is never picked.
    assert!(k::pick(&dut, 300, 7, 121).is_err());
    // A row's reduction: the last thread's ids are never offered.
    assert!(k::top_k(&dut, 6, 8192, 4, false, 131).is_err());
    // Row kernels: the last thread's columns are never written.
    assert!(k::embedding(&dut, 3, 577, 50, 11).is_err());
    assert!(k::copy_rows(&dut, 3, 577, 577, 2, 0, 111).is_err());
    // A warp shuffle that reads the absent lane is an error of the launch itself.
    let err = k::rms_norm(&dut, 3, 33, 21, false).unwrap_err();
    assert!(err.contains("absent or has returned"), "{err}");
    // Attention sums q.k across a warp: the last warp's shuffle reads the absent lane.
    let err = k::paged_attention(&dut, &[1, 17, 40], 1, 9, 3, 64, 16, 81).unwrap_err();
    assert!(err.contains("absent or has returned"), "{err}");
    assert_eq!(dut.ledger().live_count(), 0);
}
