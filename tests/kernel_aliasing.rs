//! The aliasing contract of the kernel ops on the CPU reference: an output that shares
//! memory with an input is refused, with an error naming both, and nothing is written;
//! the in-place forms the ops document (RMSNorm, the element-wise ops and softmax writing
//! over an input) still run and give what the out-of-place form gives. The emulated CUDA
//! backend runs the same checks (`kernels_emulated`'s `bad_arguments_get_the_reference_errors`).

use specdraft::backend::{
    ArgmaxArgs, BackendError, CpuBackend, DevicePtr, ElementwiseArgs, ElementwiseOp, EmbeddingArgs,
    GpuBackend, GpuBackendExt, Kernels, KvWriteArgs, LinearArgs, LinearWeight, PagedAttentionArgs,
    PickArgs, RmsNormArgs, RopeArgs, RopeStyle, SoftmaxArgs, TopKArgs,
};

/// One buffer of `n` BF16 values `0.25 * (i % 7)`, so every byte is known.
fn bf16s(gpu: &CpuBackend, n: usize) -> DevicePtr {
    let v: Vec<f32> = (0..n).map(|i| 0.25 * (i % 7) as f32).collect();
    gpu.upload_bf16(&v, "test").unwrap()
}

/// Runs `call`, expects an invalid-argument error containing `needle`, and checks that the
/// `len` bytes at `watched` (the output) did not change.
fn refused(
    gpu: &CpuBackend,
    watched: DevicePtr,
    len: usize,
    needle: &str,
    call: impl FnOnce() -> Result<(), BackendError>,
) {
    let before: Vec<u8> = gpu.download(watched, len).unwrap();
    let err = call().expect_err(needle);
    assert!(
        matches!(err, BackendError::InvalidArgument { .. }),
        "{needle}: {err:?}"
    );
    assert!(err.to_string().contains(needle), "{needle:?} not in {err}");
    let after: Vec<u8> = gpu.download(watched, len).unwrap();
    assert_eq!(before, after, "{needle}: a refused op wrote its output");
}

