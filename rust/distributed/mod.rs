//! The `Communicator`: what ranks of a multi-rank serve exchange (rank and size, sum
//! all-reduce, broadcast, barrier, and the command channel from rank 0 to the workers).
//!
//! Implementations: [`LocalCommunicator`] (rank 0 of 1, every collective the identity);
//! with feature `python`, an MPI communicator that calls mpi4py under the interpreter lock
//! (`specdraft.distributed.init()`); with feature `cuda`, `NcclCommunicator` over NCCL
//! through cudarc (`specdraft.distributed.init(backend="nccl")`, whose NCCL unique id
//! travels over MPI). MPI is reached through mpi4py rather than the Rust
//! `mpi` crate because that crate needs bindgen, libclang and an MPI installation when the
//! crate is compiled, which would make every build of specdraft depend on MPI; through
//! mpi4py, MPI (the `mpich` wheel) is needed only where ranks actually run.
//!
//! Invariants:
//! - every rank calls the same collectives in the same order; the command channel is how
//!   rank 0 tells the workers which ones come next;
//! - no method panics or waits forever: a collective that some rank never joins ends,
//!   within the implementation's stated timeout, with [`DistributedError::Timeout`] naming
//!   the waiting rank and the ranks that may be missing;
//! - BF16 sums are computed in f32 and rounded to BF16 once, after the sum, so the result
//!   does not depend on how many ranks add into it before rounding.

mod command;
mod counted;
mod error;
mod local;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(feature = "cuda")]
mod nccl_library;
mod wire;

pub use command::{Command, SeqTokens};
pub use counted::{Counted, OpCost};
#[cfg(any(feature = "python", feature = "cuda"))]
pub(crate) use error::other_ranks;
pub use error::DistributedError;
pub use local::LocalCommunicator;
#[cfg(feature = "cuda")]
pub use nccl::{NcclCommunicator, NCCL_UNIQUE_ID_BYTES};
#[cfg(feature = "cuda")]
pub use nccl_library::NCCL_WHEEL;

use half::bf16;

/// The launcher's variables that hold how many ranks run on this host: MPICH's Hydra, then
/// Open MPI's.
const LOCAL_SIZE_VARIABLES: [&str; 2] = ["MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"];

/// How many ranks the launcher (`mpiexec`) started on this host, this one included: 1 when
/// the process was not launched by one (or the launcher does not say).
pub fn local_rank_count() -> usize {
    LOCAL_SIZE_VARIABLES
        .iter()
        .filter_map(|name| std::env::var(name).ok())
        .filter_map(|v| v.trim().parse::<usize>().ok())
        .find(|&n| n > 0)
        .unwrap_or(1)
}

/// A group of ranks that run the same forwards and meet in the same collectives.
pub trait Communicator: Send + Sync {
    /// This process's rank, `0..size()`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn size(&self) -> usize;

    /// Replaces `buf` on every rank by the element-wise sum of every rank's `buf`.
    /// Every rank passes the same length.
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), DistributedError>;

    /// The BF16 sum: every rank's values widened to f32, summed in f32 (through
    /// [`Self::all_reduce_sum_f32`]) and rounded to BF16 once (nearest even), so no partial
    /// sum is rounded.
    fn all_reduce_sum_bf16(&self, buf: &mut [bf16]) -> Result<(), DistributedError> {
        let mut wide: Vec<f32> = buf.iter().map(|v| v.to_f32()).collect();
        self.all_reduce_sum_f32(&mut wide)?;
        for (out, v) in buf.iter_mut().zip(wide) {
            *out = bf16::from_f32(v);
        }
        Ok(())
    }

    /// Replaces `buf` on every rank by `root`'s `buf` (the lengths may differ: each rank's
    /// is resized to the root's).
    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<(), DistributedError>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), DistributedError>;

    /// Rank 0 sends `command` to every worker (a broadcast from rank 0). Refused on a worker.
    fn send_command(&self, command: &Command) -> Result<(), DistributedError> {
        if self.rank() != 0 {
            return Err(DistributedError::InvalidArgument {
                rank: self.rank(),
                size: self.size(),
                op: "send_command",
                message: "only rank 0 sends commands; workers receive them".into(),
            });
        }
        self.broadcast_bytes(0, &mut command.encode())
    }

    /// A worker receives the next command rank 0 sends. Refused on rank 0.
    fn recv_command(&self) -> Result<Command, DistributedError> {
        if self.rank() == 0 {
            return Err(DistributedError::InvalidArgument {
                rank: 0,
                size: self.size(),
                op: "recv_command",
                message: "rank 0 sends commands; only workers (ranks > 0) receive them".into(),
            });
        }
        let mut bytes = Vec::new();
        self.broadcast_bytes(0, &mut bytes)?;
        Command::decode(&bytes, self.rank())
    }
}

/// `Ok` when `root` is a rank of `comm`'s world, else the error naming `op`.
pub(crate) fn check_root(
    comm: &(impl Communicator + ?Sized),
    root: usize,
    op: &'static str,
) -> Result<(), DistributedError> {
    if root < comm.size() {
        Ok(())
    } else {
        Err(DistributedError::InvalidArgument {
            rank: comm.rank(),
            size: comm.size(),
            op,
            message: format!("root {root} is not a rank (0..{})", comm.size()),
        })
    }
}
