//! Decayed hit and try counts by index, and the rate they give shrunk towards a prior: what
//! the draft policy keeps by draft position, and the confidence calibration by position and
//! confidence bin.
//!
//! Invariants:
//! - A rate is `(hits + weight * prior) / (tries + weight)`: with a prior in [0, 1] and a
//!   positive weight it lies in [0, 1], and it is the prior before anything is counted.
//! - Decaying scales every count alike, so it never changes a rate whose counts are 0.

/// Hit and try counts by index, each decayed by its owner's share at each observation.
#[derive(Clone, Debug, Default)]
pub(super) struct DecayedCounts {
    hits: Vec<f64>,
    tries: Vec<f64>,
}

impl DecayedCounts {
    /// Keeps the share `keep` of every count.
    pub fn decay(&mut self, keep: f64) {
        self.hits.iter_mut().for_each(|x| *x *= keep);
        self.tries.iter_mut().for_each(|x| *x *= keep);
    }

    /// Counts one try at `at`, a hit or not.
    pub fn add(&mut self, at: usize, hit: bool) {
        if self.tries.len() <= at {
            self.hits.resize(at + 1, 0.0);
            self.tries.resize(at + 1, 0.0);
        }
        self.tries[at] += 1.0;
        if hit {
            self.hits[at] += 1.0;
        }
    }

    /// The rate at `at`, shrunk towards `prior` by `weight` pseudo-observations.
    pub fn rate(&self, at: usize, prior: f64, weight: f64) -> f64 {
        let hits = self.hits.get(at).copied().unwrap_or(0.0);
        let tries = self.tries.get(at).copied().unwrap_or(0.0);
        (hits + weight * prior) / (tries + weight)
    }
}
