//! The proposer's own confidence in its drafts (`propose_batch`'s `out_conf`), turned into
//! acceptance estimates and used to drop the drafts of a step that would not pay.
//!
//! A confidence is not trusted as a probability: each one is read through a calibration
//! table (by draft position and a tenth of confidence) of how often drafts reported with
//! it were accepted, starting from the confidence itself and moving to what is measured.
//!
//! Invariants:
//! - Drafts are only ever cut at the end (the ones kept are a prefix), so verification,
//!   `after_verify` and greedy output are unaffected.
//! - Confidences of 1 or more say nothing (a proposer reporting every draft as sure): a
//!   step whose drafts all carry them is never cut.

/// Confidence bins a draft position is split into.
const BINS: usize = 10;
/// Pseudo-observations of the reported confidence behind each calibrated estimate.
const PRIOR_WEIGHT: f64 = 4.0;
/// Share of the table's counts kept at each observation.
const KEEP: f64 = 0.998;

/// Calibration counts by `(position, bin)`.
#[derive(Clone, Debug, Default)]
pub(super) struct Calibration {
    hits: Vec<f64>,
    tries: Vec<f64>,
}

fn slot(position: usize, conf: f32) -> usize {
    let bin = ((conf.clamp(0.0, 1.0) * BINS as f32) as usize).min(BINS - 1);
    position * BINS + bin
}

impl Calibration {
    /// The estimated chance that a draft at `position` reported with `conf` is accepted.
    pub fn estimate(&self, position: usize, conf: f32) -> f64 {
        let s = slot(position, conf);
        let hits = self.hits.get(s).copied().unwrap_or(0.0);
        let tries = self.tries.get(s).copied().unwrap_or(0.0);
        (hits + PRIOR_WEIGHT * f64::from(conf.clamp(0.0, 1.0))) / (tries + PRIOR_WEIGHT)
    }

    /// Records the verdict on drafts reported with `confs`: the first `accepted` were
    /// accepted and the one after them (if any) rejected; later ones were not judged.
    pub fn observe(&mut self, confs: &[f32], accepted: usize) {
        self.hits.iter_mut().for_each(|x| *x *= KEEP);
        self.tries.iter_mut().for_each(|x| *x *= KEEP);
        for (j, &c) in confs.iter().enumerate().take(accepted + 1) {
            let s = slot(j, c);
            if self.tries.len() <= s {
                self.hits.resize(s + 1, 0.0);
                self.tries.resize(s + 1, 0.0);
            }
            self.tries[s] += 1.0;
            if j < accepted {
                self.hits[s] += 1.0;
            }
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
