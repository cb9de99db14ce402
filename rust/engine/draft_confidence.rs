//! The proposer's own confidence in its drafts (`propose_batch`'s `out_conf`, a draft
//! tree's node probabilities), turned into acceptance estimates and used to drop the drafts
//! of a step that would not pay.
//!
//! A confidence is not trusted as a probability: each one is read through a calibration
//! table (by draft position and a tenth of confidence) of how often drafts reported with
//! it were accepted, starting from the confidence itself and moving to what is measured.
//!
//! Invariants:
//! - Drafts are only ever cut at the end (the ones kept are a prefix; of a tree, a set
//!   closed under parents), so verification, `after_verify` and greedy output are
//!   unaffected.
//! - Confidences of 1 or more say nothing (a proposer reporting every draft as sure): a
//!   step whose drafts all carry them is never cut.

use super::decayed_counts::DecayedCounts;
use crate::speculative::DraftTree;

/// Confidence bins a draft position is split into.
const BINS: usize = 10;
/// Pseudo-observations of the reported confidence behind each calibrated estimate.
const PRIOR_WEIGHT: f64 = 4.0;
/// Share of the table's counts kept at each observation.
const KEEP: f64 = 0.998;

/// Calibration counts by `(position, bin)`.
#[derive(Clone, Debug, Default)]
pub(super) struct Calibration {
    counts: DecayedCounts,
}

fn slot(position: usize, conf: f32) -> usize {
    let bin = ((conf.clamp(0.0, 1.0) * BINS as f32) as usize).min(BINS - 1);
    position * BINS + bin
}

impl Calibration {
    /// The estimated chance that a draft at `position` reported with `conf` is accepted.
    pub fn estimate(&self, position: usize, conf: f32) -> f64 {
        let prior = f64::from(conf.clamp(0.0, 1.0));
        self.counts.rate(slot(position, conf), prior, PRIOR_WEIGHT)
    }

    /// Records the verdict on drafts reported with `confs`: the first `accepted` were
    /// accepted and the one after them (if any) rejected; later ones were not judged.
    pub fn observe(&mut self, confs: &[f32], accepted: usize) {
        self.counts.decay(KEEP);
        for (j, &c) in confs.iter().enumerate().take(accepted + 1) {
            self.counts.add(slot(j, c), j < accepted);
        }
    }

    /// How many of the drafts reported with `confs` to keep: all of them up to the first
    /// whose chance of being reached and accepted falls below `min_gain` (the tokens one
    /// more verify row must bring to pay for itself).
    pub fn keep(&self, confs: &[f32], min_gain: f64) -> usize {
        if confs.iter().all(|&c| c >= 1.0) {
            return confs.len();
        }
        let mut reach = 1.0;
        for (j, &c) in confs.iter().enumerate() {
            reach *= self.estimate(j, c);
            if reach < min_gain {
                return j;
            }
        }
        confs.len()
    }
}

impl Calibration {
    /// Which nodes of a well-formed draft `tree` to keep, each reported with its probability
    /// given its parent (`tree.probs`): a node whose chance of being reached and accepted
    /// (its parent's, times its own calibrated estimate at its depth) is at least
    /// `min_gain`, under a kept parent. What is kept is closed under parents, and on a chain
    /// it is a prefix, what [`Calibration::keep`] keeps. A tree without probabilities, or
    /// with every one 1 or more, says nothing: every node is kept.
    pub fn keep_tree(&self, tree: &DraftTree, min_gain: f64) -> Vec<bool> {
        let Some(probs) = tree.probs.as_deref().filter(|p| p.iter().any(|&c| c < 1.0)) else {
            return vec![true; tree.len()];
        };
        let depths = tree.depths();
        let mut reach = vec![0.0; tree.len()];
        let mut kept = vec![false; tree.len()];
        for i in 0..tree.len() {
            let (above, parent_kept) = tree.parents[i].map_or((1.0, true), |p| (reach[p], kept[p]));
            reach[i] = above * self.estimate(depths[i] - 1, probs[i]);
            kept[i] = parent_kept && reach[i] >= min_gain;
        }
        kept
    }

