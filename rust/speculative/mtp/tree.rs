//! The MTP head's dynamic draft trees (EAGLE-2): growing trees best first by path
//! probability, one sequence's or a batch's together. Where each node's rows live, and what
//! the verify keeps, is `tree_kv`'s.
//!
//! Growth. The verified token's row is written as a chain's first row (in the state's own
//! blocks, pending) and its logits give the first candidates. A max-heap holds candidates by
//! path probability (the product of the head's softmax probabilities along the path); the
//! best becomes the next node and, while the budget has room, the head runs over it (one
//! row) and offers its top [`TREE_TOP_K`] children, chosen on the device (the `top_k` op:
//! a round downloads a few ids and probabilities a row, not its logits). A child is never
//! more probable than its parent, so ancestors are taken before descendants, and the tree
//! holds the most probable paths the head's top-k lists reach. The last node taken is not
//! run: as in a chain, `budget` drafts cost `budget` one-row forwards.
//!
//! Invariants:
//! - A node is run only when its rows fit the state's capacity and the pool has its
//!   blocks; otherwise it stays a leaf (a full pool costs drafts, never the call).
//! - Candidates whose probability rounds to 0 in f32 are never offered: they could never
//!   pay for a verify row, and a node's probability lies in (0, 1].

use super::draft::DraftSeq;
use super::forward::{Depth, HiddenKind, Row};
use super::head::MtpHead;
use super::scratch::Scratch;
use super::state::{MtpState, DRAFTER_BLOCK_SIZE};
use super::tree_kv::PendingTree;
use crate::backend::{DevicePtr, Dtype, GpuBackend, GpuBackendExt, TopKArgs};
use crate::model::ForwardContext;
use crate::speculative::DraftTree;
use std::collections::BinaryHeap;

/// Children offered per node run. The target's next token is the SmolLM2 head's first
/// choice 33.5% of the time, within its top 2 47.8%, top 3 53.1% and top 5 58.6%: past
/// the fourth choice a child is rarely worth a verify row, and the best-first budget would
/// seldom reach it anyway.
pub const TREE_TOP_K: usize = 4;

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

/// One tree while it grows.
struct Growth {
    tree: DraftTree,
    pending: PendingTree,
    heap: BinaryHeap<Candidate>,
    /// Candidates offered so far (their offer order).
    offered: usize,
    /// Rows of `hidden_buf` written: one per row run.
    hidden_rows: usize,
    /// The output hidden of every row run, `[budget, hidden]`.
    hidden_buf: DevicePtr,
    /// The device block table of the node being run.
    table: DevicePtr,
    position: usize,
    /// The row the coming forward runs for this tree: `(path probability, node, depth of
    /// its children)`, the node `None` for the verified token.
    running: Option<(f64, Option<usize>, usize)>,
}

