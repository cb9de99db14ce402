//! `specdraft.GenerationStream`: the iterator `SpecEngine.stream` returns, yielding each
//! request's tokens as verification emits them.
//!
//! Each `__next__` that finds nothing buffered runs one scheduler iteration with the
//! interpreter released (and the engine lock held, as `generate` does), so Python code runs
//! between steps and other threads run during them. Text deltas are decoded incrementally
//! over a short window of ids (after vLLM's detokenizer): text is held back while it ends in
//! an incomplete UTF-8 sequence (U+FFFD), so a multi-byte character is never split.
//!
//! Invariant: whatever ends the stream (its end, `close`, leaving a `with` block, or the
//! iterator being dropped when the consumer raises), every sequence's KV, proposer state
//! and buffers are released: the run releases everything when dropped.

use super::generation::{decode, run_exclusive, to_py_result, PyGenerationResult};
use crate::engine::{FinishReason, GenerationRun, StreamUpdate};
use crate::model::TargetModel;
use pyo3::prelude::*;
use std::collections::VecDeque;
use std::sync::Mutex;

/// What the stream yields: `(request_index, new_token_ids, text_delta)`.
type StreamItem = (usize, Vec<u32>, Option<String>);

/// One request's incremental detokenizer state.
#[derive(Default)]
struct TextState {
    ids: Vec<u32>,
    /// Start of the window decoded for context.
    prefix_offset: usize,
    /// End of the ids whose text was already yielded.
    read_offset: usize,
}

impl TextState {
    /// The text `new` ids add; with `flush`, whatever is left even if incomplete.
    fn push(&mut self, tok: &Bound<'_, PyAny>, new: &[u32], flush: bool) -> PyResult<String> {
        self.ids.extend_from_slice(new);
        if self.read_offset >= self.ids.len() {
            return Ok(String::new());
        }
        let before = decode(tok, &self.ids[self.prefix_offset..self.read_offset])?;
        let after = decode(tok, &self.ids[self.prefix_offset..])?;
        if !flush && after.ends_with('\u{fffd}') {
            return Ok(String::new());
        }
        let delta = match after.strip_prefix(before.as_str()) {
            Some(d) => d.to_string(),
            // The window's text changed with the new ids (a tokenizer that merges across
            // them): yield what follows the common prefix.
            None => {
                let common = before
                    .char_indices()
                    .zip(after.chars())
                    .find(|((_, a), b)| a != b)
                    .map_or(before.len().min(after.len()), |((i, _), _)| i);
                after.get(common..).unwrap_or_default().to_string()
            }
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(delta)
    }
}

/// The iterator `SpecEngine.stream` returns: yields `(request_index, new_token_ids,
/// text_delta)` as tokens are verified (`text_delta` is None when the engine has no
/// tokenizer; it stops before the EOS token that ends a request). After the last item,
/// `results` holds one `GenerationResult` per prompt. `close()` (or leaving a `with` block)
/// stops the generation and frees what it holds; requests it cut short end with an error.
#[pyclass(name = "GenerationStream", module = "specdraft")]
pub struct PyGenerationStream {
    /// In a mutex only so the class is `Sync`; every access has `&mut self`.
    run: Mutex<Option<GenerationRun<TargetModel>>>,
    buffered: VecDeque<StreamUpdate>,
    texts: Vec<TextState>,
    tokenizer: Option<Py<PyAny>>,
    eos: Vec<u32>,
    results: Option<Vec<Py<PyGenerationResult>>>,
}

impl PyGenerationStream {
    pub(super) fn new(
        run: GenerationRun<TargetModel>,
        requests: usize,
        tokenizer: Option<Py<PyAny>>,
        eos: Vec<u32>,
    ) -> Self {
        PyGenerationStream {
            run: Mutex::new(Some(run)),
            buffered: VecDeque::new(),
            texts: (0..requests).map(|_| TextState::default()).collect(),
            tokenizer,
            eos,
            results: None,
        }
    }

    fn slot(&mut self) -> &mut Option<GenerationRun<TargetModel>> {
        self.run.get_mut().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends the run (stopping what had not ended) and keeps its results.
    fn finish(&mut self, py: Python<'_>) -> PyResult<()> {
        let Some(run) = self.slot().take() else {
            return Ok(());
        };
        let generation = py.detach(move || run_exclusive(move || run.finish()));
        let results = generation
            .results
            .into_iter()
            .map(|r| Py::new(py, to_py_result(py, r, self.tokenizer.as_ref(), &self.eos)?))
            .collect::<PyResult<Vec<_>>>()?;
        self.results = Some(results);
        Ok(())
    }

    /// The item for `u`, or None when it carries no tokens.
    fn item(&mut self, py: Python<'_>, u: StreamUpdate) -> PyResult<Option<StreamItem>> {
        let text = match &self.tokenizer {
            None => None,
            Some(tok) => {
                let ended_by_eos = u.finish == Some(FinishReason::Stop)
                    && u.tokens.last().is_some_and(|t| self.eos.contains(t));
                let shown = if ended_by_eos {
                    &u.tokens[..u.tokens.len() - 1]
                } else {
                    &u.tokens[..]
                };
                let state = &mut self.texts[u.request];
                Some(state.push(tok.bind(py), shown, u.finish.is_some())?)
            }
        };
        if u.tokens.is_empty() && text.as_deref().is_none_or(str::is_empty) {
            return Ok(None);
        }
        Ok(Some((u.request, u.tokens, text)))
    }
}

#[pymethods]
impl PyGenerationStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<StreamItem>> {
        loop {
            if let Some(u) = self.buffered.pop_front() {
                if let Some(item) = self.item(py, u)? {
                    return Ok(Some(item));
                }
                continue;
            }
            let Some(mut run) = self.slot().take() else {
                return Ok(None);
            };
            if run.is_done() {
                *self.slot() = Some(run);
                self.finish(py)?;
                return Ok(None);
            }
            let (run, updates) = py.detach(move || {
                run_exclusive(move || {
                    run.step();
                    let updates = run.take_updates();
                    (run, updates)
                })
            });
            *self.slot() = Some(run);
            self.buffered.extend(updates);
        }
    }

    /// One `GenerationResult` per prompt once the stream has ended (or been closed), else
    /// None.
    #[getter]
    fn results(&self, py: Python<'_>) -> Option<Vec<Py<PyGenerationResult>>> {
        self.results
            .as_ref()
            .map(|r| r.iter().map(|x| x.clone_ref(py)).collect())
    }

    /// Stops the generation now and frees everything it holds; requests that had not
    /// ended end with an error saying so. Closing twice does nothing.
    fn close(&mut self, py: Python<'_>) -> PyResult<()> {
        self.buffered.clear();
        self.finish(py)
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(
        &mut self,
        py: Python<'_>,
        _args: &Bound<'_, pyo3::types::PyTuple>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }
}
