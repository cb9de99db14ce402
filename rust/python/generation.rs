//! What `SpecEngine.generate`, `SpecEngine.chat` and `Conversation.send` share: the
//! generation options, prompts as token ids or text, the tokenizer calls, and
//! `specdraft.GenerationResult`.
//!
//! A tokenizer is any object with `encode(text) -> list[int]` and `decode(ids) -> str`
//! (special tokens kept, so chat markers stay visible), and, for chat messages,
//! `apply_chat_template(messages, add_generation_prompt=...)`; `specdraft.Tokenizer` is
//! one. Its calls run attached to the interpreter, outside any engine lock.

use super::backend::type_name;
use super::errors::{request_error, to_pyerr};
use super::grammar::matchers;
use crate::engine::{FinishReason, GenerateRequest, GenerateResult, Metrics, SamplingParams};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use std::sync::Mutex;

/// Held while any engine or model forward runs: a target's forward outputs are valid only
/// until its next forward, so two generations must not interleave on one model. Taken with
/// the interpreter released, so a thread waiting here never blocks a Python proposer.
static ENGINE_RUN: Mutex<()> = Mutex::new(());

/// Runs `f` while no other engine or model forward runs.
pub fn run_exclusive<R>(f: impl FnOnce() -> R) -> R {
    let _guard = ENGINE_RUN.lock().unwrap_or_else(|e| e.into_inner());
    f()
}

/// The options every generating call takes (the keyword arguments of
/// `SpecEngine.generate`).
pub struct GenerateOptions<'a, 'py> {
    /// Most tokens to generate per prompt.
    pub max_tokens: usize,
    /// Sampling; prompt `i` of a call uses seed `seed + i`.
    pub sampling: SamplingParams,
    /// A grammar with `matcher()`, or one matcher per prompt.
    pub grammar: Option<&'a Bound<'py, PyAny>>,
    /// Keep generating past the model's EOS tokens.
    pub ignore_eos: bool,
}

impl<'a, 'py> GenerateOptions<'a, 'py> {
    /// The options of the Python keyword arguments, in their order (the sampling values
    /// are checked with the request).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        max_tokens: usize,
        temperature: f32,
        top_p: f32,
        top_k: usize,
        seed: u64,
        grammar: Option<&'a Bound<'py, PyAny>>,
        ignore_eos: bool,
    ) -> Self {
        GenerateOptions {
            max_tokens,
            sampling: SamplingParams {
                temperature,
                top_p,
                top_k,
                seed,
            },
            grammar,
            ignore_eos,
        }
    }

    /// The engine requests for `prompts`, one per prompt.
    pub fn requests(&self, prompts: Vec<Vec<u32>>) -> PyResult<Vec<GenerateRequest>> {
        let grammars = matchers(self.grammar, prompts.len())?;
        Ok(prompts
            .into_iter()
            .zip(grammars)
            .enumerate()
            .map(|(i, (prompt, grammar))| {
                let mut r =
                    GenerateRequest::new(prompt, self.max_tokens).with_sampling(SamplingParams {
                        seed: self.sampling.seed.wrapping_add(i as u64),
                        ..self.sampling
                    });
                r.grammar = grammar;
                r.stop_on_eos = !self.ignore_eos;
                r
            })
            .collect())
    }
}

/// The tokenizer, or the error a text input gets without one.
pub fn need_tokenizer<'a>(tokenizer: Option<&'a Py<PyAny>>, what: &str) -> PyResult<&'a Py<PyAny>> {
    tokenizer.ok_or_else(|| {
        request_error(format!(
            "{what} needs a tokenizer, and the model has none specdraft can read \
             (specdraft.load_tokenizer(path) says why): pass tokenizer= to SpecEngine, or give token ids"
        ))
    })
}

/// `tokenizer.encode(text)` as token ids.
pub fn encode(tokenizer: &Bound<'_, PyAny>, text: &str) -> PyResult<Vec<u32>> {
    tokenizer.call_method1("encode", (text,))?.extract()
}

/// `tokenizer.decode(ids)`.
pub fn decode(tokenizer: &Bound<'_, PyAny>, ids: &[u32]) -> PyResult<String> {
    tokenizer.call_method1("decode", (ids.to_vec(),))?.extract()
}

/// `messages` rendered with the tokenizer's chat template.
pub fn render_chat(
    tokenizer: &Bound<'_, PyAny>,
    messages: &Bound<'_, PyAny>,
    add_generation_prompt: bool,
) -> PyResult<String> {
    if !tokenizer.hasattr("apply_chat_template")? {
        return Err(PyTypeError::new_err(format!(
            "chat messages need a tokenizer with apply_chat_template(messages, add_generation_prompt=...); {} has none",
            type_name(tokenizer)
        )));
    }
    let kwargs = PyDict::new(tokenizer.py());
    kwargs.set_item("add_generation_prompt", add_generation_prompt)?;
    tokenizer
        .call_method("apply_chat_template", (messages,), Some(&kwargs))?
        .extract()
}

