//! Plain decode speed of the target model (no drafting), printed as JSON: tokens/s, the
//! weight bytes one token reads, the effective weight bandwidth, and the memory bandwidth of
//! this machine measured in the same run (a parallel read on the backend's own kernel pool,
//! and a memcpy) to compare it with; and the verify-cost table: the median time of a forward
//! of 1..16 rows of one sequence (rolled back after each), over the table's own one-row entry
//! (`cost_vs_one_row`) and over the decode loop's step (`cost_vs_decode_step`); and the
//! prompt processing rate of a 384-token prompt in chunks of 128 rows.
//!
//! The two ratios differ because the table interleaves its row counts: a forward's time
//! depends on how long ago the weights were last read, since on a shared machine the other
//! tenants of the last-level cache evict them meanwhile. Measured on a 2-core share of a
//! 480 MiB L3: a one-row forward takes 3.0-3.3 ms after another one-row forward, 4.1-4.5 ms
//! after a 16-row forward (and grows steadily with the rows of the one before), 4.7-4.8 ms
//! after 8 ms of scalar work on the calling thread, 3.2 ms after writing 8 MB and 4.8-5.2 ms
//! after reading 256 MB. So the table's one-row entry is dearer than a step of the decode
//! loop, and `cost_vs_decode_step` is what a verify costs against plain decoding's steps.
//!
//! `cargo bench --bench model_decode [-- PATH] [--cuda] [--isa=NAME]`; without a path it uses
//! `$SPECDRAFT_SMOLLM2_GGUF` or fetches the default model through `specdraft.models`.
//! `--isa=` (`portable`, `avx2`, `avx2-vnni`, `avx512-vnni`, `amx`) holds the CPU kernels to an
//! instruction set below the best this CPU runs, to measure what AVX-512, say, is worth in
//! the same sitting.

