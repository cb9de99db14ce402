//! Deferred DFlash context rows: a propose of 0 drafts keeps its captured rows for a later
//! batched write instead of running the context forward at once. A head that defers must
//! draft exactly what a head that writes each row at once drafts (same tokens, same logits
//! bit for bit), across runs of declined steps longer than the backlog bound and a propose
//! redone from the same point; and a state freed with rows deferred leaks nothing.

mod dflash_common;
#[allow(unused_imports)] // the helpers re-export a GGUF writer this test does not use
mod model_util;

use dflash_common::*;
use model_util::*;
use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend, GpuBackendExt};
use specdraft::model::ForwardContext;
use specdraft::speculative::dflash::DEFERRED_ROWS;
use specdraft::speculative::{DFlashHead, DFlashState, DraftProposer, ProposerState};
use std::sync::Arc;

/// Positions the captured rows (and tokens) cover.
const ROWS: usize = 160;

fn dflash(state: &mut dyn ProposerState) -> &DFlashState {
    state.as_any().downcast_ref::<DFlashState>().unwrap()
}

/// Drafts per step: runs of declined steps (one longer than the backlog bound) between
/// drafting steps of varied widths.
fn schedule() -> Vec<usize> {
    let mut s = vec![0, 0, 3, 0, 1, 0, 0, 0, 2];
    s.extend(std::iter::repeat_n(0, DEFERRED_ROWS + 7));
    s.extend([3, 0, 3, 3, 0, 0, 1, 0, 0, 2]);
    s
}

struct Run<'a> {
    head: &'a DFlashHead,
    ctx: &'a ForwardContext<'a>,
    gpu: &'a dyn GpuBackend,
    stack: DevicePtr,
    tokens: &'a [u32],
}

impl Run<'_> {
    /// The captured rows from position `q` on (row `q` computed at `q`).
    fn rows_from(&self, q: usize) -> DevicePtr {
        self.stack.offset(q * TAPS.len() * H * 2)
    }

    /// A propose at `pos` whose captured rows start at `start`, deferring as `defer` says;
    /// the drafts, and the block's logits (as bits) when it drafted.
    fn propose(
        &self,
        st: &mut dyn ProposerState,
        start: usize,
        pos: usize,
        n: usize,
        defer: bool,
    ) -> (Vec<u32>, Vec<u32>) {
        self.head.set_defer_zero_draft_rows(defer);
        let drafts = self
            .head
            .propose(
                self.tokens[pos],
                self.stack,
                pos,
                n,
                st,
                self.ctx,
                0,
                None,
                None,
                Some(self.rows_from(start)),
            )
            .unwrap();
        let logits = if drafts.is_empty() {
            Vec::new()
        } else {
            // Compared as bits: equal floats would hide a -0.0 / 0.0 or NaN payload difference.
            let l = self.head.last_logits(self.gpu, 0).unwrap();
            l.iter().map(|x| x.to_bits()).collect()
        };
        (drafts, logits)
    }
}

#[test]
fn deferred_rows_draft_bit_identical_to_rows_written_at_once() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = target(&gpu, "deferred");
    let dir = Ckpt::default().write("deferred");
    let head = load(&dir, &model, None).unwrap();
    let width = TAPS.len() * H;
    let mut rng = Rng::new(11);
    let values: Vec<f32> = (0..ROWS * width).map(|_| 2.0 * rng.next_f32()).collect();
    let stack = gpu.upload_bf16(&values, "stack").unwrap();
    let tokens: Vec<u32> = (0..ROWS).map(|i| (i * 7 % 90) as u32).collect();
    let mut ctx = ForwardContext::new(
        gpu.clone(),
        model.buffers().clone(),
        model.config().clone(),
        Default::default(),
    );
    let (mut eager, mut lazy) = (
        head.alloc_state_for(gpu.as_ref(), 256).unwrap(),
        head.alloc_state_for(gpu.as_ref(), 256).unwrap(),
    );
    ctx.target_hidden_stack = Some(stack);
    for st in [&mut eager, &mut lazy] {
        head.prefill_drafter(&tokens[..8], stack, &mut **st, &ctx, 0)
            .unwrap();
    }
    ctx.target_hidden_stack = None;
    let run = Run {
        head: &head,
        ctx: &ctx,
        gpu: gpu.as_ref(),
        stack,
        tokens: &tokens,
    };
    let (mut start, mut pos) = (7, 8);
    let (mut most_deferred, mut drafted_after_backlog) = (0, 0);
    for (step, &n) in schedule().iter().enumerate() {
        if n > 0 {
            // A declined propose redone from the same point: its deferred rows are rewritten.
            run.propose(&mut *eager, start, pos, 0, false);
            run.propose(&mut *lazy, start, pos, 0, true);
        }
        let want = run.propose(&mut *eager, start, pos, n, false);
        let got = run.propose(&mut *lazy, start, pos, n, true);
        assert_eq!(got, want, "step {step}: propose of {n} drafts at {pos}");
        let deferred = dflash(&mut *lazy).deferred_rows();
        assert!(
            deferred <= DEFERRED_ROWS,
            "step {step}: {deferred} deferred"
        );
        most_deferred = most_deferred.max(deferred);
        assert_eq!(dflash(&mut *eager).deferred_rows(), 0, "step {step}");
        assert_eq!(
            head.drafter_rows(&mut *lazy),
            head.drafter_rows(&mut *eager),
            "step {step}: rows held, written or deferred"
        );
        if n > 0 {
            assert_eq!(
                deferred, 0,
                "step {step}: a drafting propose writes its backlog"
            );
            assert_eq!(
                dflash(&mut *lazy).positions(),
                dflash(&mut *eager).positions(),
                "step {step}"
            );
            if step > 9 + DEFERRED_ROWS {
                drafted_after_backlog += 1;
            }
        }
        // Accept all but the last draft where there are two or more.
        let accepted = want.0.len().saturating_sub(1);
        for st in [&mut eager, &mut lazy] {
            head.after_verify(accepted, &mut **st, 0).unwrap();
        }
        start = pos;
        pos += accepted + 1;
    }
    assert!(pos < ROWS);
    assert_eq!(most_deferred, DEFERRED_ROWS, "the backlog never filled");
    assert!(drafted_after_backlog >= 3);

    // Freed with rows deferred: every block back, nothing left on the ledger.
    run.propose(&mut *lazy, start, pos, 0, true);
    assert!(dflash(&mut *lazy).deferred_rows() > 0);
    for st in [&mut eager, &mut lazy] {
        head.free_state(gpu.as_ref(), &mut **st).unwrap();
    }
    assert_eq!(head.kv_blocks().0, head.kv_blocks().1, "blocks left taken");
    gpu.free(stack).unwrap();
    drop(head);
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}
