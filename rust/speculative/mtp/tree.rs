//! The MTP head's dynamic draft trees (EAGLE-2): growing a tree best first by path
//! probability, and keeping the accepted path's drafter rows after the verify.
//!
//! Growth. The verified token's row is written as a chain's first row (in the state's own
//! blocks, pending) and its logits give the first candidates. A max-heap holds candidates by
//! path probability (the product of the head's softmax probabilities along the path); the
//! best becomes the next node and, while the budget has room, the head runs over it (one
//! row) and offers its top [`TREE_TOP_K`] children. A child is never more probable than its
//! parent, so ancestors are taken before descendants, and the tree holds the most probable
//! paths the head's top-k lists reach. The last node taken is not run: as in a chain,
//! `budget` drafts cost `budget` one-row forwards.
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
//! - A node is run only when its rows fit the state's capacity and the pool has its
//!   blocks; otherwise it stays a leaf (a full pool costs drafts, never the call).
//! - Candidates whose probability rounds to 0 in f32 are never offered: they could never
//!   pay for a verify row, and a node's probability lies in (0, 1].

use super::bad;
use super::forward::{Depth, HiddenKind, Row, Scratch};
use super::head::MtpHead;
use super::state::{DrafterKv, MtpState, DRAFTER_BLOCK_SIZE};
use crate::backend::{DevicePtr, Dtype, GpuBackend, GpuBackendExt};
use crate::speculative::DraftTree;
use std::collections::BinaryHeap;

/// Children offered per node run. The target's next token is the SmolLM2 head's first
/// choice 33.5% of the time, within its top 2 47.8%, top 3 53.1% and top 5 58.6%: past
/// the fourth choice a child is rarely worth a verify row, and the best-first budget would
/// seldom reach it anyway.
pub const TREE_TOP_K: usize = 4;

/// A grown tree's rows until the verify settles them.
pub(crate) struct PendingTree {
    /// The verified token's row (the state's newest row).
    root_row: usize,
    /// The pair key of the verified token's row.
    root_key: usize,
    /// Each node's parent.
    parents: Vec<Option<usize>>,
    /// The blocks (from `b0` on) of each node that was run; `None` for a leaf.
    blocks: Vec<Option<Vec<u32>>>,
}

impl PendingTree {
    /// The first block a branch owns: the one after the verified row's, or its own when
    /// it has room left.
    fn first_block(&self) -> usize {
        (self.root_row + 1) / DRAFTER_BLOCK_SIZE
    }

    /// Returns every node's blocks to `kv`.
    pub(crate) fn release(self, kv: &DrafterKv) -> crate::Result<()> {
        let blocks: Vec<u32> = self.blocks.into_iter().flatten().flatten().collect();
        kv.allocator.free(&blocks)?;
        Ok(())
    }
}

/// A node the tree may take next.
struct Candidate {
    /// Path probability.
    reach: f64,
    /// Probability given the parent.
    prob: f64,
    /// Target id.
    token: u32,
    parent: Option<usize>,
    depth: usize,
    /// Row of the tree's hidden buffer holding the parent's output hidden.
    hidden_row: usize,
    /// Offer order, so equal probabilities come out first offered first.
    order: usize,
}

crate::speculative::draft_tree::order_by_reach!(Candidate);

/// The `k` highest logits among the ids `allowed` keeps, highest first (ties to the lower
/// id, as the argmax kernel picks), each with its softmax probability over every id.
/// Non-finite logits and probabilities that round to 0 in f32 are left out.
pub(crate) fn top_children(
    logits: &[f32],
    k: usize,
    allowed: impl Fn(usize) -> bool,
) -> Vec<(usize, f64)> {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() || k == 0 {
        return Vec::new();
    }
    let sum: f64 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| (f64::from(l) - f64::from(max)).exp())
        .sum();
    let mut best: Vec<(usize, f32)> = Vec::with_capacity(k + 1);
    for (id, &l) in logits.iter().enumerate() {
        if !l.is_finite() || (best.len() == k && l <= best[k - 1].1) || !allowed(id) {
            continue;
        }
        let at = best.partition_point(|&(_, b)| b >= l);
        best.insert(at, (id, l));
        best.truncate(k);
    }
    best.into_iter()
        .map(|(id, l)| (id, (f64::from(l) - f64::from(max)).exp() / sum))
        .filter(|&(_, p)| p as f32 > 0.0)
        .collect()
}

