//! `specdraft.Communicator`: the ranks' [`Communicator`] in Python, and the MPI one behind
//! it, which calls mpi4py under the interpreter lock (`specdraft.distributed.init()` makes
//! it from `MPI.COMM_WORLD`).
//!
//! Every collective is posted nonblocking (`Iallreduce`, `Ibcast`, `Ibarrier`) and its
//! request polled with `Test` until it completes or the timeout passes, so a rank that died
//! or hung ends the call with [`DistributedError::Timeout`] naming the ranks, never a hang.
//! Polling spins for the first millisecond (a small collective completes in microseconds),
//! then sleeps with the interpreter released, backing off to 1 ms a poll.
//!
//! Calls from several threads run one collective at a time (a broadcast's length and bytes
//! are never split by another thread's call); every rank must still make them in the same
//! order.
//!
//! A timed-out collective cannot be cancelled (MPI has no cancel for collectives) and may
//! still write into its buffer later, so its buffer and request are kept alive for the
//! process's life, and every later call on the communicator is refused
//! ([`DistributedError::Broken`]): the ranks are out of step for good.

use super::errors::IntoPyResult;
use crate::distributed::{other_ranks, Command, Communicator, DistributedError, LocalCommunicator};
use half::bf16;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

/// How long polling spins before it starts sleeping between polls.
const SPIN: Duration = Duration::from_millis(1);
/// The longest sleep between two polls.
const MAX_PAUSE: Duration = Duration::from_millis(1);

/// A [`Communicator`] over an mpi4py communicator.
pub(crate) struct MpiCommunicator {
    comm: Py<PyAny>,
    in_place: Py<PyAny>,
    sum: Py<PyAny>,
    rank: usize,
    size: usize,
    /// How long a collective may wait for the other ranks.
    timeout: Duration,
    /// How long a worker may wait for rank 0's next command (`None`: as long as rank 0
    /// idles; a rank 0 that died ends the job through `mpiexec`).
    command_timeout: Option<Duration>,
    /// The failure that made the communicator unusable, if one did.
    broken: Mutex<Option<String>>,
    /// The buffers and requests of timed-out collectives, which MPI may still write.
    in_flight: Mutex<Vec<Py<PyAny>>>,
    /// Held through each collective, so two threads never interleave the parts of theirs.
    turn: Mutex<()>,
}

impl MpiCommunicator {
    fn new(
        comm: &Bound<'_, PyAny>,
        mpi: &Bound<'_, PyAny>,
        timeout: Duration,
        command_timeout: Option<Duration>,
    ) -> PyResult<Self> {
        let rank: usize = comm.call_method0("Get_rank")?.extract()?;
        let size: usize = comm.call_method0("Get_size")?.extract()?;
        Ok(MpiCommunicator {
            comm: comm.clone().unbind(),
            in_place: mpi.getattr("IN_PLACE")?.unbind(),
            sum: mpi.getattr("SUM")?.unbind(),
            rank,
            size,
            timeout,
            command_timeout,
            broken: Mutex::new(None),
            in_flight: Mutex::new(Vec::new()),
            turn: Mutex::new(()),
        })
    }

    /// Runs `f`, one collective, attached and holding the turn, unless the communicator is
    /// broken. The turn is polled, sleeping detached, so no thread blocks on it attached.
    fn collective<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(Python<'_>) -> Result<T, DistributedError>,
    ) -> Result<T, DistributedError> {
        Python::attach(|py| {
            let _turn = loop {
                match self.turn.try_lock() {
                    Ok(turn) => break turn,
                    Err(TryLockError::Poisoned(p)) => break p.into_inner(),
                    Err(TryLockError::WouldBlock) => {
                        py.detach(|| std::thread::sleep(Duration::from_micros(50)))
                    }
                }
            };
            self.check_usable(op)?;
            f(py)
        })
    }

    fn check_usable(&self, op: &'static str) -> Result<(), DistributedError> {
        let broken = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        match broken.as_ref() {
            Some(first) => Err(DistributedError::Broken {
                rank: self.rank,
                op,
                first: first.clone(),
            }),
            None => Ok(()),
        }
    }

    fn fail(&self, err: DistributedError) -> DistributedError {
        let mut broken = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        broken.get_or_insert_with(|| err.to_string());
        err
    }

