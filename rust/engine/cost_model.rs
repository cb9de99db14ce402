//! What a step costs, as the adaptive draft policy sees it: the wall time of the verify
//! forward against the rows it holds, and of drafting against the drafts asked of one
//! sequence, each measured on the running backend and refreshed as it runs.
//!
//! A [`CostCurve`] keeps an exponentially weighted mean of the measured seconds for each
//! integer abscissa (rows, or drafts asked) and reads the straight line fitted through those
//! means by least squares, each weighing as many measurements as it holds (up to
//! [`FIT_WEIGHT_CAP`]): on a shared, noisy machine one point's noise would otherwise decide
//! the slope between neighbours, which is all the policy acts on. The slope is never
//! negative and the cost never below zero; with one point the curve is flat; with none it is
//! unknown.
//!
//! [`CostModel`] is the seam tests use: the engine records what it measured and reads a
//! snapshot ([`CostCurves`]) once a step, so a test model that ignores the records and
//! returns fixed curves makes the policy's choices exactly reproducible.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// Most measurements one point weighs in the fit.
pub const FIT_WEIGHT_CAP: f64 = 16.0;

/// Measured cost (seconds) against an integer abscissa.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CostCurve {
    /// Mean seconds and measurements held, by abscissa.
    points: BTreeMap<usize, (f64, f64)>,
}

impl CostCurve {
    /// A curve through fixed `(x, seconds)` points (a later duplicate `x` wins), each
    /// weighing one measurement.
    pub fn from_points(points: impl IntoIterator<Item = (usize, f64)>) -> Self {
        CostCurve {
            points: points.into_iter().map(|(x, y)| (x, (y, 1.0))).collect(),
        }
    }

    /// Folds a measurement into the mean at `x`: the first one sets it, later ones move it
    /// by `weight` (0 to 1) of the difference.
    pub fn record(&mut self, x: usize, seconds: f64, weight: f64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        self.points
            .entry(x)
            .and_modify(|(m, n)| {
                *m += weight * (seconds - *m);
                *n = (*n + 1.0).min(FIT_WEIGHT_CAP);
            })
            .or_insert((seconds, 1.0));
    }

    /// Distinct abscissas measured.
    pub fn len(&self) -> usize {
        self.points.len()
    }

    /// Whether nothing was measured.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// The smallest measured abscissa.
    pub fn first_x(&self) -> Option<usize> {
        self.points.keys().next().copied()
    }

    /// The fitted line's `(intercept, slope)`; `None` when nothing was measured.
    pub fn line(&self) -> Option<(f64, f64)> {
        let (mut sw, mut sx, mut sy) = (0.0, 0.0, 0.0);
        for (&x, &(y, w)) in &self.points {
            sw += w;
            sx += w * x as f64;
            sy += w * y;
        }
        if sw == 0.0 {
            return None;
        }
        let (mx, my) = (sx / sw, sy / sw);
        let (mut sxx, mut sxy) = (0.0, 0.0);
        for (&x, &(y, w)) in &self.points {
            let dx = x as f64 - mx;
            sxx += w * dx * dx;
            sxy += w * dx * (y - my);
        }
        let slope = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
        Some((my - slope * mx, slope))
    }

    /// The cost at `x` (see the module documentation); `None` when nothing was measured.
    pub fn at(&self, x: f64) -> Option<f64> {
        self.line().map(|(a, b)| (a + b * x).max(0.0))
    }
}

/// The curves the policy reads for one step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CostCurves {
    /// Seconds of a verify step (forward and verification) against the rows it holds.
    pub verify: CostCurve,
    /// Seconds of drafting for one sequence against the drafts asked of it (0: `propose`
    /// asked for none, which keeps a history-keeping proposer in step).
    pub draft: CostCurve,
}

/// Where the policy's costs come from. The engine records what it measures; the policy
/// reads [`CostModel::curves`] once a step.
pub trait CostModel: Send + Sync {
    /// A verify step over `rows` rows took `seconds`.
    fn record_verify(&self, rows: usize, seconds: f64);
    /// Drafting `asked` tokens for one sequence took `seconds`.
    fn record_draft(&self, asked: usize, seconds: f64);
    /// The current estimates.
    fn curves(&self) -> CostCurves;
}

