//! Python views of the model layer: `ModelConfig`, `ModelLevers`, `BufferArena`,
//! `ForwardContext`.
//!
//! Each view holds `Arc` clones (or copies) of what it shows, never borrows, so a Python
//! proposer may keep a `ForwardContext` past the call it was given in.

use super::backend::{backend_arg, backend_from_arc};
use super::device_ptr::{PtrArg, PyDevicePtr};
use super::errors::{ConfigError as PyConfigError, IntoPyResult};
use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig, ModelLevers};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;

/// The sizes and switches of a target model (read-only).
#[pyclass(name = "ModelConfig", module = "specdraft", frozen, eq)]
pub struct PyModelConfig {
    pub inner: Arc<ModelConfig>,
}

impl PartialEq for PyModelConfig {
    fn eq(&self, other: &Self) -> bool {
        *self.inner == *other.inner
    }
}

#[pymethods]
impl PyModelConfig {
    /// Parses the text of a Hugging Face `config.json` (`ConfigError` when invalid).
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<Self> {
        Ok(PyModelConfig {
            inner: Arc::new(ModelConfig::from_json_str(text).py()?),
        })
    }

    /// Reads a Hugging Face `config.json` file.
    #[staticmethod]
    fn from_file(path: std::path::PathBuf) -> PyResult<Self> {
        Ok(PyModelConfig {
            inner: Arc::new(ModelConfig::from_file(path).py()?),
        })
    }

    /// A small Llama-family config for tests and examples.
    #[staticmethod]
    #[pyo3(signature = (vocab_size = 256))]
    fn tiny(vocab_size: usize) -> PyResult<Self> {
        let config = ModelConfig::tiny(vocab_size);
        config.validate().py()?;
        Ok(PyModelConfig {
            inner: Arc::new(config),
        })
    }

    /// The Hugging Face `model_type` of the family.
    #[getter]
    fn model_type(&self) -> &'static str {
        self.inner.family.model_type()
    }
    /// Model width.
    #[getter]
    fn hidden_size(&self) -> usize {
        self.inner.hidden_size
    }
    /// Dense MLP width.
    #[getter]
    fn intermediate_size(&self) -> usize {
        self.inner.intermediate_size
    }
    /// Decoder layers of the main model.
    #[getter]
    fn num_hidden_layers(&self) -> usize {
        self.inner.num_hidden_layers
    }
    /// Query heads.
    #[getter]
    fn num_attention_heads(&self) -> usize {
        self.inner.num_attention_heads
    }
    /// Key/value heads.
    #[getter]
    fn num_key_value_heads(&self) -> usize {
        self.inner.num_key_value_heads
    }
    /// Width of one head.
    #[getter]
    fn head_dim(&self) -> usize {
        self.inner.head_dim
    }
    /// Vocabulary size.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }
    /// RMSNorm epsilon.
    #[getter]
    fn rms_norm_eps(&self) -> f32 {
        self.inner.rms_norm_eps
    }
    /// RoPE base.
    #[getter]
    fn rope_theta(&self) -> f32 {
        self.inner.rope_theta
    }
    /// Fraction of each head RoPE rotates.
    #[getter]
    fn partial_rotary_factor(&self) -> f32 {
        self.inner.partial_rotary_factor
    }
    /// Longest context the model was trained for.
    #[getter]
    fn max_position_embeddings(&self) -> usize {
        self.inner.max_position_embeddings
    }
    /// Whether the LM head shares the embedding's weights.
    #[getter]
    fn tie_word_embeddings(&self) -> bool {
        self.inner.tie_word_embeddings
    }
    /// Whether q/k/v projections carry biases.
    #[getter]
    fn attention_bias(&self) -> bool {
        self.inner.attention_bias
    }
    /// Whether q and k get a per-head RMSNorm.
    #[getter]
    fn qk_norm(&self) -> bool {
        self.inner.qk_norm
    }
    /// MTP modules in the checkpoint (0 when none).
    #[getter]
    fn num_nextn_predict_layers(&self) -> usize {
        self.inner.num_nextn_predict_layers
    }
    /// End-of-sequence token ids.
    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.inner.eos_token_ids.clone()
    }
    /// Width of the query projection's output.
    #[getter]
    fn q_size(&self) -> usize {
        self.inner.q_size()
    }
    /// Width of the key (and value) projection's output.
    #[getter]
    fn kv_size(&self) -> usize {
        self.inner.kv_size()
    }

    /// RoPE scaling as a dict, or None.
    #[getter]
    fn rope_scaling<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(rs) = &self.inner.rope_scaling else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("rope_type", &rs.kind)?;
        d.set_item("factor", rs.factor)?;
        d.set_item("low_freq_factor", rs.low_freq_factor)?;
        d.set_item("high_freq_factor", rs.high_freq_factor)?;
        d.set_item(
            "original_max_position_embeddings",
            rs.original_max_position_embeddings,
        )?;
        Ok(Some(d))
    }

    /// Mixture-of-experts sizes as a dict, or None for dense models.
    #[getter]
    fn moe<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(m) = &self.inner.moe else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("num_experts", m.num_experts)?;
        d.set_item("experts_per_token", m.experts_per_token)?;
        d.set_item("expert_intermediate_size", m.expert_intermediate_size)?;
        d.set_item("num_shared_experts", m.num_shared_experts)?;
        d.set_item("norm_topk_prob", m.norm_topk_prob)?;
        d.set_item("routed_scaling_factor", m.routed_scaling_factor)?;
        Ok(Some(d))
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "ModelConfig(model_type={:?}, hidden_size={}, num_hidden_layers={}, num_attention_heads={}, num_key_value_heads={}, head_dim={}, vocab_size={})",
            c.family.model_type(),
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.vocab_size
        )
    }
}