    fn mpi_error(&self, op: &'static str, e: PyErr) -> DistributedError {
        self.fail(DistributedError::Mpi {
            rank: self.rank,
            op,
            message: e.to_string(),
        })
    }

    /// Polls `request` until it completes, or fails after `timeout` (none: waits on).
    /// `buffer` is kept alive past a timeout, since MPI may still write it.
    fn wait(
        &self,
        py: Python<'_>,
        request: Bound<'_, PyAny>,
        buffer: &Bound<'_, PyAny>,
        op: &'static str,
        timeout: Option<Duration>,
    ) -> Result<(), DistributedError> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            let done = request
                .call_method0("Test")
                .and_then(|d| d.extract::<bool>())
                .map_err(|e| self.mpi_error(op, e))?;
            if done {
                return Ok(());
            }
            let waited = start.elapsed();
            if timeout.is_some_and(|t| waited >= t) {
                let mut kept = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
                kept.push(request.unbind());
                kept.push(buffer.clone().unbind());
                return Err(self.fail(DistributedError::Timeout {
                    rank: self.rank,
                    size: self.size,
                    op,
                    timeout_s: timeout.unwrap_or_default().as_secs_f64(),
                    missing: other_ranks(self.rank, self.size),
                }));
            }
            if waited >= SPIN {
                py.detach(|| std::thread::sleep(pause));
                pause = (pause * 2).min(MAX_PAUSE);
            }
        }
    }

    /// `Ibcast` of `buffer` from `root`, waited for up to `timeout`.
    fn bcast(
        &self,
        py: Python<'_>,
        buffer: &Bound<'_, PyAny>,
        root: usize,
        op: &'static str,
        timeout: Option<Duration>,
    ) -> Result<(), DistributedError> {
        let request = self
            .comm
            .bind(py)
            .call_method1("Ibcast", (buffer, root))
            .map_err(|e| self.mpi_error(op, e))?;
        self.wait(py, request, buffer, op, timeout)
    }

    /// The byte broadcast, the length first (waited for up to `first_timeout`) then the
    /// bytes (up to the collective timeout).
    fn broadcast_with(
        &self,
        root: usize,
        buf: &mut Vec<u8>,
        op: &'static str,
        first_timeout: Option<Duration>,
    ) -> Result<(), DistributedError> {
        crate::distributed::check_root(self, root, op)?;
        self.collective(op, |py| {
            let len = PyArray1::from_slice(py, &[buf.len() as u64]);
            self.bcast(py, len.as_any(), root, op, first_timeout)?;
            let n = len.readonly().as_slice().map(|s| s[0]).unwrap_or(0) as usize;
            if self.rank != root {
                buf.clear();
                buf.resize(n, 0);
            }
            if n == 0 {
                return Ok(());
            }
            let data = PyArray1::from_slice(py, buf);
            self.bcast(py, data.as_any(), root, op, Some(self.timeout))?;
            if self.rank != root {
                let got = data.readonly();
                buf.copy_from_slice(got.as_slice().map_err(|e| self.mpi_error(op, e.into()))?);
            }
            Ok(())
        })
    }
}

impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), DistributedError> {
        const OP: &str = "all_reduce_sum_f32";
        self.collective(OP, |py| {
            let arr = PyArray1::from_slice(py, buf);
            let request = self
                .comm
                .bind(py)
                .call_method1(
                    "Iallreduce",
                    (self.in_place.bind(py), &arr, self.sum.bind(py)),
                )
                .map_err(|e| self.mpi_error(OP, e))?;
            self.wait(py, request, arr.as_any(), OP, Some(self.timeout))?;
            let sum = arr.readonly();
            buf.copy_from_slice(sum.as_slice().map_err(|e| self.mpi_error(OP, e.into()))?);
            Ok(())
        })
    }

    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<(), DistributedError> {
        self.broadcast_with(root, buf, "broadcast_bytes", Some(self.timeout))
    }

    fn barrier(&self) -> Result<(), DistributedError> {
        const OP: &str = "barrier";
        self.collective(OP, |py| {
            let request = self
                .comm
                .bind(py)
                .call_method0("Ibarrier")
                .map_err(|e| self.mpi_error(OP, e))?;
            let none = py.None().into_bound(py);
            self.wait(py, request, &none, OP, Some(self.timeout))
        })
    }

    fn recv_command(&self) -> Result<Command, DistributedError> {
        const OP: &str = "recv_command";
        if self.rank == 0 {
            return Err(DistributedError::InvalidArgument {
                rank: 0,
                size: self.size,
                op: OP,
                message: "rank 0 sends commands; only workers (ranks > 0) receive them".into(),
            });
        }
        let mut bytes = Vec::new();
        self.broadcast_with(0, &mut bytes, OP, self.command_timeout)?;
        Command::decode(&bytes, self.rank).map_err(|e| self.fail(e))
    }
}

