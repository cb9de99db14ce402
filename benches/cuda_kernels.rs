//! GPU kernel benchmark (feature `cuda`): times the hot kernels on device 0 and prints one
//! JSON object with the median time of each and the memory bandwidth it achieved (bytes
//! the kernel must move / time). Without a GPU it prints `{"skipped": "..."}` and exits 0.
//!
//! Run: `cargo bench --features cuda --bench cuda_kernels`. With `SPECDRAFT_BENCH_JSON=path`
//! the object is also written to that file.

use half::bf16;
use specdraft::backend::{
    ArgmaxArgs, BackendError, CudaBackend, DevicePtr, Dtype, GpuBackend, GpuBackendExt, Kernels,
    LinearArgs, LinearWeight, PagedAttentionArgs, RmsNormArgs, SoftmaxArgs, FP8_BLOCK,
};
use std::time::Instant;

const ITERS: usize = 50;

struct Bench<'a> {
    gpu: &'a CudaBackend,
    results: Vec<serde_json::Value>,
    owned: Vec<DevicePtr>,
}

impl Bench<'_> {
    fn buf(&mut self, dtype: Dtype, len: usize, fill: u8) -> Result<DevicePtr, BackendError> {
        let p = self.gpu.alloc_zeros(dtype, len, "bench")?;
        self.owned.push(p);
        self.gpu.memset(p, fill, dtype.size() * len, 0)?;
        Ok(p)
    }

    fn upload<T: bytemuck::Pod>(&mut self, v: &[T]) -> Result<DevicePtr, BackendError> {
        let p = self.gpu.upload(v, "bench")?;
        self.owned.push(p);
        Ok(p)
    }

    /// Median over `ITERS` timed runs (after warm-up) of `f`, each followed by a sync.
    fn time(
        &mut self,
        name: &str,
        bytes: usize,
        f: impl Fn(&CudaBackend) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        for _ in 0..5 {
            f(self.gpu)?;
        }
        self.gpu.synchronize(0)?;
        let mut samples = Vec::with_capacity(ITERS);
        for _ in 0..ITERS {
            let t = Instant::now();
            f(self.gpu)?;
            self.gpu.synchronize(0)?;
            samples.push(t.elapsed().as_secs_f64());
        }
        samples.sort_by(f64::total_cmp);
        let median = samples[ITERS / 2];
        self.results.push(serde_json::json!({
            "name": name,
            "median_us": (median * 1e7).round() / 10.0,
            "bytes": bytes,
            "gb_per_s": (bytes as f64 / median / 1e8).round() / 10.0,
        }));
        Ok(())
    }
}

