//! `specdraft.TargetModel` and `specdraft.load_model`: the Llama-family target model from
//! Python.
//!
//! The object holds an `Arc` of the Rust model, so an engine built from it (in Rust) shares
//! the same weights and KV pool, and the model's tokenizer (`specdraft.Tokenizer`, read by
//! `specdraft.tokenizer` from the same file), so text works without further set-up.
//! Loading and forwards run with the interpreter released. A name that is not an existing
//! path is resolved by `specdraft.models.resolve_model`, which downloads the default model
//! on first use and raises `ConfigError` for unknown names.

use super::backend::{backend_arg, backend_from_arc};
use super::distributed::PyCommunicator;
use super::errors::{request_error, IntoPyResult, SpecdraftError};
use super::generation::run_exclusive;
use super::model::PyModelConfig;
use crate::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use crate::distributed::local_rank_count;
use crate::engine::{GenerateRequest, SpecEngine};
use crate::model::layers::ExpertShard;
use crate::model::{
    parse_weights_format, GgufFile, GgufValue, LoadOptions, LogitRows, TargetModel,
};
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::path::PathBuf;
use std::sync::Arc;

/// A loaded target model (Llama, SmolLM2, Qwen2/2.5/3) with its paged KV cache.
#[pyclass(name = "TargetModel", module = "specdraft", frozen)]
pub struct PyTargetModel {
    pub inner: Arc<TargetModel>,
    /// The tokenizer the model file carries, when specdraft can read it.
    pub tokenizer: Option<Py<PyAny>>,
}

impl PyTargetModel {
    /// The shared Rust model (for the engine bindings).
    pub fn arc(&self) -> Arc<TargetModel> {
        self.inner.clone()
    }
}

#[pymethods]
impl PyTargetModel {
    /// The model's configuration.
    #[getter]
    fn config(&self) -> PyModelConfig {
        PyModelConfig {
            inner: self.inner.config().clone(),
        }
    }

