//! Every provided method of `DraftProposer` does what the specification documents by
//! default: one test each, on a proposer that implements only the three required methods.

use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig, ModelLevers};
use specdraft::speculative::{
    DraftBinding, DraftProposer, DraftRunner, PromptLookup, ProposerState,
};
use specdraft::Result;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Implements only the required methods and counts every call to them, so a default that
/// calls back into the proposer shows up.
struct Minimal {
    allocs: AtomicUsize,
    proposes: AtomicUsize,
    verifies: AtomicUsize,
}

struct MinimalState(u32);
specdraft::impl_proposer_state!(MinimalState);

impl Minimal {
    fn calls(&self) -> [usize; 3] {
        [&self.allocs, &self.proposes, &self.verifies].map(|c| c.load(Ordering::SeqCst))
    }
}

impl DraftProposer for Minimal {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        self.allocs.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(MinimalState(41)))
    }
    fn propose(
        &self,
        last_token: u32,
        _target_hidden: DevicePtr,
        position: usize,
        num_drafts: usize,
        _state: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _stream: u64,
        _draft_embed_target: Option<DevicePtr>,
        _grammar_bitmask: Option<&[i32]>,
        _target_hidden_stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        self.proposes.fetch_add(1, Ordering::SeqCst);
        // Recognisably its own: the last token plus 1, 2, ..., offset by the position.
        Ok((1..=num_drafts as u32)
            .map(|i| last_token + i + position as u32)
            .collect())
    }
    fn after_verify(
        &self,
        _num_accepted: usize,
        _state: &mut dyn ProposerState,
        _stream: u64,
    ) -> Result<()> {
        self.verifies.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

struct Fixture {
    p: Minimal,
    gpu: Arc<CpuBackend>,
    config: Arc<ModelConfig>,
    buffers: Arc<BufferArena>,
}

fn fixture() -> Fixture {
    Fixture {
        p: Minimal {
            allocs: AtomicUsize::new(0),
            proposes: AtomicUsize::new(0),
            verifies: AtomicUsize::new(0),
        },
        gpu: Arc::new(CpuBackend::new()),
        config: Arc::new(ModelConfig::tiny(32)),
        buffers: Arc::new(BufferArena::empty(4)),
    }
}

impl Fixture {
    fn ctx(&self) -> ForwardContext<'static> {
        ForwardContext::new(
            self.gpu.clone(),
            self.buffers.clone(),
            self.config.clone(),
            ModelLevers::default(),
        )
    }
    fn state(&self) -> Box<dyn ProposerState> {
        self.p.alloc_state(&*self.gpu).unwrap()
    }
}

#[test]
fn alloc_state_for_calls_alloc_state_and_ignores_the_budget() {
    let f = fixture();
    for budget in [0, 17, usize::MAX] {
        let s = f.p.alloc_state_for(&*f.gpu, budget).unwrap();
        assert_eq!(s.as_any().downcast_ref::<MinimalState>().unwrap().0, 41);
    }
    assert_eq!(f.p.allocs.load(Ordering::SeqCst), 3);
}

#[test]
fn block_gamma_is_none() {
    assert_eq!(fixture().p.block_gamma(), None);
}

#[test]
fn prefill_hidden_rows_is_max_seq_len() {
    let f = fixture();
    for n in [0, 1, 4096, usize::MAX] {
        assert_eq!(f.p.prefill_hidden_rows(n), n);
    }
}

#[test]
fn needs_comm_is_false() {
    assert!(!fixture().p.needs_comm());
}

#[test]
fn prefill_uses_shared_buffers_is_false() {
    assert!(!fixture().p.prefill_uses_shared_buffers());
}

#[test]
fn drafter_rows_is_zero() {
    let f = fixture();
    assert_eq!(f.p.drafter_rows(&mut *f.state()), 0);
}

#[test]
fn last_pair_key_is_none() {
    let f = fixture();
    assert_eq!(f.p.last_pair_key(&mut *f.state()), None);
}

#[test]
fn take_drafter_kv_is_none() {
    let f = fixture();
    assert_eq!(f.p.take_drafter_kv(&mut *f.state()), None);
}

#[test]
fn install_drafter_kv_is_false() {
    let f = fixture();
    assert!(!f
        .p
        .install_drafter_kv(&mut *f.state(), vec![1, 2], 20, Some(19)));
}

