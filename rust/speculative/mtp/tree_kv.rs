//! The rows of the MTP head's draft trees: each branch's drafter KV until the verify, and
//! the accepted path's kept after it.
//!
//! Branch KV. Every node that is run owns blocks for the rows after the shared prefix: the
//! state's blocks before `b0 = (R + 1) / 16` (`R` the verified token's row) are shared; a
//! node's own blocks, from `b0` on, hold a copy of the prefix's rows in block `b0`, then its
//! ancestors' rows, then its own at row `R + depth` and RoPE position `p + depth`. Its
//! forward reads a block table of the shared blocks then its own, so it attends to exactly
//! the rows a chain drafting its path attends to and writes the same keys and values.
//!
//! Compaction. After the verify, the verified row and the rows of the accepted path's nodes
//! that were run (every path node but possibly the last, as a chain's last draft has no
//! row) are kept: the deepest such node's blocks replace the state's from `b0` on, so the
//! state holds the prefix then the path, what a chain over the path writes, bit for bit.
//! Every other node's blocks go back to the pool. Under `mtp_kv_exact` only the verified
//! row is kept, as after a chain (the catch-up writes the path's exact rows).
//!
//! Invariants:
//! - Between `propose_tree` and the verify the state's own rows end at the verified row
//!   (pending); tree rows live only in nodes' blocks, which every later propose, `clear`,
//!   `take_drafter_kv` and `free_state` return when no verify settled them.
//! - A branch that would pass the state's capacity, or find the pool empty, gets no blocks:
//!   its node stays a leaf.

use super::bad;
use super::head::MtpHead;
use super::state::{DrafterKv, MtpState, DRAFTER_BLOCK_SIZE};
use crate::backend::{DevicePtr, Dtype, GpuBackend, GpuBackendExt};
use crate::speculative::DraftTree;

/// A grown tree's rows until the verify settles them.
pub(crate) struct PendingTree {
    /// The verified token's row (the state's newest row).
    pub(super) root_row: usize,
    /// The pair key of the verified token's row.
    pub(super) root_key: usize,
    /// Each node's parent.
    pub(super) parents: Vec<Option<usize>>,
    /// The blocks (from `b0` on) of each node that was run; `None` for a leaf.
    pub(super) blocks: Vec<Option<Vec<u32>>>,
}

impl PendingTree {
    /// The first block a branch owns: the one after the verified row's, or its own when
    /// it has room left.
    pub(super) fn first_block(&self) -> usize {
        (self.root_row + 1) / DRAFTER_BLOCK_SIZE
    }

    /// Returns every node's blocks to `kv`.
    pub(crate) fn release(self, kv: &DrafterKv) -> crate::Result<()> {
        let blocks: Vec<u32> = self.blocks.into_iter().flatten().flatten().collect();
        kv.allocator.free(&blocks)?;
        Ok(())
    }
}

impl MtpHead {
    /// Fresh blocks for a node at `depth` under `parent` (the verified token for `None`),
    /// holding a copy of every branch row before its own; `None` when its row would pass
    /// the state's capacity or the pool has no room.
    pub(super) fn branch_blocks(
        &self,
        gpu: &dyn GpuBackend,
        st: &MtpState,
        tree: &PendingTree,
        parent: Option<usize>,
        depth: usize,
        stream: u64,
    ) -> crate::Result<Option<Vec<u32>>> {
        let row = tree.root_row + depth;
        if row >= st.capacity_rows() {
            return Ok(None);
        }
        let b0 = tree.first_block();
        let Ok(blocks) = self.kv.allocator.alloc(row / DRAFTER_BLOCK_SIZE + 1 - b0) else {
            return Ok(None);
        };
        let source: &[u32] = match parent {
            Some(p) => tree.blocks[p].as_deref().unwrap_or_default(),
            None => st.blocks.get(b0..).unwrap_or_default(),
        };
        let kv_bytes = self.spec.config.kv_cache_width() * Dtype::Bf16.size();
        let mut left = row - b0 * DRAFTER_BLOCK_SIZE;
        for (&from, &to) in source.iter().zip(&blocks) {
            let n = left.min(DRAFTER_BLOCK_SIZE);
            if n == 0 {
                break;
            }
            let bytes = n * kv_bytes;
            for cache in [self.kv.k, self.kv.v] {
                let at = |b: u32| cache.offset(b as usize * DRAFTER_BLOCK_SIZE * kv_bytes);
                gpu.copy_dtod(at(to), at(from), bytes, stream)?;
            }
            left -= n;
        }
        if left > 0 {
            self.kv.allocator.free(&blocks)?;
            return Err(bad(
                "propose_tree",
                format!("a branch's parent holds {left} rows too few to copy"),
            ));
        }
        Ok(Some(blocks))
    }

    /// The state's buffers for growing a tree of `budget` nodes: the output hidden of every
    /// row run (the verified token's and up to `budget - 1` nodes'), and a block table.
    pub(super) fn tree_buffers(
        &self,
        gpu: &dyn GpuBackend,
        st: &mut MtpState,
        budget: usize,
    ) -> crate::Result<(DevicePtr, DevicePtr)> {
        let row_bytes = self.spec.config.hidden_size * Dtype::Bf16.size();
        let hidden = match st.tree_hidden {
            Some((buf, rows)) if rows >= budget => buf,
            old => {
                if let Some((buf, _)) = old {
                    st.tree_hidden = None;
                    gpu.free(buf)?;
                }
                let buf = gpu.alloc(budget * row_bytes, "mtp:tree_hidden")?;
                st.tree_hidden = Some((buf, budget));
                buf
            }
        };
        let table = match st.tree_table {
            Some(t) => t,
            None => {
                let t = gpu.alloc_zeros(Dtype::U32, st.capacity_blocks.max(1), "mtp:tree_table")?;
                st.tree_table = Some(t);
                t
            }
        };
        Ok((hidden, table))
    }

    /// Settles a pending tree after a verify that accepted `path` (see the module doc).
    pub(crate) fn keep_tree_path(
        &self,
        st: &mut MtpState,
        tree: PendingTree,
        path: &[usize],
    ) -> crate::Result<()> {
        if let Some(fault) = DraftTree::path_fault(&tree.parents, tree.parents.len(), path) {
            tree.release(&self.kv)?;
            st.pending = 0;
            return Err(bad(
                "after_verify_tree",
                format!("the path is wrong: {fault}"),
            ));
        }
        let ran = if self.spec.levers.mtp_kv_exact {
            0
        } else {
            path.iter()
                .take_while(|&&n| tree.blocks[n].is_some())
                .count()
        };
        let b0 = tree.first_block();
        let root_key = tree.root_key;
        let mut blocks = tree.blocks;
        let kept = ran.checked_sub(1).and_then(|j| blocks[path[j]].take());
        let rest: Vec<u32> = blocks.into_iter().flatten().flatten().collect();
        st.pending = 0;
        if let Some(own) = kept {
            let dropped = st.blocks.split_off(b0.min(st.blocks.len()));
            st.synced = st.synced.min(st.blocks.len());
            st.blocks.extend(own);
            st.pair_keys.extend((1..=ran).map(|d| root_key + d));
            self.kv.allocator.free(&dropped)?;
        }
        self.kv.allocator.free(&rest)?;
        Ok(())
    }
}
