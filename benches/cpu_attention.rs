//! The CPU paged attention alone, printed as JSON: the median time of one call for the
//! shapes a forward of the default model makes (9 query heads on 3 KV heads of 64, blocks of
//! 16): a decode row, verify steps of 5 and 9 rows, and prefill chunks, each with the
//! multiply-adds per second it reaches and its time over the first case's (the decode row).
//!
//! `cargo bench --bench cpu_attention [-- --threads N] [-- --case CONTEXTxROWS]`; `calls` is
//! how many calls each case timed (with `--threads 1`, `perf stat -e task-clock` over one
//! case divided by its calls gives a CPU time that the load of a shared machine barely moves).

use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt, Kernels, PagedAttentionArgs};
use std::time::Instant;

const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const BLOCK: usize = 16;

/// Median seconds of `paged_attention` for `rows` causal query rows of one sequence that
/// end at context `ctx`, and the number of calls timed.
fn time_call(b: &CpuBackend, ctx: usize, rows: usize) -> (f64, usize) {
    let blocks = ctx.div_ceil(BLOCK);
    let width = KV_HEADS * HEAD_DIM;
    let fill = |n: usize, seed: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed) % 1000) as f32 / 500.0) - 1.0)
            .collect()
    };
    // Blocks in reverse order, so that the table is not the identity.
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let lens: Vec<u32> = (ctx - rows + 1..=ctx).map(|l| l as u32).collect();
    let ptrs = [
        b.upload_bf16(&fill(rows * HEADS * HEAD_DIM, 1), "q")
            .unwrap(),
        b.upload_bf16(&fill(blocks * BLOCK * width, 2), "k")
            .unwrap(),
        b.upload_bf16(&fill(blocks * BLOCK * width, 3), "v")
            .unwrap(),
        b.upload(&table, "table").unwrap(),
        b.upload(&vec![0u32; rows], "seqs").unwrap(),
        b.upload(&lens, "lens").unwrap(),
        b.upload(&vec![0u16; rows * HEADS * HEAD_DIM], "out")
            .unwrap(),
    ];
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 5 || (start.elapsed().as_secs_f64() < 0.5 && times.len() < 200) {
        let t = Instant::now();
        b.paged_attention(PagedAttentionArgs {
            out: ptrs[6],
            q: ptrs[0],
            k_cache: ptrs[1],
            v_cache: ptrs[2],
            block_table: ptrs[3],
            row_seq: ptrs[4],
            row_ctx_len: ptrs[5],
            row_parent: None,
            rows,
            heads: HEADS,
            kv_heads: KV_HEADS,
            head_dim: HEAD_DIM,
            block_size: BLOCK,
            max_blocks_per_seq: blocks,
            scale: 0.125,
            stream: 0,
        })
        .expect("paged_attention");
        times.push(t.elapsed().as_secs_f64());
    }
    for p in ptrs {
        b.free(p).unwrap();
    }
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], times.len())
}

/// The value after `flag` on the command line.
fn option(flag: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`.
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("cpu_attention: skipped (run `cargo bench --bench cpu_attention`)");
        return;
    }
    let b = match option("--threads") {
        Some(n) => CpuBackend::with_threads(n.parse().expect("--threads N")),
        None => CpuBackend::new(),
    };
    let mut shapes = vec![
        (512, 1),
        (512, 5),
        (512, 9),
        (128, 128),
        (512, 128),
        (512, 512),
    ];
    if let Some(case) = option("--case") {
        let (ctx, rows) = case.split_once('x').expect("--case CONTEXTxROWS");
        shapes = vec![(ctx.parse().expect("context"), rows.parse().expect("rows"))];
    }
    let mut cases = Vec::new();
    for (ctx, rows) in shapes {
        let (s, calls) = time_call(&b, ctx, rows);
        // Scores and weighted values: two multiply-adds per (row, head, context row, element).
        let keys: usize = (ctx - rows + 1..=ctx).sum();
        let macs = 2.0 * (keys * HEADS * HEAD_DIM) as f64;
        cases.push((ctx, rows, s, macs, calls));
    }
    let one_row = cases[0].2;
    let rows: Vec<serde_json::Value> = cases
        .iter()
        .map(|&(ctx, rows, s, macs, calls)| {
            serde_json::json!({
                "context": ctx,
                "rows": rows,
                "ms": s * 1e3,
                "gmac_per_s": macs / s / 1e9,
                "cost_vs_first_case": s / one_row,
                "calls": calls,
            })
        })
        .collect();
    println!(
        "{}",
        serde_json::json!({
            "bench": "cpu_attention",
            "threads": b.kernel_pool().threads(),
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "cases": rows,
        })
    );
    assert_eq!(b.ledger().live_count(), 0);
}
