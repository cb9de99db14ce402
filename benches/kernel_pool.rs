//! Cost of one `KernelPool::run` round trip, printed as JSON.
//!
//! A forward pass of a small model makes hundreds of pool calls, each tens of microseconds
//! of work, so the fixed cost of publishing a job, waking the workers and waiting for them
//! is paid hundreds of times a step. Cases, each on a pool of `--threads` (default 2)
//! participants, the median and the 10th percentile of many calls:
//! - `empty`: back-to-back calls of one empty task per participant (the pure round trip);
//! - `grain_Nus`: each participant spins for N µs (round trip = time - N);
//! - `gap_Nus`: back-to-back empty calls separated by N µs of work on the calling thread
//!   alone, as the serial ops between two linears of a forward are: it shows whether the
//!   workers are still awake when the next call comes;
//! - `inline`: the same empty job on a one-participant pool (the floor: no other thread).
//!
//! `cargo bench --bench kernel_pool [-- --threads N]`.

use serde_json::{json, Value};
use specdraft::backend::quant::KernelPool;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Busy-waits for `us` microseconds on the calling thread.
fn work(us: f64) {
    if us <= 0.0 {
        return;
    }
    let t = Instant::now();
    while t.elapsed().as_secs_f64() * 1e6 < us {
        std::hint::spin_loop();
    }
}

/// Median and 10th percentile, in microseconds, of `calls` timings of `f` (each after
/// `before()`, which is not timed).
fn measure(calls: usize, mut before: impl FnMut(), mut f: impl FnMut()) -> Value {
    for _ in 0..calls / 10 {
        before();
        f();
    }
    let mut t: Vec<f64> = (0..calls)
        .map(|_| {
            before();
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    json!({"median_us": t[t.len() / 2], "p10_us": t[t.len() / 10], "p90_us": t[t.len() * 9 / 10]})
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`.
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("kernel_pool: skipped (run `cargo bench --bench kernel_pool`)");
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let threads = args
        .iter()
        .position(|a| a == "--threads")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(2usize);
    let pool = KernelPool::new(threads);
    let n = pool.threads();
    let calls = 20_000;
    let empty = |p: &KernelPool| {
        p.run(n, &|t| {
            black_box(t);
        })
        .unwrap()
    };
    let mut out = json!({
        "bench": "kernel_pool",
        "threads": n,
        "spin_us": pool.spin().as_secs_f64() * 1e6,
        "empty": measure(calls, || {}, || empty(&pool)),
    });
    for grain in [5.0, 20.0] {
        out[format!("grain_{grain}us")] =
            measure(calls / 4, || {}, || pool.run(n, &|_| work(grain)).unwrap());
    }
    for gap in [10.0, 50.0, 150.0, 500.0] {
        out[format!("gap_{gap}us")] = measure(calls / 10, || work(gap), || empty(&pool));
    }
    // A pause far past any spin: the workers are asleep, the call pays the wake-up.
    out["after_sleep_5ms"] = measure(
        200,
        || std::thread::sleep(Duration::from_millis(5)),
        || empty(&pool),
    );
    let one = KernelPool::new(1);
    out["inline"] = measure(calls, || {}, || empty(&one));
    println!("{out}");
}
