//! A proposer wrapper that counts its tree calls, for the engine's tree tests; every other
//! method is the wrapped proposer's (`DelegatingProposer`).

use specdraft::backend::DevicePtr;
use specdraft::model::ForwardContext;
use specdraft::speculative::{DelegatingProposer, DraftProposer, DraftTree, ProposerState};
use specdraft::Result;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A proposer (one growing trees) with its tree calls counted; `batches` false answers
/// `propose_tree_batch` with `None`, as a proposer that does not batch trees.
pub struct Counted {
    pub inner: Arc<dyn DraftProposer>,
    pub batches: bool,
    /// `propose_tree_batch` calls passed on.
    pub tree_batches: AtomicUsize,
    /// Sequences in those calls.
    pub batched_sequences: AtomicUsize,
    /// `propose_tree` calls.
    pub lone_trees: AtomicUsize,
    /// `after_verify_tree` calls: steps whose tree branched.
    pub branch_settles: AtomicUsize,
}

impl Counted {
    /// `inner`, counted, passing `propose_tree_batch` on where `batches`.
    pub fn new(inner: Arc<dyn DraftProposer>, batches: bool) -> Self {
        Counted {
            inner,
            batches,
            tree_batches: AtomicUsize::new(0),
            batched_sequences: AtomicUsize::new(0),
            lone_trees: AtomicUsize::new(0),
            branch_settles: AtomicUsize::new(0),
        }
    }
}

#[allow(clippy::too_many_arguments)]
impl DelegatingProposer for Counted {
    fn inner(&self) -> &dyn DraftProposer {
        self.inner.as_ref()
    }
    fn propose_tree(
        &self,
        last: u32,
        h: DevicePtr,
        pos: usize,
        budget: usize,
        s: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        st: u64,
        d: Option<DevicePtr>,
        m: Option<&[i32]>,
        k: Option<DevicePtr>,
    ) -> Result<DraftTree> {
        self.lone_trees.fetch_add(1, Ordering::Relaxed);
        self.inner
            .propose_tree(last, h, pos, budget, s, ctx, st, d, m, k)
    }
    fn propose_tree_batch(
        &self,
        last: &[u32],
        h: &[DevicePtr],
        positions: &[usize],
        budget: usize,
        s: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        st: u64,
    ) -> Result<Option<Vec<DraftTree>>> {
        if !self.batches {
            return Ok(None);
        }
        self.tree_batches.fetch_add(1, Ordering::Relaxed);
        self.batched_sequences
            .fetch_add(last.len(), Ordering::Relaxed);
        self.inner
            .propose_tree_batch(last, h, positions, budget, s, ctx, st)
    }
    fn after_verify_tree(&self, p: &[usize], s: &mut dyn ProposerState, st: u64) -> Result<()> {
        self.branch_settles.fetch_add(1, Ordering::Relaxed);
        self.inner.after_verify_tree(p, s, st)
    }
}
