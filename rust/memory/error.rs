//! Errors of the memory layer.

use crate::backend::BackendError;
use thiserror::Error;

/// What went wrong in the KV block pool or the forward scratch.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum MemoryError {
    /// The pool has fewer free blocks than were asked for; nothing was allocated.
    #[error("KV block pool exhausted: asked for {requested} blocks, {free} of {total} free")]
    Exhausted {
        /// Blocks asked for.
        requested: usize,
        /// Blocks free in the pool.
        free: usize,
        /// Blocks in the pool.
        total: usize,
    },
    /// A block id outside the pool.
    #[error("block {block} is outside the pool of {total} blocks")]
    InvalidBlock {
        /// The block id given.
        block: u32,
        /// Blocks in the pool (valid ids are below it).
        total: usize,
    },
    /// Free, retain or release of a block nobody holds.
    #[error("block {block} is not allocated (its reference count is already zero)")]
    NotAllocated {
        /// The block id given.
        block: u32,
    },
    /// A pool or arena was asked for with a zero or overflowing size.
    #[error("invalid size: {0}")]
    InvalidSize(String),
    /// A scratch slot that the arena does not have.
    #[error("buffer arena has no slot {0:?}")]
    UnknownSlot(String),
    /// The device allocation under the arena failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}