/// Takes fixed drafter blocks at the end of every turn and records what comes back through
/// `free_drafter_kv`; keeps the default `install_drafter_kv`.
#[derive(Default)]
struct Carrier {
    freed: std::sync::Mutex<Vec<Vec<u32>>>,
    prefilled: std::sync::Mutex<Vec<usize>>,
}

impl DraftProposer for Carrier {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(MinimalState(0)))
    }
    fn propose(
        &self,
        _t: u32,
        _h: DevicePtr,
        _p: usize,
        _n: usize,
        _s: &mut dyn ProposerState,
        _c: &ForwardContext<'_>,
        _st: u64,
        _d: Option<DevicePtr>,
        _m: Option<&[i32]>,
        _k: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        Ok(vec![])
    }
    fn after_verify(&self, _a: usize, _s: &mut dyn ProposerState, _st: u64) -> Result<()> {
        Ok(())
    }
    fn prefill_drafter(
        &self,
        prompt: &[u32],
        _h: DevicePtr,
        _s: &mut dyn ProposerState,
        _c: &ForwardContext<'_>,
        _st: u64,
    ) -> Result<usize> {
        self.prefilled.lock().unwrap().push(prompt.len());
        Ok(0)
    }
    fn take_drafter_kv(
        &self,
        _s: &mut dyn ProposerState,
    ) -> Option<(Vec<u32>, usize, Option<usize>)> {
        Some((vec![5, 6, 7], 3, Some(2)))
    }
    fn free_drafter_kv(&self, blocks: &[u32]) {
        // Also called while a failed test unwinds (the conversation's drop): never panic here.
        self.freed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(blocks.to_vec());
    }
}

#[test]
fn a_declined_install_hands_the_blocks_back_and_prefills_from_scratch() {
    use specdraft::engine::testing::TableTarget;
    use specdraft::engine::{GenerateRequest, SpecEngine};
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let target = Arc::new(TableTarget::new(gpu.clone(), 16, 64, 16, 3, 0.2).unwrap());
    let carrier = Arc::new(Carrier::default());
    let engine = SpecEngine::new(target, Some(carrier.clone()), 2).unwrap();
    let mut chat = engine.conversation();
    chat.send(GenerateRequest::new(vec![1, 2, 3, 4], 3))
        .unwrap();
    assert!(carrier.freed.lock().unwrap().is_empty());
    chat.send(GenerateRequest::new(vec![5, 6], 3)).unwrap();
    // The default install declined: the carried blocks came back once, and the drafter
    // was prefilled over the whole second prompt (4 + 3 + 2 tokens).
    assert_eq!(*carrier.freed.lock().unwrap(), vec![vec![5, 6, 7]]);
    assert_eq!(*carrier.prefilled.lock().unwrap(), vec![4, 9]);
    drop((chat, engine));
    assert_eq!(
        carrier.freed.lock().unwrap().len(),
        2,
        "dropped with blocks"
    );
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

#[test]
fn free_drafter_kv_touches_nothing() {
    use specdraft::backend::GpuBackendExt;
    use specdraft::memory::BlockAllocator;
    let f = fixture();
    // Live device memory and live blocks that the default must leave alone.
    let held = f.gpu.upload(&[7u32; 8], "owned by the test").unwrap();
    let pool = BlockAllocator::new(8, 16).unwrap();
    let blocks = pool.alloc(3).unwrap();
    f.p.free_drafter_kv(&blocks);
    assert_eq!(f.gpu.ledger().live_count(), 1);
    assert_eq!(pool.num_free(), 5);
    assert_eq!(f.p.calls(), [0, 0, 0], "the default called the proposer");
    pool.free(&blocks).unwrap();
    f.gpu.free(held).unwrap();
}

#[test]
fn catchup_drafter_writes_no_rows() {
    let f = fixture();
    let n =
        f.p.catchup_drafter(
            &[1, 2, 3],
            DevicePtr::NULL,
            5,
            6,
            &mut *f.state(),
            &f.ctx(),
            0,
        )
        .unwrap();
    assert_eq!(n, 0);
}

#[test]
fn propose_batch_is_none() {
    let f = fixture();
    let (mut a, mut b) = (f.state(), f.state());
    let mut states: Vec<&mut dyn ProposerState> = vec![&mut *a, &mut *b];
    let mut conf = vec![vec![0.5f32]];
    let out =
        f.p.propose_batch(
            &[1, 2],
            &[DevicePtr::NULL; 2],
            &[3, 4],
            4,
            &mut states,
            &f.ctx(),
            0,
            Some(&mut conf),
        )
        .unwrap();
    assert_eq!(out, None);
    assert_eq!(
        conf,
        vec![vec![0.5f32]],
        "the default must not touch out_conf"
    );
}

#[test]
fn propose_batch_max_is_one() {
    let f = fixture();
    assert_eq!(f.p.propose_batch_max(&f.buffers, &f.config), 1);
}

#[test]
fn catchup_batch_writes_no_rows() {
    let f = fixture();
    let mut a = f.state();
    let mut states: Vec<&mut dyn ProposerState> = vec![&mut *a];
    let n =
        f.p.catchup_batch(
            &[vec![1, 2]],
            &[vec![DevicePtr::NULL; 2]],
            &[7],
            &mut states,
            &f.ctx(),
            0,
        )
        .unwrap();
    assert_eq!(n, 0);
}

#[test]
fn prefill_drafter_writes_no_rows() {
    let f = fixture();
    assert_eq!(
        f.p.prefill_drafter(&[1, 2, 3], DevicePtr::NULL, &mut *f.state(), &f.ctx(), 0)
            .unwrap(),
        0
    );
}

#[test]
fn read_deferred_draft_token_is_zero() {
    let f = fixture();
    assert_eq!(f.p.read_deferred_draft_token(&*f.gpu).unwrap(), 0);
}

#[test]
fn free_state_frees_nothing() {
    let f = fixture();
    use specdraft::backend::GpuBackendExt;
    let p = f.gpu.upload(&[1u32], "owned by the test").unwrap();
    f.p.free_state(&*f.gpu, &mut *f.state()).unwrap();
    assert_eq!(
        f.gpu.ledger().live_count(),
        1,
        "the default free_state must not free anything"
    );
    f.gpu.free(p).unwrap();
}

#[test]
fn circuit_draft_is_none() {
    let f = fixture();
    assert!(f
        .p
        .circuit_draft(&f.config, &ModelLevers::default())
        .is_none());
}

/// A runner that counts its calls and drafts something no proposer here would.
#[derive(Default)]
struct CountingRunner(AtomicUsize);
impl DraftRunner for CountingRunner {
    fn run(
        &self,
        _b: &DraftBinding,
        _t: u32,
        _h: DevicePtr,
        _p: usize,
        n: usize,
        _s: &mut dyn ProposerState,
        _c: &ForwardContext<'_>,
        _st: u64,
        _m: Option<&[i32]>,
    ) -> Result<Vec<u32>> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(vec![9; n])
    }
}

