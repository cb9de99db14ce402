//! `LocalCommunicator`: the one-process world, rank 0 of 1.

use super::{Communicator, DistributedError};

/// Rank 0 of a world of one: every collective is the identity and completes at once.
///
/// Lets single-process code and tests run the multi-rank paths unchanged.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalCommunicator;

impl Communicator for LocalCommunicator {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn all_reduce_sum_f32(&self, _buf: &mut [f32]) -> Result<(), DistributedError> {
        Ok(())
    }

    fn broadcast_bytes(&self, root: usize, _buf: &mut Vec<u8>) -> Result<(), DistributedError> {
        super::check_root(self, root, "broadcast_bytes")
    }

    fn barrier(&self) -> Result<(), DistributedError> {
        Ok(())
    }
}
