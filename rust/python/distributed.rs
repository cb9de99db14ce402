//! `specdraft.Communicator`: the ranks' [`Communicator`] in Python (the MPI one of
//! `distributed_mpi`, or the local one), and rank 0's commands as dicts (converted in
//! `distributed_commands`).

use super::distributed_commands::{command_from_dict, command_to_dict};
use super::distributed_mpi::MpiCommunicator;
#[cfg(not(feature = "cuda"))]
use super::errors::to_pyerr;
use super::errors::IntoPyResult;
#[cfg(not(feature = "cuda"))]
use crate::distributed::DistributedError;
#[cfg(feature = "cuda")]
use crate::distributed::NcclCommunicator;
use crate::distributed::{Communicator, Counted, LocalCommunicator};
use half::bf16;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::Arc;
use std::time::Duration;

/// The ranks of a multi-rank serve: rank and size, sum all-reduce, broadcast, barrier, and
/// rank 0's commands to its workers.
///
/// `specdraft.distributed.init()` makes one over MPI (under `mpiexec`), or over NCCL with
/// `backend="nccl"`; `Communicator.local()` is rank 0 of 1, whose collectives are the
/// identity. A collective that some rank does not join within `timeout` seconds raises
/// `BackendError` naming the ranks, and the communicator refuses every later call.
#[pyclass(name = "Communicator", module = "specdraft._core", frozen)]
pub struct PyCommunicator {
    inner: Arc<Counted<dyn Communicator>>,
    timeout: Option<f64>,
}

impl PyCommunicator {
    /// The shared communicator.
    pub(super) fn arc(&self) -> Arc<dyn Communicator> {
        self.inner.clone() as Arc<dyn Communicator>
    }
}

/// The error of NCCL calls in a build without feature `cuda`.
#[cfg(not(feature = "cuda"))]
fn no_cuda_build(rank: usize) -> PyErr {
    to_pyerr(&crate::Error::from(DistributedError::Unavailable {
        rank,
        message: "NCCL needs specdraft built with CUDA (the `cuda` feature: \
                  `maturin develop --release --features python,cuda`); this build has none"
            .into(),
    }))
}

fn seconds(arg: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "{arg} must be a positive number of seconds, got {s}"
            ))
        })
}

#[pymethods]
impl PyCommunicator {
    /// Rank 0 of a world of one: every collective is the identity.
    #[staticmethod]
    fn local() -> Self {
        PyCommunicator {
            inner: Arc::new(Counted::new(Box::new(LocalCommunicator))),
            timeout: None,
        }
    }

    /// The communicator over an mpi4py communicator `comm` (`mpi` is the `mpi4py.MPI`
    /// module); `specdraft.distributed.init()` calls this.
    #[staticmethod]
    #[pyo3(signature = (comm, mpi, timeout, command_timeout=None))]
    fn _from_mpi(
        comm: &Bound<'_, PyAny>,
        mpi: &Bound<'_, PyAny>,
        timeout: f64,
        command_timeout: Option<f64>,
    ) -> PyResult<Self> {
        let t = seconds("timeout", timeout)?;
        let ct = command_timeout
            .map(|c| seconds("command_timeout", c))
            .transpose()?;
        Ok(PyCommunicator {
            inner: Arc::new(Counted::new(Box::new(MpiCommunicator::new(
                comm, mpi, t, ct,
            )?))),
            timeout: Some(timeout),
        })
    }