/// `ModelLevers(*, mtp_kv_exact=False, mtp_target_postnorm=False, mtp_chain_postnorm=False,
/// defer_drafter_prefill=False)`: the switches that change how the model and its draft head
/// run (resolved once). Levers set by hand; unset means off.
#[pyclass(name = "ModelLevers", module = "specdraft", frozen, eq, from_py_object)]
#[derive(Clone, Copy, PartialEq)]
pub struct PyModelLevers(pub ModelLevers);

#[pymethods]
impl PyModelLevers {
    #[new]
    #[pyo3(signature = (*, mtp_kv_exact = false, mtp_target_postnorm = false, mtp_chain_postnorm = false, defer_drafter_prefill = false))]
    fn new(
        mtp_kv_exact: bool,
        mtp_target_postnorm: bool,
        mtp_chain_postnorm: bool,
        defer_drafter_prefill: bool,
    ) -> Self {
        PyModelLevers(ModelLevers {
            mtp_kv_exact,
            mtp_target_postnorm,
            mtp_chain_postnorm,
            defer_drafter_prefill,
        })
    }

    /// Reads the levers from the `SPECDRAFT_*` environment variables; unset means off
    /// (`ConfigError` on bad values).
    #[staticmethod]
    fn from_env() -> PyResult<Self> {
        ModelLevers::from_env()
            .map(PyModelLevers)
            .map_err(PyConfigError::new_err)
    }

    /// Write exact drafter KV rows for accepted drafts after each verify.
    #[getter]
    fn mtp_kv_exact(&self) -> bool {
        self.0.mtp_kv_exact
    }
    /// Feed the draft head the target hidden after the final norm.
    #[getter]
    fn mtp_target_postnorm(&self) -> bool {
        self.0.mtp_target_postnorm
    }
    /// Feed the head's own hidden after its final norm for later drafts.
    #[getter]
    fn mtp_chain_postnorm(&self) -> bool {
        self.0.mtp_chain_postnorm
    }
    /// Always run the drafter prefill at the first propose.
    #[getter]
    fn defer_drafter_prefill(&self) -> bool {
        self.0.defer_drafter_prefill
    }

    fn __repr__(&self) -> String {
        let l = &self.0;
        format!(
            "ModelLevers(mtp_kv_exact={}, mtp_target_postnorm={}, mtp_chain_postnorm={}, defer_drafter_prefill={})",
            py_bool(l.mtp_kv_exact),
            py_bool(l.mtp_target_postnorm),
            py_bool(l.mtp_chain_postnorm),
            py_bool(l.defer_drafter_prefill)
        )
    }
}

fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

/// `BufferArena(max_rows=1)`: the shared forward scratch (a read-only view). Made by hand,
/// an arena with no buffers, for proposers that never touch the scratch.
#[pyclass(name = "BufferArena", module = "specdraft", frozen)]
pub struct PyBufferArena {
    pub inner: Arc<BufferArena>,
}

#[pymethods]
impl PyBufferArena {
    #[new]
    #[pyo3(signature = (max_rows = 1))]
    fn new(max_rows: usize) -> Self {
        PyBufferArena {
            inner: Arc::new(BufferArena::empty(max_rows)),
        }
    }

    /// Rows every slot holds.
    #[getter]
    fn max_rows(&self) -> usize {
        self.inner.max_rows()
    }

    /// Every slot as `(name, ptr, dtype, row_elems)`.
    #[getter]
    fn slots(&self) -> Vec<(&'static str, PyDevicePtr, &'static str, usize)> {
        self.inner
            .slots()
            .iter()
            .map(|s| (s.name, PyDevicePtr(s.ptr), s.dtype.name(), s.row_elems))
            .collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "BufferArena(max_rows={}, {} slots)",
            self.inner.max_rows(),
            self.inner.slots().len()
        )
    }
}