/// The ranks of a multi-rank serve: rank and size, sum all-reduce, broadcast, barrier, and
/// rank 0's commands to its workers.
///
/// `specdraft.distributed.init()` makes one over MPI (under `mpiexec`);
/// `Communicator.local()` is rank 0 of 1, whose collectives are the identity. A collective
/// that some rank does not join within `timeout` seconds raises `BackendError` naming the
/// ranks, and the communicator refuses every later call.
#[pyclass(name = "Communicator", module = "specdraft._core", frozen)]
pub struct PyCommunicator {
    inner: Arc<dyn Communicator>,
    timeout: Option<f64>,
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
            inner: Arc::new(LocalCommunicator),
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
            inner: Arc::new(MpiCommunicator::new(comm, mpi, t, ct)?),
            timeout: Some(timeout),
        })
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

    /// Rank 0 sends `command` to every worker: a dict with `"kind"` (`"prefill"`,
    /// `"verify"`, `"mtp_propose"`, `"free"` or `"shutdown"`) and its fields (`"seq"`;
    /// `"tokens"` for prefill and verify; `"num_drafts"` for mtp_propose).
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

fn command_from_dict(d: &Bound<'_, PyDict>) -> PyResult<Command> {
    let kind: String = d
        .get_item("kind")?
        .ok_or_else(|| PyValueError::new_err("command: missing \"kind\""))?
        .extract()?;
    let allowed: &[&str] = match kind.as_str() {
        "prefill" | "verify" => &["kind", "seq", "tokens"],
        "mtp_propose" => &["kind", "seq", "num_drafts"],
        "free" => &["kind", "seq"],
        "shutdown" => &["kind"],
        other => {
            return Err(PyValueError::new_err(format!(
                "command: unknown kind {other:?}; expected prefill, verify, mtp_propose, free or shutdown"
            )))
        }
    };
    for key in d.keys() {
        let key: String = key.extract()?;
        if !allowed.contains(&key.as_str()) {
            return Err(PyValueError::new_err(format!(
                "command {kind:?}: unexpected key {key:?}; its keys are {allowed:?}"
            )));
        }
    }
    let field = |name: &str| -> PyResult<Bound<'_, PyAny>> {
        d.get_item(name)?
            .ok_or_else(|| PyValueError::new_err(format!("command {kind:?}: missing {name:?}")))
    };
    Ok(match kind.as_str() {
        "prefill" => Command::Prefill {
            seq: field("seq")?.extract()?,
            tokens: field("tokens")?.extract()?,
        },
        "verify" => Command::Verify {
            seq: field("seq")?.extract()?,
            tokens: field("tokens")?.extract()?,
        },
        "mtp_propose" => Command::MtpPropose {
            seq: field("seq")?.extract()?,
            num_drafts: field("num_drafts")?.extract()?,
        },
        "free" => Command::Free {
            seq: field("seq")?.extract()?,
        },
        _ => Command::Shutdown,
    })
}

fn command_to_dict<'py>(py: Python<'py>, cmd: &Command) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("kind", cmd.kind())?;
    match cmd {
        Command::Prefill { seq, tokens } | Command::Verify { seq, tokens } => {
            d.set_item("seq", seq)?;
            d.set_item("tokens", tokens.clone())?;
        }
        Command::MtpPropose { seq, num_drafts } => {
            d.set_item("seq", seq)?;
            d.set_item("num_drafts", num_drafts)?;
        }
        Command::Free { seq } => d.set_item("seq", seq)?,
        Command::Shutdown => {}
    }
    Ok(d)
}
