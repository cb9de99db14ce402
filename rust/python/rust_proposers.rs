//! Rust proposers as Python classes. Each is a subclass of `specdraft.DraftProposer` whose
//! base holds the Rust proposer, so every protocol method runs the Rust implementation, and
//! a Python subclass overrides exactly the methods it defines.

use super::errors::IntoPyResult;
use super::proposer::PyDraftProposer;
use crate::speculative::PromptLookup;
use pyo3::prelude::*;
use std::sync::Arc;

/// `PromptLookup(min_ngram, max_ngram)`: n-gram drafting from the prompt and the output
/// so far (Rust; no device memory).
///
/// Matches suffixes of `min_ngram ..= max_ngram` tokens (by default the lengths measured
/// fastest: see `PromptLookup().min_ngram` and `.max_ngram`); raises `ProposerError` unless
/// `1 <= min_ngram <= max_ngram`. Its state is an opaque `ProposerState`. A Python subclass
/// may override single methods; the others run in Rust. The constructor's arguments reach
/// `__new__`, so a subclass's `__init__` takes the same ones (or the subclass defines
/// `__new__`).
#[pyclass(name = "PromptLookup", module = "specdraft", extends = PyDraftProposer, subclass, frozen)]
pub struct PyPromptLookup {
    min_ngram: usize,
    max_ngram: usize,
}

#[pymethods]
impl PyPromptLookup {
    #[new]
    #[pyo3(signature = (min_ngram = crate::speculative::DEFAULT_MIN_NGRAM, max_ngram = crate::speculative::DEFAULT_MAX_NGRAM))]
    fn new(min_ngram: usize, max_ngram: usize) -> PyResult<PyClassInitializer<Self>> {
        let pl = PromptLookup::new(min_ngram, max_ngram).py()?;
        Ok(
            PyClassInitializer::from(PyDraftProposer::holding(Arc::new(pl), "PromptLookup"))
                .add_subclass(PyPromptLookup {
                    min_ngram,
                    max_ngram,
                }),
        )
    }

    /// Shortest suffix it matches.
    #[getter]
    fn min_ngram(&self) -> usize {
        self.min_ngram
    }

    /// Longest suffix it matches.
    #[getter]
    fn max_ngram(&self) -> usize {
        self.max_ngram
    }

    /// The drafts for `history` without any state: the continuation of the most recent
    /// earlier occurrence of its longest matching suffix.
    #[pyo3(signature = (history, num_drafts))]
    fn lookup(&self, history: Vec<u32>, num_drafts: usize) -> PyResult<Vec<u32>> {
        let pl = PromptLookup::new(self.min_ngram, self.max_ngram).py()?;
        Ok(pl.lookup(&history, num_drafts, None))
    }

    fn __repr__(&self) -> String {
        format!(
            "PromptLookup(min_ngram={}, max_ngram={})",
            self.min_ngram, self.max_ngram
        )
    }
}