fn run(gpu: &CudaBackend) -> Result<Vec<serde_json::Value>, BackendError> {
    let mut b = Bench {
        gpu,
        results: Vec::new(),
        owned: Vec::new(),
    };
    let (n, k) = (4096usize, 4096usize);
    let small: Vec<bf16> = (0..n * k)
        .map(|i| bf16::from_f32(((i % 17) as f32 - 8.0) / 64.0))
        .collect();
    let w = b.upload(&small)?;
    let x = b.upload(&small[..8 * k])?;
    let out = b.buf(Dtype::F32, 8 * n, 0)?;
    for rows in [1usize, 8] {
        let bytes = n * k * 2 + rows * (k * 2 + n * 2);
        b.time(&format!("linear_bf16 {rows}x{k} @ {n}x{k}"), bytes, |g| {
            g.linear(LinearArgs {
                out,
                out_dtype: Dtype::Bf16,
                x,
                weight: LinearWeight::Bf16 { weight: w },
                bias: None,
                rows,
                in_features: k,
                out_features: n,
                stream: 0,
            })
        })?;
    }
    let codes = b.buf(Dtype::U8, n * k / 2, 0x35)?;
    let scales = b.buf(Dtype::U8, n * k / 16, 0x38)?;
    b.time(
        &format!("linear_nvfp4 1x{k} @ {n}x{k}"),
        n * k / 2 + n * k / 16 + k * 2 + n * 2,
        |g| {
            g.linear(LinearArgs {
                out,
                out_dtype: Dtype::Bf16,
                x,
                weight: LinearWeight::Nvfp4 {
                    codes,
                    block_scales: scales,
                    global_scale: 0.01,
                },
                bias: None,
                rows: 1,
                in_features: k,
                out_features: n,
                stream: 0,
            })
        },
    )?;

    let fp8 = b.buf(Dtype::U8, n * k, 0x38)?;
    let fp8_scales = b.upload(&vec![
        0.01f32;
        n.div_ceil(FP8_BLOCK) * k.div_ceil(FP8_BLOCK)
    ])?;
    b.time(
        &format!("linear_fp8 1x{k} @ {n}x{k}"),
        n * k + k * 2 + n * 2,
        |g| {
            g.linear(LinearArgs {
                out,
                out_dtype: Dtype::Bf16,
                x,
                weight: LinearWeight::Fp8 {
                    weight: fp8,
                    block_scales: fp8_scales,
                },
                bias: None,
                rows: 1,
                in_features: k,
                out_features: n,
                stream: 0,
            })
        },
    )?;

    // Decode attention: 8 sequences of 4096 cached rows, 32 heads on 8 KV heads of 128.
    let (seqs, ctx, heads, kv_heads, dim, block) =
        (8usize, 4096usize, 32usize, 8usize, 128usize, 16usize);
    let blocks_per_seq = ctx / block;
    let cache_len = seqs * ctx * kv_heads * dim;
    let kc = b.buf(Dtype::Bf16, cache_len, 0x3c)?;
    let vc = b.buf(Dtype::Bf16, cache_len, 0x3c)?;
    let table: Vec<u32> = (0..(seqs * blocks_per_seq) as u32).collect();
    let table = b.upload(&table)?;
    let row_seq = b.upload(&(0..seqs as u32).collect::<Vec<_>>())?;
    let row_len = b.upload(&vec![ctx as u32; seqs])?;
    let q = b.buf(Dtype::Bf16, seqs * heads * dim, 0x3c)?;
    let o = b.buf(Dtype::Bf16, seqs * heads * dim, 0)?;
    b.time(
        &format!("paged_attention decode {seqs}x{ctx} ctx, {heads}/{kv_heads} heads of {dim}"),
        cache_len * 2 * 2,
        |g| {
            g.paged_attention(PagedAttentionArgs {
                out: o,
                q,
                k_cache: kc,
                v_cache: vc,
                block_table: table,
                row_seq,
                row_ctx_len: row_len,
                row_parent: None,
                rows: seqs,
                heads,
                kv_heads,
                head_dim: dim,
                block_size: block,
                max_blocks_per_seq: blocks_per_seq,
                scale: 0.088,
                stream: 0,
            })
        },
    )?;

    let vocab = 49152usize;
    let logits = b.buf(Dtype::F32, 8 * vocab, 0x3f)?;
    let probs = b.buf(Dtype::F32, 8 * vocab, 0)?;
    let ids = b.buf(Dtype::U32, 8, 0)?;
    b.time(&format!("argmax 8x{vocab}"), 8 * vocab * 4, |g| {
        g.argmax(ArgmaxArgs {
            out: ids,
            logits,
            bitmask: None,
            rows: 8,
            vocab,
            stream: 0,
        })
    })?;
    b.time(&format!("softmax 8x{vocab}"), 8 * vocab * 4 * 2, |g| {
        g.softmax(SoftmaxArgs {
            out: probs,
            logits,
            rows: 8,
            vocab,
            temperature: 1.0,
            stream: 0,
        })
    })?;
    let hidden = b.buf(Dtype::Bf16, 8 * k, 0x3c)?;
    let norm_w = b.buf(Dtype::Bf16, k, 0x3f)?;
    b.time(&format!("rms_norm 8x{k}"), 8 * k * 2 * 2 + k * 2, |g| {
        g.rms_norm(RmsNormArgs {
            out: hidden,
            x: hidden,
            weight: norm_w,
            rows: 8,
            dim: k,
            eps: 1e-6,
            stream: 0,
        })
    })?;

    for p in std::mem::take(&mut b.owned) {
        gpu.free(p)?;
    }
    Ok(b.results)
}

fn main() {
    let report = match CudaBackend::new(0) {
        Err(e) => serde_json::json!({ "skipped": e.to_string() }),
        Ok(gpu) => match run(&gpu) {
            Ok(results) => serde_json::json!({
                "device": gpu.device_name().unwrap_or_default(),
                "iterations": ITERS,
                "results": results,
                "leaked_allocations": gpu.ledger().live_count(),
            }),
            Err(e) => serde_json::json!({ "error": e.to_string() }),
        },
    };
    let text = serde_json::to_string_pretty(&report).unwrap_or_default();
    println!("{text}");
    if let Ok(path) = std::env::var("SPECDRAFT_BENCH_JSON") {
        if let Err(e) = std::fs::write(&path, &text) {
            eprintln!("cannot write {path}: {e}");
        }
    }
    if report.get("error").is_some() {
        std::process::exit(1);
    }
}