impl MtpHead {
    /// Turns tree growth on or off (off by default): on, `grows_trees()` is true and an
    /// engine under the `"tree"` draft shape asks for trees (`propose_tree_batch` for the
    /// sequences that propose together). `propose_tree` and `propose_tree_batch` grow trees
    /// either way.
    pub fn set_grow_trees(&self, on: bool) {
        self.grow_trees
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// `propose_tree` for each of `seqs`: checks and settles every state, writes any
    /// deferred rows, then grows the trees together.
    pub(crate) fn propose_trees(
        &self,
        method: &'static str,
        ctx: &ForwardContext<'_>,
        seqs: &mut [DraftSeq<'_>],
        mask: Option<&[i32]>,
        budget: usize,
        stream: u64,
    ) -> crate::Result<Vec<DraftTree>> {
        let gpu = ctx.gpu.as_ref();
        self.start_drafts(method, seqs)?;
        let mut states: Vec<&mut MtpState> = seqs.iter_mut().map(|s| &mut *s.state).collect();
        self.flush_deferred(gpu, &mut states, stream)?;
        self.grow_trees(gpu, seqs, mask, budget, stream)
    }

    /// Grows a tree of at most `budget >= 1` nodes for each of `seqs` (each state settled,
    /// nothing deferred; see the module doc) and leaves each pending in its state. `mask`
    /// (over target ids) holds every tree's nodes. The
    /// trees grow in lockstep: the verified tokens' rows run in one forward, then each
    /// round takes every tree's next node and runs all of those that need a row in one
    /// forward. Each tree is the one it would be grown alone: a row's outputs do not depend
    /// on the other rows of its forward, and each tree's choices read only its own rows.
    pub(crate) fn grow_trees(
        &self,
        gpu: &dyn GpuBackend,
        seqs: &mut [DraftSeq<'_>],
        mask: Option<&[i32]>,
        budget: usize,
        stream: u64,
    ) -> crate::Result<Vec<DraftTree>> {
        let draft_mask = mask.map(|m| self.spec.draft_mask(m));
        let mut growths: Vec<Option<Growth>> = Vec::with_capacity(seqs.len());
        let mut roots = Vec::new();
        let mut tables = Vec::new();
        for seq in seqs.iter_mut() {
            let st = &mut *seq.state;
            if st.reserve(gpu, &self.kv, 1)? == 0 {
                // Budget or pool exhausted: nothing to draft from, as for a chain.
                growths.push(None);
                continue;
            }
            let (hidden_buf, table) = self.tree_buffers(gpu, st, budget)?;
            let root_row = st.rows();
            roots.push(Row {
                token: seq.token,
                hidden: seq.hidden,
                position: seq.position,
                seq: tables.len(),
                slot: st.slot(root_row).unwrap_or(0),
                ctx_len: root_row + 1,
            });
            tables.push((st.table, st.capacity_blocks));
            growths.push(Some(Growth {
                tree: DraftTree {
                    tokens: Vec::new(),
                    parents: Vec::new(),
                    probs: Some(Vec::new()),
                },
                pending: PendingTree {
                    root_row,
                    root_key: seq.position - 1,
                    parents: Vec::new(),
                    blocks: Vec::new(),
                },
                heap: BinaryHeap::new(),
                offered: 0,
                hidden_rows: 0,
                hidden_buf,
                table,
                position: seq.position,
                running: None,
            }));
        }
        let sc = self.lock_scratch();
        let grown = (|| -> crate::Result<()> {
            // Every row of a forward is one tree's, and every tree has the same mask.
            if let Some(m) = &draft_mask {
                gpu.write(sc.grammar_mask, &m.repeat(seqs.len().min(sc.rows)), stream)?;
            }
            let masked = draft_mask.is_some();
            self.spec.forward_rows(
                gpu,
                &sc,
                &roots,
                &tables,
                HiddenKind::Target,
                Depth::Logits,
                stream,
            )?;
            let mut at = 0;
            let mut ran = Vec::new();
            for (seq, g) in seqs.iter_mut().zip(&mut growths) {
                if let Some(g) = g {
                    seq.state.pair_keys.push(g.pending.root_key);
                    seq.state.pending = 1;
                    g.running = Some((1.0, None, 1));
                    ran.push((at, g));
                    at += 1;
                }
            }
            self.offer_children(gpu, &sc, &mut ran, masked, stream)?;
            loop {
                let mut rows = Vec::new();
                let mut tables = Vec::new();
                let mut ran = Vec::new();
                for (seq, g) in seqs.iter_mut().zip(&mut growths) {
                    let Some(g) = g else { continue };
                    if let Some(mut row) = self.next_node(gpu, seq.state, g, budget, stream)? {
                        row.seq = rows.len();
                        tables.push((g.table, seq.state.capacity_blocks));
                        ran.push((rows.len(), g));
                        rows.push(row);
                    }
                }
                if rows.is_empty() {
                    return Ok(());
                }
                self.spec.forward_rows(
                    gpu,
                    &sc,
                    &rows,
                    &tables,
                    HiddenKind::Chain,
                    Depth::Logits,
                    stream,
                )?;
                self.offer_children(gpu, &sc, &mut ran, masked, stream)?;
            }
        })();
        drop(sc);
        let mut trees = Vec::with_capacity(seqs.len());
        for (seq, g) in seqs.iter_mut().zip(growths) {
            let Some(g) = g else {
                trees.push(DraftTree::default());
                continue;
            };
            // Every node's blocks stay with the state, so a failed growth frees them later.
            seq.state.tree = Some(g.pending);
            seq.state.last_drafts = g.tree.tokens.clone();
            trees.push(g.tree);
        }
        grown?;
        Ok(trees)
    }

    /// Takes `g`'s best candidates as nodes until one needs a row run (returned, its table
    /// written), the budget is full or no candidate is left (`None`).
    fn next_node(
        &self,
        gpu: &dyn GpuBackend,
        st: &MtpState,
        g: &mut Growth,
        budget: usize,
        stream: u64,
    ) -> crate::Result<Option<Row>> {
        while g.tree.tokens.len() < budget {
            let Some(c) = g.heap.pop() else { break };
            let node = g.tree.tokens.len();
            g.tree.tokens.push(c.token);
            g.tree.parents.push(c.parent);
            g.tree
                .probs
                .get_or_insert_with(Vec::new)
                .push(c.prob as f32);
            g.pending.parents.push(c.parent);
            g.pending.blocks.push(None);
            if g.tree.tokens.len() == budget {
                break;
            }
            let Some(blocks) =
                self.branch_blocks(gpu, st, &g.pending, c.parent, c.depth, stream)?
            else {
                continue;
            };
            let b0 = g.pending.first_block();
            let mut ids: Vec<u32> = st.blocks[..b0].to_vec();
            ids.extend(&blocks);
            gpu.write(g.table, &ids, stream)?;
            let row = g.pending.root_row + c.depth;
            let slot = blocks[row / DRAFTER_BLOCK_SIZE - b0] * DRAFTER_BLOCK_SIZE as u32
                + (row % DRAFTER_BLOCK_SIZE) as u32;
            g.pending.blocks[node] = Some(blocks);
            g.running = Some((c.reach, Some(node), c.depth + 1));
            return Ok(Some(Row {
                token: c.token,
                hidden: g.hidden_buf.offset(c.hidden_row * self.tree_row_bytes()),
                position: g.position + c.depth,
                seq: 0,
                slot,
                ctx_len: row + 1,
            }));
        }
        Ok(None)
    }

    /// After a forward whose row `i` ran `g`'s running node, for each `(i, g)` in `ran`:
    /// keeps the row's output hidden and offers its top [`TREE_TOP_K`] children (allowed by
    /// the grammar mask the scratch holds for each row when `masked`). The children are
    /// chosen on the device, so one small download brings every row's.
    fn offer_children(
        &self,
        gpu: &dyn GpuBackend,
        sc: &Scratch,
        ran: &mut [(usize, &mut Growth)],
        masked: bool,
        stream: u64,
    ) -> crate::Result<()> {
        let Some(rows) = ran.iter().map(|(i, _)| i + 1).max() else {
            return Ok(());
        };
        let k = TREE_TOP_K;
        let row_bytes = self.tree_row_bytes();
        // The ids, then their probabilities, side by side for one download.
        gpu.top_k(TopKArgs {
            ids: sc.children,
            probs: sc.children.offset(rows * k * 4),
            logits: sc.logits,
            bitmask: masked.then_some(sc.grammar_mask),
            rows,
            width: self.spec.draft_vocab,
            k,
            stream,
        })?;
        let children = gpu.download::<u32>(sc.children, 2 * rows * k)?;
        let (ids, probs) = children.split_at(rows * k);
        for (i, g) in ran.iter_mut() {
            let Some((reach, parent, depth)) = g.running.take() else {
                continue;
            };
            let at = g.hidden_buf.offset(g.hidden_rows * row_bytes);
            gpu.copy_dtod(at, self.spec.chain_hidden(sc, *i), row_bytes, stream)?;
            for (&d, &p) in ids[*i * k..(*i + 1) * k].iter().zip(&probs[*i * k..]) {
                if d == u32::MAX {
                    break;
                }
                let prob = f64::from(f32::from_bits(p));
                g.heap.push(Candidate {
                    reach: reach * prob,
                    prob,
                    token: self.spec.to_target(d),
                    parent,
                    depth,
                    hidden_row: g.hidden_rows,
                    order: g.offered,
                });
                g.offered += 1;
            }
            g.hidden_rows += 1;
        }
        Ok(())
    }

    /// Bytes of one hidden row of a tree's buffer.
    fn tree_row_bytes(&self) -> usize {
        self.spec.config.hidden_size * Dtype::Bf16.size()
    }
}
