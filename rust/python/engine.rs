//! `specdraft.SpecEngine`: the speculative decoding engine from Python.
//!
//! The engine runs with the interpreter released; it attaches only to call a Python
//! proposer (through the proposer adapter), a Python grammar matcher, or the tokenizer.
//! Prompts are token-id lists or text; chat messages go through the tokenizer's chat
//! template. The tokenizer is the model's own (`model.tokenizer`) unless one is given.
//!
//! A bad request (an empty or too-long prompt, ids outside the vocabulary, sampling
//! parameters out of range) raises `RequestError` before anything runs; a failure while
//! running ends only its own sequence, whose result carries the exception.

use super::adapter::wrap;
use super::conversation::PyConversation;
use super::drafter_pool::drafter_pool_of;
use super::errors::{to_pyerr, IntoPyResult};
use super::generation::{
    encode, metrics_dict, need_tokenizer, prompt_ids, render_chat, run_exclusive, to_py_result,
    GenerateOptions, PyGenerationResult,
};
use super::model::PyModelLevers;
use super::stream::PyGenerationStream;
use super::target_model::PyTargetModel;
use crate::engine::{
    DraftPolicyKind, DraftShape, EngineError, GenerateRequest, Metrics, SpecEngine,
};
use crate::model::{ModelLevers, TargetModel};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

/// `SpecEngine(model, proposer=None, num_drafts=4, *, tokenizer=None, levers=None,
/// max_batch=256, max_batch_tokens=None, draft_policy="adaptive", draft_shape="tree")`:
/// speculative decoding on a target model with an optional proposer.
///
/// `tokenizer` defaults to `model.tokenizer`, so text prompts and chat messages work with
/// a model that carries one; without `levers` they are read from the `SPECDRAFT_*`
/// variables. Prompts wait in a queue and run while the model's KV pool has room (the
/// newest is preempted and later recomputed when it runs dry, without changing its
/// output): `max_batch` bounds the sequences that run at once, `max_batch_tokens` the rows
/// of one forward (long prompts are prefilled in chunks of it; None: the model's limit).
/// A prompt whose `max_tokens` the whole pool could never hold fails alone.
/// `draft_policy` is `"adaptive"` (each step, each sequence is asked for the draft count,
/// up to `num_drafts`, that maximises expected tokens per second from its measured
/// acceptance and the measured cost of drafting and verifying) or `"fixed"` (always
/// `num_drafts`). `draft_shape` is `"tree"` (a proposer that grows trees, such as
/// `PromptLookup`, is asked `propose_tree` with that count as its node budget, and one
/// forward verifies every node: greedily, or by lossless rejection sampling over the tree
/// when sampling, under the grammar's masks when there is one) or `"chain"` (always
/// `propose`).
#[pyclass(name = "SpecEngine", module = "specdraft", frozen)]
pub struct PySpecEngine {
    pub(super) engine: SpecEngine<TargetModel>,
    pub(super) tokenizer: Option<Py<PyAny>>,
    proposer: Option<Py<PyAny>>,
    last_metrics: Mutex<Option<Metrics>>,
    /// Whether `close` has told the workers to stop.
    closed: AtomicBool,
}

impl PySpecEngine {
    /// The model's EOS ids (a result's text stops before them).
    pub(super) fn eos(&self) -> &[u32] {
        &self.engine.target().config().eos_token_ids
    }

    /// The requests of `prompts`, each checked (raising `RequestError` for the first bad
    /// one).
    fn checked_requests(
        &self,
        prompts: Vec<Vec<u32>>,
        options: &GenerateOptions<'_, '_>,
    ) -> PyResult<Vec<GenerateRequest>> {
        let requests = options.requests(prompts)?;
        for (i, r) in requests.iter().enumerate() {
            self.engine
                .check_request(i, r)
                .map_err(|e| to_pyerr(&e.into()))?;
        }
        Ok(requests)
    }

    /// Token ids of each of `prompts` (a list of strings or of token-id lists).
    fn prompt_list(&self, prompts: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
        if prompts.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err(
                "prompts must be a list (of strings or of token-id lists), not one string",
            ));
        }
        prompts
            .try_iter()?
            .map(|p| prompt_ids(&p?, self.tokenizer.as_ref()))
            .collect()
    }

    /// Checks every request (raising `RequestError` for the first bad one), runs them all
    /// together and converts the results.
    fn run(
        &self,
        py: Python<'_>,
        prompts: Vec<Vec<u32>>,
        options: &GenerateOptions<'_, '_>,
    ) -> PyResult<Vec<PyGenerationResult>> {
        let requests = self.checked_requests(prompts, options)?;
        let engine = self.engine.clone();
        let generation = py.detach(move || run_exclusive(|| engine.generate(requests)));
        *self.last_metrics.lock().unwrap_or_else(|e| e.into_inner()) = Some(generation.metrics);
        generation
            .results
            .into_iter()
            .map(|r| to_py_result(py, r, self.tokenizer.as_ref(), self.eos()))
            .collect()
    }
}

