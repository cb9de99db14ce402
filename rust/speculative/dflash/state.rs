//! A DFlash head's per-sequence state: the context rows it holds in the head's paged KV (one
//! row per committed position, the same slot in every draft layer's cache), the device block
//! table the attention reads, and where the captured rows the engine passes stand.
//!
//! Invariants:
//! - `positions` (one per context row, row `j` at slot `blocks[j / 16] * 16 + j % 16`) is
//!   strictly increasing; a block forward's rows go right after the last context row and are
//!   never counted as rows (the next propose writes over them).
//! - The device table mirrors `blocks` for its first `synced` entries, and `synced ==
//!   blocks.len()` whenever a forward reads it.
//! - Deferred rows (see `deferred`) follow every context row; what drops context rows drops
//!   them too.
//! - `free` returns every block to the pool and frees the table and the deferred rows'
//!   buffer; afterwards the state refuses every method.

use super::deferred::DeferredRows;
use crate::backend::{DevicePtr, Dtype, GpuBackend, GpuBackendExt};
use crate::memory::BlockAllocator;

/// Rows per drafter KV block.
pub const DFLASH_BLOCK_ROWS: usize = 16;

/// Per-sequence state of a [`DFlashHead`](super::DFlashHead).
pub struct DFlashState {
    pub(crate) head_id: u64,
    blocks: Vec<u32>,
    /// The RoPE position of each context row, oldest first.
    positions: Vec<usize>,
    /// Device u32 `[capacity_blocks]`: the block table the kernels read.
    table: DevicePtr,
    capacity_blocks: usize,
    synced: usize,
    /// The position the captured rows of the next propose start at (the position whose
    /// computed row comes first), once a prefill or a verified propose has said.
    pub(crate) stack_start: Option<usize>,
    /// The position of the latest propose, until `after_verify` settles it.
    pub(crate) proposed_at: Option<usize>,
    /// Drafts the latest propose returned.
    pub(crate) last_drafts: usize,
    /// Captured rows whose context write waits for the next drafting propose.
    pub(crate) deferred: DeferredRows,
    pub(crate) freed: bool,
}

crate::impl_proposer_state!(DFlashState);

impl DFlashState {
    pub(crate) fn new(
        gpu: &dyn GpuBackend,
        head_id: u64,
        capacity_blocks: usize,
    ) -> crate::Result<Self> {
        let table = gpu.alloc_zeros(Dtype::U32, capacity_blocks.max(1), "dflash:block_table")?;
        Ok(DFlashState {
            head_id,
            blocks: Vec::new(),
            positions: Vec::new(),
            table,
            capacity_blocks,
            synced: 0,
            stack_start: None,
            proposed_at: None,
            last_drafts: 0,
            deferred: DeferredRows::default(),
            freed: false,
        })
    }

    /// Context rows held.
    pub fn rows(&self) -> usize {
        self.positions.len()
    }

    /// Captured rows kept for a later context write (not in [`Self::rows`]).
    pub fn deferred_rows(&self) -> usize {
        self.deferred.len
    }

    /// The RoPE position of every context row, oldest first.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// Block ids held, in row order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// Rows the state can ever hold (context and one block).
    pub fn capacity_rows(&self) -> usize {
        self.capacity_blocks * DFLASH_BLOCK_ROWS
    }

    pub(crate) fn table(&self) -> DevicePtr {
        self.table
    }

    pub(crate) fn capacity_blocks(&self) -> usize {
        self.capacity_blocks
    }

    /// The cache slot of row `row` (which must lie in a held block).
    pub(crate) fn slot(&self, row: usize) -> u32 {
        self.blocks[row / DFLASH_BLOCK_ROWS] * DFLASH_BLOCK_ROWS as u32
            + (row % DFLASH_BLOCK_ROWS) as u32
    }

    /// Drops the context rows, written or deferred, at or after position `start` (a
    /// repeated propose rewrites them).
    pub(crate) fn keep_before(&mut self, start: usize) {
        let keep = self.positions.partition_point(|&p| p < start);
        self.positions.truncate(keep);
        self.deferred.keep_before(start);
    }

    /// Records `n` new context rows at positions `first ..`, after the held ones; their
    /// slots must already be reserved.
    pub(crate) fn push_rows(&mut self, first: usize, n: usize) {
        debug_assert!(self.positions.last().is_none_or(|&p| p < first));
        self.positions.extend(first..first + n);
    }

    /// Makes room for `total` rows (context and block), taking blocks from `pool` and
    /// writing the new table entries. False, with nothing taken, when the state's capacity
    /// or the pool is short.
    pub(crate) fn reserve(
        &mut self,
        gpu: &dyn GpuBackend,
        pool: &BlockAllocator,
        total: usize,
        stream: u64,
    ) -> crate::Result<bool> {
        let want = total.div_ceil(DFLASH_BLOCK_ROWS);
        if want > self.capacity_blocks {
            return Ok(false);
        }
        if want > self.blocks.len() {
            match pool.alloc(want - self.blocks.len()) {
                Ok(b) => self.blocks.extend(b),
                Err(_) => return Ok(false),
            }
        }
        if self.synced < self.blocks.len() {
            let from = self.synced;
            gpu.write(self.table.offset(from * 4), &self.blocks[from..], stream)?;
            self.synced = self.blocks.len();
        }
        Ok(true)
    }

    /// Returns every block to `pool` and forgets every row, written or deferred, keeping
    /// where the captured rows stand.
    pub(crate) fn drop_rows(&mut self, pool: &BlockAllocator) -> crate::Result<()> {
        let blocks = std::mem::take(&mut self.blocks);
        self.positions.clear();
        self.deferred.len = 0;
        self.synced = 0;
        pool.free(&blocks)?;
        Ok(())
    }

    /// Returns every block to `pool` and forgets every row and where the rows stand.
    pub(crate) fn clear(&mut self, pool: &BlockAllocator) -> crate::Result<()> {
        self.stack_start = None;
        self.proposed_at = None;
        self.last_drafts = 0;
        self.drop_rows(pool)
    }

    /// [`Self::clear`], then frees the device table and the deferred rows' buffer; the
    /// state is unusable afterwards.
    pub(crate) fn free(
        &mut self,
        gpu: &dyn GpuBackend,
        pool: &BlockAllocator,
    ) -> crate::Result<()> {
        let cleared = self.clear(pool);
        self.freed = true;
        let deferred = self.deferred.free(gpu);
        gpu.free(self.table)?;
        deferred?;
        cleared
    }
}
