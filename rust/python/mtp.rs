//! `specdraft.MtpHead`, `specdraft.ReferenceDraftRunner` and `specdraft.quantize_nvfp4`.
//!
//! `MtpHead` is a `specdraft.DraftProposer` subclass whose base holds the Rust head, so every
//! protocol method runs in Rust; it is made with `MtpHead.from_checkpoint(path, gpu, ...)`
//! (a classmethod, so a Python subclass gets its own class back) and remembers the backend
//! its weights live on. `quantize_nvfp4` is the Rust NVFP4 quantizer, which
//! `specdraft quantize` uses.

use super::backend::{backend_arg, type_name, PyBackend};
use super::errors::IntoPyResult;
use super::model::PyModelLevers;
use super::proposer::{PyDraftProposer, PyDraftRunner};
use super::target_model::PyTargetModel;
use crate::backend::GpuBackend;
use crate::model::TargetModel;
use crate::speculative::mtp::quantize_nvfp4 as rust_quantize;
use crate::speculative::mtp::ReferenceDraftRunner;
use crate::speculative::{MtpHead, MtpQuantization};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};
use std::path::PathBuf;
use std::sync::Arc;

pub(super) fn parse_quant(quant: &str) -> PyResult<MtpQuantization> {
    MtpQuantization::parse(quant).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// The multi-token-prediction draft head of a checkpoint.
///
/// Finds the MTP module of a DeepSeek-V3 / GLM, MiMo or Qwen3-Next checkpoint and drafts
/// with it; every protocol method runs in Rust. Made with `MtpHead.from_checkpoint(path,
/// gpu, ...)`; `MtpHead(path, gpu, ...)` is the same call, and a subclass's `__init__`
/// receives those arguments.
#[pyclass(name = "MtpHead", module = "specdraft", extends = PyDraftProposer, subclass, frozen)]
pub struct PyMtpHead {
    head: Arc<MtpHead>,
}

impl PyMtpHead {
    /// The Rust head (the engine reads its drafter KV pool).
    pub(super) fn head(&self) -> &Arc<MtpHead> {
        &self.head
    }
}

#[pymethods]
impl PyMtpHead {
    #[new]
    #[pyo3(signature = (path, gpu, *, target = None, quant = "bf16", mtp_vocab_size = 0, max_seq_len = 4096, main_kv_blocks = 4096, levers = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        gpu: &Bound<'_, PyAny>,
        target: Option<&Bound<'_, PyAny>>,
        quant: &str,
        mtp_vocab_size: u32,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: Option<PyRef<'_, PyModelLevers>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let quant = parse_quant(quant)?;
        let gpu = backend_arg(gpu)?.get().arc()?;
        let target = target.map(|t| target_arg(t, &gpu)).transpose()?;
        let levers = levers.map(|l| l.0).unwrap_or_default();
        let home = gpu.clone();
        let head = py
            .detach(move || match target {
                Some(target) => MtpHead::from_checkpoint_for_target(
                    path,
                    target,
                    quant,
                    mtp_vocab_size,
                    max_seq_len,
                    main_kv_blocks,
                    &levers,
                ),
                None => MtpHead::from_checkpoint(
                    path,
                    gpu,
                    quant,
                    mtp_vocab_size,
                    max_seq_len,
                    main_kv_blocks,
                    &levers,
                ),
            })
            .py()?;
        let head = Arc::new(head);
        Ok(PyClassInitializer::from(
            PyDraftProposer::holding(head.clone(), "MtpHead").on_backend(home),
        )
        .add_subclass(PyMtpHead { head }))
    }

    /// Loads the MTP module of the checkpoint folder `path` onto `gpu`; called on a
    /// subclass, returns an instance of that subclass.
    ///
    /// With `target` (a `TargetModel` on `gpu`) the folder need hold only the head's own
    /// weights: the embedding, final norm and LM head are the target's, read in place (no
    /// copy), and the head keeps the target alive. `quant` is how the head's projections
    /// are stored: `"bf16"` (as given), `"fp8"`, `"nvfp4"`, or a GGUF block format such as
    /// `"q8_0"`, quantized at load by the quantizer `load_model(weights=...)` uses and run
    /// on the CPU backend's block kernels (another backend keeps the projections as given); `mtp_vocab_size` restricts drafts to the first
    /// rows of the LM head (0: all, or beside a target the `mtp_vocab_size` of the head's
    /// `config.json`).
    #[classmethod]
    #[pyo3(signature = (path, gpu, *, target = None, quant = "bf16", mtp_vocab_size = 0, max_seq_len = 4096, main_kv_blocks = 4096, levers = None))]
    #[allow(clippy::too_many_arguments)]
    fn from_checkpoint<'py>(
        cls: &Bound<'py, PyType>,
        path: PathBuf,
        gpu: &Bound<'py, PyAny>,
        target: Option<Bound<'py, PyAny>>,
        quant: &str,
        mtp_vocab_size: u32,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: Option<Bound<'py, PyModelLevers>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kwargs = PyDict::new(cls.py());
        kwargs.set_item("target", target)?;
        kwargs.set_item("quant", quant)?;
        kwargs.set_item("mtp_vocab_size", mtp_vocab_size)?;
        kwargs.set_item("max_seq_len", max_seq_len)?;
        kwargs.set_item("main_kv_blocks", main_kv_blocks)?;
        kwargs.set_item("levers", levers)?;
        cls.call((path, gpu), Some(&kwargs))
    }

    /// Rows of the LM head drafts are chosen from.
    #[getter]
    fn draft_vocab_size(&self) -> usize {
        self.head.draft_vocab_size()
    }

    /// How the head's own projections are stored (`"bf16"`, `"q8_0"`, ...).
    #[getter]
    fn projection_format(&self) -> &'static str {
        self.head.projection_format()
    }

    /// Bytes of weights one draft step reads.
    #[getter]
    fn bytes_per_draft(&self) -> usize {
        self.head.bytes_per_draft()
    }

    /// `(total, free)` blocks of the drafter KV pool.
    #[getter]
    fn kv_blocks(&self) -> (usize, usize) {
        self.head.kv_blocks()
    }

    /// Whether the head reads a target's embedding and LM head in place (loaded with
    /// `target=`).
    #[getter]
    fn shares_target(&self) -> bool {
        self.head.shares_target()
    }

    /// The checkpoint layout: `"deepseek_v3"`, `"mimo"` or `"qwen3_next"`.
    #[getter]
    fn layout(&self) -> &'static str {
        self.head.weights().layout.name()
    }

    /// Row `row` of the f32 logits of the head's latest forward.
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

    /// Turns tree growth on or off (off by default): on, `grows_trees()` is true and an
    /// engine under `draft_shape="tree"` asks the head for EAGLE-2 trees, grown together
    /// for the sequences that propose together.
    fn set_grow_trees(&self, on: bool) {
        self.head.set_grow_trees(on);
    }

    fn __repr__(&self) -> String {
        format!(
            "MtpHead(layout={:?}, draft_vocab_size={})",
            self.head.weights().layout.name(),
            self.head.draft_vocab_size()
        )
    }
}

