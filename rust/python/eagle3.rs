//! `specdraft.Eagle3Head`: the EAGLE-3 draft head as a `specdraft.DraftProposer` subclass
//! whose base holds the Rust head, so every protocol method runs in Rust.
//!
//! Made with `Eagle3Head.from_checkpoint(path, gpu, ...)` (a classmethod, so a Python
//! subclass gets its own class back), beside its target (`target=`) or alone with the
//! target's layer count (`target_layers=`); it remembers the backend its weights live on.

use super::backend::{backend_arg, PyBackend};
use super::errors::IntoPyResult;
use super::model::PyModelLevers;
use super::mtp::{parse_quant, target_arg};
use super::proposer::PyDraftProposer;
use crate::speculative::Eagle3Head;
use numpy::PyArray1;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};
use std::path::PathBuf;
use std::sync::Arc;

/// The EAGLE-3 draft head of a checkpoint (speculators or original EAGLE-3 layout).
///
/// Drafts from the target's hiddens captured at several layers (its `target_layer_ids`),
/// which the engine passes as `target_hidden_stack`; every protocol method runs in Rust.
/// Made with `Eagle3Head.from_checkpoint(path, gpu, ...)`; `Eagle3Head(path, gpu, ...)` is the
/// same call, and a subclass's `__init__` receives those arguments.
#[pyclass(name = "Eagle3Head", module = "specdraft", extends = PyDraftProposer, subclass, frozen)]
pub struct PyEagle3Head {
    head: Arc<Eagle3Head>,
}

impl PyEagle3Head {
    /// The Rust head (the engine reads its drafter KV pool).
    pub(super) fn head(&self) -> &Arc<Eagle3Head> {
        &self.head
    }
}

