//! `Counted`: a [`Communicator`] that forwards every call to another and counts what it
//! costs (calls, payload bytes and wall time, by operation), so a serve can report its
//! communication per decode step.
//!
//! Invariants: every call reaches the inner communicator unchanged and its result comes
//! back unchanged (errors included); a call is counted whether it succeeds or fails, with
//! the bytes this rank passed in (an all-reduce's buffer, a broadcast's bytes after the
//! call, a command's encoding).

use super::{Command, Communicator, DistributedError};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What one kind of call cost so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpCost {
    /// Calls made.
    pub calls: u64,
    /// Payload bytes this rank passed (or received, for a broadcast's non-root).
    pub bytes: u64,
    /// Wall time spent in the calls.
    pub time: Duration,
}

/// A communicator that counts the cost of each call to `inner`.
pub struct Counted<C: Communicator + ?Sized> {
    costs: Mutex<BTreeMap<&'static str, OpCost>>,
    inner: Box<C>,
}

impl<C: Communicator + ?Sized> Counted<C> {
    /// Counts `inner`'s calls from now on.
    pub fn new(inner: Box<C>) -> Self {
        Counted {
            costs: Mutex::new(BTreeMap::new()),
            inner,
        }
    }

    /// The costs so far, by operation (`all_reduce_f32`, `all_reduce_bf16`, `broadcast`, `barrier`,
    /// `send_command`, `recv_command`).
    pub fn costs(&self) -> BTreeMap<&'static str, OpCost> {
        self.costs.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Forgets every cost counted so far.
    pub fn reset(&self) {
        self.costs.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    fn count<T>(&self, op: &'static str, call: impl FnOnce() -> (T, usize)) -> T {
        let start = Instant::now();
        let (out, bytes) = call();
        let elapsed = start.elapsed();
        let mut costs = self.costs.lock().unwrap_or_else(|p| p.into_inner());
        let c = costs.entry(op).or_default();
        c.calls += 1;
        c.bytes += bytes as u64;
        c.time += elapsed;
        out
    }
}

impl<C: Communicator + ?Sized> Communicator for Counted<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), DistributedError> {
        let bytes = std::mem::size_of_val(buf);
        self.count("all_reduce_f32", || {
            (self.inner.all_reduce_sum_f32(buf), bytes)
        })
    }

    fn all_reduce_sum_bf16(&self, buf: &mut [half::bf16]) -> Result<(), DistributedError> {
        let bytes = std::mem::size_of_val(buf);
        self.count("all_reduce_bf16", || {
            (self.inner.all_reduce_sum_bf16(buf), bytes)
        })
    }

    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<(), DistributedError> {
        self.count("broadcast", || {
            let out = self.inner.broadcast_bytes(root, buf);
            (out, buf.len())
        })
    }

    fn barrier(&self) -> Result<(), DistributedError> {
        self.count("barrier", || (self.inner.barrier(), 0))
    }

    fn send_command(&self, command: &Command) -> Result<(), DistributedError> {
        let bytes = command.encode().len();
        self.count("send_command", || (self.inner.send_command(command), bytes))
    }

    fn recv_command(&self) -> Result<Command, DistributedError> {
        self.count("recv_command", || {
            let out = self.inner.recv_command();
            let bytes = out.as_ref().map_or(0, |c| c.encode().len());
            (out, bytes)
        })
    }
}
