//! `ExpertShard`: which routed experts of a MoE layer this rank holds, and the
//! communicator their outputs are exchanged over (expert parallelism).
//!
//! Rank `r` of `n` holds the contiguous block `r * E / n .. (r + 1) * E / n` of the `E`
//! routed experts; the router, the shared experts, attention and everything dense are
//! replicated on every rank. A checkpoint whose expert count does not divide by the ranks
//! is refused at load.
//!
//! How the routed sum stays bit-identical to one rank's: each rank computes its own
//! experts' scaled outputs into the `[rows, top_k, hidden]` slots of the choices they
//! answer, leaving the others zero; an all-reduce sum then gives every rank every slot
//! exactly (`x + 0` is `x`, and the BF16 sum is rounded once from an exact f32), and each
//! rank accumulates the slots in choice order as one rank would. That moves `top_k` times
//! the bytes of a reduce of partial sums, whose result would depend on how the experts
//! are split (BF16 sums are not associative): token-identical output across rank counts
//! is the contract, and the communication cost is measured (`benches/comm_mpi.py`).

use crate::distributed::Communicator;
use std::ops::Range;
use std::sync::Arc;

/// This rank's part of every MoE layer's routed experts.
#[derive(Clone)]
pub struct ExpertShard {
    comm: Arc<dyn Communicator>,
}

impl ExpertShard {
    /// The shard of `comm`'s rank, or `None` on a world of one rank (nothing is split).
    pub fn new(comm: Arc<dyn Communicator>) -> Option<Self> {
        (comm.size() > 1).then_some(ExpertShard { comm })
    }

    /// The communicator the routed outputs are exchanged over.
    pub fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    /// The shared handle to the communicator.
    pub fn comm_arc(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// The experts this rank holds out of `num_experts`, or why they cannot be split.
    pub fn range(&self, num_experts: usize) -> Result<Range<usize>, String> {
        let (rank, size) = (self.comm.rank(), self.comm.size());
        if num_experts == 0 || !num_experts.is_multiple_of(size) {
            return Err(format!(
                "{num_experts} routed experts cannot be split evenly across {size} ranks; \
                 run with a number of ranks that divides {num_experts}"
            ));
        }
        let per = num_experts / size;
        Ok(rank * per..(rank + 1) * per)
    }
}

impl std::fmt::Debug for ExpertShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ExpertShard {{ rank: {}, size: {} }}",
            self.comm.rank(),
            self.comm.size()
        )
    }
}

impl PartialEq for ExpertShard {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.comm, &other.comm)
    }
}
