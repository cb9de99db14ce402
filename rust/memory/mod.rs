//! The memory layer: the paged KV block pool and the shared forward scratch.
//!
//! Invariants:
//! - A block id is handed out by [`BlockAllocator::alloc`] only while its reference count
//!   is zero; it returns to the free list exactly when its count drops back to zero.
//! - A multi-block allocation is all-or-nothing: on failure the pool is unchanged.
//! - A [`BufferArena`] is sized once, from a slot list the model layer computes, and never
//!   grows; it owns its device buffers until [`BufferArena::free`] returns them.
//! - This layer knows devices, never models: nothing here reads a model's configuration.

mod arena;
mod block_allocator;
mod error;

pub use arena::{ArenaSlot, BufferArena, SlotSpec};
pub use block_allocator::BlockAllocator;
pub use error::MemoryError;
