//! Rust proposers as Python classes. Each is a subclass of `specdraft.DraftProposer` whose
//! base holds the Rust proposer, so every protocol method runs the Rust implementation, and
//! a Python subclass overrides exactly the methods it defines.

use super::errors::IntoPyResult;
use super::proposer::PyDraftProposer;
use crate::speculative::suffix::{self, SuffixDecoding, SuffixDecodingOptions};
use crate::speculative::PromptLookup;
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;

/// `PromptLookup(min_ngram, max_ngram, *, trees=False)`: n-gram drafting from the prompt
/// and the output so far (Rust; no device memory).
///
/// Matches suffixes of `min_ngram ..= max_ngram` tokens (by default the lengths measured
/// fastest: see `PromptLookup().min_ngram` and `.max_ngram`); raises `ProposerError` unless
/// `1 <= min_ngram <= max_ngram`. With `trees=True` it grows trees (`grows_trees()`): its
/// `propose_tree` drafts the continuations of several earlier matches as branches, and the
/// engine asks it for them under `draft_shape="tree"`; off by default, as on SmolLM2 trees
/// ran at 1.00x-1.03x the chain's speed alone and 0.91x-0.96x at `max_batch` 4. Its state is an opaque `ProposerState`. A Python subclass
/// may override single methods; the others run in Rust. The constructor's arguments reach
/// `__new__`, so a subclass's `__init__` takes the same ones (or the subclass defines
/// `__new__`).
#[pyclass(name = "PromptLookup", module = "specdraft", extends = PyDraftProposer, subclass, frozen)]
pub struct PyPromptLookup {
    min_ngram: usize,
    max_ngram: usize,
    trees: bool,
}

#[pymethods]
impl PyPromptLookup {
    #[new]
    #[pyo3(signature = (min_ngram = crate::speculative::DEFAULT_MIN_NGRAM, max_ngram = crate::speculative::DEFAULT_MAX_NGRAM, *, trees = false))]
    fn new(min_ngram: usize, max_ngram: usize, trees: bool) -> PyResult<PyClassInitializer<Self>> {
        let pl = PromptLookup::new(min_ngram, max_ngram)
            .py()?
            .with_trees(trees);
        Ok(
            PyClassInitializer::from(PyDraftProposer::holding(Arc::new(pl), "PromptLookup"))
                .add_subclass(PyPromptLookup {
                    min_ngram,
                    max_ngram,
                    trees,
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
        let trees = if self.trees { ", trees=True" } else { "" };
        format!(
            "PromptLookup(min_ngram={}, max_ngram={}{trees})",
            self.min_ngram, self.max_ngram
        )
    }
}

/// Drafting from suffix trees over the prompt, the output so far and the outputs of earlier
/// sequences on this proposer (host-only, no device memory). With `trees=True` it grows
/// draft trees (`grows_trees()`): the continuations of its match most likely to be reached,
/// best first, which the engine verifies under `draft_shape="tree"`.
#[pyclass(name = "SuffixDecoding", module = "specdraft", extends = PyDraftProposer, subclass, frozen)]
pub struct PySuffixDecoding {
    inner: Arc<SuffixDecoding>,
}

#[pymethods]
impl PySuffixDecoding {
    #[new]
    #[pyo3(signature = (max_depth = suffix::DEFAULT_MAX_DEPTH, min_token_prob = suffix::DEFAULT_MIN_TOKEN_PROB, max_spec_factor = suffix::DEFAULT_MAX_SPEC_FACTOR, max_tree_nodes = suffix::DEFAULT_MAX_TREE_NODES, *, trees = false))]
    fn new(
        max_depth: usize,
        min_token_prob: f32,
        max_spec_factor: f32,
        max_tree_nodes: usize,
        trees: bool,
    ) -> PyResult<PyClassInitializer<Self>> {
        let inner = Arc::new(
            SuffixDecoding::new(SuffixDecodingOptions {
                max_depth,
                min_token_prob,
                max_spec_factor,
                max_tree_nodes,
            })
            .py()?
            .with_trees(trees),
        );
        Ok(
            PyClassInitializer::from(PyDraftProposer::holding(inner.clone(), "SuffixDecoding"))
                .add_subclass(PySuffixDecoding { inner }),
        )
    }

    /// Longest string the trees keep: the matched suffix plus its drafts.
    #[getter]
    fn max_depth(&self) -> usize {
        self.inner.options().max_depth
    }

    /// Drafting stops before a draft reached with a lower estimated probability.
    #[getter]
    fn min_token_prob(&self) -> f32 {
        self.inner.options().min_token_prob
    }

    /// A match of `L` tokens drafts at most `floor(L * max_spec_factor)` tokens.
    #[getter]
    fn max_spec_factor(&self) -> f32 {
        self.inner.options().max_spec_factor
    }

    /// The shared tree's bound, in nodes and in stored output tokens.
    #[getter]
    fn max_tree_nodes(&self) -> usize {
        self.inner.options().max_tree_nodes
    }

    /// Whether it grows draft trees (`grows_trees()`), as built with `trees=True`.
    #[getter]
    fn trees(&self) -> bool {
        self.inner.trees()
    }

    /// What the shared tree of earlier outputs holds: outputs, tokens, nodes, bytes.
    fn shared_tree(&self) -> PyResult<HashMap<&'static str, usize>> {
        let s = self.inner.shared_tree().py()?;
        Ok(HashMap::from([
            ("outputs", s.outputs),
            ("tokens", s.tokens),
            ("nodes", s.nodes),
            ("bytes", s.bytes),
        ]))
    }

    /// Adds `output` to the shared tree as if a sequence had just produced it.
    fn remember_output(&self, output: Vec<u32>) -> PyResult<()> {
        self.inner.remember_output(&output).py()
    }

    fn __repr__(&self) -> String {
        let o = self.inner.options();
        format!(
            "SuffixDecoding(max_depth={}, min_token_prob={}, max_spec_factor={}, max_tree_nodes={}{})",
            o.max_depth,
            o.min_token_prob,
            o.max_spec_factor,
            o.max_tree_nodes,
            if self.inner.trees() { ", trees=True" } else { "" }
        )
    }
}
