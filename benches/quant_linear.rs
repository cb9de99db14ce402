//! Speed of the quantized linear (`specdraft::backend::quant`), printed as JSON.
//!
//! For each weight format on SmolLM2-135M's shapes (576x576, 192x576, 1536x576, 576x1536;
//! K-quants need in-features a multiple of 256, so only 576x1536; plus the 49152x576 Q8_0
//! LM head): median time per call and weight GB/s at 1, 2, 5, 9, 16 and 128 rows, the cost
//! of k rows relative to one, and GFLOP/s. Weights rotate through copies larger than the
//! last-level cache, so every call streams its weights from memory as a real forward does
//! (`"hot"` repeats one copy, cache-resident). `smollm2_step` runs all 211 linears of one
//! SmolLM2 forward (30 layers of Q4_1 + the Q8_0 head) per step. Memory bandwidth (parallel
//! read and parallel memcpy), and the pool's fork/join cost against rayon's, are measured
//! in the same run.
//!
//! On a shared machine wall time varies with the other load, so each case also reports the
//! calling thread's CPU time per call on a one-thread pool (`cpu_us`, Linux), which other
//! processes do not inflate, with hot weights: the compute cost alone.
//!
//! `cargo bench --bench quant_linear [-- FILTER...] [--quick]`: FILTERs keep the formats
//! whose name contains one of them. `-- --kernel` prints only the single-thread compute cost
//! per call (fastest of many batches) by rows, the figure a kernel change moves; `-- --step`
//! only the `smollm2_step` table. Both run once per SIMD instruction set this CPU runs, or only
//! on the one `--isa=NAME` names (`avx2`, `avx2-vnni`, `avx512-vnni`, `amx`).

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use specdraft::backend::quant::{linear, BlockFormat, Isa, KernelPool, PackedWeight};
use std::hint::black_box;
use std::time::{Duration, Instant};

const ROWS: [usize; 6] = [1, 2, 5, 9, 16, 128];
/// Rotate through at least this many weight bytes (twice a 32 MiB last-level cache).
const STREAM_BYTES: usize = 64 << 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median seconds of `f()` over repeats filling about `budget` (at least 7 samples).
fn time(budget: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut samples = Vec::new();
    while samples.len() < 7 || (start.elapsed() < budget && samples.len() < 5000) {
        let t = Instant::now();
        f();
        samples.push(t.elapsed().as_secs_f64());
    }
    median(samples)
}

/// CPU time of the calling thread, seconds (Linux; `None` elsewhere).
fn thread_cpu_seconds() -> Option<f64> {
    #[cfg(target_os = "linux")]
    {
        #[repr(C)]
        struct Timespec {
            sec: i64,
            nsec: i64,
        }
        extern "C" {
            fn clock_gettime(clock: i32, t: *mut Timespec) -> i32;
        }
        const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
        let mut t = Timespec { sec: 0, nsec: 0 };
        // SAFETY: a valid clock id and a valid out-pointer.
        if unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut t) } == 0 {
            return Some(t.sec as f64 + t.nsec as f64 * 1e-9);
        }
    }
    None
}

/// Median CPU seconds per call of `f()` on this thread (batches of calls, so the clock's
/// granularity does not matter).
fn cpu_time(budget: Duration, f: impl FnMut()) -> Option<f64> {
    cpu_samples(budget, f).map(median)
}

/// CPU seconds per call of `f()` on this thread, one sample per batch of ten calls.
fn cpu_samples(budget: Duration, mut f: impl FnMut()) -> Option<Vec<f64>> {
    f();
    let start = Instant::now();
    let mut samples = Vec::new();
    while samples.len() < 7 || (start.elapsed() < budget && samples.len() < 200) {
        let t0 = thread_cpu_seconds()?;
        for _ in 0..10 {
            f();
        }
        samples.push((thread_cpu_seconds()? - t0) / 10.0);
    }
    Some(samples)
}