    /// The backend the model lives on.
    #[getter]
    fn gpu<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        backend_from_arc(py, self.inner.gpu())
    }

    /// Longest sequence a forward accepts.
    #[getter]
    fn max_seq_len(&self) -> usize {
        self.inner.max_seq_len()
    }

    /// Vocabulary size (columns of the logits).
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.config().vocab_size
    }

    /// Weight bytes one decode step reads.
    #[getter]
    fn weight_bytes_per_token(&self) -> usize {
        self.inner.weight_bytes_per_token()
    }

    /// `(total, free)` blocks of the KV pool.
    #[getter]
    fn kv_blocks(&self) -> (usize, usize) {
        let pool = self.inner.kv_pool();
        (pool.num_blocks(), pool.num_free())
    }

    /// The model's tokenizer (a `specdraft.Tokenizer` with its chat template), or None when
    /// the model file carries none that specdraft can read.
    #[getter]
    fn tokenizer(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.tokenizer.as_ref().map(|t| t.clone_ref(py))
    }

    /// The f32 logits of a fresh forward over `tokens`, as a flat numpy array of
    /// `len(tokens) * vocab_size` values (row-major); the KV it used is returned at once.
    fn logits<'py>(
        &self,
        py: Python<'py>,
        tokens: Vec<u32>,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let model = self.inner.clone();
        let values = py
            .detach(move || {
                run_exclusive(|| -> crate::Result<Vec<f32>> {
                    let mut seq = model.new_sequence();
                    let run = model.forward(&mut [&mut seq], &[&tokens]).and_then(|out| {
                        Ok(model
                            .gpu()
                            .download::<f32>(out.logits, out.rows * model.config().vocab_size)?)
                    });
                    model.free_sequence(&mut seq)?;
                    run
                })
            })
            .py()?;
        Ok(PyArray1::from_vec(py, values))
    }

    /// The hidden state before the final norm at every position of a fresh forward over
    /// `tokens` (teacher forcing), as a float32 numpy array `[len(tokens), hidden]`; long
    /// inputs run in chunks of `max_rows`, and the KV is returned at once.
    ///
    /// With `layers` (decoder layer ids, each below `config.num_hidden_layers`, none twice)
    /// it is instead the hidden after each of those layers, side by side in the order given:
    /// `[len(tokens), len(layers) * hidden]`, what the engine passes a proposer that names
    /// them as `target_layer_ids` (id `i` is layer `i`'s output, before any final norm).
    #[pyo3(signature = (tokens, layers = None))]
    fn hidden_states<'py>(
        &self,
        py: Python<'py>,
        tokens: Vec<u32>,
        layers: Option<Vec<usize>>,
    ) -> PyResult<Bound<'py, numpy::PyArray2<f32>>> {
        let model = self.inner.clone();
        let h = model.config().hidden_size;
        let n = tokens.len();
        let width = layers.as_ref().map_or(h, |l| l.len() * h);
        if layers.as_ref().is_some_and(|l| l.is_empty()) {
            return Err(request_error(
                "hidden_states: layers is empty (name at least one layer, or leave it out for the final hidden)",
            ));
        }
        let values = py
            .detach(move || {
                run_exclusive(|| -> crate::Result<Vec<f32>> {
                    let ids = layers.as_deref().unwrap_or(&[]);
                    let mut seq = model.new_sequence();
                    let mut values = Vec::with_capacity(tokens.len() * width);
                    // Only the last row's logits are computed: the hiddens are what is wanted.
                    let run = tokens.chunks(model.max_rows()).try_for_each(|chunk| {
                        let out = model.forward_capturing(
                            &mut [&mut seq],
                            &[chunk],
                            LogitRows::LastPerSequence,
                            ids,
                        )?;
                        let src = out.hidden_stack.unwrap_or(out.hiddens);
                        let rows: Vec<half::bf16> = model.gpu().download(src, out.rows * width)?;
                        values.extend(rows.into_iter().map(f32::from));
                        Ok(())
                    });
                    model.free_sequence(&mut seq)?;
                    run.map(|()| values)
                })
            })
            .py()?;
        numpy::ndarray::Array2::from_shape_vec((n, width), values)
            .map(|a| numpy::PyArray2::from_owned_array(py, a))
            .map_err(|e| SpecdraftError::new_err(e.to_string()))
    }

    /// Greedy decoding without drafting (the engine with no proposer): the ids that follow
    /// `prompt`, at most `max_tokens`, ending after an end-of-sequence id.
    #[pyo3(signature = (prompt, max_tokens = 16))]
    fn generate_greedy(
        &self,
        py: Python<'_>,
        prompt: Vec<u32>,
        max_tokens: usize,
    ) -> PyResult<Vec<u32>> {
        let engine = SpecEngine::new(self.inner.clone(), None, 0).py()?;
        let request = GenerateRequest::new(prompt, max_tokens);
        engine.check_request(0, &request).py()?;
        let mut generation = py.detach(move || run_exclusive(|| engine.generate(vec![request])));
        let result = generation
            .results
            .pop()
            .ok_or_else(|| request_error("generate_greedy: the engine returned no result"))?;
        match result.error {
            Some(e) => Err(e).py(),
            None => Ok(result.tokens),
        }
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "TargetModel({}, hidden={}, layers={}, vocab={}, backend={})",
            c.family.model_type(),
            c.hidden_size,
            c.num_hidden_layers,
            c.vocab_size,
            self.inner.gpu().name()
        )
    }
}