    /// Records the verdict on the nodes of a well-formed draft `tree` reported with
    /// `tree.probs`: every child of the last verified token or of a node on the accepted
    /// `path` was judged, and accepted when it is on the path; the others were not judged.
    /// On a chain this is [`Calibration::observe`]. A tree without probabilities records
    /// nothing.
    pub fn observe_tree(&mut self, tree: &DraftTree, path: &[usize]) {
        let Some(probs) = tree.probs.as_deref() else {
            return;
        };
        self.counts.decay(KEEP);
        let depths = tree.depths();
        for (i, (&parent, &c)) in tree.parents.iter().zip(probs).enumerate() {
            if !parent.is_none_or(|p| path.contains(&p)) {
                continue;
            }
            self.counts.add(slot(depths[i] - 1, c), path.contains(&i));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tree of these parents and node probabilities (its tokens do not matter here).
    fn shape(parents: &[Option<usize>], probs: &[f32]) -> DraftTree {
        DraftTree {
            tokens: vec![0; parents.len()],
            parents: parents.to_vec(),
            probs: Some(probs.to_vec()),
        }
    }

    #[test]
    fn unsure_tails_are_cut_until_measured_otherwise() {
        let mut cal = Calibration::default();
        // Uncalibrated, a confidence is its own estimate: reach 0.9, then 0.9 * 0.2 = 0.18.
        assert_eq!(cal.keep(&[0.9, 0.2, 0.9], 0.3), 1);
        assert_eq!(cal.keep(&[0.9, 0.2, 0.9], 0.1), 3);
        // Sure drafts say nothing and are never cut, even where a row is dear.
        assert_eq!(cal.keep(&[1.0, 1.0], 0.99), 2);
        // Drafts reported at 0.2 in second place turn out always accepted: kept.
        for _ in 0..50 {
            cal.observe(&[0.9, 0.2, 0.9], 3);
        }
        assert!(cal.estimate(1, 0.2) > 0.9, "{}", cal.estimate(1, 0.2));
        assert_eq!(cal.keep(&[0.9, 0.2, 0.9], 0.3), 3);
        // Only judged drafts count: the third, after a rejection, is not recorded.
        let before = cal.estimate(2, 0.5);
        cal.observe(&[0.5, 0.5, 0.5], 0);
        assert!(cal.estimate(0, 0.5) < 1.0);
        assert_eq!(cal.estimate(2, 0.5), before);
    }

    #[test]
    fn a_trees_unsure_nodes_are_cut_with_everything_under_them() {
        let cal = Calibration::default();
        // Root children at 0.6, 0.3 and 0.1; node 3 under node 0 at 0.5 (reach 0.3), node 4
        // under node 2 at 0.9 (reach 0.09), node 5 under node 3 at 0.5 (reach 0.15).
        let parents = [None, None, None, Some(0), Some(2), Some(3)];
        let probs = [0.6, 0.3, 0.1, 0.5, 0.9, 0.5];
        let kept = cal.keep_tree(&shape(&parents, &probs), 0.2);
        assert_eq!(kept, [true, true, false, true, false, false]);
        // A sure child under a cut parent goes with it.
        let kept = cal.keep_tree(&shape(&[None, Some(0)], &[0.1, 1.0]), 0.2);
        assert_eq!(kept, [false, false]);
        // Sure nodes say nothing.
        assert_eq!(
            cal.keep_tree(&shape(&[None, None], &[1.0, 1.0]), 0.99),
            [true, true]
        );
        // On a chain the tree rule keeps what the chain rule keeps.
        let chain = [None, Some(0), Some(1)];
        for (confs, min_gain) in [
            ([0.9, 0.2, 0.9], 0.3),
            ([0.9, 0.2, 0.9], 0.1),
            ([0.4, 0.9, 0.9], 0.5),
        ] {
            let kept = cal.keep_tree(&shape(&chain, &confs), min_gain);
            let n = cal.keep(&confs, min_gain);
            assert_eq!(kept, (0..3).map(|i| i < n).collect::<Vec<_>>(), "{confs:?}");
        }
    }

    #[test]
    fn a_tree_judges_the_children_of_its_accepted_path_only() {
        // Node 1, a sibling reported at 0.3, is always the one accepted, with its child.
        let parents = [None, None, Some(0), Some(1)];
        let probs = [0.6, 0.3, 0.5, 0.5];
        let mut cal = Calibration::default();
        let under_node_0 = cal.estimate(1, 0.5);
        for _ in 0..50 {
            cal.observe_tree(&shape(&parents, &probs), &[1, 3]);
        }
        assert!(cal.estimate(0, 0.3) > 0.9, "{}", cal.estimate(0, 0.3));
        assert!(cal.estimate(0, 0.6) < 0.1, "{}", cal.estimate(0, 0.6));
        // Node 2, under node 0, was never judged; node 3, under node 1, always accepted,
        // in the same (depth, confidence) slot.
        assert!(cal.estimate(1, 0.5) > under_node_0);
        assert_eq!(
            cal.keep_tree(&shape(&parents, &probs), 0.5),
            [false, true, false, true]
        );
        // On a chain the tree rule records what the chain rule records.
        let (mut a, mut b) = (Calibration::default(), Calibration::default());
        a.observe(&[0.9, 0.4, 0.7], 1);
        b.observe_tree(&shape(&[None, Some(0), Some(1)], &[0.9, 0.4, 0.7]), &[0]);
        for (pos, conf) in [(0, 0.9), (1, 0.4), (2, 0.7)] {
            assert_eq!(a.estimate(pos, conf), b.estimate(pos, conf));
        }
    }
}