/// `--kernel`: the compute cost of rows alone. One thread, weights in cache, the *fastest*
/// batch of calls (a shared machine only ever adds time), for SmolLM2's Q4_1 shapes, its down
/// projection as Q4_K and as Q6_K (the K-quants a Q4_K_M file mixes), and its Q8_0 head, at
/// 1..16 rows and a 128-row prefill chunk: microseconds per call, the cost relative to one
/// row, and GMAC/s; once per SIMD instruction set this CPU runs (AVX2, AVX-VNNI,
/// AVX-512 VNNI where it has them), so the dots are compared in one run.
fn kernel_costs(rng: &mut SmallRng, budget: Duration, isas: &[Isa]) -> Value {
    let mut out = Vec::new();
    for &isa in isas {
        let single = KernelPool::with_options(1, isa, KernelPool::DEFAULT_SPIN);
        match kernel_costs_on(&single, rng, budget) {
            Value::Null => return Value::Null,
            formats => out.push(json!({"isa": isa.name(), "formats": formats})),
        }
    }
    Value::Array(out)
}

/// [`kernel_costs`] on one single-thread pool.
fn kernel_costs_on(single: &KernelPool, rng: &mut SmallRng, budget: Duration) -> Value {
    let cases = [
        (BlockFormat::Q4_1, 576, 576),
        (BlockFormat::Q4_1, 1536, 576),
        (BlockFormat::Q4_1, 576, 1536),
        (BlockFormat::Q4_K, 576, 1536),
        (BlockFormat::Q6_K, 576, 1536),
        (BlockFormat::Q8_0, 4096, 576),
    ];
    let mut out = Vec::new();
    for (format, outf, inf) in cases {
        let w = random_weight(rng, format, outf, inf);
        let copies = vec![w.clone(); STREAM_BYTES.div_ceil(w.bytes().len())];
        let x: Vec<f32> = (0..128 * inf)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let mut y = vec![0f32; 128 * outf];
        let mut one = 0.0;
        let mut rows_json = Vec::new();
        let fastest = |v: Vec<f64>| v.into_iter().fold(f64::MAX, f64::min);
        for rows in [1, 2, 3, 4, 5, 8, 9, 12, 16, 128] {
            let Some(samples) = cpu_samples(budget, || {
                linear(
                    single,
                    &w,
                    &x[..rows * inf],
                    rows,
                    None,
                    &mut y[..rows * outf],
                )
                .unwrap()
            }) else {
                return Value::Null;
            };
            let best = fastest(samples);
            // The same on one thread with the weights streamed from memory: how much of the
            // memory time the compute hides.
            let mut i = 0;
            let streamed = cpu_samples(budget, || {
                i = (i + 1) % copies.len();
                let (x, y) = (&x[..rows * inf], &mut y[..rows * outf]);
                linear(single, &copies[i], x, rows, None, y).unwrap()
            })
            .map(fastest);
            if rows == 1 {
                one = best;
            }
            rows_json.push(json!({
                "rows": rows, "cpu_us_min": best * 1e6, "cost_vs_1_row": best / one,
                "gmacs": (rows * outf * inf) as f64 / best / 1e9,
                "streamed_cpu_us_min": streamed.map(|s| s * 1e6),
            }));
        }
        out.push(json!({
            "format": format.name(), "out_features": outf, "in_features": inf, "rows": rows_json,
        }));
    }
    Value::Array(out)
}