/// The measured cost model: exponentially weighted means of what the engine records.
#[derive(Debug)]
pub struct MeasuredCost {
    curves: Mutex<CostCurves>,
    weight: f64,
}

impl MeasuredCost {
    /// Each new measurement moves its point's mean by `weight` (clamped to 0.01..1) of the
    /// difference: about the last `1 / weight` measurements count.
    pub fn new(weight: f64) -> Self {
        MeasuredCost {
            curves: Mutex::new(CostCurves::default()),
            weight: weight.clamp(0.01, 1.0),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut CostCurves) -> R) -> R {
        // A poisoned lock only means another thread panicked mid-update of plain numbers.
        let mut guard = self.curves.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard)
    }
}

impl Default for MeasuredCost {
    /// About the last 20 measurements of each point count: on a shared machine a step's
    /// time varies by tens of percent, more than one verify row costs.
    fn default() -> Self {
        MeasuredCost::new(0.05)
    }
}

impl CostModel for MeasuredCost {
    fn record_verify(&self, rows: usize, seconds: f64) {
        let w = self.weight;
        self.with(|c| c.verify.record(rows, seconds, w));
    }

    fn record_draft(&self, asked: usize, seconds: f64) {
        let w = self.weight;
        self.with(|c| c.draft.record(asked, seconds, w));
    }

    fn curves(&self) -> CostCurves {
        self.with(|c| c.clone())
    }
}

/// A cost model with fixed curves that ignores what is measured (tests, reproducible runs).
#[derive(Clone, Debug, Default)]
pub struct FixedCost(pub CostCurves);

impl CostModel for FixedCost {
    fn record_verify(&self, _rows: usize, _seconds: f64) {}
    fn record_draft(&self, _asked: usize, _seconds: f64) {}
    fn curves(&self) -> CostCurves {
        self.0.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_curve_is_the_weighted_line_through_its_means() {
        let empty = CostCurve::default();
        assert_eq!(empty.at(3.0), None);
        let one = CostCurve::from_points([(4, 2.0)]);
        assert_eq!((one.at(1.0), one.at(9.0)), (Some(2.0), Some(2.0)));
        // On a line: read back exactly, and extended both ways.
        let c = CostCurve::from_points([(1, 1.0), (3, 2.0), (5, 3.0)]);
        assert_eq!(c.line(), Some((0.5, 0.5)));
        assert_eq!((c.at(2.0), c.at(9.0)), (Some(1.5), Some(5.0)));
        // Falling costs read as flat; a steep line stops at zero.
        let falling = CostCurve::from_points([(1, 2.0), (2, 1.0)]);
        assert_eq!((falling.at(1.0), falling.at(2.0)), (Some(1.5), Some(1.5)));
        let steep = CostCurve::from_points([(2, 1.0), (3, 5.0)]);
        assert_eq!((steep.at(0.0), steep.at(5.0)), (Some(0.0), Some(13.0)));
        // A point measured more often weighs more: 3 measurements at 1 s against one 3 s.
        let mut w = CostCurve::default();
        for _ in 0..3 {
            w.record(2, 1.0, 0.5);
        }
        w.record(4, 3.0, 0.5);
        w.record(6, 3.0, 0.5);
        // Weighted means x 3.2, y 1.8; sxx 12.8, sxy 7.2: slope 0.5625, intercept 0.
        let (a, b) = w.line().unwrap();
        assert!((b - 0.5625).abs() < 1e-12 && a.abs() < 1e-12, "{a} {b}");
    }

    #[test]
    fn records_are_exponentially_weighted_and_bad_ones_ignored() {
        let m = MeasuredCost::new(0.5);
        m.record_verify(2, 4.0);
        m.record_verify(2, 2.0);
        m.record_verify(2, f64::NAN);
        m.record_verify(2, -1.0);
        m.record_draft(0, 0.25);
        let c = m.curves();
        assert_eq!(c.verify.at(2.0), Some(3.0));
        assert_eq!(c.verify.len(), 1);
        assert_eq!(c.draft.at(0.0), Some(0.25));
        let fixed = FixedCost(c.clone());
        fixed.record_verify(2, 100.0);
        assert_eq!(fixed.curves(), c);
    }
}
