//! The scheduler in front of the decoding loop: a queue of requests, admitted while the
//! target's KV pool (and the drafter's, when the engine can see it) has room, joining and
//! leaving between steps (continuous batching), preempted newest first when the pool runs
//! dry, and prefilled in chunks of at most `max_batch_tokens` rows.
//!
//! One scheduler iteration admits from the queue, plans the iteration's rows (preempting
//! until every running sequence's needed rows fit, then sharing the blocks left over as
//! room for drafts), runs one prefill forward over the prefilling sequences' next chunks,
//! runs one decode step over the others, and releases the sequences that finished. When the
//! prefill forward emits a request's first token, [`GenerationRun::step`] returns there and
//! the next call runs the iteration's decode step: a poll in between hands the first token
//! over without waiting for a decode step of the whole batch (time to first token).
//!
//! Invariants:
//! - Admission is first come, first served: the queue's head waits until it fits, and later
//!   requests wait behind it. A preempted sequence goes back to the head of the queue.
//! - The oldest running sequence is never preempted while another runs, so every call ends:
//!   the oldest fits the pool alone (a request that never could fails at once with
//!   [`EngineError::NeverFits`]).
//! - A preempted sequence keeps its tokens, sampler and grammar and gives up everything else;
//!   it recomputes its KV when readmitted, and its output is what it would have been.
//! - Forwards never ask the pool for more blocks than it has free: the plan counts every
//!   row of the iteration's prefill and verify forwards before they run.
//! - Nothing is admitted or planned between a deferred decode step and the prefill forward
//!   of its iteration, so the plan's row grants still hold when it runs (a cancel in
//!   between only frees blocks).
//! - Whatever stops a run (its end, or dropping it half-way, as an abandoned stream does),
//!   every sequence's resources are released exactly once.

mod plan;
mod serving;

use super::sequence::EngineSequence;
use super::{
    CarriedKv, EngineError, FinishReason, GenerateRequest, GenerateResult, Generation, Metrics,
    SpecEngine, Target,
};
use crate::model::ForwardContext;
use plan::{grants, total_new_blocks, Demand};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

pub use serving::ServeUpdate;

/// A prefill chunk: the sequence and its rows.
type Chunk = (usize, usize);

/// Tokens a request emitted since the last [`GenerationRun::take_updates`], and whether it
/// has ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamUpdate {
    /// The request's index in its call (or the id [`GenerationRun::submit`] gave it).
    pub request: usize,
    /// Newly emitted token ids (possibly none, on the update that reports the end).
    pub tokens: Vec<u32>,
    /// Why it ended, on its last update.
    pub finish: Option<FinishReason>,
}

/// A generation in progress: the engine's scheduler over one call's requests.
pub struct GenerationRun<T: Target> {
    engine: SpecEngine<T>,
    ctx: ForwardContext<'static>,
    seqs: Vec<EngineSequence<T::KvSequence>>,
    queue: VecDeque<usize>,
    /// Admitted sequences, oldest admission first.
    running: Vec<usize>,
    /// Whether each request's end was reported by `take_updates`.
    reported: Vec<bool>,
    total: Metrics,
    started: Instant,
    want_carry: bool,
    /// The id the next [`GenerationRun::submit`] gives (ids of the call's own requests are
    /// their indices).
    next_id: usize,
    /// Whether the next step runs the decode step of an iteration whose prefill forward ran.
    decode_pending: bool,
}

