//! Where the wall time of a one-row decode step and of an engine step goes, printed as JSON.
//!
//! The model runs on a [`TimedBackend`]: the CPU backend observed by a [`Timer`] that times
//! each kernel and copy call and adds it to its part (the linears, the LM head, attention, the
//! KV write, each small op, embedding, copies). What a step spends outside every call (the
//! forward's argument checks and staging, block bookkeeping, the layer loop) is the rest of
//! its wall time. Pool dispatch is inside each op; the `calls` column with the
//! `kernel_pool` bench's round trip bounds it. The wrapper adds two clock reads a call
//! (about 40 ns each here, under 0.02 ms a step).
//!
//! The engine part runs `SpecEngine::generate` (plain greedy decoding, one sequence) on the
//! same model through a [`Target`] wrapper that times the target's forwards: an engine step
//! is the decode wall time (prefill forwards taken out) over the steps; what is outside the
//! forward is split into the backend calls the engine makes itself (the greedy picks' argmax
//! and download, the hidden-row copy) and the rest (verification on the host, bookkeeping).
//!
//! `cargo bench --bench step_profile [-- PATH] [--threads=N] [--rows=N]`: threads default to
//! one per core; `--rows=N` makes each model step a verify-shaped forward of N rows, trimmed
//! back to its first row after (the engine part always decodes plainly).

use specdraft::backend::{
    BackendError, Call, CpuBackend, ElementwiseOp, GpuBackend, Observed, Observer,
};
use specdraft::engine::{GenerateRequest, KvPoolStatus, SpecEngine, Target, TargetOutput};
use specdraft::memory::BufferArena;
use specdraft::model::{KvSequence, LoadOptions, LogitRows, ModelConfig, TargetModel};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[path = "common/default_model.rs"]
mod default_model;

/// Time and calls per part.
#[derive(Default)]
struct Ledger(BTreeMap<&'static str, (Duration, u64)>);

/// Times each call of the CPU backend into its part (see the module doc).
struct Timer {
    /// The LM head is the linear with this many outputs (set once the model is loaded).
    vocab: AtomicUsize,
    parts: Mutex<Ledger>,
    /// Whether the calls come from inside a target forward (else from the engine).
    in_forward: AtomicBool,
}

/// The CPU backend, each call timed into its part.
type TimedBackend = Observed<CpuBackend, Timer>;

impl Timer {
    /// The part `call` is timed into.
    fn part(&self, call: &Call) -> &'static str {
        let part = match call {
            Call::Elementwise(a) => match a.op {
                ElementwiseOp::Add => "residual add",
                ElementwiseOp::SiluMul => "silu_mul",
                _ => "elementwise (other)",
            },
            Call::Linear(a) if a.out_features == self.vocab.load(Ordering::Relaxed) => "lm head",
            Call::Linear(_) => "linear o/down",
            Call::GroupedLinear(a) => match a.parts.iter().flatten().count() {
                3 => "grouped linear q/k/v",
                _ => "grouped linear gate/up",
            },
            Call::PagedAttention(_) => "attention",
            Call::CopyRows(_) => "layer capture",
            Call::KvCopy(_) => "kv compaction",
            Call::MlaAttention(_) => "latent attention",
            other => other.name(),
        };
        match (self.in_forward.load(Ordering::Relaxed), part) {
            (false, "copy_dtoh") => "engine: download",
            (false, "argmax") => "engine: greedy picks",
            (false, "copy_dtod") => "engine: hidden-row copy",
            (false, "copy_htod") => "engine: upload",
            _ => part,
        }
    }

    fn take(&self) -> Ledger {
        std::mem::take(&mut *self.parts.lock().unwrap())
    }
}

impl Observer for Timer {
    fn observe(
        &self,
        call: Call,
        run: &mut dyn FnMut() -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        let t = Instant::now();
        let r = run();
        let dt = t.elapsed();
        let part = self.part(&call);
        let mut l = self.parts.lock().unwrap();
        let e = l.0.entry(part).or_default();
        e.0 += dt;
        e.1 += 1;
        r
    }
}

/// The real model, its forwards timed and marked (see [`Timer::in_forward`]).
struct TimedTarget {
    model: TargetModel,
    backend: Arc<TimedBackend>,
    /// (decode forwards, prefill forwards) wall time.
    forwards: Mutex<(Duration, Duration)>,
}

impl TimedTarget {
    fn mark<R>(&self, prefill: bool, f: impl FnOnce() -> R) -> R {
        self.backend
            .observer
            .in_forward
            .store(true, Ordering::Relaxed);
        let t = Instant::now();
        let r = f();
        let dt = t.elapsed();
        self.backend
            .observer
            .in_forward
            .store(false, Ordering::Relaxed);
        let mut fw = self.forwards.lock().unwrap();
        if prefill {
            fw.1 += dt;
        } else {
            fw.0 += dt;
        }
        r
    }
}