impl MtpHead {
    /// Turns tree growth on or off (off by default): on, `grows_trees()` is true and an
    /// engine under the `"tree"` draft shape asks `propose_tree` per sequence. A
    /// `propose_tree` grows a tree either way.
    pub fn set_grow_trees(&self, on: bool) {
        self.grow_trees
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Grows a tree of at most `budget >= 1` nodes for `st` (settled, nothing deferred; see
    /// the module doc) and leaves it pending in the state.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn grow_tree(
        &self,
        gpu: &dyn GpuBackend,
        st: &mut MtpState,
        token: u32,
        hidden: DevicePtr,
        position: usize,
        budget: usize,
        mask: Option<&[i32]>,
        stream: u64,
    ) -> crate::Result<DraftTree> {
        let mut tree = DraftTree {
            tokens: Vec::new(),
            parents: Vec::new(),
            probs: Some(Vec::new()),
        };
        if st.reserve(gpu, &self.kv, 1)? == 0 {
            // Budget or pool exhausted: nothing to draft from, as for a chain.
            return Ok(DraftTree::default());
        }
        let (hidden_buf, table) = self.tree_buffers(gpu, st, budget)?;
        let row_bytes = self.spec.config.hidden_size * Dtype::Bf16.size();
        let draft_mask = mask.map(|m| self.spec.draft_mask(m));
        let allowed = |d: usize| {
            draft_mask
                .as_ref()
                .is_none_or(|m| (m[d / 32] >> (d % 32)) & 1 == 1)
        };
        let sc = self.lock_scratch();
        let root_row = st.rows();
        let root = Row {
            token,
            hidden,
            position,
            seq: 0,
            slot: st.slot(root_row).unwrap_or(0),
            ctx_len: root_row + 1,
        };
        let tables = [(st.table, st.capacity_blocks)];
        self.spec.forward_rows(
            gpu,
            &sc,
            &[root],
            &tables,
            HiddenKind::Target,
            Depth::Logits,
            stream,
        )?;
        st.pair_keys.push(position - 1);
        st.pending = 1;
        let mut pending = PendingTree {
            root_row,
            root_key: position - 1,
            parents: Vec::new(),
            blocks: Vec::new(),
        };
        let mut heap = BinaryHeap::new();
        let mut offered = 0;
        let mut hidden_rows = 0;
        let mut offer = |heap: &mut BinaryHeap<Candidate>,
                         sc: &Scratch,
                         reach: f64,
                         parent: Option<usize>,
                         depth: usize|
         -> crate::Result<()> {
            let at = hidden_buf.offset(hidden_rows * row_bytes);
            gpu.copy_dtod(at, self.spec.chain_hidden(sc, 0), row_bytes, stream)?;
            let logits = gpu.download::<f32>(sc.logits, self.spec.draft_vocab)?;
            for (d, prob) in top_children(&logits, TREE_TOP_K, allowed) {
                heap.push(Candidate {
                    reach: reach * prob,
                    prob,
                    token: self.spec.to_target(d as u32),
                    parent,
                    depth,
                    hidden_row: hidden_rows,
                    order: offered,
                });
                offered += 1;
            }
            hidden_rows += 1;
            Ok(())
        };
        let grown = (|| -> crate::Result<()> {
            offer(&mut heap, &sc, 1.0, None, 1)?;
            while tree.tokens.len() < budget {
                let Some(c) = heap.pop() else { break };
                let node = tree.tokens.len();
                tree.tokens.push(c.token);
                tree.parents.push(c.parent);
                tree.probs.get_or_insert_with(Vec::new).push(c.prob as f32);
                pending.parents.push(c.parent);
                pending.blocks.push(None);
                if tree.tokens.len() == budget {
                    break;
                }
                let Some(blocks) =
                    self.branch_blocks(gpu, st, &pending, c.parent, c.depth, stream)?
                else {
                    continue;
                };
                let b0 = pending.first_block();
                let mut ids: Vec<u32> = st.blocks[..b0].to_vec();
                ids.extend(&blocks);
                gpu.write(table, &ids, stream)?;
                let row = root_row + c.depth;
                let slot = blocks[row / DRAFTER_BLOCK_SIZE - b0] * DRAFTER_BLOCK_SIZE as u32
                    + (row % DRAFTER_BLOCK_SIZE) as u32;
                pending.blocks[node] = Some(blocks);
                let r = Row {
                    token: c.token,
                    hidden: hidden_buf.offset(c.hidden_row * row_bytes),
                    position: position + c.depth,
                    seq: 0,
                    slot,
                    ctx_len: row + 1,
                };
                self.spec.forward_rows(
                    gpu,
                    &sc,
                    &[r],
                    &[(table, st.capacity_blocks)],
                    HiddenKind::Chain,
                    Depth::Logits,
                    stream,
                )?;
                offer(&mut heap, &sc, c.reach, Some(node), c.depth + 1)?;
            }
            Ok(())
        })();
        drop(sc);
        st.tree = Some(pending);
        grown?;
        st.last_drafts = tree.tokens.clone();
        Ok(tree)
    }

    /// Fresh blocks for a node at `depth` under `parent` (the verified token for `None`),
    /// holding a copy of every branch row before its own; `None` when its row would pass
    /// the state's capacity or the pool has no room.
    fn branch_blocks(
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
    fn tree_buffers(
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

#[cfg(test)]
mod tests {
    use super::top_children;

    #[test]
    fn children_are_the_top_logits_with_softmax_probabilities() {
        let logits = [1.0f32, 3.0, 3.0, f32::NAN, 2.0, -50.0];
        let got = top_children(&logits, 3, |_| true);
        let ids: Vec<usize> = got.iter().map(|c| c.0).collect();
        assert_eq!(ids, [1, 2, 4], "ties go to the lower id");
        let z: f64 = [1.0f64, 3.0, 3.0, 2.0, -50.0]
            .iter()
            .map(|l| (l - 3.0f64).exp())
            .sum();
        assert!((got[0].1 - 1.0 / z).abs() < 1e-12);
        assert!((got[2].1 - (-1.0f64).exp() / z).abs() < 1e-12);
        let masked: Vec<usize> = top_children(&logits, 2, |d| d != 1)
            .iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(masked, [2, 4]);
        assert!(top_children(&logits, 2, |_| false).is_empty());
    }

    #[test]
    fn a_child_whose_probability_rounds_to_zero_is_left_out() {
        let got = top_children(&[0.0, -200.0, -20.0], 3, |_| true);
        assert_eq!(got.iter().map(|c| c.0).collect::<Vec<_>>(), [0, 2]);
    }
}