impl<T: Target> GenerationRun<T> {
    pub(super) fn new(
        engine: SpecEngine<T>,
        requests: Vec<GenerateRequest>,
        carry_in: Vec<Option<CarriedKv>>,
        want_carry: bool,
    ) -> Self {
        let ctx = ForwardContext::new(
            engine.target.gpu().clone(),
            engine.target.buffers().clone(),
            engine.target.config().clone(),
            engine.levers,
        );
        let mut carry_in = carry_in.into_iter();
        let seqs: Vec<_> = requests
            .into_iter()
            .enumerate()
            .map(|(i, r)| engine.new_seq(i, r, carry_in.next().flatten()))
            .collect();
        // Entries without a request still own their blocks.
        for extra in carry_in.flatten() {
            if let Some(p) = &engine.proposer {
                p.free_drafter_kv(&extra.blocks);
            }
        }
        let n = seqs.len();
        let mut run = GenerationRun {
            engine,
            ctx,
            seqs,
            queue: VecDeque::with_capacity(n),
            running: Vec::new(),
            reported: vec![false; n],
            total: Metrics::default(),
            started: Instant::now(),
            want_carry,
            next_id: n,
            decode_pending: false,
        };
        for i in 0..n {
            if run.seqs[i].live() {
                run.queue.push_back(i);
            } else {
                // Refused before running: it holds nothing but carried blocks.
                run.engine.release(&mut run.seqs[i], false);
            }
        }
        run
    }

    /// Whether every request has ended.
    pub fn is_done(&self) -> bool {
        self.queue.is_empty() && self.running.is_empty()
    }

    /// Requests waiting in the queue.
    pub fn waiting(&self) -> usize {
        self.queue.len()
    }

    /// Sequences admitted and not yet ended.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// One scheduler iteration, or its first half when its prefill forward emitted a first
    /// token (the next call then runs the decode step; see the module documentation).
    /// Returns false, doing nothing, once every request has ended.
    pub fn step(&mut self) -> bool {
        if self.is_done() {
            self.decode_pending = false;
            return false;
        }
        if !std::mem::take(&mut self.decode_pending) {
            self.admit();
            let work = self.plan();
            if !work.is_empty() {
                let silent: Vec<usize> = work
                    .iter()
                    .map(|w| w.0)
                    .filter(|&i| self.seqs[i].generated() == 0)
                    .collect();
                let dt = self
                    .engine
                    .prefill_forward(&work, &mut self.seqs, &self.ctx);
                self.total.prefill_time += dt;
                if silent.iter().any(|&i| self.seqs[i].generated() > 0) {
                    self.decode_pending = true;
                    return true;
                }
            }
        }
        if self.running.iter().any(|&i| self.seqs[i].active()) {
            self.engine.step(&mut self.seqs, &self.ctx, &mut self.total);
        }
        let (engine, seqs, want_carry) = (&self.engine, &mut self.seqs, self.want_carry);
        self.running.retain(|&i| {
            let seq = &mut seqs[i];
            seq.mark_first_token();
            if seq.live() {
                return true;
            }
            engine.release(seq, want_carry);
            false
        });
        true
    }

    /// Tokens emitted since the last call, one update per request that emitted any or ended
    /// (each end reported once), in request order.
    pub fn take_updates(&mut self) -> Vec<StreamUpdate> {
        let mut updates = Vec::new();
        for (i, seq) in self.seqs.iter_mut().enumerate() {
            let generated = seq.generated();
            let ended = seq.released && !self.reported[i];
            if generated > seq.streamed || ended {
                let from = seq.prompt_len + seq.streamed;
                updates.push(StreamUpdate {
                    request: seq.request,
                    tokens: seq.tokens[from..].to_vec(),
                    finish: if ended {
                        seq.finish.or(Some(FinishReason::Error))
                    } else {
                        None
                    },
                });
                seq.streamed = generated;
                self.reported[i] |= ended;
            }
        }
        updates
    }

    /// Steps to the end and returns the results.
    pub fn run_to_end(mut self) -> (Generation, Vec<Option<CarriedKv>>) {
        while self.step() {}
        self.results()
    }

    /// The results of the requests; those that had not ended (when called before
    /// [`GenerationRun::is_done`]) end now with the error that says so.
    pub fn finish(mut self) -> Generation {
        self.results().0
    }

