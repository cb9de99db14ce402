//! `specdraft.SpecEngine`, `specdraft.Conversation` and `specdraft.GenerationResult`: the
//! speculative decoding engine from Python.
//!
//! The engine runs with the interpreter released; it attaches only to call a Python
//! proposer (through the proposer adapter), a Python grammar matcher, or the tokenizer.
//! Prompts are token-id lists, or strings when a tokenizer (any object with `encode(text)`
//! and `decode(ids)`) is given; results carry `text` when there is a tokenizer.
//! A grammar is an object with a `matcher()` method returning a fresh matcher per sequence
//! (see `specdraft.grammar`), or a list of matchers, one per prompt; a matcher has
//! `fill_mask(mask)` (an int32 numpy array to fill in place), `advance(token)` and,
//! optionally, `is_finished()`.

use super::adapter::{format_traceback, wrap};
use super::errors::IntoPyResult;
use super::model::PyModelLevers;
use super::target_model::PyTargetModel;
use crate::engine::{
    Conversation, EngineError, GenerateRequest, GenerateResult, GrammarMatcher, Metrics,
    SamplingParams, SpecEngine,
};
use crate::model::{ModelLevers, TargetModel};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use std::sync::{Arc, Mutex};

/// Held while any engine runs: a target's forward outputs are valid only until its next
/// forward, so two generations must not interleave on one model. Taken with the
/// interpreter released, so a thread waiting here never blocks a Python proposer.
static ENGINE_RUN: Mutex<()> = Mutex::new(());

fn run_exclusive<R>(f: impl FnOnce() -> R) -> R {
    let _guard = ENGINE_RUN.lock().unwrap_or_else(|e| e.into_inner());
    f()
}

/// A Python grammar matcher behind [`GrammarMatcher`].
struct PyGrammar {
    obj: Py<PyAny>,
    has_is_finished: bool,
}

fn grammar_err(py: Python<'_>, what: &str, e: &PyErr) -> crate::Error {
    EngineError::Grammar(format!("{what}: {}", format_traceback(py, e))).into()
}

impl GrammarMatcher for PyGrammar {
    fn fill_mask(&mut self, mask: &mut [i32]) -> crate::Result<()> {
        Python::attach(|py| {
            let mut run = || -> PyResult<()> {
                let arr = PyArray1::<i32>::zeros(py, mask.len(), false);
                self.obj.bind(py).call_method1("fill_mask", (&arr,))?;
                mask.copy_from_slice(arr.readonly().as_slice()?);
                Ok(())
            };
            run().map_err(|e| grammar_err(py, "fill_mask", &e))
        })
    }

    fn advance(&mut self, token: u32) -> crate::Result<()> {
        Python::attach(|py| {
            let ok = self.obj.bind(py).call_method1("advance", (token,));
            match ok {
                // A matcher may return False to refuse a token.
                Ok(v)
                    if v.is_instance_of::<pyo3::types::PyBool>()
                        && !v.is_truthy().unwrap_or(true) =>
                {
                    Err(EngineError::Grammar(format!(
                        "advance({token}): the matcher refused the token"
                    ))
                    .into())
                }
                Ok(_) => Ok(()),
                Err(e) => Err(grammar_err(py, "advance", &e)),
            }
        })
    }

    fn is_finished(&self) -> bool {
        if !self.has_is_finished {
            return false;
        }
        Python::attach(|py| {
            self.obj
                .bind(py)
                .call_method0("is_finished")
                .and_then(|v| v.is_truthy())
                .unwrap_or(false)
        })
    }
}

fn matcher(obj: Bound<'_, PyAny>) -> PyResult<Box<dyn GrammarMatcher>> {
    for m in ["fill_mask", "advance"] {
        if !obj.hasattr(m)? {
            return Err(PyTypeError::new_err(format!(
                "a grammar matcher needs fill_mask(mask) and advance(token); {} has no {m}",
                super::backend::type_name(&obj)
            )));
        }
    }
    let has_is_finished = obj.hasattr("is_finished")?;
    Ok(Box::new(PyGrammar {
        obj: obj.unbind(),
        has_is_finished,
    }))
}

/// One matcher per prompt from `grammar` (a grammar with `matcher()`, or a list).
fn matchers(
    grammar: Option<&Bound<'_, PyAny>>,
    n: usize,
) -> PyResult<Vec<Option<Box<dyn GrammarMatcher>>>> {
    let Some(g) = grammar else {
        return Ok((0..n).map(|_| None).collect());
    };
    if let Ok(list) = g.cast::<PyList>() {
        if list.len() != n {
            return Err(PyValueError::new_err(format!(
                "grammar: {} matchers for {n} prompts (give one per prompt, or a grammar with matcher())",
                list.len()
            )));
        }
        return list.iter().map(|m| matcher(m).map(Some)).collect();
    }
    if g.hasattr("matcher")? {
        return (0..n)
            .map(|_| matcher(g.call_method0("matcher")?).map(Some))
            .collect();
    }
    if n == 1 {
        return Ok(vec![Some(matcher(g.clone())?)]);
    }
    Err(PyTypeError::new_err(
        "grammar must have a matcher() method, or be a list of matchers (one per prompt)",
    ))
}

