//! `specdraft.ServingEngine`: one long-lived generation on a `SpecEngine` that a server's
//! engine loop drives: requests are submitted and cancelled between steps and join and
//! leave the running batch (continuous batching across callers).
//!
//! Each `step` runs one scheduler iteration with the interpreter released (and the engine
//! lock held, as `generate` does) and returns what every request emitted since the last
//! step. A request is checked when it is submitted, with the engine's own checks, so a bad
//! one raises `RequestError` at once and never queues.
//!
//! Invariants: a cancelled request's KV, proposer state and buffers are released before
//! `cancel` returns; `close()` (or dropping the object) releases everything still queued or
//! running, and later calls raise.

use super::engine::PySpecEngine;
use super::errors::{request_error, to_pyerr};
use super::generation::{metrics_dict, prompt_ids, run_exclusive, GenerateOptions};
use crate::engine::{GenerationRun, SpecEngine, Target};
use crate::model::TargetModel;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Mutex;

/// What `step` returns for one request: `(id, new_token_ids, finish_reason, metrics,
/// error)`; the last three are None until the update that reports its end.
type StepItem = (
    usize,
    Vec<u32>,
    Option<&'static str>,
    Option<Py<PyDict>>,
    Option<Py<PyAny>>,
);

/// `ServingEngine(engine)`: a long-lived generation on `engine` (a `SpecEngine`, whose
/// proposer, draft policy, batch limits and KV pool it uses) that takes requests while it
/// runs. `submit` queues a request and returns its id; `step` runs one scheduler
/// iteration, in which queued requests join the running batch as slots and KV blocks allow,
/// and returns `(id, new_token_ids, finish_reason, metrics, error)` for each request that
/// emitted tokens or ended (`finish_reason` is "stop", "length", "context", "grammar",
/// "error" or "cancelled", with the request's metrics dict, on its last update);
/// `cancel(id)` ends a request and frees what it holds at once. One thread should drive it;
/// calls from others wait for the running step.
#[pyclass(name = "ServingEngine", module = "specdraft", frozen)]
pub struct PyServingEngine {
    engine: SpecEngine<TargetModel>,
    tokenizer: Option<Py<PyAny>>,
    /// None once closed.
    run: Mutex<Option<GenerationRun<TargetModel>>>,
}

impl PyServingEngine {
    /// Runs `f` on the open run with the interpreter released and the engine lock held.
    fn with_run<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut GenerationRun<TargetModel>) -> R + Send,
    ) -> PyResult<R> {
        py.detach(|| {
            let mut slot = self.run.lock().unwrap_or_else(|e| e.into_inner());
            slot.as_mut().map(|run| run_exclusive(|| f(run)))
        })
        .ok_or_else(|| request_error("this ServingEngine is closed"))
    }
}

#[pymethods]
impl PyServingEngine {
    #[new]
    fn new(engine: &Bound<'_, PySpecEngine>) -> Self {
        let e = engine.get();
        PyServingEngine {
            engine: e.engine.clone(),
            tokenizer: e.tokenizer.as_ref().map(|t| t.clone_ref(engine.py())),
            run: Mutex::new(Some(e.engine.serve())),
        }
    }

    /// Queues one prompt (a string, or a list of token ids) with `SpecEngine.generate`'s
    /// options and returns its id. A bad request (the engine's checks, a prompt plus
    /// `max_tokens` beyond the context or the whole KV pool) raises `RequestError` and
    /// nothing is queued.
    #[pyo3(signature = (prompt, max_tokens = 64, temperature = 0.0, top_p = 1.0, top_k = 0, seed = 0, grammar = None, ignore_eos = false))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        max_tokens: usize,
        temperature: f32,
        top_p: f32,
        top_k: usize,
        seed: u64,
        grammar: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
    ) -> PyResult<usize> {
        let ids = prompt_ids(prompt, self.tokenizer.as_ref())?;
        let options = GenerateOptions::new(
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            grammar,
            ignore_eos,
        );
        let request = options
            .requests(vec![ids])?
            .pop()
            .ok_or_else(|| request_error("no request was made of the prompt"))?;
        self.engine
            .check_request(0, &request)
            .and_then(|()| self.engine.check_fits(0, &request))
            .map_err(|e| to_pyerr(&e.into()))?;
        self.with_run(py, move |run| run.submit(request))
    }

    /// Ends request `id` and frees its KV, proposer state and buffers now; returns False
    /// when no such request is queued or running. Its end ("cancelled") comes with the
    /// next step's updates.
    fn cancel(&self, py: Python<'_>, id: usize) -> PyResult<bool> {
        self.with_run(py, |run| run.cancel(id))
    }

    /// One scheduler iteration (nothing when no request is queued or running), then what
    /// each request emitted since the last step: a list of `(id, new_token_ids,
    /// finish_reason, metrics, error)`.
    fn step(&self, py: Python<'_>) -> PyResult<Vec<StepItem>> {
        let updates = self.with_run(py, |run| {
            run.step();
            run.poll()
        })?;
        updates
            .into_iter()
            .map(|u| {
                let metrics = u
                    .metrics
                    .as_ref()
                    .map(|m| metrics_dict(py, m).map(Bound::unbind))
                    .transpose()?;
                let error = u.error.map(|e| to_pyerr(&e).into_value(py).into_any());
                Ok((u.id, u.tokens, u.finish.map(|f| f.as_str()), metrics, error))
            })
            .collect()
    }

    /// Requests waiting for a slot or KV blocks.
    #[getter]
    fn waiting(&self, py: Python<'_>) -> PyResult<usize> {
        self.with_run(py, |run| run.waiting())
    }

    /// Requests in the running batch.
    #[getter]
    fn running(&self, py: Python<'_>) -> PyResult<usize> {
        self.with_run(py, |run| run.running())
    }

    /// Whether no request is queued or running.
    #[getter]
    fn idle(&self, py: Python<'_>) -> PyResult<bool> {
        self.with_run(py, |run| run.is_done())
    }

    /// The target's KV pool as `(total_blocks, free_blocks)`, or None when the model's KV
    /// is not a pool of blocks.
    #[getter]
    fn kv_blocks(&self) -> Option<(usize, usize)> {
        // The engine's view of the pool (the model also has an inherent `kv_pool`).
        Target::kv_pool(self.engine.target().as_ref()).map(|p| (p.num_blocks, p.num_free))
    }

    /// Ends every request still queued or running and frees what they hold; later calls
    /// raise. Closing twice does nothing.
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            let run = self.run.lock().unwrap_or_else(|e| e.into_inner()).take();
            run_exclusive(move || drop(run));
        });
    }
}
