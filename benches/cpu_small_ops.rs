//! Cost of the CPU backend's small per-layer ops (RMSNorm, add, SiLU-mul, RoPE) and of the
//! per-step picks over logits rows (`argmax` over the vocabulary, a greedy verify's picks;
//! `top_k` over a draft vocabulary, a tree round's children) on SmolLM2-135M's shapes,
//! printed as JSON: microseconds per call by rows, through the public
//! `Kernels` API (argument checks included), on a one-thread backend (the compute cost) and
//! on the default one (where a large call may be split over the pool).
//!
//! Each figure is the fastest of many short batches of calls: on a shared machine the
//! fastest batch is the one no other process interrupted.
//!
//! `cargo bench --bench cpu_small_ops`.

use serde_json::{json, Value};
use specdraft::backend::{
    ArgmaxArgs, CpuBackend, DevicePtr, ElementwiseArgs, ElementwiseOp, GpuBackend, GpuBackendExt,
    Kernels, RmsNormArgs, RopeArgs, RopeStyle, TopKArgs,
};
use std::time::Instant;

const HIDDEN: usize = 576;
const MLP: usize = 1536;
const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const ROWS: [usize; 5] = [1, 5, 9, 16, 128];
const VOCAB: usize = 49152;
/// The shipped heads' draft vocabulary, and the tree growth's children per node.
const DRAFT_VOCAB: usize = 8192;
const TREE_TOP_K: usize = 4;
/// Logits rows a step picks from: one sequence's verify rows up to batch 16 with 4 drafts.
const PICK_ROWS: [usize; 5] = [1, 5, 16, 40, 80];

/// Fastest per-call microseconds of `f` over batches of `per_batch` calls.
fn fastest(per_batch: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..200)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..per_batch {
                f();
            }
            t.elapsed().as_secs_f64() * 1e6 / per_batch as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn upload(b: &CpuBackend, n: usize, seed: usize) -> DevicePtr {
    let v: Vec<f32> = (0..n)
        .map(|i| ((i * 7919 + seed * 104_729) % 1000) as f32 / 250.0 - 2.0)
        .collect();
    b.upload_bf16(&v, "bench").expect("upload")
}

fn ops(b: &CpuBackend, rows: usize) -> Value {
    let per_batch = (2000 / rows).max(4);
    let x = upload(b, rows * MLP, 1);
    let y = upload(b, rows * MLP, 2);
    let out = upload(b, rows * MLP, 3);
    let w = upload(b, HIDDEN, 4);
    let pos: Vec<u32> = (0..rows as u32).map(|r| 100 + r).collect();
    let pos_ptr = b.upload(&pos, "bench positions").expect("upload");
    let freq: Vec<f32> = (0..HEAD_DIM / 2)
        .map(|i| 100_000f32.powf(-((2 * i) as f32) / HEAD_DIM as f32))
        .collect();
    let freq_ptr = b.upload(&freq, "bench freq").expect("upload");
    let norm = fastest(per_batch, || {
        b.rms_norm(RmsNormArgs {
            out,
            x,
            weight: w,
            rows,
            dim: HIDDEN,
            eps: 1e-5,
            stream: 0,
        })
        .expect("rms_norm")
    });
    let binary = |op, n| {
        fastest(per_batch, || {
            b.elementwise(ElementwiseArgs {
                op,
                out,
                a: x,
                b: y,
                n,
                stream: 0,
            })
            .expect("elementwise")
        })
    };
    let add = binary(ElementwiseOp::Add, rows * HIDDEN);
    let silu = binary(ElementwiseOp::SiluMul, rows * MLP);
    let rope = |heads| {
        fastest(per_batch, || {
            b.rope(RopeArgs {
                x: out,
                positions: pos_ptr,
                inv_freq: freq_ptr,
                rows,
                heads,
                head_dim: HEAD_DIM,
                rotary_dim: HEAD_DIM,
                style: RopeStyle::Interleaved,
                stream: 0,
            })
            .expect("rope")
        })
    };
    let (rope_q, rope_k) = (rope(HEADS), rope(KV_HEADS));
    for p in [x, y, out, w, pos_ptr, freq_ptr] {
        b.free(p).expect("free");
    }
    // One layer runs two norms, two adds, one SiLU-mul and RoPE on queries and keys.
    let layer = 2.0 * norm + 2.0 * add + silu + rope_q + rope_k;
    json!({
        "rows": rows, "rms_norm_us": norm, "add_us": add, "silu_mul_us": silu,
        "rope_q_us": rope_q, "rope_k_us": rope_k, "per_layer_us": layer,
    })
}

/// `argmax` over `rows` vocabulary rows and `top_k` over `rows` draft-vocabulary rows.
fn picks(b: &CpuBackend, rows: usize) -> Value {
    let per_batch = (400 / rows).max(4);
    let logits: Vec<f32> = (0..rows * VOCAB)
        .map(|i| ((i * 7919) % 100_003) as f32 / 5000.0 - 10.0)
        .collect();
    let logits = b.upload(&logits, "bench logits").expect("upload");
    let out = b.alloc(rows * 4, "bench picks").expect("alloc");
    let ids = b.alloc(rows * TREE_TOP_K * 4, "bench ids").expect("alloc");
    let probs = b
        .alloc(rows * TREE_TOP_K * 4, "bench probs")
        .expect("alloc");
    let argmax = fastest(per_batch, || {
        b.argmax(ArgmaxArgs {
            out,
            logits,
            bitmask: None,
            rows,
            vocab: VOCAB,
            stream: 0,
        })
        .expect("argmax")
    });
    let top_k = fastest(per_batch, || {
        b.top_k(TopKArgs {
            ids,
            probs,
            logits,
            bitmask: None,
            rows,
            width: DRAFT_VOCAB,
            k: TREE_TOP_K,
            stream: 0,
        })
        .expect("top_k")
    });
    for p in [logits, out, ids, probs] {
        b.free(p).expect("free");
    }
    json!({"rows": rows, "argmax_us": argmax, "top_k_us": top_k})
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`.
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("cpu_small_ops: skipped (run `cargo bench --bench cpu_small_ops`)");
        return;
    }
    let one = CpuBackend::with_threads(1);
    let all = CpuBackend::new();
    let table = |b: &CpuBackend| ROWS.iter().map(|&r| ops(b, r)).collect::<Vec<_>>();
    let pick_table = |b: &CpuBackend| PICK_ROWS.iter().map(|&r| picks(b, r)).collect::<Vec<_>>();
    println!(
        "{}",
        json!({
            "bench": "cpu_small_ops",
            "one_thread": table(&one),
            "default_threads": all.kernel_pool().threads(),
            "default": table(&all),
            "picks_one_thread": pick_table(&one),
            "picks_default": pick_table(&all),
        })
    );
    assert_eq!(one.ledger().live_count() + all.ledger().live_count(), 0);
}
