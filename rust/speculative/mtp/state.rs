//! The MTP head's per-sequence state and its own paged drafter KV pool.
//!
//! The pool is the head's: its own [`BlockAllocator`] of [`DRAFTER_BLOCK_SIZE`]-row blocks and
//! one K and one V cache on the device. A state holds block ids of that pool, one pair key
//! per row, the rows the latest propose wrote that are not verified yet, and a device copy of
//! its block table (which kernels read).
//!
//! Invariants:
//! - `pair_keys.len()` is the row count; row `j` lives at slot
//!   `blocks[j / 16] * 16 + j % 16`, and `blocks.len() == ceil(rows / 16)` after every
//!   operation that shrinks (rows never hold blocks they do not use for long).
//! - A row written at RoPE position `p` has pair key `p - 1` (DESIGN.md, "MTP pairing").
//! - The device table mirrors `blocks` for its first `blocks.len()` entries.
//! - Every block and the device table are returned by `free_state`; after `take_drafter_kv`
//!   the state owns no blocks and is indistinguishable from a fresh one.
//! - Deferred rows (verified rows of proposes that drafted nothing, not yet written) come
//!   after every written row: the logical rows are `pair_keys` then `deferred`, and a
//!   deferred row at position `p` has pair key `p - 1` like a written one. Their target
//!   hiddens live in `deferred_hidden` (row `j` for `deferred[j]`), which `free_state` frees.
//! - A draft tree waiting for its verify (`tree`) owns blocks of the pool besides `blocks`;
//!   settling before a propose, `clear` and `drop_tree` return them. Its buffers
//!   (`tree_hidden`, `tree_table`) live until `free_state`.

use super::tree_kv::PendingTree;
use crate::backend::{DevicePtr, Dtype, GpuBackend, GpuBackendExt};
use crate::memory::BlockAllocator;
use crate::speculative::ProposerError;

/// Rows per drafter KV block.
pub const DRAFTER_BLOCK_SIZE: usize = 16;

/// The head's drafter KV pool: the allocator and the caches it indexes.
pub(crate) struct DrafterKv {
    pub allocator: BlockAllocator,
    /// BF16 `[num_blocks * 16, kv_cache_width]` (see `ModelConfig::kv_cache_row`).
    pub k: DevicePtr,
    pub v: DevicePtr,
    pub num_blocks: usize,
}

impl DrafterKv {
    pub fn num_slots(&self) -> usize {
        self.num_blocks * DRAFTER_BLOCK_SIZE
    }
}

/// Per-sequence state of an [`MtpHead`](super::MtpHead).
pub struct MtpState {
    pub(crate) head_id: u64,
    pub(crate) blocks: Vec<u32>,
    pub(crate) pair_keys: Vec<usize>,
    /// Rows written by the latest propose and not yet settled by `after_verify`.
    pub(crate) pending: usize,
    pub(crate) last_drafts: Vec<u32>,
    /// Device u32 `[capacity_blocks]`: the block table kernels read.
    pub(crate) table: DevicePtr,
    pub(crate) capacity_blocks: usize,
    /// Leading entries of the device table known to match `blocks`.
    pub(crate) synced: usize,
    pub(crate) freed: bool,
    /// Verified rows not written yet, oldest first: `(token, position)`.
    pub(crate) deferred: Vec<(u32, usize)>,
    /// Device BF16 `[DEFERRED_ROWS, hidden]`: the target hiddens of `deferred`, allocated at
    /// the first deferral.
    pub(crate) deferred_hidden: Option<DevicePtr>,
    /// The latest `propose_tree`'s nodes and their blocks, until the verify settles them.
    pub(crate) tree: Option<PendingTree>,
    /// Device BF16 `[rows, hidden]` (with its row count): the output hidden of each row a
    /// tree's growth ran, allocated at the first tree.
    pub(crate) tree_hidden: Option<(DevicePtr, usize)>,
    /// Device u32 `[capacity_blocks]`: the block table of the tree node being run.
    pub(crate) tree_table: Option<DevicePtr>,
}