fn free_all(gpu: &CpuBackend, ptrs: &[DevicePtr]) {
    for &p in ptrs {
        gpu.free(p).unwrap();
    }
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

#[test]
fn linear_output_must_not_overlap_any_input() {
    let gpu = CpuBackend::new();
    let (rows, inf, outf) = (2, 16, 4);
    let buf = bf16s(&gpu, 256);
    let (x, w, bias) = (
        bf16s(&gpu, rows * inf),
        bf16s(&gpu, outf * inf),
        bf16s(&gpu, outf),
    );
    let codes: Vec<u8> = (0..outf * inf / 2).map(|i| i as u8).collect();
    let (codes, scales) = (
        gpu.upload(&codes, "codes").unwrap(),
        gpu.upload(&[0x38u8; 4], "scales").unwrap(),
    );
    let args = |out, x, weight, bias| LinearArgs {
        out,
        out_dtype: specdraft::backend::Dtype::Bf16,
        x,
        weight: LinearWeight::Bf16 { weight },
        bias,
        rows,
        in_features: inf,
        out_features: outf,
        stream: 0,
    };
    // The output inside the input, the weight, and the bias, in turn.
    let out_bytes = rows * outf * 2;
    refused(&gpu, buf, out_bytes, "linear out overlaps linear x", || {
        gpu.linear(args(buf, buf.offset(8), w, None))
    });
    refused(
        &gpu,
        buf,
        out_bytes,
        "linear out overlaps linear weight",
        || gpu.linear(args(buf, x, buf.offset(4), None)),
    );
    refused(
        &gpu,
        buf,
        out_bytes,
        "linear out overlaps linear bias",
        || gpu.linear(args(buf, x, w, Some(buf.offset(2)))),
    );
    let nvfp4 = |out, block_scales| LinearArgs {
        weight: LinearWeight::Nvfp4 {
            codes,
            block_scales,
            global_scale: 1.0,
        },
        ..args(out, x, w, None)
    };
    refused(
        &gpu,
        codes,
        out_bytes,
        "linear out overlaps linear nvfp4 codes",
        || gpu.linear(nvfp4(codes, scales)),
    );
    // Apart, the same call runs.
    gpu.linear(args(buf, x, w, Some(bias))).unwrap();
    gpu.linear(nvfp4(buf, scales)).unwrap();
    free_all(&gpu, &[buf, x, w, bias, codes, scales]);
}

#[test]
fn documented_in_place_forms_run_and_match_the_out_of_place_ones() {
    let gpu = CpuBackend::new();
    let (rows, dim) = (3, 32);
    let n = rows * dim;
    // Each buffer has 8 spare values, so a shifted output still lies inside it.
    let (x, weight, other, out) = (
        bf16s(&gpu, n + 8),
        bf16s(&gpu, dim),
        bf16s(&gpu, n + 8),
        bf16s(&gpu, n + 8),
    );
    let norm = |out, x| RmsNormArgs {
        out,
        x,
        weight,
        rows,
        dim,
        eps: 1e-6,
        stream: 0,
    };
    gpu.rms_norm(norm(out, x)).unwrap();
    let want = gpu.download_bf16(out, n).unwrap();
    gpu.rms_norm(norm(x, x)).unwrap();
    assert_eq!(gpu.download_bf16(x, n).unwrap(), want, "rms_norm in place");
    refused(
        &gpu,
        x,
        2 * n,
        "rms_norm out partly overlaps rms_norm x",
        || gpu.rms_norm(norm(x.offset(2), x)),
    );
    refused(
        &gpu,
        x,
        2 * n,
        "rms_norm out overlaps rms_norm weight",
        || {
            gpu.rms_norm(RmsNormArgs {
                weight: x.offset(16),
                ..norm(x, x)
            })
        },
    );

    for op in [
        ElementwiseOp::Add,
        ElementwiseOp::SiluMul,
        ElementwiseOp::SigmoidMul,
    ] {
        let args = |out, a, b| ElementwiseArgs {
            op,
            out,
            a,
            b,
            n,
            stream: 0,
        };
        gpu.elementwise(args(out, x, other)).unwrap();
        let want = gpu.download_bf16(out, n).unwrap();
        let (a, b) = (bf16s(&gpu, n + 8), bf16s(&gpu, n + 8));
        gpu.copy_dtod(a, x, 2 * n, 0).unwrap();
        gpu.copy_dtod(b, other, 2 * n, 0).unwrap();
        gpu.elementwise(args(a, a, other)).unwrap();
        gpu.elementwise(args(b, x, b)).unwrap();
        assert_eq!(gpu.download_bf16(a, n).unwrap(), want, "{op:?} over a");
        assert_eq!(gpu.download_bf16(b, n).unwrap(), want, "{op:?} over b");
        let needle = format!("{} out partly overlaps", op.name());
        refused(&gpu, a, 2 * n, &needle, || {
            gpu.elementwise(args(a.offset(4), a, other))
        });
        refused(&gpu, b, 2 * n, &needle, || {
            gpu.elementwise(args(b.offset(2), x, b))
        });
        free_some(&gpu, &[a, b]);
    }

    let logits = gpu
        .upload(&[0.5f32, -1.0, 2.0, 0.0, 1.0, 3.0], "logits")
        .unwrap();
    let probs = gpu.alloc(24, "probs").unwrap();
    let softmax = |out, logits, vocab| SoftmaxArgs {
        out,
        logits,
        rows: 1,
        vocab,
        temperature: 0.5,
        stream: 0,
    };
    gpu.softmax(softmax(probs, logits, 6)).unwrap();
    let want: Vec<f32> = gpu.download(probs, 6).unwrap();
    gpu.softmax(softmax(logits, logits, 6)).unwrap();
    assert_eq!(
        gpu.download::<f32>(logits, 6).unwrap(),
        want,
        "softmax in place"
    );
    refused(
        &gpu,
        logits,
        24,
        "softmax out partly overlaps softmax logits",
        || gpu.softmax(softmax(logits.offset(4), logits, 5)),
    );
    free_all(&gpu, &[x, weight, other, out, logits, probs]);
}

/// Frees `ptrs` only (the caller's other buffers stay live).
fn free_some(gpu: &CpuBackend, ptrs: &[DevicePtr]) {
    for &p in ptrs {
        gpu.free(p).unwrap();
    }
}

#[test]
fn index_and_cache_ops_refuse_outputs_over_their_inputs() {
    let gpu = CpuBackend::new();
    let (hidden, vocab) = (8, 4);
    let table = bf16s(&gpu, vocab * hidden);
    let ids = gpu.upload(&[1u32, 3], "ids").unwrap();
    let buf = bf16s(&gpu, 64);
    refused(
        &gpu,
        table,
        2 * vocab * hidden,
        "embedding out overlaps embedding table",
        || {
            gpu.embedding(EmbeddingArgs {
                out: table.offset(16),
                table: LinearWeight::Bf16 { weight: table },
                ids,
                rows: 2,
                hidden,
                vocab,
                stream: 0,
            })
        },
    );

    let positions = gpu.upload(&[3u32, 5], "positions").unwrap();
    let freq = gpu.upload(&[1.0f32, 0.5, 0.25, 0.125], "freq").unwrap();
    refused(&gpu, positions, 8, "rope x overlaps rope positions", || {
        gpu.rope(RopeArgs {
            x: positions,
            positions,
            inv_freq: freq,
            rows: 2,
            heads: 1,
            head_dim: 2,
            rotary_dim: 2,
            style: RopeStyle::Half,
            stream: 0,
        })
    });

    // kv_write: 2 rows of width 8 into 4 slots per cache.
    let (k, v, slots) = (
        bf16s(&gpu, 16),
        bf16s(&gpu, 16),
        gpu.upload(&[0u32, 2], "slots").unwrap(),
    );
    let caches = bf16s(&gpu, 2 * 4 * 8);
    let kv = |k_cache, v_cache, k| KvWriteArgs {
        k_cache,
        v_cache,
        k,
        v,
        slots,
        rows: 2,
        kv_heads: 1,
        head_dim: 8,
        num_slots: 4,
        stream: 0,
    };
    refused(
        &gpu,
        caches,
        128,
        "kv_write k_cache overlaps kv_write v_cache",
        || gpu.kv_write(kv(caches, caches.offset(32), k)),
    );
    refused(
        &gpu,
        caches,
        128,
        "kv_write k_cache overlaps kv_write k",
        || gpu.kv_write(kv(caches, caches.offset(64), caches.offset(16))),
    );
    gpu.kv_write(kv(caches, caches.offset(64), k)).unwrap();

    // Attention writing over its own query.
    let (table_ptr, lens) = (
        gpu.upload(&[0u32], "block table").unwrap(),
        gpu.upload(&[2u32], "lens").unwrap(),
    );
    let seq = gpu.upload(&[0u32], "row_seq").unwrap();
    let q = bf16s(&gpu, 8);
    let attention = |out| PagedAttentionArgs {
        out,
        q,
        k_cache: caches,
        v_cache: caches.offset(64),
        block_table: table_ptr,
        row_seq: seq,
        row_ctx_len: lens,
        row_parent: None,
        rows: 1,
        heads: 1,
        kv_heads: 1,
        head_dim: 8,
        block_size: 4,
        max_blocks_per_seq: 1,
        scale: 0.5,
        stream: 0,
    };
    refused(
        &gpu,
        q,
        16,
        "paged_attention out overlaps paged_attention q",
        || gpu.paged_attention(attention(q)),
    );
    gpu.paged_attention(attention(buf)).unwrap();

    let logits = gpu.upload(&[0.5f32, 2.0, -1.0, 0.0], "logits").unwrap();
    refused(
        &gpu,
        logits,
        16,
        "argmax out overlaps argmax logits",
        || {
            gpu.argmax(ArgmaxArgs {
                out: logits.offset(4),
                logits,
                bitmask: None,
                rows: 1,
                vocab: 4,
                stream: 0,
            })
        },
    );
    free_all(
        &gpu,
        &[
            table, ids, buf, positions, freq, k, v, slots, caches, table_ptr, lens, seq, q, logits,
        ],
    );
}

#[test]
fn misaligned_pointers_are_refused_before_any_view_is_made() {
    let gpu = CpuBackend::new();
    let x = bf16s(&gpu, 16);
    let out = bf16s(&gpu, 16);
    refused(
        &gpu,
        out,
        32,
        "add a: the address is 1 bytes past a multiple of its 2-byte elements",
        || {
            gpu.elementwise(ElementwiseArgs {
                op: ElementwiseOp::Add,
                out,
                a: x.offset(1),
                b: x,
                n: 8,
                stream: 0,
            })
        },
    );
    free_all(&gpu, &[x, out]);
}

#[test]
fn pick_refuses_an_output_over_its_values_or_its_index() {
    let gpu = CpuBackend::new();
    let values = gpu
        .upload(&[0.5f32, -1.0, 2.0, 0.0, 1.0, 3.0], "values")
        .unwrap();
    let index = gpu.upload(&[2u32, 0], "index").unwrap();
    let out = gpu.alloc(8, "out").unwrap();
    let pick = |out| PickArgs {
        out,
        values,
        index,
        rows: 2,
        width: 3,
        stream: 0,
    };
    gpu.pick(pick(out)).unwrap();
    assert_eq!(gpu.download::<f32>(out, 2).unwrap(), [2.0, 0.0]);
    refused(&gpu, values, 24, "pick out overlaps pick values", || {
        gpu.pick(pick(values.offset(4)))
    });
    refused(&gpu, index, 8, "pick out overlaps pick index", || {
        gpu.pick(pick(index))
    });
    free_all(&gpu, &[values, index, out]);
}

#[test]
fn top_k_refuses_outputs_over_an_input_or_each_other_and_a_bad_k() {
    let gpu = CpuBackend::new();
    let logits = gpu
        .upload(&[0.5f32, -1.0, 2.0, 0.0, 1.0, 3.0], "logits")
        .unwrap();
    let mask = gpu.upload(&[0b101i32, 0b110], "mask").unwrap();
    let ids = gpu.alloc(16, "ids").unwrap();
    let probs = gpu.alloc(16, "probs").unwrap();
    let top = |ids, probs, k| TopKArgs {
        ids,
        probs,
        logits,
        bitmask: Some(mask),
        rows: 2,
        width: 3,
        k,
        stream: 0,
    };
    gpu.top_k(top(ids, probs, 2)).unwrap();
    // Row 0 allows ids 0 and 2, row 1 ids 1 and 2.
    assert_eq!(gpu.download::<u32>(ids, 4).unwrap(), [2, 0, 2, 1]);
    refused(&gpu, logits, 24, "top_k ids overlaps top_k logits", || {
        gpu.top_k(top(logits, probs, 2))
    });
    refused(&gpu, mask, 8, "top_k probs overlaps top_k bitmask", || {
        gpu.top_k(top(ids, mask, 1))
    });
    refused(&gpu, ids, 16, "top_k probs overlaps top_k ids", || {
        gpu.top_k(top(ids, ids.offset(4), 1))
    });
    for k in [0, 9] {
        refused(
            &gpu,
            ids,
            16,
            &format!("k is {k}; it must be 1 to 8"),
            || gpu.top_k(top(ids, probs, k)),
        );
    }
    free_all(&gpu, &[logits, mask, ids, probs]);
}
