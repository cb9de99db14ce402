//! The engine's side of the draft policy: choosing each step's draft counts for its
//! sequences, cutting doubted drafts, grouping batched proposes by count, and feeding the
//! step's measured costs and verdicts back.
//!
//! Invariants:
//! - Every sequence that may draft this step (a live proposer state and a budget above 0)
//!   gets a count, recorded in its metrics' draft-length histogram, and is observed once
//!   after the step (a failed sequence is forgotten, not observed).
//! - A `propose_batch` call asks one count of every member, so a group holds equal counts.

use super::draft_policy::{Candidate, DraftPolicyKind};
use super::sequence::EngineSequence;
use super::{SpecEngine, Target};
use std::time::Duration;

/// Splits the sequences that propose together into `propose_batch` groups: equal counts
/// together (one call asks one count of all), at most `batch_max` a group, in order.
pub(super) fn batch_groups(
    batchable: &[usize],
    asked: &[usize],
    batch_max: usize,
) -> Vec<Vec<usize>> {
    let mut sorted = batchable.to_vec();
    sorted.sort_by_key(|&i| (asked[i], i));
    let mut groups = Vec::new();
    for run in sorted.chunk_by(|&a, &b| asked[a] == asked[b]) {
        groups.extend(run.chunks(batch_max.max(1)).map(<[usize]>::to_vec));
    }
    groups
}

impl<T: Target> SpecEngine<T> {
    /// Whether `propose_batch` is asked for its confidences (the fixed policy ignores them).
    pub(super) fn wants_confidence(&self) -> bool {
        self.draft_policy.kind == DraftPolicyKind::Adaptive
    }

    /// Applies [`super::draft_policy::DraftPolicy::trim`] to `seq`'s drafts with the confidences `confs`.
    pub(super) fn trim_drafts(
        &self,
        seq: &mut EngineSequence<T::KvSequence>,
        confs: Option<&[f32]>,
    ) {
        self.draft_policy
            .trim(&mut seq.draft_stats, &mut seq.drafts, confs);
    }

    /// This step's draft count for every sequence (0 where `may_draft` is false), recorded
    /// in each drafting sequence's metrics and policy state.
    pub(super) fn plan_drafts(
        &self,
        seqs: &mut [EngineSequence<T::KvSequence>],
        budgets: &[usize],
        may_draft: impl Fn(usize) -> bool,
    ) -> Vec<usize> {
        let drafting: Vec<usize> = (0..seqs.len()).filter(|&i| may_draft(i)).collect();
        let others = seqs.iter().filter(|s| s.active()).count() - drafting.len();
        let candidates: Vec<Candidate<'_>> = drafting
            .iter()
            .map(|&i| Candidate {
                budget: budgets[i],
                stats: &seqs[i].draft_stats,
            })
            .collect();
        let (chosen, min_gain) = self.draft_policy.plan(&candidates, others, self.trees);
        let mut asked = vec![0; seqs.len()];
        for (&i, &k) in drafting.iter().zip(&chosen) {
            let seq = &mut seqs[i];
            asked[i] = k;
            seq.draft_stats.asked = Some(k);
            seq.draft_stats.tree_path = None;
            seq.draft_stats.min_gain = min_gain;
            seq.draft_stats.draft_mark = seq.metrics.draft_time;
            seq.draft_stats.probe.probing = k > 0 && self.draft_policy.probe_due(&seq.draft_stats);
            seq.metrics.record_draft_length(k);
        }
        asked
    }

    /// Feeds a finished step back: the verify step's `rows` and `verify_time`, and each
    /// planned sequence's drafting time and outcome (`returned[i]` drafts went to verify;
    /// what is left in `drafts` was accepted).
    pub(super) fn observe_step(
        &self,
        seqs: &mut [EngineSequence<T::KvSequence>],
        returned: &[usize],
        rows: usize,
        verify_time: Duration,
    ) {
        let policy = &self.draft_policy;
        if rows > 0 {
            policy.cost.record_verify(rows, verify_time.as_secs_f64());
        }
        for (seq, &got) in seqs.iter_mut().zip(returned) {
            let Some(asked) = seq.draft_stats.asked else {
                continue;
            };
            if seq.error.is_some() || !seq.proposed {
                seq.draft_stats.asked = None;
                continue;
            }
            let spent = seq
                .metrics
                .draft_time
                .saturating_sub(seq.draft_stats.draft_mark);
            policy
                .cost
                .record_draft(policy.draft_abscissa(asked), spent.as_secs_f64());
            let accepted = seq.drafts.len();
            policy.observe(&mut seq.draft_stats, got, accepted);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_groups_hold_equal_counts_in_order() {
        let asked = [2, 0, 2, 4, 2, 2, 0];
        let groups = batch_groups(&[0, 1, 2, 3, 4, 5, 6], &asked, 3);
        assert_eq!(groups, vec![vec![1, 6], vec![0, 2, 4], vec![5], vec![3]]);
        assert!(batch_groups(&[], &asked, 3).is_empty());
    }
}
