//! Acceptance and timing metrics, per request and in total.
//!
//! Definitions (the ones vLLM and SGLang report):
//! - `drafted` / `accepted`: draft tokens proposed / accepted by verification.
//! - mean acceptance length: tokens emitted per verify forward (1 with no proposer; at most
//!   `num_drafts + 1`). The first token, picked by the prefill, is not counted.
//! - acceptance rate at draft position `k`: of the verify steps that had a draft at
//!   position `k`, the fraction that accepted it.

use serde::Serialize;
use std::time::Duration;

/// Counters and timings of one request, or summed over many.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Metrics {
    /// Draft tokens proposed (after clamping to what could be verified).
    pub drafted: u64,
    /// Draft tokens accepted.
    pub accepted: u64,
    /// Verify forwards (decode steps).
    pub verify_steps: u64,
    /// Tokens emitted by decode steps (excluding the prefill's token).
    pub decode_tokens: u64,
    /// Tokens emitted in all, the prefill's included.
    pub emitted: u64,
    /// Prompt tokens prefilled.
    pub prompt_tokens: u64,
    /// Steps that had a draft at position `k`.
    pub drafted_at: Vec<u64>,
    /// Steps that accepted the draft at position `k`.
    pub accepted_at: Vec<u64>,
    /// Steps at which the engine asked for `k` drafts (index `k`; 0 is a plain step), over
    /// the steps at which the sequence could draft.
    pub draft_lengths: Vec<u64>,
    /// Time spent in the proposer (prefill of the drafter, propose, catch-up, after_verify).
    #[serde(serialize_with = "secs")]
    pub draft_time: Duration,
    /// Time spent in verify forwards and verification.
    #[serde(serialize_with = "secs")]
    pub verify_time: Duration,
    /// Time spent in the target's prefill (a share of each prefill forward by rows,
    /// recomputation after a preemption included).
    #[serde(serialize_with = "secs")]
    pub prefill_time: Duration,
    /// Time spent waiting in the queue for a slot and KV blocks (after a preemption too).
    /// Summed over requests in a total.
    #[serde(serialize_with = "secs")]
    pub queue_time: Duration,
    /// From the call's start to the first emitted token (zero when none was emitted).
    /// Summed over requests in a total; divide by `first_tokens` for the mean.
    #[serde(serialize_with = "secs")]
    pub time_to_first_token: Duration,
    /// Requests that emitted a first token (1 or 0 for a request; summed in a total).
    pub first_tokens: u64,
    /// Times the sequence was preempted (its KV freed, to be recomputed).
    pub preemptions: u64,
    /// Rows prefilled again after preemptions.
    pub recomputed_tokens: u64,
    /// Wall time from the start of the request (or of the batch) to its end.
    #[serde(serialize_with = "secs")]
    pub wall_time: Duration,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl Metrics {
    /// Records one verify step that drafted `drafted` tokens, accepted `accepted` of them
    /// and emitted `emitted` tokens.
    pub fn record_step(&mut self, drafted: usize, accepted: usize, emitted: usize) {
        self.verify_steps += 1;
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        self.decode_tokens += emitted as u64;
        self.emitted += emitted as u64;
        if self.drafted_at.len() < drafted {
            self.drafted_at.resize(drafted, 0);
            self.accepted_at.resize(drafted, 0);
        }
        for k in 0..drafted {
            self.drafted_at[k] += 1;
            if k < accepted {
                self.accepted_at[k] += 1;
            }
        }
    }

    /// Records that a step asked for `k` drafts.
    pub fn record_draft_length(&mut self, k: usize) {
        if self.draft_lengths.len() <= k {
            self.draft_lengths.resize(k + 1, 0);
        }
        self.draft_lengths[k] += 1;
    }

    /// Tokens emitted per verify forward; 0 before the first step.
    pub fn mean_acceptance_length(&self) -> f64 {
        if self.verify_steps == 0 {
            0.0
        } else {
            self.decode_tokens as f64 / self.verify_steps as f64
        }
    }

    /// Accepted / drafted over all positions; 0 when nothing was drafted.
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Acceptance rate at each draft position.
    pub fn acceptance_by_position(&self) -> Vec<f64> {
        self.drafted_at
            .iter()
            .zip(&self.accepted_at)
            .map(|(&d, &a)| if d == 0 { 0.0 } else { a as f64 / d as f64 })
            .collect()
    }

    /// Mean time to first token over the requests that emitted one; zero when none did.
    pub fn mean_time_to_first_token(&self) -> Duration {
        match self.first_tokens {
            0 => Duration::ZERO,
            n => self.time_to_first_token / n as u32,
        }
    }

    /// Emitted tokens per second of wall time; 0 when no time was measured.
    pub fn tokens_per_second(&self) -> f64 {
        let s = self.wall_time.as_secs_f64();
        if s > 0.0 {
            self.emitted as f64 / s
        } else {
            0.0
        }
    }

    /// Adds `other`'s counters and timings to these (wall time included: callers that
    /// overlap requests set the total's wall time themselves).
    pub fn merge(&mut self, other: &Metrics) {
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.verify_steps += other.verify_steps;
        self.decode_tokens += other.decode_tokens;
        self.emitted += other.emitted;
        self.prompt_tokens += other.prompt_tokens;
        let n = self.drafted_at.len().max(other.drafted_at.len());
        self.drafted_at.resize(n, 0);
        self.accepted_at.resize(n, 0);
        for k in 0..other.drafted_at.len() {
            self.drafted_at[k] += other.drafted_at[k];
            self.accepted_at[k] += other.accepted_at[k];
        }
        if self.draft_lengths.len() < other.draft_lengths.len() {
            self.draft_lengths.resize(other.draft_lengths.len(), 0);
        }
        for (mine, theirs) in self.draft_lengths.iter_mut().zip(&other.draft_lengths) {
            *mine += theirs;
        }
        self.draft_time += other.draft_time;
        self.verify_time += other.verify_time;
        self.prefill_time += other.prefill_time;
        self.queue_time += other.queue_time;
        self.time_to_first_token += other.time_to_first_token;
        self.first_tokens += other.first_tokens;
        self.preemptions += other.preemptions;
        self.recomputed_tokens += other.recomputed_tokens;
        self.wall_time += other.wall_time;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acceptance_figures_follow_their_definitions() {
        let mut m = Metrics::default();
        m.record_step(4, 2, 3);
        m.record_step(4, 4, 5);
        m.record_step(2, 0, 1);
        assert_eq!((m.drafted, m.accepted, m.verify_steps), (10, 6, 3));
        assert!((m.mean_acceptance_length() - 3.0).abs() < 1e-12);
        assert_eq!(
            m.acceptance_by_position(),
            vec![2.0 / 3.0, 2.0 / 3.0, 0.5, 0.5]
        );
        let mut total = Metrics::default();
        total.merge(&m);
        total.merge(&m);
        assert_eq!(total.drafted_at, vec![6, 6, 4, 4]);
        assert_eq!(total.acceptance_by_position(), m.acceptance_by_position());
        assert_eq!(Metrics::default().mean_acceptance_length(), 0.0);
    }
}
