//! Twin states of one head that reads `target_hidden_stack`: one set proposing each sequence
//! alone, one proposing in batches, driven from the same prompts and captured rows. The
//! shared driver of the heads' batch tests; each test asserts its own contracts on what the
//! twins return.

use specdraft::backend::{DevicePtr, GpuBackend};
use specdraft::model::ForwardContext;
use specdraft::speculative::{DraftProposer, ProposerState};
use specdraft::Result;

/// A sequence's captured row computed at a position: `row(s, q)`.
pub type RowAt<'r> = &'r dyn Fn(usize, usize) -> DevicePtr;

/// The twins of [`Twins::new`] and where each sequence stands.
pub struct Twins<'h> {
    pub head: &'h dyn DraftProposer,
    pub ctx: ForwardContext<'static>,
    /// A final hidden no such head reads.
    pub hidden: DevicePtr,
    pub tokens: Vec<Vec<u32>>,
    pub single: Vec<Box<dyn ProposerState>>,
    pub batched: Vec<Box<dyn ProposerState>>,
    /// The position each sequence proposes at next.
    pub pos: Vec<usize>,
    /// Where each sequence's rows for its next propose start (its last propose's position).
    pub start: Vec<usize>,
}

impl<'h> Twins<'h> {
    /// Two states a sequence, each prefilled with the sequence's first `prompt[s]` tokens
    /// and its rows from position 0.
    pub fn new(
        head: &'h dyn DraftProposer,
        ctx: ForwardContext<'static>,
        hidden: DevicePtr,
        tokens: Vec<Vec<u32>>,
        prompt: &[usize],
        row: RowAt<'_>,
    ) -> Twins<'h> {
        let gpu = ctx.gpu.clone();
        let (mut single, mut batched) = (Vec::new(), Vec::new());
        for (s, &p) in prompt.iter().enumerate() {
            for states in [&mut single, &mut batched] {
                let mut st = head.alloc_state(gpu.as_ref()).unwrap();
                let pctx = ForwardContext {
                    target_hidden_stack: Some(row(s, 0)),
                    ..ctx.clone()
                };
                head.prefill_drafter(&tokens[s][..p], hidden, &mut *st, &pctx, 0)
                    .unwrap();
                states.push(st);
            }
        }
        Twins {
            head,
            ctx,
            hidden,
            tokens,
            single,
            batched,
            pos: prompt.to_vec(),
            start: prompt.iter().map(|p| p - 1).collect(),
        }
    }

    /// Each sequence's `propose` of `n` drafts on its single state, `after(s, drafts)`
    /// called right after each.
    pub fn one_by_one(
        &mut self,
        n: usize,
        row: RowAt<'_>,
        mut after: impl FnMut(usize, &[u32]),
    ) -> Vec<Vec<u32>> {
        (0..self.single.len())
            .map(|s| {
                let d = self
                    .head
                    .propose(
                        self.tokens[s][self.pos[s]],
                        self.hidden,
                        self.pos[s],
                        n,
                        &mut *self.single[s],
                        &self.ctx,
                        0,
                        None,
                        None,
                        Some(row(s, self.start[s])),
                    )
                    .unwrap();
                after(s, &d);
                d
            })
            .collect()
    }

    /// One `propose_batch` of `n` drafts on the batched states, given `stacks` as
    /// `ctx.target_hidden_stacks`, and `conf` as `out_conf`.
    pub fn batch(
        &mut self,
        n: usize,
        stacks: Option<&[DevicePtr]>,
        conf: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        let seqs = self.batched.len();
        let last: Vec<u32> = (0..seqs).map(|s| self.tokens[s][self.pos[s]]).collect();
        let ctx = ForwardContext {
            target_hidden_stacks: stacks,
            ..self.ctx.clone()
        };
        let mut refs: Vec<&mut dyn ProposerState> = self
            .batched
            .iter_mut()
            .map(|b| -> &mut dyn ProposerState { &mut **b })
            .collect();
        self.head.propose_batch(
            &last,
            &vec![self.hidden; seqs],
            &self.pos,
            n,
            &mut refs,
            &ctx,
            0,
            conf,
        )
    }

    /// Each sequence's rows for its next propose.
    pub fn stacks(&self, row: RowAt<'_>) -> Vec<DevicePtr> {
        (0..self.pos.len()).map(|s| row(s, self.start[s])).collect()
    }

    /// Settles step `step` on both twins: sequence `s` accepts `(step + s) % (len + 1)` of
    /// its `drafts[s]`, so sequences move on by different counts.
    pub fn settle(&mut self, step: usize, drafts: &[Vec<u32>]) {
        for (s, d) in drafts.iter().enumerate() {
            let a = (step + s) % (d.len() + 1);
            self.head.after_verify(a, &mut *self.single[s], 0).unwrap();
            self.head.after_verify(a, &mut *self.batched[s], 0).unwrap();
            self.start[s] = self.pos[s];
            self.pos[s] += a + 1;
        }
    }

    /// Frees every state.
    pub fn free(&mut self, gpu: &dyn GpuBackend) {
        for st in self.single.iter_mut().chain(self.batched.iter_mut()) {
            self.head.free_state(gpu, &mut **st).unwrap();
        }
    }
}
