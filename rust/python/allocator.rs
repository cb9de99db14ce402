//! `specdraft.BlockAllocator`: the paged KV block pool, as Python sees it.
//!
//! A thin wrapper: every invariant (all-or-nothing allocation, reference counts, errors that
//! leave the pool unchanged) is the Rust allocator's; errors arrive as `AllocationError`.

use super::errors::IntoPyResult;
use crate::memory::BlockAllocator;
use pyo3::prelude::*;
use std::sync::Arc;

/// `BlockAllocator(num_blocks, block_size)`: a pool of `num_blocks` KV blocks of
/// `block_size` rows, with per-block reference counts. Both sizes must be at least 1 (else
/// `AllocationError`). Allocation is all or nothing; a failed call leaves the pool
/// unchanged.
#[pyclass(name = "BlockAllocator", module = "specdraft", frozen)]
pub struct PyBlockAllocator {
    pub inner: Arc<BlockAllocator>,
}

#[pymethods]
impl PyBlockAllocator {
    #[new]
    fn new(num_blocks: usize, block_size: usize) -> PyResult<Self> {
        Ok(PyBlockAllocator {
            inner: Arc::new(BlockAllocator::new(num_blocks, block_size).py()?),
        })
    }

    /// Allocates `n` blocks (reference count 1 each); all or nothing.
    fn alloc(&self, n: usize) -> PyResult<Vec<u32>> {
        self.inner.alloc(n).py()
    }

    /// Gives the blocks back (one holder each).
    fn free(&self, blocks: Vec<u32>) -> PyResult<()> {
        self.inner.free(&blocks).py()
    }

    /// Adds a holder to each block, for sharing a prefix.
    fn retain(&self, blocks: Vec<u32>) -> PyResult<()> {
        self.inner.retain(&blocks).py()
    }

    /// Drops one holder of each block; a block with no holder left returns to the pool.
    fn release(&self, blocks: Vec<u32>) -> PyResult<()> {
        self.inner.release(&blocks).py()
    }

    /// The reference count of `block` (0 when free).
    fn refcount(&self, block: u32) -> PyResult<u32> {
        self.inner.refcount(block).py()
    }

    /// Blocks needed to hold `rows` rows.
    fn blocks_for(&self, rows: usize) -> usize {
        self.inner.blocks_for(rows)
    }

    /// Blocks currently free.
    #[getter]
    fn num_free(&self) -> usize {
        self.inner.num_free()
    }

    /// Blocks in the pool.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }

    /// Rows per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockAllocator({} blocks of {} rows, {} free)",
            self.inner.num_blocks(),
            self.inner.block_size(),
            self.inner.num_free()
        )
    }
}
