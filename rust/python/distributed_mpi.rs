//! The MPI [`Communicator`] behind `specdraft.Communicator`: it calls mpi4py under the
//! interpreter lock (`specdraft.distributed.init()` makes it from `MPI.COMM_WORLD`).
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

use crate::distributed::{other_ranks, Command, Communicator, DistributedError};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use std::sync::{Mutex, TryLockError};
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
    pub(super) fn new(
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