/// A prompt as token ids: a list of ints as is, a string through the tokenizer.
pub fn prompt_ids(p: &Bound<'_, PyAny>, tokenizer: Option<&Py<PyAny>>) -> PyResult<Vec<u32>> {
    if let Ok(text) = p.cast::<PyString>() {
        let tok = need_tokenizer(tokenizer, "a text prompt")?;
        return encode(tok.bind(p.py()), &text.to_cow()?);
    }
    p.extract::<Vec<u32>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "a prompt must be a list of token ids or a string, got {}",
            type_name(p)
        ))
    })
}

/// The metrics as the dict Python sees.
pub fn metrics_dict<'py>(py: Python<'py>, m: &Metrics) -> PyResult<Bound<'py, PyDict>> {
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
    d.set_item("draft_lengths", m.draft_lengths.clone())?;
    d.set_item("draft_time_s", m.draft_time.as_secs_f64())?;
    d.set_item("verify_time_s", m.verify_time.as_secs_f64())?;
    d.set_item("prefill_time_s", m.prefill_time.as_secs_f64())?;
    d.set_item("queue_time_s", m.queue_time.as_secs_f64())?;
    d.set_item(
        "time_to_first_token_s",
        m.mean_time_to_first_token().as_secs_f64(),
    )?;
    d.set_item("preemptions", m.preemptions)?;
    d.set_item("recomputed_tokens", m.recomputed_tokens)?;
    d.set_item("wall_time_s", m.wall_time.as_secs_f64())?;
    d.set_item("tokens_per_s", m.tokens_per_second())?;
    Ok(d)
}

/// The outcome of one prompt of `SpecEngine.generate`, `SpecEngine.chat` or
/// `Conversation.send`.
#[pyclass(name = "GenerationResult", module = "specdraft", frozen, get_all)]
pub struct PyGenerationResult {
    /// Generated token ids (the EOS id included when it ended the sequence).
    pub tokens: Vec<u32>,
    /// The decoded text of the generated tokens, without the EOS token that ended them;
    /// None when the engine has no tokenizer.
    pub text: Option<String>,
    /// Why it ended: "stop", "length", "context", "grammar" or "error".
    pub finish_reason: String,
    /// The exception that ended the sequence (a `SpecdraftError` subclass, with the error it
    /// wraps as its `__cause__`) when `finish_reason` is "error", else None.
    pub error: Option<Py<PyAny>>,
    /// Acceptance and timing figures (a dict): drafted, accepted, verify_steps, emitted,
    /// decode_tokens, prompt_tokens, mean_acceptance_length, acceptance_rate,
    /// acceptance_by_position, drafted_at, accepted_at, draft_lengths (steps that asked
    /// for k drafts at index k), draft_time_s, verify_time_s, prefill_time_s, queue_time_s
    /// (time waiting for a slot and KV blocks), time_to_first_token_s (from the call's
    /// start), preemptions, recomputed_tokens, wall_time_s, tokens_per_s.
    pub metrics: Py<PyDict>,
}

#[pymethods]
impl PyGenerationResult {
    fn __repr__(&self) -> String {
        format!(
            "GenerationResult(tokens={} ids, finish_reason={:?}{})",
            self.tokens.len(),
            self.finish_reason,
            if self.error.is_some() {
                ", error=..."
            } else {
                ""
            }
        )
    }
}

/// The tokens whose text a result shows: all of them, less the EOS token that ended them.
pub fn text_tokens<'a>(r: &'a GenerateResult, eos: &[u32]) -> &'a [u32] {
    match r.tokens.split_last() {
        Some((last, rest)) if r.finish == FinishReason::Stop && eos.contains(last) => rest,
        _ => &r.tokens,
    }
}

/// The Python result of `r`; `eos` are the model's EOS ids.
pub fn to_py_result(
    py: Python<'_>,
    r: GenerateResult,
    tokenizer: Option<&Py<PyAny>>,
    eos: &[u32],
) -> PyResult<PyGenerationResult> {
    let text = match tokenizer {
        Some(t) => Some(decode(t.bind(py), text_tokens(&r, eos))?),
        None => None,
    };
    Ok(PyGenerationResult {
        text,
        finish_reason: r.finish.as_str().to_string(),
        error: r.error.map(|e| to_pyerr(&e).into_value(py).into_any()),
        metrics: metrics_dict(py, &r.metrics)?.unbind(),
        tokens: r.tokens,
    })
}