use specdraft::backend::quant::{Isa, KernelPool};
use specdraft::backend::{ArgmaxArgs, CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::model::{LoadOptions, LogitRows, TargetModel};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[path = "common/default_model.rs"]
mod default_model;
use default_model::model_path;

/// The backend: `--cuda` (feature `cuda`) for device 0, else the CPU (with `--isa`, held to
/// that instruction set).
fn backend() -> Arc<dyn GpuBackend> {
    if let Some(name) = std::env::args().find_map(|a| a.strip_prefix("--isa=").map(String::from)) {
        let Some(isa) = Isa::ALL.into_iter().find(|i| i.name() == name) else {
            let names: Vec<&str> = Isa::ALL.iter().map(|i| i.name()).collect();
            panic!("--isa= takes one of {names:?}, not {name:?}");
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let pool = KernelPool::with_options(threads, isa, KernelPool::DEFAULT_SPIN);
        eprintln!("model_decode: kernels on {}", pool.isa().name());
        return Arc::new(CpuBackend::with_kernel_pool(pool));
    }
    if std::env::args().any(|a| a == "--cuda") {
        #[cfg(feature = "cuda")]
        return Arc::new(specdraft::backend::CudaBackend::new(0).expect("CUDA device 0"));
        #[cfg(not(feature = "cuda"))]
        panic!("--cuda needs the bench built with `--features cuda`");
    }
    Arc::new(CpuBackend::new())
}

/// Host memory bandwidth on `pool` (the threads the CPU kernels run on), best of several
/// passes over buffers far larger than the caches: `(read GB/s, memcpy GB/s)`. A decode step
/// only reads weights, so the read figure is its bound.
fn host_gbps(pool: &KernelPool) -> (f64, f64) {
    let n = 256 << 20;
    let src = vec![1u64; n / 8];
    let mut dst = vec![0u64; n / 8];
    let chunks = 64;
    let per = src.len() / chunks;
    let sums: Vec<AtomicU64> = (0..chunks).map(|_| AtomicU64::new(0)).collect();
    let (mut read, mut copy) = (f64::MAX, f64::MAX);
    for _ in 0..5 {
        let t = Instant::now();
        pool.run(chunks, &|c| {
            let s: u64 = src[c * per..(c + 1) * per]
                .iter()
                .fold(0u64, |a, &x| a.wrapping_add(x));
            sums[c].store(s, Ordering::Relaxed);
        })
        .expect("read pass");
        read = read.min(t.elapsed().as_secs_f64());
        let d = SyncPtr(dst.as_mut_ptr());
        let t = Instant::now();
        pool.run(chunks, &|c| {
            let d = &d;
            // SAFETY: chunk `c` of `dst` is written by task `c` alone.
            let out = unsafe { std::slice::from_raw_parts_mut(d.0.add(c * per), per) };
            out.copy_from_slice(&src[c * per..(c + 1) * per]);
        })
        .expect("copy pass");
        copy = copy.min(t.elapsed().as_secs_f64());
    }
    let total: u64 = sums.iter().map(|s| s.load(Ordering::Relaxed)).sum();
    assert_eq!((total, dst[n / 8 - 1]), ((per * chunks) as u64, 1));
    // A copy reads and writes every byte.
    (n as f64 / read / 1e9, 2.0 * n as f64 / copy / 1e9)
}

struct SyncPtr(*mut u64);
// SAFETY: tasks write disjoint chunks through it while `host_gbps` holds the vector.
unsafe impl Sync for SyncPtr {}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Best device-to-device copy bandwidth of the backend (the bound for a device's decode).
fn device_copy_gbps(gpu: &dyn GpuBackend) -> f64 {
    let n = 256 << 20;
    let (a, b) = (
        gpu.alloc(n, "bench copy a").expect("alloc"),
        gpu.alloc(n, "bench copy b").expect("alloc"),
    );
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        gpu.copy_dtod(b, a, n, 0).expect("copy");
        gpu.synchronize(0).expect("sync");
        best = best.min(t.elapsed().as_secs_f64());
    }
    gpu.free(a).expect("free");
    gpu.free(b).expect("free");
    2.0 * n as f64 / best / 1e9
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`; the measurement needs
    // the real model and an optimised build, so it runs only under `cargo bench`.
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("model_decode: skipped (run `cargo bench --bench model_decode`)");
        return;
    }
    let path = model_path();
    let gpu = backend();
    let t = Instant::now();
    let model = TargetModel::load(
        &path,
        gpu.clone(),
        LoadOptions {
            max_rows: 128,
            max_seq_len: Some(512),
            kv_blocks: Some(64),
        },
    )
    .expect("model loads");
    let load_s = t.elapsed().as_secs_f64();
    let vocab = model.config().vocab_size;
    let prompt: Vec<u32> = vec![
        504, 3575, 282, 4649, 314, 7042, 28, 284, 260, 3575, 282, 7158, 314,
    ];
    let mut seq = model.new_sequence();
    let t = Instant::now();
    let out = model
        .forward_with(&mut [&mut seq], &[&prompt], LogitRows::LastPerSequence)
        .expect("prefill");
    let prefill_s = t.elapsed().as_secs_f64();
    let argmax_buf = gpu.alloc(4, "bench argmax").expect("alloc");
    let last = |out: &specdraft::model::ForwardOutput| -> u32 {
        gpu.argmax(ArgmaxArgs {
            out: argmax_buf,
            logits: out.logits.offset((out.logits_rows - 1) * vocab * 4),
            bitmask: None,
            rows: 1,
            vocab,
            stream: 0,
        })
        .expect("argmax");
        gpu.download::<u32>(argmax_buf, 1).expect("download")[0]
    };
    let mut tok = last(&out);
    let steps = 48;
    let warmup = 4;
    let mut generated = vec![tok];
    let mut t0 = Instant::now();
    for i in 0..steps + warmup {
        if i == warmup {
            t0 = Instant::now();
        }
        let out = model.forward(&mut [&mut seq], &[&[tok]]).expect("decode");
        tok = last(&out);
        generated.push(tok);
    }
    let per_token = t0.elapsed().as_secs_f64() / steps as f64;
    // Speculative verification: one forward of the last token and k-1 drafts (k rows),
    // rolled back after each; ideally it costs little more than a 1-row decode. Sizes are
    // interleaved in each round so that a change of machine load hits them all alike.
    let base_len = seq.len();
    let max_rows = 16;
    let rounds = 9;
    let drafts: Vec<u32> = generated[generated.len() - max_rows..].to_vec();
    let mut times = vec![Vec::new(); max_rows + 1];
    for _ in 0..rounds {
        for (k, t) in times.iter_mut().enumerate().skip(1) {
            let tv = Instant::now();
            model
                .forward(&mut [&mut seq], &[&drafts[..k]])
                .expect("verify");
            t.push(tv.elapsed().as_secs_f64());
            model.trim(&mut seq, base_len).expect("trim");
        }
    }
    let medians: Vec<f64> = times.iter_mut().skip(1).map(|t| median(t)).collect();
    let verify_table: Vec<serde_json::Value> = medians
        .iter()
        .enumerate()
        .map(|(i, m)| {
            serde_json::json!({
                "rows": i + 1,
                "ms": m * 1e3,
                "cost_vs_one_row": m / medians[0],
                "cost_vs_decode_step": m / per_token,
            })
        })
        .collect();
    // Batched decode: 8 sequences, one token each per forward, weights read once per step.
    let batch = 8;
    let mut seqs: Vec<_> = (0..batch).map(|_| model.new_sequence()).collect();
    {
        let mut refs: Vec<&mut _> = seqs.iter_mut().collect();
        let prompts: Vec<&[u32]> = (0..batch).map(|_| &prompt[..]).collect();
        model
            .forward_with(&mut refs, &prompts, LogitRows::LastPerSequence)
            .expect("batch prefill");
    }
    let batch_steps = 8;
    let tb = Instant::now();
    for step in 0..batch_steps {
        let toks: Vec<[u32; 1]> = (0..batch).map(|i| [(100 + i + step) as u32]).collect();
        let tok_refs: Vec<&[u32]> = toks.iter().map(|t| &t[..]).collect();
        let mut refs: Vec<&mut _> = seqs.iter_mut().collect();
        model.forward(&mut refs, &tok_refs).expect("batched decode");
    }
    let batch_tps = (batch * batch_steps) as f64 / tb.elapsed().as_secs_f64();
    for s in seqs.iter_mut() {
        model.free_sequence(s).expect("free sequence");
    }
    // Prompt processing: a 384-token prompt in forwards of at most `max_rows` (128) rows, the
    // fastest of three fresh sequences (the ids cycle through the decoded text: the content
    // does not change the work).
    let long: Vec<u32> = generated.iter().copied().cycle().take(384).collect();
    let mut prompt_s = f64::MAX;
    for _ in 0..3 {
        let mut s = model.new_sequence();
        let tp = Instant::now();
        for chunk in long.chunks(128) {
            model
                .forward_with(&mut [&mut s], &[chunk], LogitRows::LastPerSequence)
                .expect("long prefill");
        }
        prompt_s = prompt_s.min(tp.elapsed().as_secs_f64());
        model.free_sequence(&mut s).expect("free sequence");
    }
    let bytes = model.weight_bytes_per_token() as f64;
    // The CPU backend's kernels run on its pool, so its bound is that pool's host read.
    let cpu = gpu.as_any().downcast_ref::<CpuBackend>();
    let threads = cpu.map_or(0, |c| c.kernel_pool().threads());
    let (read, memcpy) = match cpu {
        Some(c) => host_gbps(c.kernel_pool()),
        None => (f64::NAN, device_copy_gbps(gpu.as_ref())),
    };
    let weight_gbps = bytes / per_token / 1e9;
    println!(
        "{}",
        serde_json::json!({
            "bench": "model_decode",
            "backend": gpu.name(),
            "model": path.display().to_string(),
            "threads": threads,
            "load_s": load_s,
            "prefill_tokens": prompt.len(),
            "prefill_s": prefill_s,
            "prompt_tokens": long.len(),
            "prompt_tokens_per_s": long.len() as f64 / prompt_s,
            "decode_tokens_per_s": 1.0 / per_token,
            "batch8_decode_tokens_per_s": batch_tps,
            "ms_per_token": per_token * 1e3,
            "one_row_step_ms": medians[0] * 1e3,
            "verify_cost": verify_table,
            "weight_bytes_per_token": bytes,
            "weight_gb_per_s": weight_gbps,
            "read_gb_per_s": read,
            "fraction_of_read": weight_gbps / read,
            "memcpy_gb_per_s": memcpy,
            "fraction_of_memcpy": weight_gbps / memcpy,
            "generated": generated,
        })
    );
    gpu.free(argmax_buf).expect("free");
    model.free_sequence(&mut seq).expect("free sequence");
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0);
}
