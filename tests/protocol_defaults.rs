//! Every provided method of `DraftProposer` does what the specification documents by
//! default: one test each, on a proposer that implements only the three required methods.

use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig, ModelLevers};
use specdraft::speculative::{DraftBinding, DraftProposer, DraftRunner, ProposerState};
use specdraft::Result;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

struct Minimal {
    allocs: AtomicUsize,
}

struct MinimalState(u32);
specdraft::impl_proposer_state!(MinimalState);

impl DraftProposer for Minimal {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        self.allocs.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(MinimalState(41)))
    }
    fn propose(
        &self,
        _last_token: u32,
        _target_hidden: DevicePtr,
        _position: usize,
        _num_drafts: usize,
        _state: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _stream: u64,
        _draft_embed_target: Option<DevicePtr>,
        _grammar_bitmask: Option<&[i32]>,
        _target_hidden_stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        Ok(vec![])
    }
    fn after_verify(
        &self,
        _num_accepted: usize,
        _state: &mut dyn ProposerState,
        _stream: u64,
    ) -> Result<()> {
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

#[test]
fn free_drafter_kv_does_nothing() {
    let f = fixture();
    f.p.free_drafter_kv(&[0, 1, 2]);
    assert_eq!(f.gpu.ledger().live_count(), 0);
    assert_eq!(f.p.allocs.load(Ordering::SeqCst), 0);
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

struct NeverRuns;
impl DraftRunner for NeverRuns {
    fn run(
        &self,
        _b: &DraftBinding,
        _t: u32,
        _h: DevicePtr,
        _p: usize,
        _n: usize,
        _s: &mut dyn ProposerState,
        _c: &ForwardContext<'_>,
        _st: u64,
    ) -> Result<Vec<u32>> {
        Ok(vec![9])
    }
}

#[test]
fn set_circuit_draft_is_ignored() {
    let f = fixture();
    f.p.set_circuit_draft(Some(Arc::new(NeverRuns)));
    let drafts =
        f.p.propose(
            1,
            DevicePtr::NULL,
            0,
            4,
            &mut *f.state(),
            &f.ctx(),
            0,
            None,
            None,
            None,
        )
        .unwrap();
    assert!(
        drafts.is_empty(),
        "a proposer without a binding must keep its own forward"
    );
    f.p.set_circuit_draft(None);
}
