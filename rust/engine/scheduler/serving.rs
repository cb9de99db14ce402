//! Serving on a long-lived [`GenerationRun`]: requests are submitted and cancelled between
//! steps, and each poll hands over what every request emitted since the last one, so one
//! loop serves any number of clients (continuous batching across calls).
//!
//! Invariants:
//! - A submitted request gets the next id (ids are never reused) and goes through the same
//!   checks, queue, admission and preemption as a request of the call itself; a request the
//!   checks refuse holds nothing and ends at the next poll with its error.
//! - A cancelled request gives up everything it holds (proposer state, target KV, engine
//!   buffers) at once, before the next step, and ends with [`FinishReason::Cancelled`].
//! - A request whose end a poll reported is forgotten: a run that serves for ever holds only
//!   the requests still queued or running.

use super::GenerationRun;
use crate::engine::{FinishReason, GenerateRequest, Metrics, Target};

/// What a request emitted since the last [`GenerationRun::poll`], and how it ended.
#[derive(Debug)]
pub struct ServeUpdate {
    /// The id [`GenerationRun::submit`] gave the request.
    pub id: usize,
    /// Newly emitted token ids (possibly none, on the update that reports the end).
    pub tokens: Vec<u32>,
    /// Why it ended, on its last update.
    pub finish: Option<FinishReason>,
    /// The error that ended it, when `finish` is [`FinishReason::Error`].
    pub error: Option<crate::Error>,
    /// The request's metrics, on its last update.
    pub metrics: Option<Metrics>,
}

impl<T: Target> GenerationRun<T> {
    /// Queues `request` behind those waiting and returns its id; it joins the running batch
    /// at a later step. A request that [`SpecEngine::check_request`](crate::engine::SpecEngine::check_request)
    /// or `check_fits` refuses holds nothing and ends at the next poll with the error.
    pub fn submit(&mut self, request: GenerateRequest) -> usize {
        let id = self.next_id;
        self.next_id += 1;
        let seq = self.engine.new_seq(id, request, None);
        self.seqs.push(seq);
        self.reported.push(false);
        let i = self.seqs.len() - 1;
        if self.seqs[i].live() {
            self.queue.push_back(i);
        } else {
            self.engine.release(&mut self.seqs[i], false);
        }
        id
    }

    /// Ends request `id` now, releasing what it holds; returns false when no such request
    /// is queued or running (unknown, already ended, or cancelled before).
    pub fn cancel(&mut self, id: usize) -> bool {
        let Some(i) = self.seqs.iter().position(|s| s.request == id) else {
            return false;
        };
        if self.seqs[i].released {
            return false;
        }
        self.queue.retain(|&q| q != i);
        self.running.retain(|&r| r != i);
        let seq = &mut self.seqs[i];
        if seq.live() {
            seq.finish = Some(FinishReason::Cancelled);
        }
        self.engine.release(seq, false);
        true
    }

    /// What each request emitted since the last poll (one update per request that emitted
    /// any or ended, each end reported once with its metrics and error), in submission
    /// order; requests whose end it reports are forgotten.
    pub fn poll(&mut self) -> Vec<ServeUpdate> {
        let updates = self.take_updates();
        let mut out = Vec::with_capacity(updates.len());
        for u in updates {
            let (mut error, mut metrics) = (None, None);
            if u.finish.is_some() {
                if let Some(seq) = self.seqs.iter_mut().find(|s| s.request == u.request) {
                    error = seq.error.take();
                    metrics = Some(seq.metrics.clone());
                }
            }
            out.push(ServeUpdate {
                id: u.request,
                tokens: u.tokens,
                finish: u.finish,
                error,
                metrics,
            });
        }
        self.forget_reported();
        out
    }

    /// Drops the requests whose end was reported, renumbering the queue and the running list.
    fn forget_reported(&mut self) {
        if !self.reported.iter().any(|&r| r) {
            return;
        }
        let mut new_index = vec![usize::MAX; self.seqs.len()];
        let seqs = std::mem::take(&mut self.seqs);
        let reported = std::mem::take(&mut self.reported);
        for (i, (seq, done)) in seqs.into_iter().zip(reported).enumerate() {
            if done && seq.released {
                continue;
            }
            new_index[i] = self.seqs.len();
            self.seqs.push(seq);
            self.reported.push(done);
        }
        for q in self.queue.iter_mut().chain(self.running.iter_mut()) {
            *q = new_index[*q];
        }
    }

    /// Requests submitted or given to the call and not yet forgotten by a poll.
    pub fn tracked(&self) -> usize {
        self.seqs.len()
    }
}