    fn results(&mut self) -> (Generation, Vec<Option<CarriedKv>>) {
        self.release_all();
        let mut total = std::mem::take(&mut self.total);
        let mut results = Vec::with_capacity(self.seqs.len());
        let mut carry_out = Vec::with_capacity(self.seqs.len());
        for seq in std::mem::take(&mut self.seqs) {
            let mut counters = seq.metrics.clone();
            // The call's own clocks measure these; the requests' shares overlap.
            counters.draft_time = Duration::ZERO;
            counters.verify_time = Duration::ZERO;
            counters.prefill_time = Duration::ZERO;
            counters.wall_time = Duration::ZERO;
            total.merge(&counters);
            carry_out.push(seq.carry_out);
            results.push(GenerateResult {
                tokens: seq.tokens[seq.prompt_len.min(seq.tokens.len())..].to_vec(),
                finish: seq.finish.unwrap_or(FinishReason::Error),
                metrics: seq.metrics,
                error: seq.error,
            });
        }
        total.wall_time = self.started.elapsed();
        (
            Generation {
                results,
                metrics: total,
            },
            carry_out,
        )
    }

    /// Ends and releases every sequence still queued or running.
    fn release_all(&mut self) {
        self.queue.clear();
        self.running.clear();
        for seq in self.seqs.iter_mut().filter(|s| !s.released) {
            if seq.live() {
                seq.fail(
                    EngineError::Stopped {
                        request: seq.request,
                    }
                    .into(),
                );
            }
            self.engine.release(seq, self.want_carry);
        }
    }

    /// Blocks running sequence `i` needs for its next step's first row (all of its prefill,
    /// when prefilling).
    fn reserved_blocks(&self, i: usize) -> usize {
        let Some(pool) = self.engine.target.kv_pool() else {
            return 0;
        };
        let seq = &self.seqs[i];
        let kv_len = self.kv_len(i);
        let goal = if seq.prefilling() {
            seq.prefill_end + 1
        } else {
            kv_len + 1
        };
        pool.blocks_for(goal.min(self.most_rows(i)))
            .saturating_sub(pool.blocks_for(kv_len))
    }

    fn kv_len(&self, i: usize) -> usize {
        self.seqs[i]
            .kv
            .as_ref()
            .map_or(0, |kv| self.engine.target.seq_len(kv))
    }

    fn most_rows(&self, i: usize) -> usize {
        let seq = &self.seqs[i];
        self.engine
            .most_kv_rows(seq.prompt_len, seq.max_tokens)
            .max(1)
    }

    /// Admits from the head of the queue while a slot and the blocks for its (re)prefill
    /// plus a step's rows are free.
    fn admit(&mut self) {
        while self.running.len() < self.engine.max_batch {
            let Some(&i) = self.queue.front() else {
                return;
            };
            let seq = &self.seqs[i];
            let prefill_end = if seq.generated() == 0 {
                seq.prompt_len
            } else {
                seq.tokens.len() - 1
            };
            let rows = (prefill_end + 1 + self.engine.num_drafts).min(self.most_rows(i));
            if let Some(pool) = self.engine.target.kv_pool() {
                let reserved: usize = self.running.iter().map(|&r| self.reserved_blocks(r)).sum();
                let needed = pool.blocks_for(rows);
                if needed + reserved > pool.num_free {
                    if !self.running.is_empty() {
                        return;
                    }
                    self.queue.pop_front();
                    let seq = &mut self.seqs[i];
                    seq.fail(
                        EngineError::PoolHeldElsewhere {
                            request: seq.request,
                            needed,
                            free: pool.num_free,
                            total: pool.num_blocks,
                        }
                        .into(),
                    );
                    self.engine.release(seq, false);
                    continue;
                }
            }
            if let Some(probe) = &self.engine.drafter_pool {
                // A drafter takes its blocks as its sequence's prefill completes: count those
                // promised to the running sequences still prefilling.
                let d = probe();
                let promised: usize = self
                    .running
                    .iter()
                    .filter(|&&r| self.kv_len(r) < self.seqs[r].prompt_len)
                    .map(|&r| d.blocks_for(self.seqs[r].prompt_len + 1 + self.engine.num_drafts))
                    .sum();
                if !self.running.is_empty() && d.blocks_for(rows) + promised > d.num_free {
                    return;
                }
            }
            self.queue.pop_front();
            self.running.push(i);
            let seq = &mut self.seqs[i];
            if let Err(e) = self.engine.admit(seq) {
                seq.fail(e);
            }
        }
    }