/// Loads a target model from a HF checkpoint folder, a `.gguf` file, or a known name
/// (`"smollm2"`), with the tokenizer the file carries as `model.tokenizer`. `gpu`
/// defaults to a new `CpuBackend` (with `comm`, one whose kernels take this rank's share of
/// the host's cores: cores / the ranks `mpiexec` started on the host). `weights` (`"q8_0"`, `"q4_0"`, `"q4_k"`, ...) quantizes
/// a safetensors checkpoint's matrices at load; `None` keeps what the file has. `comm`
/// (from `specdraft.distributed.init()`) loads this rank's share of a multi-rank model:
/// each MoE layer's routed experts are split evenly across the ranks (a count the ranks do
/// not divide is refused), everything else is replicated. On rank 0, `SpecEngine` then
/// announces each forward to the workers, which serve it with `SpecEngine.run_worker()`.
#[pyfunction]
#[pyo3(signature = (path_or_name, gpu = None, max_rows = 512, max_seq_len = None, kv_blocks = None, weights = None, comm = None))]
#[allow(clippy::too_many_arguments)]
pub fn load_model(
    py: Python<'_>,
    path_or_name: &Bound<'_, PyAny>,
    gpu: Option<&Bound<'_, PyAny>>,
    max_rows: usize,
    max_seq_len: Option<usize>,
    kv_blocks: Option<usize>,
    weights: Option<&str>,
    comm: Option<PyRef<'_, PyCommunicator>>,
) -> PyResult<PyTargetModel> {
    let launched = comm.is_some();
    // One rank of several holds only its share of each MoE layer's routed experts.
    let shard = comm.and_then(|c| ExpertShard::new(c.arc()));
    let weights = weights
        .map(parse_weights_format)
        .transpose()
        .map_err(crate::Error::from)
        .py()?;
    let resolved = py
        .import("specdraft.models")?
        .call_method1("resolve_model", (path_or_name,))?;
    let path: PathBuf = resolved.str()?.to_string().into();
    let gpu: Arc<dyn GpuBackend> = match gpu {
        Some(obj) => backend_arg(obj)?.get().arc()?,
        // The ranks launched on this host share its cores.
        None if launched => Arc::new(CpuBackend::sharing_cores(local_rank_count())),
        None => Arc::new(CpuBackend::new()),
    };
    if max_rows == 0 {
        return Err(request_error("max_rows must be at least 1"));
    }
    let opts = LoadOptions {
        max_rows,
        max_seq_len,
        kv_blocks,
    };
    let tokenizer = py
        .import("specdraft.tokenizer")?
        .call_method1("_tokenizer_or_none", (&resolved,))?;
    let model = py
        .detach(move || TargetModel::load_sharded(&path, gpu, opts, weights, shard))
        .py()?;
    Ok(PyTargetModel {
        inner: Arc::new(model),
        tokenizer: (!tokenizer.is_none()).then(|| tokenizer.unbind()),
    })
}

fn gguf_value_to_py<'py>(py: Python<'py>, v: &GgufValue) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        GgufValue::UInt(x) => x.into_pyobject(py)?.into_any(),
        GgufValue::Int(x) => x.into_pyobject(py)?.into_any(),
        GgufValue::Float(x) => x.into_pyobject(py)?.into_any(),
        GgufValue::Bool(x) => x.into_pyobject(py)?.to_owned().into_any(),
        GgufValue::Str(x) => x.into_pyobject(py)?.into_any(),
        GgufValue::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(gguf_value_to_py(py, item)?)?;
            }
            list.into_any()
        }
    })
}

/// The metadata of a GGUF file as a dict (all keys, or only `keys` that are present).
#[pyfunction]
#[pyo3(signature = (path, keys = None))]
pub fn gguf_metadata<'py>(
    py: Python<'py>,
    path: PathBuf,
    keys: Option<Vec<String>>,
) -> PyResult<Bound<'py, PyDict>> {
    let file = py
        .detach(move || GgufFile::open(&path))
        .map_err(crate::Error::from)
        .py()?;
    let out = PyDict::new(py);
    match keys {
        Some(keys) => {
            for k in keys {
                if let Some(v) = file.metadata.get(&k) {
                    out.set_item(&k, gguf_value_to_py(py, v)?)?;
                }
            }
        }
        None => {
            for (k, v) in &file.metadata {
                out.set_item(k, gguf_value_to_py(py, v)?)?;
            }
        }
    }
    Ok(out)
}