crate::impl_proposer_state!(MtpState);

impl MtpState {
    /// Drafter rows held.
    pub fn rows(&self) -> usize {
        self.pair_keys.len()
    }

    /// Rows held, written or deferred.
    pub fn logical_rows(&self) -> usize {
        self.pair_keys.len() + self.deferred.len()
    }

    /// Rows whose KV write is deferred to the next drafting propose.
    pub fn deferred_rows(&self) -> usize {
        self.deferred.len()
    }

    /// The pair key of every row, written or deferred, oldest first.
    pub fn logical_pair_keys(&self) -> Vec<usize> {
        (0..self.logical_rows())
            .map(|r| self.logical_key(r))
            .collect()
    }

    /// The pair key of logical row `row` (written or deferred).
    pub(crate) fn logical_key(&self, row: usize) -> usize {
        match self.pair_keys.get(row) {
            Some(&k) => k,
            None => self.deferred[row - self.pair_keys.len()].1 - 1,
        }
    }

    /// Block ids held, in row order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// The pair key of every row, oldest first.
    pub fn pair_keys(&self) -> &[usize] {
        &self.pair_keys
    }

    /// The drafts of the latest propose.
    pub fn last_drafts(&self) -> &[u32] {
        &self.last_drafts
    }

    /// The device block table (u32, one entry per held block, then unused capacity).
    pub fn block_table(&self) -> DevicePtr {
        self.table
    }

    /// Entries the device block table has room for.
    pub fn capacity_blocks(&self) -> usize {
        self.capacity_blocks
    }

    /// Rows the state can ever hold.
    pub fn capacity_rows(&self) -> usize {
        self.capacity_blocks * DRAFTER_BLOCK_SIZE
    }

    /// The cache slot of row `row`.
    pub fn slot(&self, row: usize) -> Option<u32> {
        let b = *self.blocks.get(row / DRAFTER_BLOCK_SIZE)?;
        Some(b * DRAFTER_BLOCK_SIZE as u32 + (row % DRAFTER_BLOCK_SIZE) as u32)
    }

    pub(crate) fn new(
        gpu: &dyn GpuBackend,
        head_id: u64,
        capacity_blocks: usize,
    ) -> crate::Result<Self> {
        let table = gpu.alloc_zeros(Dtype::U32, capacity_blocks.max(1), "mtp:block_table")?;
        Ok(MtpState {
            head_id,
            blocks: Vec::new(),
            pair_keys: Vec::new(),
            pending: 0,
            last_drafts: Vec::new(),
            table,
            capacity_blocks,
            synced: 0,
            freed: false,
            deferred: Vec::new(),
            deferred_hidden: None,
            tree: None,
            tree_hidden: None,
            tree_table: None,
        })
    }

    /// Makes room for `extra` more rows, allocating blocks from `kv` as needed. Returns how
    /// many of them fit (fewer when the budget or the pool runs out; never an error, so a
    /// full pool costs drafts, not the sequence).
    pub(crate) fn reserve(
        &mut self,
        gpu: &dyn GpuBackend,
        kv: &DrafterKv,
        extra: usize,
    ) -> crate::Result<usize> {
        let want_rows = (self.rows() + extra).min(self.capacity_rows());
        let want_blocks = want_rows.div_ceil(DRAFTER_BLOCK_SIZE);
        let have = self.blocks.len();
        if want_blocks > have {
            // All-or-nothing per call, so fall back block by block when the pool is short.
            match kv.allocator.alloc(want_blocks - have) {
                Ok(b) => self.blocks.extend(b),
                Err(_) => {
                    while self.blocks.len() < want_blocks {
                        match kv.allocator.alloc(1) {
                            Ok(b) => self.blocks.extend(b),
                            Err(_) => break,
                        }
                    }
                }
            }
        }
        if self.synced < self.blocks.len() {
            let from = self.synced;
            gpu.write(
                self.table.offset(from * 4),
                &self.blocks[from..],
                crate::backend::DEFAULT_STREAM,
            )?;
            self.synced = self.blocks.len();
        }
        Ok((self.blocks.len() * DRAFTER_BLOCK_SIZE)
            .min(self.capacity_rows())
            .saturating_sub(self.rows())
            .min(extra))
    }