/// Random blocks with f16 scales of magnitude 2^-8..2^-4 (the test-weight recipe).
fn random_weight(rng: &mut SmallRng, format: BlockFormat, outf: usize, inf: usize) -> PackedWeight {
    let mut bytes = vec![0u8; format.matrix_bytes(outf, inf).unwrap()];
    rng.fill(&mut bytes[..]);
    let d_fields: &[usize] = match format {
        BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0 => &[0],
        BlockFormat::Q4_1 | BlockFormat::Q5_1 | BlockFormat::Q4_K | BlockFormat::Q5_K => &[0, 2],
        BlockFormat::Q2_K => &[80, 82],
        BlockFormat::Q3_K => &[108],
        BlockFormat::Q6_K => &[208],
        _ => &[],
    };
    if format.is_quantized() {
        for block in bytes.chunks_exact_mut(format.block_bytes()) {
            for &at in d_fields {
                let v = half::f16::from_f32(rng.random_range(0.004..0.06));
                block[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
    } else {
        let values: Vec<f32> = (0..outf * inf)
            .map(|_| rng.random_range(-0.1..0.1))
            .collect();
        return PackedWeight::from_f32(format, outf, inf, &values).unwrap();
    }
    PackedWeight::new(format, outf, inf, &bytes).unwrap()
}

/// Parallel read and memcpy bandwidth (GB/s; a copy counts its reads and writes), median of 7.
fn bandwidth(pool: &KernelPool) -> (f64, f64) {
    let n = 256 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let chunk = 1 << 20;
    let read = time(Duration::ZERO, || {
        let sums: Vec<std::sync::atomic::AtomicU64> =
            (0..n / chunk).map(|_| Default::default()).collect();
        pool.run(n / chunk, &|t| {
            let s: u64 = src[t * chunk..(t + 1) * chunk]
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .fold(0, u64::wrapping_add);
            sums[t].store(s, std::sync::atomic::Ordering::Relaxed);
        })
        .unwrap();
        black_box(&sums);
    });
    let dst_ptr = dst.as_mut_ptr() as usize;
    let copy = time(Duration::ZERO, || {
        pool.run(n / chunk, &|t| {
            // SAFETY: each task writes its own chunk of `dst`, which outlives the call.
            let d = unsafe {
                std::slice::from_raw_parts_mut((dst_ptr as *mut u8).add(t * chunk), chunk)
            };
            d.copy_from_slice(&src[t * chunk..(t + 1) * chunk]);
        })
        .unwrap();
    });
    black_box(&dst);
    (n as f64 / read / 1e9, 2.0 * n as f64 / copy / 1e9)
}

/// Fork/join round trips: the pool against rayon, microseconds (median).
fn fork_join(pool: &KernelPool) -> Value {
    let b = Duration::from_millis(300);
    let work = |us: f64| {
        let t = Instant::now();
        while t.elapsed().as_secs_f64() * 1e6 < us {
            std::hint::spin_loop();
        }
    };
    let threads = pool.threads();
    let mut out = json!({});
    for grain_us in [0.0, 10.0, 30.0] {
        let serial = time(b, || (0..threads).for_each(|_| work(grain_us))) * 1e6;
        let ours = time(b, || pool.run(threads, &|_| work(grain_us)).unwrap()) * 1e6;
        let rayon = time(b, || {
            use rayon::prelude::*;
            (0..threads).into_par_iter().for_each(|_| work(grain_us))
        }) * 1e6;
        out[format!("{grain_us}us_per_thread")] = json!({
            "serial_us": serial, "pool_us": ours, "rayon_us": rayon,
            "pool_overhead_us": ours - grain_us, "rayon_overhead_us": rayon - grain_us,
        });
    }
    out
}

struct Case {
    format: BlockFormat,
    outf: usize,
    inf: usize,
}

fn shapes(format: BlockFormat) -> Vec<(usize, usize)> {
    let mut s = if format.is_k_quant() {
        vec![(576, 1536)]
    } else {
        vec![(576, 576), (192, 576), (1536, 576), (576, 1536)]
    };
    if format == BlockFormat::Q8_0 {
        s.push((49152, 576));
    }
    s
}

fn bench_case(
    pool: &KernelPool,
    single: &KernelPool,
    rng: &mut SmallRng,
    c: &Case,
    budget: Duration,
) -> Value {
    let w = random_weight(rng, c.format, c.outf, c.inf);
    let bytes = w.bytes().len();
    let copies: Vec<PackedWeight> = (0..STREAM_BYTES.div_ceil(bytes).max(1))
        .map(|_| w.clone())
        .collect();
    let x: Vec<f32> = (0..128 * c.inf)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let mut out = vec![0f32; 128 * c.outf];
    let mut rows_json = Vec::new();
    let mut one = 0.0;
    for rows in ROWS {
        let mut i = 0;
        let secs = time(budget, || {
            i = (i + 1) % copies.len();
            linear(
                pool,
                &copies[i],
                &x[..rows * c.inf],
                rows,
                None,
                &mut out[..rows * c.outf],
            )
            .unwrap();
        });
        if rows == 1 {
            one = secs;
        }
        let cpu = cpu_time(budget, || {
            linear(
                single,
                &w,
                &x[..rows * c.inf],
                rows,
                None,
                &mut out[..rows * c.outf],
            )
            .unwrap();
        });
        rows_json.push(json!({
            "rows": rows,
            "us": secs * 1e6,
            "cpu_us": cpu.map(|s| s * 1e6),
            "weight_gbps": bytes as f64 / secs / 1e9,
            "gflops": 2.0 * (rows * c.outf * c.inf) as f64 / secs / 1e9,
            "cost_vs_1_row": secs / one,
        }));
    }
    let hot = time(budget, || {
        linear(pool, &w, &x[..c.inf], 1, None, &mut out[..c.outf]).unwrap()
    });
    json!({
        "format": c.format.name(), "out_features": c.outf, "in_features": c.inf,
        "weight_bytes": bytes, "hot_1_row_us": hot * 1e6, "streamed": rows_json,
    })
}

/// One SmolLM2-135M forward's linears: 30 layers (q, k, v, o, gate, up, down) in Q4_1, then
/// the Q8_0 head, for 1 to 128 rows.
fn smollm2_step(pool: &KernelPool, rng: &mut SmallRng, budget: Duration) -> Value {
    let f = BlockFormat::Q4_1;
    let layer = [
        (576, 576),
        (192, 576),
        (192, 576),
        (576, 576),
        (1536, 576),
        (1536, 576),
        (576, 1536),
    ];
    let mut ws: Vec<PackedWeight> = (0..30)
        .flat_map(|_| {
            layer
                .iter()
                .map(|&(o, i)| random_weight(rng, f, o, i))
                .collect::<Vec<_>>()
        })
        .collect();
    ws.push(random_weight(rng, BlockFormat::Q8_0, 49152, 576));
    let bytes: usize = ws.iter().map(|w| w.bytes().len()).sum();
    let x: Vec<f32> = (0..128 * 1536)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let mut out = vec![0f32; 128 * 49152];
    let mut rows_json = Vec::new();
    let mut one = 0.0;
    for rows in [1, 2, 5, 9, 16, 128] {
        let secs = time(budget, || {
            for w in &ws {
                let (o, i) = (w.out_features(), w.in_features());
                linear(pool, w, &x[..rows * i], rows, None, &mut out[..rows * o]).unwrap();
            }
        });
        if rows == 1 {
            one = secs;
        }
        rows_json.push(json!({
            "rows": rows, "ms": secs * 1e3, "weight_gbps": bytes as f64 / secs / 1e9,
            "cost_vs_1_row": secs / one,
        }));
    }
    json!({"weight_bytes": bytes, "linears": ws.len(), "steps": rows_json})
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let quick = args.iter().any(|a| a == "--quick");
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    let budget = Duration::from_millis(if quick { 40 } else { 150 });
    let pool = KernelPool::per_core();
    let single = KernelPool::new(1);
    let mut rng = SmallRng::seed_from_u64(1);
    // The SIMD levels to compare: every one this CPU runs, or the one `--isa=` names.
    let isas: Vec<Isa> = match args.iter().find_map(|a| a.strip_prefix("--isa=")) {
        Some(name) => match Isa::available_simd().into_iter().find(|i| i.name() == name) {
            Some(isa) => vec![isa],
            None => {
                let names: Vec<&str> = Isa::available_simd().iter().map(|i| i.name()).collect();
                panic!("--isa= takes one of {names:?} on this CPU, not {name:?}");
            }
        },
        None => Isa::available_simd(),
    };
    if args.iter().any(|a| a == "--kernel") {
        let report = json!({"kernel_cpu": kernel_costs(&mut rng, budget * 2, &isas)});
        println!("{}", serde_json::to_string_pretty(&report).unwrap());
        return;
    }
    if args.iter().any(|a| a == "--step") {
        // Once per SIMD instruction set this CPU runs, on as many threads as `pool`.
        let mut steps = Vec::new();
        for &isa in &isas {
            let pool = KernelPool::with_options(pool.threads(), isa, KernelPool::DEFAULT_SPIN);
            let step = smollm2_step(&pool, &mut rng, budget * 4);
            steps.push(json!({"isa": isa.name(), "step": step}));
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({"smollm2_step": steps})).unwrap()
        );
        return;
    }
    let (read_gbps, memcpy_gbps) = bandwidth(&pool);
    let mut cases = Vec::new();
    for format in BlockFormat::ALL {
        if !filters.is_empty() && !filters.iter().any(|f| format.name().contains(f.as_str())) {
            continue;
        }
        for (outf, inf) in shapes(format) {
            cases.push(bench_case(
                &pool,
                &single,
                &mut rng,
                &Case { format, outf, inf },
                budget,
            ));
        }
    }
    let step = if filters.is_empty() {
        smollm2_step(&pool, &mut rng, budget * 4)
    } else {
        Value::Null
    };
    let (read_after, memcpy_after) = bandwidth(&pool);
    let report = json!({
        "threads": pool.threads(),
        "isa": pool.isa().name(),
        "read_gbps": [read_gbps, read_after],
        "memcpy_gbps": [memcpy_gbps, memcpy_after],
        "fork_join": fork_join(&pool),
        "smollm2_step": step,
        "cases": cases,
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
}