    /// Plans this iteration: each prefilling sequence's next chunk (within one forward's
    /// rows), each decoding sequence's one row (a sequence whose prefill completes this
    /// iteration decodes in it too), preempting the newest until those fit, then each
    /// decoding sequence's room for drafts. Returns the prefill work in sequence order.
    fn plan(&mut self) -> Vec<(usize, usize)> {
        loop {
            let (work, asks) = self.demands();
            let demands: Vec<Demand> = asks.iter().map(|a| a.1).collect();
            let Some(pool) = self.engine.target.kv_pool() else {
                for &i in &self.running {
                    self.seqs[i].row_cap = usize::MAX;
                }
                return work;
            };
            let needed = total_new_blocks(&pool, &demands);
            if needed <= pool.num_free {
                for (&(i, _), rows) in asks.iter().zip(grants(&pool, &demands)) {
                    // Rows the prefill chunk takes come before the decode step's.
                    let chunk = work.iter().find(|w| w.0 == i).map_or(0, |w| w.1);
                    self.seqs[i].row_cap = rows - chunk;
                }
                return work;
            }
            if self.running.len() == 1 {
                // The oldest alone does not fit: blocks are held outside this call.
                let seq = &mut self.seqs[self.running[0]];
                seq.fail(
                    EngineError::PoolHeldElsewhere {
                        request: seq.request,
                        needed,
                        free: pool.num_free,
                        total: pool.num_blocks,
                    }
                    .into(),
                );
                return Vec::new();
            }
            let Some(victim) = self.running.pop() else {
                return Vec::new();
            };
            self.preempt(victim);
        }
    }

    /// What each live running sequence asks this iteration (in admission order; its prefill
    /// chunk, then its decode row and drafts when it will decode), and the prefill work
    /// (sequence, rows) in sequence order.
    fn demands(&mut self) -> (Vec<Chunk>, Vec<(usize, Demand)>) {
        let mut budget = self.engine.forward_rows();
        let mut work = Vec::new();
        let mut demands = Vec::new();
        for k in 0..self.running.len() {
            let i = self.running[k];
            if !self.seqs[i].live() {
                continue;
            }
            let kv_len = self.kv_len(i);
            let seq = &mut self.seqs[i];
            let mut chunk = 0;
            if seq.prefilling() {
                chunk = (seq.prefill_end - seq.prefilled).min(budget);
                budget -= chunk;
                if chunk > 0 {
                    work.push((i, chunk));
                }
            }
            let decodes = seq.prefilled + chunk >= seq.prefill_end;
            seq.row_cap = usize::MAX;
            let extra = if decodes {
                self.engine.draft_budget(seq)
            } else {
                0
            };
            demands.push((
                i,
                Demand {
                    kv_len,
                    need: chunk + usize::from(decodes),
                    extra,
                },
            ));
        }
        work.sort_unstable();
        (work, demands)
    }

    /// Frees what running sequence `i` holds and puts it back at the head of the queue; its
    /// tokens stay, and it recomputes its KV when readmitted.
    fn preempt(&mut self, i: usize) {
        let seq = &mut self.seqs[i];
        self.engine.free_held(seq, false);
        seq.admitted = false;
        seq.prefilled = 0;
        seq.drafts.clear();
        seq.proposed = false;
        seq.metrics.preemptions += 1;
        seq.queued_at = Instant::now();
        if seq.live() {
            self.queue.push_front(i);
        } else {
            // Freeing failed: the error ends it.
            self.engine.release(seq, false);
        }
    }
}

impl<T: Target> Drop for GenerationRun<T> {
    fn drop(&mut self) {
        self.release_all();
    }
}