/// A prompt as token ids: a list of ints as is, a string through the tokenizer.
fn prompt_ids(p: &Bound<'_, PyAny>, tokenizer: Option<&Py<PyAny>>) -> PyResult<Vec<u32>> {
    if p.is_instance_of::<PyString>() {
        let Some(tok) = tokenizer else {
            return Err(PyValueError::new_err(
                "a text prompt needs a tokenizer: pass tokenizer= to SpecEngine, or give token ids",
            ));
        };
        return tok.bind(p.py()).call_method1("encode", (p,))?.extract();
    }
    p.extract::<Vec<u32>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "a prompt must be a list of token ids or a string, got {}",
            super::backend::type_name(p)
        ))
    })
}

fn metrics_dict<'py>(py: Python<'py>, m: &Metrics) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("drafted", m.drafted)?;
    d.set_item("accepted", m.accepted)?;
    d.set_item("verify_steps", m.verify_steps)?;
    d.set_item("emitted", m.emitted)?;
    d.set_item("decode_tokens", m.decode_tokens)?;
    d.set_item("prompt_tokens", m.prompt_tokens)?;
    d.set_item("mean_acceptance_length", m.mean_acceptance_length())?;
    d.set_item("acceptance_rate", m.acceptance_rate())?;
    d.set_item("acceptance_by_position", m.acceptance_by_position())?;
    d.set_item("drafted_at", m.drafted_at.clone())?;
    d.set_item("accepted_at", m.accepted_at.clone())?;
    d.set_item("draft_time_s", m.draft_time.as_secs_f64())?;
    d.set_item("verify_time_s", m.verify_time.as_secs_f64())?;
    d.set_item("prefill_time_s", m.prefill_time.as_secs_f64())?;
    d.set_item("wall_time_s", m.wall_time.as_secs_f64())?;
    d.set_item("tokens_per_s", m.tokens_per_second())?;
    Ok(d)
}

/// The outcome of one prompt.
#[pyclass(name = "GenerationResult", module = "specdraft", frozen, get_all)]
pub struct PyGenerationResult {
    /// Generated token ids.
    tokens: Vec<u32>,
    /// The decoded text, when the engine has a tokenizer.
    text: Option<String>,
    /// "stop", "length", "context", "grammar" or "error".
    finish_reason: String,
    /// The error message when `finish_reason` is "error".
    error: Option<String>,
    /// Acceptance and timing figures (a dict).
    metrics: Py<PyDict>,
}

#[pymethods]
impl PyGenerationResult {
    fn __repr__(&self) -> String {
        format!(
            "GenerationResult(tokens={} ids, finish_reason={:?}{})",
            self.tokens.len(),
            self.finish_reason,
            self.error
                .as_ref()
                .map(|e| format!(", error={e:?}"))
                .unwrap_or_default()
        )
    }
}

fn to_py_result(
    py: Python<'_>,
    r: GenerateResult,
    tokenizer: Option<&Py<PyAny>>,
) -> PyResult<PyGenerationResult> {
    let text = match tokenizer {
        Some(t) => Some(
            t.bind(py)
                .call_method1("decode", (r.tokens.clone(),))?
                .extract()?,
        ),
        None => None,
    };
    Ok(PyGenerationResult {
        text,
        finish_reason: r.finish.as_str().to_string(),
        error: r.error.map(|e| e.to_string()),
        metrics: metrics_dict(py, &r.metrics)?.unbind(),
        tokens: r.tokens,
    })
}

fn sampling(temperature: f32, top_p: f32, top_k: usize, seed: u64) -> PyResult<SamplingParams> {
    let s = SamplingParams {
        temperature,
        top_p,
        top_k,
        seed,
    };
    s.validate()
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(s)
}

/// Speculative decoding on a target model with an optional proposer.
#[pyclass(name = "SpecEngine", module = "specdraft", frozen)]
pub struct PySpecEngine {
    engine: SpecEngine<TargetModel>,
    tokenizer: Option<Py<PyAny>>,
    proposer: Option<Py<PyAny>>,
    last_metrics: Mutex<Option<Metrics>>,
}

#[pymethods]
impl PySpecEngine {
    /// `SpecEngine(model, proposer=None, num_drafts=4, *, tokenizer=None, levers=None,
    /// max_batch=None)`. Without `levers` they are read from the `SPECDRAFT_*` variables.
    #[new]
    #[pyo3(signature = (model, proposer = None, num_drafts = 4, *, tokenizer = None, levers = None, max_batch = None))]
    fn new(
        model: &Bound<'_, PyAny>,
        proposer: Option<&Bound<'_, PyAny>>,
        num_drafts: usize,
        tokenizer: Option<Bound<'_, PyAny>>,
        levers: Option<PyModelLevers>,
        max_batch: Option<usize>,
    ) -> PyResult<Self> {
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
            .with_levers(levers);
        if let Some(n) = max_batch {
            engine = engine.with_max_batch(n);
        }
        Ok(PySpecEngine {
            engine,
            tokenizer: tokenizer.map(Bound::unbind),
            proposer: proposer.map(|p| p.clone().unbind()),
            last_metrics: Mutex::new(None),
        })
    }

