//! `specdraft.DFlashHead`: the DFlash block-diffusion draft head as a
//! `specdraft.DraftProposer` subclass whose base holds the Rust head, so every protocol
//! method runs in Rust.
//!
//! Made with `DFlashHead.from_checkpoint(path, gpu, target=model, ...)` (a classmethod, so a
//! Python subclass gets its own class back), always beside its target: the head reads the
//! target's embedding and LM head in place. It remembers the backend its weights live on.

use super::backend::{backend_arg, PyBackend};
use super::errors::IntoPyResult;
use super::mtp::target_arg;
use super::proposer::PyDraftProposer;
use crate::speculative::{DFlashHead, MtpQuantization};
use numpy::PyArray1;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};
use std::path::PathBuf;
use std::sync::Arc;

/// The DFlash draft head of a checkpoint (z-lab's layout): a few Qwen3 layers that draft a
/// whole block of `block_size - 1` tokens in one forward.
///
/// Drafts from the target's hiddens captured at several layers (its `target_layer_ids`),
/// which the engine passes as `target_hidden_stack`; `block_gamma()` is the checkpoint's
/// `block_size`, so an engine asks it for `block_size - 1` drafts a step. Every protocol
/// method runs in Rust. Made with `DFlashHead.from_checkpoint(path, gpu, target=model)`;
/// `DFlashHead(path, gpu, target=model)` is the same call, and a subclass's `__init__`
/// receives those arguments.
#[pyclass(name = "DFlashHead", module = "specdraft", extends = PyDraftProposer, subclass, frozen)]
pub struct PyDFlashHead {
    head: Arc<DFlashHead>,
}

impl PyDFlashHead {
    /// The Rust head (the engine reads its drafter KV pool).
    pub(super) fn head(&self) -> &Arc<DFlashHead> {
        &self.head
    }
}

#[pymethods]
impl PyDFlashHead {
    #[new]
    #[pyo3(signature = (path, gpu, *, target, draft_vocab = None, quant = "bf16", max_seq_len = None, main_kv_blocks = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        gpu: &Bound<'_, PyAny>,
        target: &Bound<'_, PyAny>,
        draft_vocab: Option<usize>,
        quant: &str,
        max_seq_len: Option<usize>,
        main_kv_blocks: Option<usize>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let quant = match MtpQuantization::parse(quant) {
            Ok(MtpQuantization::Bf16) => None,
            Ok(MtpQuantization::Block(f)) => Some(f),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "quant {quant:?}: a DFlashHead's projections are \"bf16\" (as stored) or a GGUF block format to quantize to (\"q8_0\", ...)"
                )))
            }
        };
        let gpu = backend_arg(gpu)?.get().arc()?;
        let target = target_arg(target, &gpu)?;
        let max_seq_len = max_seq_len.unwrap_or_else(|| target.max_seq_len());
        let main_kv_blocks = main_kv_blocks.unwrap_or_else(|| target.kv_pool().num_blocks());
        let head = py
            .detach(move || {
                DFlashHead::from_checkpoint_for_target(
                    path,
                    target,
                    draft_vocab,
                    quant,
                    max_seq_len,
                    main_kv_blocks,
                )
            })
            .py()?;
        let head = Arc::new(head);
        Ok(PyClassInitializer::from(
            PyDraftProposer::holding(head.clone(), "DFlashHead").on_backend(gpu),
        )
        .add_subclass(PyDFlashHead { head }))
    }

    /// Loads the DFlash head in the checkpoint folder `path` beside `target` (a
    /// `TargetModel` on `gpu`); called on a subclass, returns an instance of that subclass.
    ///
    /// The folder holds z-lab's layout: `config.json` (a Qwen3 config of the draft layers
    /// with `block_size`, `num_target_layers` and `dflash_config: {target_layer_ids,
    /// mask_token_id}`) and safetensors of `fc`, `hidden_norm`, `layers.*` and `norm`. The
    /// target's embedding and LM head are read in place. `draft_vocab`: score only the LM
    /// head's first `draft_vocab` rows (every row when `None`). `quant`: the head's
    /// projections as stored (`"bf16"`) or quantized at load to a GGUF block format
    /// (`"q8_0"`, ...; on the CPU backend, run by the kernels the target's quantized
    /// projections run on). `max_seq_len` and `main_kv_blocks` size the drafter KV pool (the
    /// target's by default).
    #[classmethod]
    #[pyo3(signature = (path, gpu, *, target, draft_vocab = None, quant = "bf16", max_seq_len = None, main_kv_blocks = None))]
    #[allow(clippy::too_many_arguments)]
    fn from_checkpoint<'py>(
        cls: &Bound<'py, PyType>,
        path: PathBuf,
        gpu: &Bound<'py, PyAny>,
        target: Bound<'py, PyAny>,
        draft_vocab: Option<usize>,
        quant: &str,
        max_seq_len: Option<usize>,
        main_kv_blocks: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kwargs = PyDict::new(cls.py());
        kwargs.set_item("target", target)?;
        kwargs.set_item("draft_vocab", draft_vocab)?;
        kwargs.set_item("quant", quant)?;
        kwargs.set_item("max_seq_len", max_seq_len)?;
        kwargs.set_item("main_kv_blocks", main_kv_blocks)?;
        cls.call((path, gpu), Some(&kwargs))
    }

    /// γ: rows of one block forward; a propose drafts at most `block_size - 1` tokens.
    #[getter]
    fn block_size(&self) -> usize {
        self.head.block_size()
    }

    /// The token every block row after the first holds (`dflash_config.mask_token_id`).
    #[getter]
    fn mask_token_id(&self) -> u32 {
        self.head.mask_token_id()
    }

    /// Rows of the target's LM head drafts are chosen from.
    #[getter]
    fn draft_vocab_size(&self) -> usize {
        self.head.draft_vocab_size()
    }

    /// The storage of the head's projections (`"bf16"`, `"q8_0"`, ...).
    #[getter]
    fn projection_format(&self) -> &'static str {
        self.head.projection_format()
    }

    /// Draft layers.
    #[getter]
    fn num_layers(&self) -> usize {
        self.head.num_layers()
    }

    /// `(total, free)` blocks of the drafter KV pool.
    #[getter]
    fn kv_blocks(&self) -> (usize, usize) {
        self.head.kv_blocks()
    }

    /// Bytes of weights one block forward reads (the draft layers, `norm`, the block's
    /// embedding rows and the LM head rows drafts are chosen from).
    #[getter]
    fn bytes_per_block(&self) -> usize {
        self.head.bytes_per_block()
    }

    /// Row `row` of the f32 logits (over the draft vocabulary) of the latest block: the
    /// logits that picked draft `row`.
    #[pyo3(signature = (gpu, row = 0))]
    fn last_logits<'py>(
        &self,
        py: Python<'py>,
        gpu: PyRef<'_, PyBackend>,
        row: usize,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let v = gpu.with(|g| self.head.last_logits(g, row).py())?;
        Ok(PyArray1::from_vec(py, v))
    }

    fn __repr__(&self) -> String {
        format!(
            "DFlashHead(block_size={}, layers={}, target_layer_ids={:?}, draft_vocab_size={})",
            self.head.block_size(),
            self.head.num_layers(),
            self.head.capture_layer_ids(),
            self.head.draft_vocab_size()
        )
    }
}