    /// Drops the newest logical rows (deferred ones first) down to `rows` and returns
    /// unused blocks to `kv`.
    pub(crate) fn truncate(&mut self, kv: &DrafterKv, rows: usize) -> crate::Result<()> {
        self.deferred
            .truncate(rows.saturating_sub(self.pair_keys.len()));
        self.pair_keys.truncate(rows);
        self.pending = self.pending.min(rows);
        let keep = self.rows().div_ceil(DRAFTER_BLOCK_SIZE);
        if self.blocks.len() > keep {
            let extra = self.blocks.split_off(keep);
            self.synced = self.synced.min(keep);
            kv.allocator.free(&extra)?;
        }
        Ok(())
    }

    /// Rolls back rows of a propose that was never verified, and rows at or after the
    /// sequence position `position` (they belong to a future being re-drafted).
    pub(crate) fn settle_before(&mut self, kv: &DrafterKv, position: usize) -> crate::Result<()> {
        self.drop_tree(kv)?;
        let mut rows = self.logical_rows() - self.pending;
        match position.checked_sub(1) {
            None => rows = 0,
            Some(newest) => {
                while rows > 0 && self.logical_key(rows - 1) >= newest {
                    rows -= 1;
                }
            }
        }
        self.pending = 0;
        self.truncate(kv, rows)
    }

    /// Releases every block to `kv` and clears the bookkeeping (the device table stays).
    pub(crate) fn clear(&mut self, kv: &DrafterKv) -> crate::Result<()> {
        let tree = self.drop_tree(kv);
        let blocks = std::mem::take(&mut self.blocks);
        self.synced = 0;
        self.pair_keys.clear();
        self.pending = 0;
        self.last_drafts.clear();
        self.deferred.clear();
        kv.allocator.free(&blocks)?;
        tree
    }

    /// Returns the blocks of a tree no verify settled to `kv` (its rows were never
    /// accepted).
    pub(crate) fn drop_tree(&mut self, kv: &DrafterKv) -> crate::Result<()> {
        self.tree.take().map_or(Ok(()), |t| t.release(kv))
    }

    /// Forgets the blocks without releasing them (they were moved out), and drops deferred
    /// rows (whoever takes the blocks catches up from their last pair key).
    pub(crate) fn forget(&mut self) {
        self.blocks.clear();
        self.synced = 0;
        self.pair_keys.clear();
        self.pending = 0;
        self.last_drafts.clear();
        self.deferred.clear();
    }

    /// Takes carried blocks into this fresh state; the device table is written at the next
    /// forward (install has no backend to write it with).
    pub(crate) fn install(
        &mut self,
        blocks: Vec<u32>,
        rows: usize,
        last_pair_key: Option<usize>,
    ) -> Result<(), ProposerError> {
        let fail = |message: String| ProposerError::InvalidArgument {
            method: "install_drafter_kv",
            message,
        };
        if !self.blocks.is_empty() || self.logical_rows() != 0 {
            return Err(fail("the state already holds drafter rows".into()));
        }
        if blocks.len() != rows.div_ceil(DRAFTER_BLOCK_SIZE) || blocks.len() > self.capacity_blocks
        {
            return Err(fail(format!(
                "{} blocks for {rows} rows (need {}, state capacity {})",
                blocks.len(),
                rows.div_ceil(DRAFTER_BLOCK_SIZE),
                self.capacity_blocks
            )));
        }
        // Carried rows are contiguous in sequence space and end at the given key.
        self.pair_keys = match (rows, last_pair_key) {
            (0, _) => Vec::new(),
            (_, Some(k)) if k + 1 >= rows => (k + 1 - rows..=k).collect(),
            _ => {
                return Err(fail(format!(
                    "{rows} rows need a last pair key of at least {}",
                    rows.saturating_sub(1)
                )))
            }
        };
        self.blocks = blocks;
        self.synced = 0;
        Ok(())
    }
}
