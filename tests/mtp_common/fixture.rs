//! The head fixture the protocol tests share: a tiny checkpoint loaded on a CPU backend,
//! random target hiddens and tokens, and a leak check at the end.

use super::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend, GpuBackendExt};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig, ModelLevers};
use specdraft::speculative::{DraftProposer, DraftTree, MtpHead, MtpQuantization, ProposerState};
use std::sync::Arc;

pub struct Fixture {
    pub gpu: Arc<dyn GpuBackend>,
    pub head: Option<MtpHead>,
    pub ctx: ForwardContext<'static>,
    pub hiddens: DevicePtr,
    pub tokens: Vec<u32>,
    /// The checkpoint's layout and the head's quantization, for [`Fixture::twin_head`].
    pub layout: String,
    pub quant: MtpQuantization,
}

pub const ROWS: usize = 160;

impl Fixture {
    pub fn new(name: &str, layout: &str, levers: ModelLevers, quant: MtpQuantization) -> Fixture {
        let dir = scratch_dir(&format!("mtp_head_{name}"));
        write_checkpoint(&dir, layout, 3);
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let head =
            MtpHead::from_checkpoint(&dir, gpu.clone(), quant, 0, 512, 256, &levers).unwrap();
        let config = ModelConfig::from_file(dir.join("config.json")).unwrap();
        let ctx = ForwardContext::new(
            gpu.clone(),
            Arc::new(BufferArena::empty(16)),
            Arc::new(config),
            levers,
        );
        let mut rng = SmallRng::seed_from_u64(9);
        let vals: Vec<f32> = (0..ROWS * HIDDEN)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        let hiddens = gpu.upload_bf16(&vals, "test:hiddens").unwrap();
        let tokens = (0..ROWS)
            .map(|_| rng.random_range(0..VOCAB as u32))
            .collect();
        Fixture {
            gpu,
            head: Some(head),
            ctx,
            hiddens,
            tokens,
            layout: layout.to_string(),
            quant,
        }
    }

    pub fn head(&self) -> &MtpHead {
        self.head.as_ref().unwrap()
    }

    /// Another head with the fixture head's weights (its checkpoint's seed) and levers, on
    /// the same backend, loaded from a folder of its own named after `name`. Its KV pool is
    /// its own: check it is whole (`kv_blocks`) before dropping it.
    pub fn twin_head(&self, name: &str) -> Arc<MtpHead> {
        let dir = scratch_dir(&format!("mtp_twin_{name}"));
        write_checkpoint(&dir, &self.layout, 3);
        let head = MtpHead::from_checkpoint(
            &dir,
            self.gpu.clone(),
            self.quant,
            0,
            512,
            256,
            &self.ctx.levers,
        )
        .unwrap();
        Arc::new(head)
    }

    pub fn hidden(&self, p: usize) -> DevicePtr {
        self.hiddens.offset(p * HIDDEN * 2)
    }

    pub fn state(&self) -> Box<dyn ProposerState> {
        self.head().alloc_state_for(self.gpu.as_ref(), 400).unwrap()
    }

    pub fn prefill(&self, state: &mut dyn ProposerState, len: usize) -> usize {
        self.head()
            .prefill_drafter(&self.tokens[..len], self.hiddens, state, &self.ctx, 0)
            .unwrap()
    }

    pub fn propose(&self, state: &mut dyn ProposerState, pos: usize, n: usize) -> Vec<u32> {
        self.head()
            .propose(
                self.tokens[pos],
                self.hidden(pos - 1),
                pos,
                n,
                state,
                &self.ctx,
                0,
                None,
                None,
                None,
            )
            .unwrap()
    }

    /// `propose_tree` of `budget` nodes after the token at `pos`.
    pub fn propose_tree(
        &self,
        state: &mut dyn ProposerState,
        pos: usize,
        budget: usize,
    ) -> DraftTree {
        self.head()
            .propose_tree(
                self.tokens[pos],
                self.hidden(pos - 1),
                pos,
                budget,
                state,
                &self.ctx,
                0,
                None,
                None,
                None,
            )
            .unwrap()
    }

    /// Every drafter KV row `state` holds, as raw BF16 bits.
    pub fn drafter_kv_rows(&self, state: &mut dyn ProposerState) -> Vec<Vec<u16>> {
        kv_rows(self.head(), self.gpu.as_ref(), state)
    }

    /// Drops the head and checks that the pool was full and the ledger is now empty.
    pub fn finish(mut self) {
        let head = self.head.take().unwrap();
        let (total, free) = head.kv_blocks();
        assert_eq!(total, free, "drafter KV blocks still held");
        drop(head);
        self.gpu.free(self.hiddens).unwrap();
        assert_eq!(
            self.gpu.ledger().live_count(),
            0,
            "{:?}",
            self.gpu.ledger().live_report()
        );
    }
}

/// Every drafter KV row `head`'s `state` holds, as raw BF16 bits.
pub fn kv_rows(
    head: &MtpHead,
    gpu: &dyn GpuBackend,
    state: &mut dyn ProposerState,
) -> Vec<Vec<u16>> {
    let n = head.drafter_rows(state);
    (0..n)
        .map(|r| head.drafter_kv_row(gpu, state, r).unwrap())
        .collect()
}