/// The reference circuit runner: drafts from the binding `circuit_draft` describes, with
/// the MTP head's equations, grammar masks included.
///
/// `head.set_circuit_draft(specdraft.ReferenceDraftRunner())` makes an `MtpHead` draft
/// through it (one sequence at a time: `propose_batch` then answers None); the drafts are
/// the head's own. A check for a circuit executor, and an example of the binding's use.
#[pyclass(name = "ReferenceDraftRunner", module = "specdraft", extends = PyDraftRunner, frozen)]
pub struct PyReferenceDraftRunner;

#[pymethods]
impl PyReferenceDraftRunner {
    #[new]
    fn new() -> PyClassInitializer<Self> {
        PyClassInitializer::from(PyDraftRunner {
            inner: Arc::new(ReferenceDraftRunner),
        })
        .add_subclass(PyReferenceDraftRunner)
    }

    fn __repr__(&self) -> &'static str {
        "ReferenceDraftRunner()"
    }
}

/// The Rust target behind a `target=` argument, which must live on `gpu`.
pub(super) fn target_arg(
    target: &Bound<'_, PyAny>,
    gpu: &Arc<dyn GpuBackend>,
) -> PyResult<Arc<TargetModel>> {
    let model = target.cast::<PyTargetModel>().map_err(|_| {
        PyTypeError::new_err(format!(
            "target must be a specdraft TargetModel (specdraft.load_model), got {}",
            type_name(target)
        ))
    })?;
    let model = model.get().arc();
    if !Arc::ptr_eq(model.gpu(), gpu) {
        return Err(PyValueError::new_err(format!(
            "the target lives on the {} backend it was loaded on, not on the gpu given; pass gpu=model.gpu",
            model.gpu().name()
        )));
    }
    Ok(model)
}

/// Quantizes a float32 `[out, in]` matrix to NVFP4 (ModelOpt layout) with the Rust
/// quantizer: returns `(weight uint8 [out, in/2], weight_scale uint8 [out, in/16] (FP8
/// E4M3 bytes), weight_scale_2 float)`.
#[pyfunction]
pub fn quantize_nvfp4<'py>(
    py: Python<'py>,
    w: PyReadonlyArray2<'py, f32>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>, f32)> {
    let shape = w.shape().to_vec();
    let (rows, cols) = (shape[0], shape[1]);
    let data: Vec<f32> = w.as_array().iter().copied().collect();
    let q = rust_quantize(&data, rows, cols).py()?;
    let codes = PyArray1::from_vec(py, q.codes)
        .reshape([rows, cols / 2])?
        .into_any();
    let scales = PyArray1::from_vec(py, q.scales)
        .reshape([rows, cols / 16])?
        .into_any();
    Ok((codes, scales, q.global_scale))
}