#[pymethods]
impl PySpecEngine {
    #[new]
    #[pyo3(signature = (model, proposer = None, num_drafts = 4, *, tokenizer = None, levers = None, max_batch = 256, max_batch_tokens = None, draft_policy = "adaptive", draft_shape = "tree"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        model: &Bound<'_, PyAny>,
        proposer: Option<&Bound<'_, PyAny>>,
        num_drafts: usize,
        tokenizer: Option<Bound<'_, PyAny>>,
        levers: Option<PyModelLevers>,
        max_batch: usize,
        max_batch_tokens: Option<usize>,
        draft_policy: &str,
        draft_shape: &str,
    ) -> PyResult<Self> {
        if max_batch == 0 || max_batch_tokens == Some(0) {
            return Err(super::errors::request_error(
                "max_batch and max_batch_tokens must be at least 1",
            ));
        }
        let policy: DraftPolicyKind = draft_policy
            .parse()
            .map_err(|e: EngineError| to_pyerr(&e.into()))?;
        let shape = DraftShape::parse(draft_shape).ok_or_else(|| {
            super::errors::request_error(format!(
                "draft_shape must be \"tree\" or \"chain\", got {draft_shape:?}"
            ))
        })?;
        let model = model.cast::<PyTargetModel>().map_err(|_| {
            PyTypeError::new_err(format!(
                "model must be a specdraft.TargetModel (from specdraft.load_model), got {}",
                super::backend::type_name(model)
            ))
        })?;
        let target: Arc<TargetModel> = model.get().arc();
        let rust = proposer.map(wrap).transpose()?;
        let levers = match levers {
            Some(l) => l.0,
            None => ModelLevers::from_env().map_err(super::errors::ConfigError::new_err)?,
        };
        let mut engine = SpecEngine::new(target, rust, num_drafts)
            .py()?
            .with_levers(levers)
            .with_max_batch(max_batch)
            .with_draft_policy(policy)
            .with_draft_shape(shape);
        if let Some(n) = max_batch_tokens {
            engine = engine.with_max_batch_tokens(n);
        }
        if let Some(probe) = proposer.and_then(drafter_pool_of) {
            engine = engine.with_drafter_pool(probe);
        }
        let py = model.py();
        let tokenizer = match tokenizer {
            Some(t) => Some(t.unbind()),
            None => model.get().tokenizer.as_ref().map(|t| t.clone_ref(py)),
        };
        Ok(PySpecEngine {
            engine,
            tokenizer,
            proposer: proposer.map(|p| p.clone().unbind()),
            last_metrics: Mutex::new(None),
            closed: AtomicBool::new(false),
        })
    }

    /// On a worker (rank > 0) of a model loaded with `load_model(..., comm=comm)`: runs
    /// every forward rank 0 announces (prefills, verifies, trims, frees, and the calls of a
    /// draft head whose experts are split, which this engine's proposer then runs) on this
    /// rank's shard, until rank 0 calls `close()`. Returns what it served: `{"commands",
    /// "by_kind", "failed", "last_error", "leftover_sequences"}` (`by_kind` counts the
    /// commands by their `"kind"`). Raises `RequestError` on a model
    /// loaded on one rank, and `BackendError` if the ranks fall out of step (a rank died or
    /// hung past the communicator's timeout).
    fn run_worker<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        super::ranks::serve(
            py,
            self.engine.target().clone(),
            self.engine.proposer().cloned(),
            self.engine.levers(),
        )
    }

    /// On rank 0 of a multi-rank model, tells the workers to leave `run_worker()` (once;
    /// later calls do nothing). On one rank or on a worker it does nothing. Call it when
    /// done with the engine; `with SpecEngine(...) as engine:` calls it on exit.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        super::ranks::close(py, self.engine.target(), &self.closed)
    }

    /// The engine itself, for a `with` block that ends in `close()`.
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Calls `close()`; exceptions propagate.
    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    /// One completion per prompt (a string, or a list of token ids), all stepping
    /// together; prompt `i` samples with seed `seed + i`. A bad request raises
    /// `RequestError` and nothing runs; a prompt that fails while running (a proposer
    /// error, out of memory) has `finish_reason == "error"` and its exception in `error`,
    /// and the others run on.
    #[pyo3(signature = (prompts, max_tokens = 64, temperature = 0.0, top_p = 1.0, top_k = 0, seed = 0, grammar = None, ignore_eos = false))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        py: Python<'_>,
        prompts: &Bound<'_, PyAny>,
        max_tokens: usize,
        temperature: f32,
        top_p: f32,
        top_k: usize,
        seed: u64,
        grammar: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
    ) -> PyResult<Vec<PyGenerationResult>> {
        let ids = self.prompt_list(prompts)?;
        let options = GenerateOptions::new(
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            grammar,
            ignore_eos,
        );
        self.run(py, ids, &options)
    }

    /// `generate`'s prompts and options, streamed: returns a `GenerationStream` that yields
    /// `(request_index, new_token_ids, text_delta)` as tokens are verified (`text_delta`
    /// is None without a tokenizer; multi-byte characters are never split). A bad request
    /// raises `RequestError` before anything runs. Use it in a `with` block, or call
    /// `close()`, to free its sequences early; its `results` hold the `GenerationResult`s
    /// once it has ended.
    #[pyo3(signature = (prompts, max_tokens = 64, temperature = 0.0, top_p = 1.0, top_k = 0, seed = 0, grammar = None, ignore_eos = false))]
    #[allow(clippy::too_many_arguments)]
    fn stream(
        &self,
        py: Python<'_>,
        prompts: &Bound<'_, PyAny>,
        max_tokens: usize,
        temperature: f32,
        top_p: f32,
        top_k: usize,
        seed: u64,
        grammar: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
    ) -> PyResult<PyGenerationStream> {
        let ids = self.prompt_list(prompts)?;
        let options = GenerateOptions::new(
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            grammar,
            ignore_eos,
        );
        let requests = self.checked_requests(ids, &options)?;
        let n = requests.len();
        let run = self.engine.begin(requests);
        Ok(PyGenerationStream::new(
            run,
            n,
            self.tokenizer.as_ref().map(|t| t.clone_ref(py)),
            self.eos().to_vec(),
        ))
    }

    /// One reply per conversation, each a list of `{"role", "content"}` messages rendered
    /// with the tokenizer's chat template (the assistant's turn opened); the options are
    /// `generate`'s.
    #[pyo3(signature = (conversations, max_tokens = 64, temperature = 0.0, top_p = 1.0, top_k = 0, seed = 0, grammar = None, ignore_eos = false))]
    #[allow(clippy::too_many_arguments)]
    fn chat(
        &self,
        py: Python<'_>,
        conversations: &Bound<'_, PyAny>,
        max_tokens: usize,
        temperature: f32,
        top_p: f32,
        top_k: usize,
        seed: u64,
        grammar: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
    ) -> PyResult<Vec<PyGenerationResult>> {
        let tok = need_tokenizer(self.tokenizer.as_ref(), "chat")?.bind(py);
        let mut ids = Vec::new();
        for messages in conversations.try_iter()? {
            let messages = messages?;
            if messages.is_instance_of::<PyDict>() || messages.is_instance_of::<PyString>() {
                return Err(PyTypeError::new_err(
                    "chat takes a list of conversations, each a list of {\"role\", \"content\"} messages: \
                     wrap a single conversation in a list",
                ));
            }
            ids.push(encode(tok, &render_chat(tok, &messages, true)?)?);
        }
        let options = GenerateOptions::new(
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            grammar,
            ignore_eos,
        );
        self.run(py, ids, &options)
    }

    /// Figures of the last `generate` or `chat` call over all its prompts (a dict), or None.
    #[getter]
    fn last_metrics<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let m = self
            .last_metrics
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        m.map(|m| metrics_dict(py, &m)).transpose()
    }

    /// Most drafts per step.
    #[getter]
    fn num_drafts(&self) -> usize {
        self.engine.num_drafts()
    }

    /// Most sequences running at once.
    #[getter]
    fn max_batch(&self) -> usize {
        self.engine.max_batch()
    }

    /// Most rows in one forward (the model's own limit included).
    #[getter]
    fn max_batch_tokens(&self) -> usize {
        self.engine.max_batch_tokens()
    }

    /// The rule that picks each step's draft count: "adaptive" or "fixed".
    #[getter]
    fn draft_policy(&self) -> &'static str {
        self.engine.draft_policy().as_str()
    }

    /// What the engine asks its proposer for: "tree" or "chain".
    #[getter]
    fn draft_shape(&self) -> &'static str {
        self.engine.draft_shape().name()
    }

    /// Whether steps draft trees: the shape is "tree" and the proposer grows them.
    #[getter]
    fn drafts_trees(&self) -> bool {
        self.engine.drafts_trees()
    }

    /// The proposer object given at construction, or None.
    #[getter]
    fn proposer(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.proposer.as_ref().map(|p| p.clone_ref(py))
    }

    /// The tokenizer text goes through (the model's own unless one was given), or None.
    #[getter]
    fn tokenizer(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.tokenizer.as_ref().map(|t| t.clone_ref(py))
    }

    /// A multi-turn chat on this engine that carries the drafter's KV between turns.
    fn conversation(slf: &Bound<'_, Self>) -> PyConversation {
        PyConversation::new(slf.py(), slf.get())
    }

    fn __repr__(&self) -> String {
        format!(
            "SpecEngine(proposer={}, num_drafts={}, draft_policy={:?})",
            if self.engine.proposer().is_some() {
                "yes"
            } else {
                "None"
            },
            self.engine.num_drafts(),
            self.engine.draft_policy().as_str()
        )
    }
}

/// Registers the engine classes on the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySpecEngine>()?;
    m.add_class::<PyConversation>()?;
    m.add_class::<PyGenerationResult>()?;
    m.add_class::<PyGenerationStream>()?;
    Ok(())
}