#[pymethods]
impl PyEagle3Head {
    #[new]
    #[pyo3(signature = (path, gpu, *, target = None, target_layers = None, quant = "bf16", max_seq_len = 4096, main_kv_blocks = 4096, levers = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        gpu: &Bound<'_, PyAny>,
        target: Option<&Bound<'_, PyAny>>,
        target_layers: Option<usize>,
        quant: &str,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: Option<PyRef<'_, PyModelLevers>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let quant = parse_quant(quant)?;
        let gpu = backend_arg(gpu)?.get().arc()?;
        let target = target.map(|t| target_arg(t, &gpu)).transpose()?;
        let levers = levers.map(|l| l.0).unwrap_or_default();
        let home = gpu.clone();
        let head = match (target, target_layers) {
            (Some(target), layers) => {
                let theirs = target.config().num_hidden_layers;
                if layers.is_some_and(|l| l != theirs) {
                    return Err(PyValueError::new_err(format!(
                        "target_layers={} but the target has {theirs} layers; leave target_layers out with target=",
                        layers.unwrap_or(0)
                    )));
                }
                py.detach(move || {
                    Eagle3Head::from_checkpoint_for_target_quantized(
                        path,
                        target,
                        quant,
                        max_seq_len,
                        main_kv_blocks,
                        &levers,
                    )
                })
            }
            (None, Some(layers)) => py.detach(move || {
                Eagle3Head::from_checkpoint_quantized(
                    path,
                    gpu,
                    layers,
                    quant,
                    max_seq_len,
                    main_kv_blocks,
                    &levers,
                )
            }),
            (None, None) => {
                return Err(PyValueError::new_err(
                    "Eagle3Head needs its target: pass target= (a TargetModel) or target_layers= (the target's layer count)",
                ))
            }
        }
        .py()?;
        let head = Arc::new(head);
        Ok(PyClassInitializer::from(
            PyDraftProposer::holding(head.clone(), "Eagle3Head").on_backend(home),
        )
        .add_subclass(PyEagle3Head { head }))
    }

    /// Loads the EAGLE-3 head in the checkpoint folder `path` onto `gpu`; called on a
    /// subclass, returns an instance of that subclass.
    ///
    /// The folder holds a speculators checkpoint (`config.json` with
    /// `speculators_model_type: "eagle3"`, `layers.0.*`) or an original EAGLE-3 one
    /// (`midlayer.*`): `fc`, the decoder layer, `norm`, `lm_head` over the draft vocabulary
    /// and `d2t`. With `target` (a `TargetModel` on `gpu`) the target's embedding is read in
    /// place unless the folder has `embed_tokens.weight`, and the target's layer count
    /// decides the default capture layers; without it, pass `target_layers` (the target's
    /// `num_hidden_layers`) and the folder must carry its own embedding. `quant` is how the
    /// head's matrices (`fc`, the layer's projections and its own LM head) are stored, as
    /// `MtpHead`'s `quant` says: `"bf16"` as loaded, `"q8_0"` (or another GGUF block format)
    /// quantized at load and run by the block-format kernels on the CPU, `"fp8"`, `"nvfp4"`.
    #[classmethod]
    #[pyo3(signature = (path, gpu, *, target = None, target_layers = None, quant = "bf16", max_seq_len = 4096, main_kv_blocks = 4096, levers = None))]
    #[allow(clippy::too_many_arguments)]
    fn from_checkpoint<'py>(
        cls: &Bound<'py, PyType>,
        path: PathBuf,
        gpu: &Bound<'py, PyAny>,
        target: Option<Bound<'py, PyAny>>,
        target_layers: Option<usize>,
        quant: &str,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: Option<Bound<'py, PyModelLevers>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kwargs = PyDict::new(cls.py());
        kwargs.set_item("target", target)?;
        kwargs.set_item("target_layers", target_layers)?;
        kwargs.set_item("quant", quant)?;
        kwargs.set_item("max_seq_len", max_seq_len)?;
        kwargs.set_item("main_kv_blocks", main_kv_blocks)?;
        kwargs.set_item("levers", levers)?;
        cls.call((path, gpu), Some(&kwargs))
    }

    /// Rows of the head's own LM head (its draft vocabulary).
    #[getter]
    fn draft_vocab_size(&self) -> usize {
        self.head.draft_vocab_size()
    }

    /// The target id of each draft id (`d + d2t[d]`), as uint32.
    #[getter]
    fn draft_to_target<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        PyArray1::from_slice(py, self.head.draft_to_target())
    }

    /// The checkpoint's `eagle_aux_hidden_state_layer_ids` (or vLLM's default): the hidden
    /// entering layer `k`; `target_layer_ids()` is `k - 1` for each.
    #[getter]
    fn aux_layer_ids(&self) -> Vec<usize> {
        self.head.aux_layer_ids().to_vec()
    }

    /// `"speculators"` or `"eagle3"` (the original release's `config.json`).
    #[getter]
    fn format(&self) -> &'static str {
        self.head.format()
    }

    /// Whether the head reads its target's embedding in place (loaded with `target=` from
    /// a folder without `embed_tokens.weight`).
    #[getter]
    fn shares_target(&self) -> bool {
        self.head.shares_target()
    }

    /// `(total, free)` blocks of the drafter KV pool.
    #[getter]
    fn kv_blocks(&self) -> (usize, usize) {
        self.head.kv_blocks()
    }

    /// Bytes of weights one draft step reads.
    #[getter]
    fn bytes_per_draft(&self) -> usize {
        self.head.bytes_per_draft()
    }

    /// The storage of the head's projections (`"bf16"`, `"q8_0"`, ...).
    #[getter]
    fn projection_format(&self) -> &'static str {
        self.head.projection_format()
    }

    /// The storage of the head's own LM head (`"bf16"`, `"q8_0"`, ...).
    #[getter]
    fn lm_head_format(&self) -> &'static str {
        self.head.lm_head_format()
    }

    /// Row `row` of the f32 logits (over the draft vocabulary) of the head's latest forward.
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

    /// Turns tree growth on or off (off by default), as `MtpHead.set_grow_trees` does.
    fn set_grow_trees(&self, on: bool) {
        self.head.set_grow_trees(on);
    }

    fn __repr__(&self) -> String {
        format!(
            "Eagle3Head(format={:?}, draft_vocab_size={}, aux_layer_ids={:?})",
            self.head.format(),
            self.head.draft_vocab_size(),
            self.head.aux_layer_ids()
        )
    }
}