    /// A new NCCL unique id (128 bytes), made on rank 0 and sent to every rank;
    /// `specdraft.distributed.init(backend="nccl")` calls this. Raises
    /// `BackendUnavailableError` without libnccl or in a build without CUDA.
    #[staticmethod]
    fn _nccl_unique_id(py: Python<'_>) -> PyResult<Bound<'_, PyBytes>> {
        #[cfg(feature = "cuda")]
        {
            let id = NcclCommunicator::unique_id().py()?;
            Ok(PyBytes::new(py, &id))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = py;
            Err(no_cuda_build(0))
        }
    }

    /// Rank `rank` of `size` over NCCL on GPU `device`, joining the ranks given the same
    /// `unique_id`; `specdraft.distributed.init(backend="nccl")` calls this.
    #[staticmethod]
    #[pyo3(signature = (rank, size, unique_id, device, timeout, command_timeout=None))]
    fn _from_nccl(
        py: Python<'_>,
        rank: usize,
        size: usize,
        unique_id: Vec<u8>,
        device: usize,
        timeout: f64,
        command_timeout: Option<f64>,
    ) -> PyResult<Self> {
        let t = seconds("timeout", timeout)?;
        let ct = command_timeout
            .map(|c| seconds("command_timeout", c))
            .transpose()?;
        #[cfg(feature = "cuda")]
        {
            // The start-up waits for the other ranks: let other threads run meanwhile.
            let comm = py
                .detach(|| NcclCommunicator::new(rank, size, &unique_id, device, t, ct))
                .py()?;
            Ok(PyCommunicator {
                inner: Arc::new(Counted::new(Box::new(comm))),
                timeout: Some(timeout),
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (py, size, unique_id, device, t, ct);
            Err(no_cuda_build(rank))
        }
    }

    /// The rank of this process, `0..size`.
    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    /// Number of ranks.
    #[getter]
    fn size(&self) -> usize {
        self.inner.size()
    }

    /// Seconds a collective waits for the other ranks (`None` for the local communicator,
    /// whose collectives never wait).
    #[getter]
    fn timeout(&self) -> Option<f64> {
        self.timeout
    }

    /// The element-wise sum of every rank's `array`, as a new array of its shape.
    ///
    /// float32 arrays sum in f32. With `dtype="bf16"`, `array` holds bf16 bit patterns as
    /// uint16: they are summed in f32 and rounded to bf16 once.
    #[pyo3(signature = (array, dtype=None))]
    fn all_reduce<'py>(
        &self,
        py: Python<'py>,
        array: &Bound<'py, PyAny>,
        dtype: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let np = py.import("numpy")?;
        let shape = array.getattr("shape")?;
        let flat = np
            .call_method1("ascontiguousarray", (array,))?
            .call_method1("reshape", (-1,))?;
        match dtype {
            None | Some("f32") | Some("float32") => {
                let arr = flat.cast::<PyArray1<f32>>().map_err(|_| {
                    PyTypeError::new_err(format!(
                        "all_reduce: expected a float32 array, got dtype {} (pass dtype=\"bf16\" for bf16 bits in a uint16 array)",
                        flat.getattr("dtype").map(|d| d.to_string()).unwrap_or_default()
                    ))
                })?;
                let mut buf = arr.readonly().as_slice()?.to_vec();
                self.inner.all_reduce_sum_f32(&mut buf).py()?;
                PyArray1::from_vec(py, buf).call_method1("reshape", (shape,))
            }
            Some("bf16") => {
                let arr = flat.cast::<PyArray1<u16>>().map_err(|_| {
                    PyTypeError::new_err(format!(
                        "all_reduce(dtype=\"bf16\"): expected the bf16 bit patterns as a uint16 array, got dtype {}",
                        flat.getattr("dtype").map(|d| d.to_string()).unwrap_or_default()
                    ))
                })?;
                let mut buf: Vec<bf16> = arr
                    .readonly()
                    .as_slice()?
                    .iter()
                    .map(|&b| bf16::from_bits(b))
                    .collect();
                self.inner.all_reduce_sum_bf16(&mut buf).py()?;
                let bits: Vec<u16> = buf.iter().map(|v| v.to_bits()).collect();
                PyArray1::from_vec(py, bits).call_method1("reshape", (shape,))
            }
            Some(other) => Err(PyValueError::new_err(format!(
                "all_reduce: dtype must be None, \"f32\" or \"bf16\", got {other:?}"
            ))),
        }
    }

    /// `root`'s `data` on every rank (other ranks' `data` is ignored and may be `None`).
    #[pyo3(signature = (data=None, root=0))]
    fn broadcast<'py>(
        &self,
        py: Python<'py>,
        data: Option<Vec<u8>>,
        root: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mut buf = if self.inner.rank() == root {
            data.ok_or_else(|| {
                PyValueError::new_err(format!(
                    "broadcast: rank {root} is the root and must pass data"
                ))
            })?
        } else {
            Vec::new()
        };
        self.inner.broadcast_bytes(root, &mut buf).py()?;
        Ok(PyBytes::new(py, &buf))
    }

    /// Returns once every rank has called it.
    fn barrier(&self) -> PyResult<()> {
        self.inner.barrier().py()
    }

    /// What the calls on this communicator cost so far, by operation (`"all_reduce_f32"`,
    /// `"all_reduce_bf16"`, `"broadcast"`, `"barrier"`, `"send_command"`,
    /// `"recv_command"`): `{"calls", "bytes", "seconds"}`, bytes being the payload this
    /// rank passed in or received. Counts every call since `init()` or `reset_costs()`.
    fn costs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (op, c) in self.inner.costs() {
            let d = PyDict::new(py);
            d.set_item("calls", c.calls)?;
            d.set_item("bytes", c.bytes)?;
            d.set_item("seconds", c.time.as_secs_f64())?;
            out.set_item(op, d)?;
        }
        Ok(out)
    }

    /// Forgets the costs counted so far.
    fn reset_costs(&self) {
        self.inner.reset();
    }

    /// Rank 0 sends `command` to every worker: a dict with `"kind"` and its fields:
    /// `"prefill"` and `"verify"` take `"batch"` (a list of `{"seq", "tokens"}`) and
    /// optionally `"layers"` (capture layers), a verify also `"trees"` (per sequence a
    /// parent list or None); `"trim"` `"seq"` and `"len"`; `"compact"` `"seq"`, `"start"`
    /// and `"rows"`; `"free"` `"seq"`; `"shutdown"` nothing. A sharded proposer's calls
    /// name its `"state"`: `"mtp_propose"` (`"last_token"`, `"position"`, `"num_drafts"`,
    /// `"hidden"` bytes, optional `"grammar"`), `"proposer_alloc"` (`"budget"`),
    /// `"proposer_prefill"` (`"tokens"`, `"hidden"`), `"proposer_after_verify"`
    /// (`"accepted"`), `"proposer_catchup"` (`"tokens"`, `"hidden"`, `"row_base"`,
    /// `"pos_base"`) and `"proposer_free"`; `"mtp_propose_batch"` names its `"states"`, with
    /// `"last_tokens"`, `"positions"`, `"num_drafts"`, `"hidden"` (every row's bytes, one
    /// after another) and `"confidences"` (a bool).
    fn send_command(&self, command: &Bound<'_, PyDict>) -> PyResult<()> {
        let cmd = command_from_dict(command)?;
        self.inner.send_command(&cmd).py()
    }

    /// A worker's next command from rank 0, as the dict `send_command` was given.
    fn recv_command<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let cmd = self.inner.recv_command().py()?;
        command_to_dict(py, &cmd)
    }

    fn __repr__(&self) -> String {
        format!(
            "Communicator(rank={}, size={})",
            self.inner.rank(),
            self.inner.size()
        )
    }
}