    /// Generates a completion for each prompt (all stepping together). Sequence `i` samples
    /// with seed `seed + i`. Returns one `GenerationResult` per prompt; a prompt that fails
    /// (bad input, a proposer error) has `finish_reason == "error"` and the others run on.
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
        if prompts.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err(
                "prompts must be a list (of strings or of token-id lists), not one string",
            ));
        }
        let items: Vec<Bound<'_, PyAny>> = prompts.try_iter()?.collect::<PyResult<_>>()?;
        let ids: Vec<Vec<u32>> = items
            .iter()
            .map(|p| prompt_ids(p, self.tokenizer.as_ref()))
            .collect::<PyResult<_>>()?;
        let base = sampling(temperature, top_p, top_k, seed)?;
        let grammars = matchers(grammar, ids.len())?;
        let requests: Vec<GenerateRequest> = ids
            .into_iter()
            .zip(grammars)
            .enumerate()
            .map(|(i, (p, g))| {
                let mut r = GenerateRequest::new(p, max_tokens).with_sampling(SamplingParams {
                    seed: base.seed.wrapping_add(i as u64),
                    ..base
                });
                r.grammar = g;
                r.stop_on_eos = !ignore_eos;
                r
            })
            .collect();
        let engine = self.engine.clone();
        let generation = py.detach(move || run_exclusive(|| engine.generate(requests)));
        *self.last_metrics.lock().unwrap_or_else(|e| e.into_inner()) = Some(generation.metrics);
        generation
            .results
            .into_iter()
            .map(|r| to_py_result(py, r, self.tokenizer.as_ref()))
            .collect()
    }

    /// Figures of the last `generate` call over all its prompts (a dict), or None.
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

    /// The proposer object given at construction, or None.
    #[getter]
    fn proposer(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.proposer.as_ref().map(|p| p.clone_ref(py))
    }

    /// A multi-turn conversation that carries the drafter's KV between turns.
    fn conversation(&self, py: Python<'_>) -> PyConversation {
        PyConversation {
            inner: Mutex::new(self.engine.conversation()),
            tokenizer: self.tokenizer.as_ref().map(|t| t.clone_ref(py)),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "SpecEngine(proposer={}, num_drafts={})",
            if self.engine.proposer().is_some() {
                "yes"
            } else {
                "None"
            },
            self.engine.num_drafts()
        )
    }
}

/// A chat session: each `send` appends its tokens to the history and generates a reply.
#[pyclass(name = "Conversation", module = "specdraft", frozen)]
pub struct PyConversation {
    inner: Mutex<Conversation<TargetModel>>,
    tokenizer: Option<Py<PyAny>>,
}

#[pymethods]
impl PyConversation {
    /// Sends `message` (token ids, or a string with a tokenizer) and returns the reply.
    #[pyo3(signature = (message, max_tokens = 64, temperature = 0.0, top_p = 1.0, top_k = 0, seed = 0, grammar = None))]
    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        py: Python<'_>,
        message: &Bound<'_, PyAny>,
        max_tokens: usize,
        temperature: f32,
        top_p: f32,
        top_k: usize,
        seed: u64,
        grammar: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyGenerationResult> {
        let ids = prompt_ids(message, self.tokenizer.as_ref())?;
        let s = sampling(temperature, top_p, top_k, seed)?;
        let g = matchers(grammar, 1)?.pop().flatten();
        let result = py.detach(|| {
            let mut conv = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            run_exclusive(|| conv.send(&ids, max_tokens, s, g))
        });
        to_py_result(py, result.py()?, self.tokenizer.as_ref())
    }

    /// Every token so far (prompts and replies).
    #[getter]
    fn history(&self, py: Python<'_>) -> Vec<u32> {
        py.detach(|| {
            self.inner
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .history()
                .to_vec()
        })
    }

    /// Drafter KV rows carried into the next turn (0 when none).
    #[getter]
    fn carried_rows(&self, py: Python<'_>) -> usize {
        py.detach(|| {
            self.inner
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .carried()
                .map_or(0, |c| c.rows)
        })
    }

    /// Forgets the history and frees carried drafter KV.
    fn reset(&self, py: Python<'_>) {
        py.detach(|| {
            let mut conv = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            run_exclusive(|| conv.reset())
        });
    }
}

/// Registers the engine classes on the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySpecEngine>()?;
    m.add_class::<PyConversation>()?;
    m.add_class::<PyGenerationResult>()?;
    Ok(())
}
