//! Errors of the distributed layer: every failure names the rank that saw it.

use thiserror::Error;

/// What went wrong in a collective or on the command channel.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum DistributedError {
    /// A collective did not complete within the timeout: some rank never joined it.
    #[error("rank {rank} of {size}: {op} timed out after {timeout_s:.1} s waiting for {missing}, which died or hung; the communicator is unusable now")]
    Timeout {
        /// The rank that waited.
        rank: usize,
        /// Number of ranks.
        size: usize,
        /// The collective that timed out.
        op: &'static str,
        /// The timeout, in seconds.
        timeout_s: f64,
        /// The ranks that may not have joined ("rank 1", "one of ranks 1, 2, 3").
        missing: String,
    },
    /// A collective called after an earlier one failed: the ranks are out of step for good.
    #[error("rank {rank}: {op} refused: the communicator is unusable since an earlier failure ({first})")]
    Broken {
        /// The rank whose call was refused.
        rank: usize,
        /// The refused call.
        op: &'static str,
        /// The message of the failure that broke it.
        first: String,
    },
    /// The MPI library (through mpi4py) raised.
    #[error("rank {rank}: {op} failed in MPI: {message}")]
    Mpi {
        /// The rank whose call failed.
        rank: usize,
        /// The call that failed.
        op: &'static str,
        /// What MPI (or mpi4py) said.
        message: String,
    },
    /// NCCL returned an error, at once or later through the communicator's asynchronous
    /// error; the communicator was aborted and refuses later calls.
    #[error("rank {rank}: {op} failed in NCCL: {message}")]
    Nccl {
        /// The rank whose call failed.
        rank: usize,
        /// The call that failed.
        op: &'static str,
        /// What NCCL (or the CUDA driver under it) said.
        message: String,
    },
    /// The transport cannot start on this machine or build (no libnccl, no CUDA driver or
    /// device, a build without CUDA); the message says what to install.
    #[error("rank {rank}: {message}")]
    Unavailable {
        /// The rank that tried to start it.
        rank: usize,
        /// What is missing and how to get it.
        message: String,
    },
    /// Bytes received on the command channel that are not a command.
    #[error("rank {rank}: bad command bytes ({len} bytes): {reason}")]
    BadCommand {
        /// The rank that decoded them.
        rank: usize,
        /// Number of bytes received.
        len: usize,
        /// What was wrong with them.
        reason: String,
    },
    /// A call its rank may not make, or arguments out of range.
    #[error("rank {rank} of {size}: {op}: {message}")]
    InvalidArgument {
        /// The rank of the caller.
        rank: usize,
        /// Number of ranks.
        size: usize,
        /// The refused call.
        op: &'static str,
        /// Why it was refused.
        message: String,
    },
}

/// The ranks other than `rank` in a world of `size`, as a timeout message names them.
#[cfg(any(feature = "python", feature = "cuda"))]
pub(crate) fn other_ranks(rank: usize, size: usize) -> String {
    let others: Vec<String> = (0..size)
        .filter(|&r| r != rank)
        .map(|r| r.to_string())
        .collect();
    match others.len() {
        0 => "no other rank".to_string(),
        1 => format!("rank {}", others[0]),
        _ => format!("one of ranks {}", others.join(", ")),
    }
}
