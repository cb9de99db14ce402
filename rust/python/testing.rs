//! Hooks for tests and the protocol benchmark, not part of the public API: Python reaches
//! them through `specdraft.testing`. A proposer as Rust sees it (`_as_rust`), and a timing
//! loop that calls `propose` through `dyn DraftProposer` from Rust with the interpreter
//! released (`_time_propose`), so the measured cost of a Python proposer includes
//! attaching, the call and the conversions, as in the engine.

use super::adapter::{overridden, wrap};
use super::errors::{request_error, IntoPyResult};
use super::proposer::PyDraftProposer;
use crate::backend::{CpuBackend, DevicePtr, GpuBackend, GpuBackendExt};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig, ModelLevers};
use crate::speculative::DraftProposer;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;
use std::time::Instant;

/// A proposer seen through `dyn DraftProposer`: every method call goes through the same
/// path the engine uses (Python overrides through the adapter, the rest in Rust).
#[pyclass(name = "_DynProposer", module = "specdraft", extends = PyDraftProposer, frozen)]
pub struct PyDynProposer {
    python_methods: Vec<&'static str>,
}

#[pymethods]
impl PyDynProposer {
    /// The methods that call into Python; every other one runs in Rust.
    #[getter]
    fn python_methods(&self) -> Vec<&'static str> {
        self.python_methods.clone()
    }
}

/// `proposer` as the engine sees it.
#[pyfunction]
pub fn _as_rust(proposer: &Bound<'_, PyAny>) -> PyResult<Py<PyDynProposer>> {
    let rust = wrap(proposer)?;
    let methods = overridden(proposer)?;
    let name = proposer
        .get_type()
        .qualname()
        .map(|n| n.to_string())
        .unwrap_or_default();
    let mut base = PyDraftProposer::holding(rust, &name);
    if let Ok(original) = proposer.cast::<PyDraftProposer>() {
        base.home = original.get().home.clone();
    }
    Py::new(
        proposer.py(),
        PyClassInitializer::from(base).add_subclass(PyDynProposer {
            python_methods: methods,
        }),
    )
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i]
}

fn time_propose(
    proposer: &dyn DraftProposer,
    iters: usize,
    num_drafts: usize,
    vocab_size: usize,
    prompt_len: usize,
) -> crate::Result<(Vec<f64>, usize)> {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let config = ModelConfig::tiny(vocab_size);
    let hidden = gpu.upload_bf16(&vec![0.0; config.hidden_size], "bench:target_hidden")?;
    let ctx = ForwardContext::new(
        gpu.clone(),
        Arc::new(BufferArena::empty(1)),
        Arc::new(config),
        ModelLevers::default(),
    );
    // A prompt with period 8, so n-gram lookup always finds a continuation.
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|i| (i % 8) as u32 % vocab_size as u32)
        .collect();
    let mut state = proposer.alloc_state(&*gpu)?;
    let result = (|| -> crate::Result<(Vec<f64>, usize)> {
        proposer.prefill_drafter(&prompt, DevicePtr::NULL, &mut *state, &ctx, 0)?;
        let last = (prompt_len % 8) as u32 % vocab_size as u32;
        let mut times = Vec::with_capacity(iters);
        let mut drafted = 0;
        for _ in 0..iters {
            let t0 = Instant::now();
            let d = proposer.propose(
                last,
                hidden,
                prompt_len,
                num_drafts,
                &mut *state,
                &ctx,
                0,
                None,
                None,
                None,
            )?;
            times.push(t0.elapsed().as_secs_f64() * 1e6);
            drafted = d.len();
        }
        Ok((times, drafted))
    })();
    let freed = proposer.free_state(&*gpu, &mut *state);
    gpu.free(hidden)?;
    let out = result?;
    freed?;
    Ok(out)
}

/// Times `propose` through `dyn DraftProposer`, driven from Rust with the interpreter
/// released. Returns microseconds per call: median, p10, p90, mean, plus the draft count.
#[pyfunction]
#[pyo3(signature = (proposer, iters = 20000, num_drafts = 4, vocab_size = 256, prompt_len = 64))]
pub fn _time_propose<'py>(
    py: Python<'py>,
    proposer: &Bound<'py, PyAny>,
    iters: usize,
    num_drafts: usize,
    vocab_size: usize,
    prompt_len: usize,
) -> PyResult<Bound<'py, PyDict>> {
    if iters == 0 || prompt_len == 0 || vocab_size == 0 {
        return Err(request_error(
            "iters, prompt_len and vocab_size must be at least 1",
        ));
    }
    let rust = wrap(proposer)?;
    let (mut times, drafted) = py
        .detach(|| time_propose(&*rust, iters, num_drafts, vocab_size, prompt_len))
        .py()?;
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    times.sort_by(f64::total_cmp);
    let d = PyDict::new(py);
    d.set_item("iters", iters)?;
    d.set_item("median_us", percentile(&times, 0.5))?;
    d.set_item("p10_us", percentile(&times, 0.1))?;
    d.set_item("p90_us", percentile(&times, 0.9))?;
    d.set_item("mean_us", mean)?;
    d.set_item("drafts_per_call", drafted)?;
    Ok(d)
}
