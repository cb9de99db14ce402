//! Errors of the memory layer.

use crate::backend::BackendError;
use thiserror::Error;

/// What went wrong in the KV block pool or the forward scratch.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum MemoryError {
    /// The pool has fewer free blocks than were asked for; nothing was allocated.
    #[error("KV block pool exhausted: asked for {requested} blocks, {free} of {total} free")]
    Exhausted {
        requested: usize,
        free: usize,
        total: usize,
    },
    /// A block id outside the pool.
    #[error("block {block} is outside the pool of {total} blocks")]
    InvalidBlock { block: u32, total: usize },
    /// Free, retain or release of a block nobody holds.
    #[error("block {block} is not allocated (its reference count is already zero)")]
    NotAllocated { block: u32 },
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