impl Target for TimedTarget {
    type KvSequence = KvSequence;
    fn config(&self) -> &Arc<ModelConfig> {
        Target::config(&self.model)
    }
    fn gpu(&self) -> &Arc<dyn GpuBackend> {
        Target::gpu(&self.model)
    }
    fn max_seq_len(&self) -> usize {
        Target::max_seq_len(&self.model)
    }
    fn new_sequence(&self) -> KvSequence {
        Target::new_sequence(&self.model)
    }
    fn seq_len(&self, seq: &KvSequence) -> usize {
        seq.len()
    }
    fn forward(&self, s: &mut [&mut KvSequence], t: &[&[u32]]) -> specdraft::Result<TargetOutput> {
        self.mark(false, || Target::forward(&self.model, s, t))
    }
    fn forward_last(
        &self,
        s: &mut [&mut KvSequence],
        t: &[&[u32]],
    ) -> specdraft::Result<TargetOutput> {
        self.mark(true, || Target::forward_last(&self.model, s, t))
    }
    fn trim(&self, seq: &mut KvSequence, new_len: usize) -> specdraft::Result<()> {
        Target::trim(&self.model, seq, new_len)
    }
    fn free_sequence(&self, seq: &mut KvSequence) -> specdraft::Result<()> {
        Target::free_sequence(&self.model, seq)
    }
    fn buffers(&self) -> &Arc<BufferArena> {
        Target::buffers(&self.model)
    }
    fn kv_pool(&self) -> Option<KvPoolStatus> {
        Target::kv_pool(&self.model)
    }
}

/// `{part: {ms, calls}}` per step, with the rest of `wall` as `"outside the calls"`.
fn table(parts: &Ledger, wall: Duration, steps: u64) -> serde_json::Value {
    let per = |d: Duration| d.as_secs_f64() * 1e3 / steps as f64;
    let mut out = serde_json::Map::new();
    let mut inside = Duration::ZERO;
    for (name, &(d, calls)) in &parts.0 {
        inside += d;
        let calls = calls as f64 / steps as f64;
        out.insert(
            name.to_string(),
            serde_json::json!({"ms": per(d), "calls": calls}),
        );
    }
    out.insert(
        "outside the calls".into(),
        serde_json::json!({"ms": per(wall.saturating_sub(inside))}),
    );
    out.insert("total".into(), serde_json::json!({"ms": per(wall)}));
    serde_json::Value::Object(out)
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`; this needs the real
    // model and an optimised build.
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("step_profile: skipped (run `cargo bench --bench step_profile`)");
        return;
    }
    let path = default_model::model_path();
    let arg = |name: &str| {
        std::env::args().find_map(|a| a.strip_prefix(name).and_then(|n| n.parse::<usize>().ok()))
    };
    let threads = arg("--threads=");
    let rows = arg("--rows=").unwrap_or(1).clamp(1, 64);
    let backend = Arc::new(TimedBackend::new(
        threads.map_or_else(CpuBackend::new, CpuBackend::with_threads),
        Timer {
            vocab: AtomicUsize::new(0),
            parts: Mutex::default(),
            in_forward: AtomicBool::new(true),
        },
    ));
    let gpu: Arc<dyn GpuBackend> = backend.clone();
    let opts = LoadOptions {
        max_rows: 256,
        max_seq_len: Some(512),
        kv_blocks: Some(64),
    };
    let model = TargetModel::load(&path, gpu.clone(), opts).expect("model loads");
    let vocab = model.config().vocab_size;
    backend.observer.vocab.store(vocab, Ordering::Relaxed);
    let prompt: Vec<u32> = (0..160u32).map(|i| 260 + (i * 37) % 3000).collect();

    // One-row decode steps of the model alone, at a context of 160..224.
    let mut seq = model.new_sequence();
    model
        .forward_with(&mut [&mut seq], &[&prompt], LogitRows::LastPerSequence)
        .expect("prefill");
    let steps = 64u64;
    let mut tok = 1234u32;
    for _ in 0..4 {
        model.forward(&mut [&mut seq], &[&[tok]]).expect("warm-up");
    }
    backend.observer.take();
    let t = Instant::now();
    for i in 0..steps {
        // A verify-shaped forward of `rows` rows keeps its first row, as when every draft
        // is rejected (one row: a plain decode step).
        let kept = seq.len() + 1;
        let toks: Vec<u32> = (0..rows as u32).map(|r| tok + 7 * r).collect();
        model.forward(&mut [&mut seq], &[&toks]).expect("decode");
        if rows > 1 {
            model.trim(&mut seq, kept).expect("trim");
        }
        tok = 300 + (i as u32 * 101) % 4000;
    }
    let model_wall = t.elapsed();
    let model_parts = backend.observer.take();
    model.free_sequence(&mut seq).expect("free");

    // Engine steps: plain greedy decoding of one sequence.
    let target = Arc::new(TimedTarget {
        model,
        backend: backend.clone(),
        forwards: Mutex::default(),
    });
    backend.observer.in_forward.store(false, Ordering::Relaxed);
    let engine = SpecEngine::new(target.clone(), None, 4).expect("engine");
    let request = |n| vec![GenerateRequest::new(prompt.clone(), n).ignore_eos()];
    engine.generate(request(8)); // warm-up
    backend.observer.take();
    *target.forwards.lock().unwrap() = Default::default();
    let t = Instant::now();
    let g = engine.generate(request(65));
    let wall = t.elapsed();
    let (decode, prefill) = *target.forwards.lock().unwrap();
    let engine_steps = g.metrics.verify_steps;
    let mut engine_parts = backend.observer.take();
    // The forwards' own calls are in the model table; here the forward is one part.
    engine_parts.0.retain(|k, _| k.starts_with("engine"));
    engine_parts
        .0
        .insert("target forward", (decode, engine_steps));
    drop(engine);
    let target = Arc::try_unwrap(target).ok().expect("last reference");
    drop(target);
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({
            "bench": "step_profile",
            "threads": backend.inner.kernel_pool().threads(),
            "context": prompt.len(),
            "rows": rows,
            "model_step": table(&model_parts, model_wall, steps),
            "engine_step": table(&engine_parts, wall.saturating_sub(prefill), engine_steps),
            "engine_steps": engine_steps,
        }))
        .expect("json")
    );
    assert_eq!(backend.ledger().live_count(), 0);
}
