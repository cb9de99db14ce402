//! `DelegatingProposer`: a wrapper that writes only `inner()` answers every protocol method
//! as its inner proposer does, the methods without an error channel included (each checked
//! against an inner whose answers all differ from the protocol's defaults); a method it
//! writes replaces the inner one and the rest stay delegated; and a wrapped `MtpHead`
//! growing trees passes the conformance check with every check the head alone runs.

mod mtp_common;

use mtp_common::*;
use specdraft::backend::{DevicePtr, GpuBackend};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelLevers};
use specdraft::speculative::conformance::{check_proposer_on, CheckOptions};
use specdraft::speculative::{
    DelegatingProposer, DraftProposer, DraftRunner, MtpQuantization, ProposerState,
};
use specdraft::Result;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct Nothing;
specdraft::impl_proposer_state!(Nothing);

/// Answers every method without an error channel with something other than the protocol's
/// default, and records the calls that return nothing.
#[derive(Default)]
struct Distinct {
    freed_blocks: Mutex<Vec<u32>>,
    runners_set: AtomicUsize,
}

#[allow(clippy::too_many_arguments)]
impl DraftProposer for Distinct {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(Nothing))
    }
    fn propose(
        &self,
        last: u32,
        _h: DevicePtr,
        position: usize,
        n: usize,
        _s: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _st: u64,
        _d: Option<DevicePtr>,
        _m: Option<&[i32]>,
        _k: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        Ok((0..n as u32).map(|i| last + position as u32 + i).collect())
    }
    fn after_verify(&self, _a: usize, _s: &mut dyn ProposerState, _st: u64) -> Result<()> {
        Ok(())
    }
    fn block_gamma(&self) -> Option<usize> {
        Some(4)
    }
    fn target_layer_ids(&self) -> Vec<usize> {
        vec![2, 0]
    }
    fn prefill_hidden_rows(&self, max_seq_len: usize) -> usize {
        max_seq_len / 3
    }
    fn needs_comm(&self) -> bool {
        true
    }
    fn prefill_uses_shared_buffers(&self) -> bool {
        true
    }
    fn drafter_rows(&self, _s: &mut dyn ProposerState) -> usize {
        11
    }
    fn last_pair_key(&self, _s: &mut dyn ProposerState) -> Option<usize> {
        Some(5)
    }
    fn take_drafter_kv(
        &self,
        _s: &mut dyn ProposerState,
    ) -> Option<(Vec<u32>, usize, Option<usize>)> {
        Some((vec![7, 8], 3, Some(2)))
    }
    fn install_drafter_kv(
        &self,
        _s: &mut dyn ProposerState,
        blocks: Vec<u32>,
        rows: usize,
        _key: Option<usize>,
    ) -> bool {
        blocks == [7, 8] && rows == 3
    }
    fn free_drafter_kv(&self, blocks: &[u32]) {
        self.freed_blocks.lock().unwrap().extend_from_slice(blocks);
    }
    fn propose_batch_max(&self, _b: &BufferArena, _c: &specdraft::model::ModelConfig) -> usize {
        6
    }
    fn grows_trees(&self) -> bool {
        true
    }
    fn read_deferred_draft_token(&self, _gpu: &dyn GpuBackend) -> Result<u32> {
        Ok(9)
    }
    fn set_circuit_draft(&self, runner: Option<Arc<dyn DraftRunner>>) {
        if runner.is_none() {
            self.runners_set.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Writes nothing but `inner()`.
struct Plain(Arc<dyn DraftProposer>);

impl DelegatingProposer for Plain {
    fn inner(&self) -> &dyn DraftProposer {
        self.0.as_ref()
    }
}

/// Truncates drafts to one; everything else is the inner proposer's.
struct OneDraft(Arc<dyn DraftProposer>);

#[allow(clippy::too_many_arguments)]
impl DelegatingProposer for OneDraft {
    fn inner(&self) -> &dyn DraftProposer {
        self.0.as_ref()
    }
    fn propose(
        &self,
        last: u32,
        h: DevicePtr,
        position: usize,
        n: usize,
        s: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        st: u64,
        d: Option<DevicePtr>,
        m: Option<&[i32]>,
        k: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        let mut drafts = self
            .inner()
            .propose(last, h, position, n, s, ctx, st, d, m, k)?;
        drafts.truncate(1);
        Ok(drafts)
    }
}

#[test]
fn a_wrapper_that_writes_nothing_answers_every_method_as_its_inner_proposer() {
    let inner = Arc::new(Distinct::default());
    let plain: Arc<dyn DraftProposer> = Arc::new(Plain(inner.clone()));
    let f = Fixture::new(
        "delegating_plain",
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let gpu = f.gpu.as_ref();
    let mut s = plain.alloc_state_for(gpu, 64).unwrap();
    assert_eq!(plain.block_gamma(), Some(4));
    assert_eq!(plain.target_layer_ids(), vec![2, 0]);
    assert_eq!(plain.prefill_hidden_rows(300), 100);
    assert!(plain.needs_comm() && plain.prefill_uses_shared_buffers() && plain.grows_trees());
    assert_eq!(plain.drafter_rows(&mut *s), 11);
    assert_eq!(plain.last_pair_key(&mut *s), Some(5));
    assert_eq!(
        plain.take_drafter_kv(&mut *s),
        Some((vec![7, 8], 3, Some(2)))
    );
    assert!(plain.install_drafter_kv(&mut *s, vec![7, 8], 3, None));
    plain.free_drafter_kv(&[1, 2, 3]);
    assert_eq!(*inner.freed_blocks.lock().unwrap(), vec![1, 2, 3]);
    assert_eq!(plain.propose_batch_max(&f.ctx.buffers, &f.ctx.config), 6);
    assert_eq!(plain.read_deferred_draft_token(gpu).unwrap(), 9);
    plain.set_circuit_draft(None);
    assert_eq!(inner.runners_set.load(Ordering::Relaxed), 1);
    // The provided methods with an error channel reach it too: its chain, as a tree.
    let tree = plain
        .propose_tree(3, f.hidden(0), 10, 2, &mut *s, &f.ctx, 0, None, None, None)
        .unwrap();
    assert_eq!(tree.tokens, vec![13, 14]);
    plain.free_state(gpu, &mut *s).unwrap();
    drop(plain);
    f.finish();
}

#[test]
fn a_method_the_wrapper_writes_replaces_the_inner_one_and_the_rest_stay_delegated() {
    let f = Fixture::new(
        "delegating_one_draft",
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let one: Arc<dyn DraftProposer> = Arc::new(OneDraft(Arc::new(Distinct::default())));
    let mut s = one.alloc_state(f.gpu.as_ref()).unwrap();
    let drafts = one
        .propose(3, f.hidden(0), 10, 4, &mut *s, &f.ctx, 0, None, None, None)
        .unwrap();
    assert_eq!(drafts, vec![13]);
    assert_eq!(one.target_layer_ids(), vec![2, 0]);
    assert_eq!(one.propose_batch_max(&f.ctx.buffers, &f.ctx.config), 6);
    f.finish();
}

#[test]
fn a_wrapped_mtp_head_passes_every_check_the_head_alone_runs() {
    let f = Fixture::new(
        "delegating_mtp",
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    f.head().set_grow_trees(true);
    let options = CheckOptions {
        label: "wrapped".into(),
        vocab_size: VOCAB,
        hidden_size: HIDDEN,
        num_sequences: 3,
        num_drafts: 5,
        steps: 6,
        seed: 2,
    };
    let alone = check_proposer_on(f.head(), f.gpu.clone(), &options);
    assert!(alone.violations.is_empty(), "{alone:?}");
    let twin = f.twin_head("delegating_mtp");
    twin.set_grow_trees(true);
    let head: Arc<dyn DraftProposer> = twin.clone();
    let wrapped = check_proposer_on(&Plain(head.clone()), f.gpu.clone(), &options);
    assert!(wrapped.violations.is_empty(), "{wrapped:?}");
    assert_eq!(wrapped.checks_run, alone.checks_run);
    for check in ["propose_batch", "propose_tree", "propose_tree_batch"] {
        assert!(wrapped.checks_run.iter().any(|c| c == check), "{check}");
    }
    drop(head);
    let (total, free) = twin.kv_blocks();
    assert_eq!(
        total, free,
        "the wrapped head's drafter KV blocks still held"
    );
    drop(twin);
    f.finish();
}