#[test]
fn set_circuit_draft_is_ignored() {
    let f = fixture();
    let runner = Arc::new(CountingRunner::default());
    let mut state = f.state();
    let propose = |p: &dyn DraftProposer, s: &mut dyn ProposerState, last: u32| {
        p.propose(
            last,
            DevicePtr::NULL,
            5,
            4,
            s,
            &f.ctx(),
            0,
            None,
            None,
            None,
        )
        .unwrap()
    };
    f.p.set_circuit_draft(Some(runner.clone()));
    assert_eq!(propose(&f.p, &mut *state, 3), vec![9, 10, 11, 12]);
    f.p.set_circuit_draft(None);
    assert_eq!(propose(&f.p, &mut *state, 3), vec![9, 10, 11, 12]);
    assert_eq!(f.p.calls(), [1, 2, 0]);

    // A Rust proposer without a binding (PromptLookup keeps the default) drafts the same
    // with a runner set as without, and never runs it.
    let lookup = PromptLookup::new(1, 2).unwrap();
    let prompt = [4, 5, 6, 7, 4, 5];
    let fresh = || {
        let mut s = lookup.alloc_state(&*f.gpu).unwrap();
        lookup
            .prefill_drafter(&prompt, DevicePtr::NULL, &mut *s, &f.ctx(), 0)
            .unwrap();
        s
    };
    let (mut plain, mut with_runner) = (fresh(), fresh());
    let want = propose(&lookup, &mut *plain, 5);
    // The suffix [4, 5] matches two tokens at the start, so the lookup drafts the two
    // tokens that followed them.
    assert_eq!(want, vec![6, 7], "the lookup continues the repeat");
    lookup.set_circuit_draft(Some(runner.clone()));
    assert_eq!(propose(&lookup, &mut *with_runner, 5), want);
    lookup.set_circuit_draft(None);
    assert_eq!(runner.0.load(Ordering::SeqCst), 0, "the runner ran");
}
