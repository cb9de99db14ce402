//! A proposer wrapper that counts its tree calls, for the engine's tree tests.

use specdraft::backend::{DevicePtr, GpuBackend};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig};
use specdraft::speculative::{DraftProposer, DraftTree, ProposerState};
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
impl DraftProposer for Counted {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        self.inner.alloc_state(gpu)
    }
    fn alloc_state_for(&self, gpu: &dyn GpuBackend, b: usize) -> Result<Box<dyn ProposerState>> {
        self.inner.alloc_state_for(gpu, b)
    }
    fn propose(
        &self,
        last: u32,
        h: DevicePtr,
        pos: usize,
        n: usize,
        s: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        st: u64,
        d: Option<DevicePtr>,
        m: Option<&[i32]>,
        k: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        self.inner.propose(last, h, pos, n, s, ctx, st, d, m, k)
    }
    fn after_verify(&self, a: usize, s: &mut dyn ProposerState, st: u64) -> Result<()> {
        self.inner.after_verify(a, s, st)
    }
    fn prefill_drafter(
        &self,
        p: &[u32],
        h: DevicePtr,
        s: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        st: u64,
    ) -> Result<usize> {
        self.inner.prefill_drafter(p, h, s, ctx, st)
    }
    fn propose_batch_max(&self, b: &BufferArena, c: &ModelConfig) -> usize {
        self.inner.propose_batch_max(b, c)
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
    fn grows_trees(&self) -> bool {
        self.inner.grows_trees()
    }
    fn after_verify_tree(&self, p: &[usize], s: &mut dyn ProposerState, st: u64) -> Result<()> {
        self.branch_settles.fetch_add(1, Ordering::Relaxed);
        self.inner.after_verify_tree(p, s, st)
    }
    fn free_state(&self, gpu: &dyn GpuBackend, s: &mut dyn ProposerState) -> Result<()> {
        self.inner.free_state(gpu, s)
    }
    fn prefill_hidden_rows(&self, max_seq_len: usize) -> usize {
        self.inner.prefill_hidden_rows(max_seq_len)
    }
}