/// `ForwardContext(gpu, config, levers=None, buffers=None, target_hidden_stack=None,
/// target_hidden_stacks=None)`: what a forward runs with (backend, shared scratch,
/// configuration, levers, and the captured target rows of a proposer that names
/// `target_layer_ids`). It holds shared handles, so keeping it is safe. Made by hand, a
/// single-rank context (`gpu` must be a backend you created).
#[pyclass(name = "ForwardContext", module = "specdraft", frozen)]
pub struct PyForwardContext {
    pub gpu: Arc<dyn GpuBackend>,
    pub buffers: Arc<BufferArena>,
    pub config: Arc<ModelConfig>,
    pub levers: ModelLevers,
    pub target_hidden_stack: Option<DevicePtr>,
    pub target_hidden_stacks: Option<Vec<DevicePtr>>,
}

impl PyForwardContext {
    /// A view of `ctx` holding clones of its shared handles.
    pub fn from_ctx(ctx: &ForwardContext<'_>) -> Self {
        PyForwardContext {
            gpu: ctx.gpu.clone(),
            buffers: ctx.buffers.clone(),
            config: ctx.config.clone(),
            levers: ctx.levers,
            target_hidden_stack: ctx.target_hidden_stack,
            target_hidden_stacks: ctx.target_hidden_stacks.map(<[DevicePtr]>::to_vec),
        }
    }

    /// The Rust context this view stands for (single rank).
    pub fn to_rust(&self) -> ForwardContext<'_> {
        ForwardContext {
            target_hidden_stack: self.target_hidden_stack,
            target_hidden_stacks: self.target_hidden_stacks.as_deref(),
            ..ForwardContext::new(
                self.gpu.clone(),
                self.buffers.clone(),
                self.config.clone(),
                self.levers,
            )
        }
    }
}

#[pymethods]
impl PyForwardContext {
    #[new]
    #[pyo3(signature = (gpu, config, levers = None, buffers = None, target_hidden_stack = None, target_hidden_stacks = None))]
    fn new(
        gpu: &Bound<'_, PyAny>,
        config: &Bound<'_, PyModelConfig>,
        levers: Option<PyModelLevers>,
        buffers: Option<&Bound<'_, PyBufferArena>>,
        target_hidden_stack: Option<PtrArg>,
        target_hidden_stacks: Option<Vec<PtrArg>>,
    ) -> PyResult<Self> {
        let gpu = backend_arg(gpu)?.get().arc()?;
        Ok(PyForwardContext {
            target_hidden_stack: target_hidden_stack.map(|p| p.0),
            target_hidden_stacks: target_hidden_stacks
                .map(|v| v.into_iter().map(|p| p.0).collect()),
            gpu,
            buffers: buffers.map_or_else(
                || Arc::new(BufferArena::empty(1)),
                |b| b.get().inner.clone(),
            ),
            config: config.get().inner.clone(),
            levers: levers.map_or_else(ModelLevers::default, |l| l.0),
        })
    }

    /// The backend every buffer belongs to.
    #[getter]
    fn gpu<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        backend_from_arc(py, &self.gpu)
    }

    /// The target model's configuration.
    #[getter]
    fn config(&self) -> PyModelConfig {
        PyModelConfig {
            inner: self.config.clone(),
        }
    }

    /// The levers.
    #[getter]
    fn levers(&self) -> PyModelLevers {
        PyModelLevers(self.levers)
    }

    /// The shared forward scratch.
    #[getter]
    fn buffers(&self) -> PyBufferArena {
        PyBufferArena {
            inner: self.buffers.clone(),
        }
    }

    /// The captured target rows paired row for row with the `hiddens` of the call this
    /// context was passed to (bf16 `[rows, len(target_layer_ids) * hidden]`), or None when
    /// the proposer names no layers or the call has no hiddens.
    #[getter]
    fn target_hidden_stack(&self) -> Option<PyDevicePtr> {
        self.target_hidden_stack.map(PyDevicePtr)
    }

    /// In `propose_batch`, one entry per sequence of the batch, in order: the captured rows
    /// that sequence's `propose` would get as `target_hidden_stack`. None in every other
    /// call, and when the proposer names no layers.
    #[getter]
    fn target_hidden_stacks(&self) -> Option<Vec<PyDevicePtr>> {
        self.target_hidden_stacks
            .as_ref()
            .map(|v| v.iter().copied().map(PyDevicePtr).collect())
    }

    fn __repr__(&self) -> String {
        format!(
            "ForwardContext(gpu={}, vocab_size={}, hidden_size={})",
            self.gpu.name(),
            self.config.vocab_size,
            self.config.hidden_size
        )
    }
}
