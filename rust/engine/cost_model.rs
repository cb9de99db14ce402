//! What a step costs, as the adaptive draft policy sees it: the wall time of the verify
//! forward against the rows it holds, and of drafting against the drafts asked of one
//! sequence, each measured on the running backend and refreshed as it runs.
//!
//! A [`CostCurve`] keeps an exponentially weighted mean of the measured seconds for each
//! integer abscissa (rows, or drafts asked) and reads between and beyond them:
//! - between measured points it interpolates linearly;
//! - the curve it reads is the running maximum of the measured means from the left, so a
//!   noisy measurement never makes more rows look cheaper than fewer;
//! - beyond the measured range it extends the slope of the two nearest points (never
//!   negative, never below zero); with one point it is flat; with none it is unknown.
//!
//! [`CostModel`] is the seam tests use: the engine records what it measured and reads a
//! snapshot ([`CostCurves`]) once a step, so a test model that ignores the records and
//! returns fixed curves makes the policy's choices exactly reproducible.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// Measured cost (seconds) against an integer abscissa.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CostCurve {
    points: BTreeMap<usize, f64>,
}

impl CostCurve {
    /// A curve through fixed `(x, seconds)` points (a later duplicate `x` wins).
    pub fn from_points(points: impl IntoIterator<Item = (usize, f64)>) -> Self {
        CostCurve {
            points: points.into_iter().collect(),
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
            .and_modify(|m| *m += weight * (seconds - *m))
            .or_insert(seconds);
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

    /// The cost at `x` (see the module documentation); `None` when nothing was measured.
    pub fn at(&self, x: f64) -> Option<f64> {
        let mut envelope: Vec<(f64, f64)> = Vec::with_capacity(self.points.len());
        let mut top = f64::NEG_INFINITY;
        for (&px, &py) in &self.points {
            top = top.max(py);
            envelope.push((px as f64, top));
        }
        let n = envelope.len();
        match n {
            0 => return None,
            1 => return Some(envelope[0].1),
            _ => {}
        }
        let line = |(x0, y0): (f64, f64), (x1, y1): (f64, f64)| {
            let slope = ((y1 - y0) / (x1 - x0)).max(0.0);
            move |x: f64| (y0 + slope * (x - x0)).max(0.0)
        };
        if x <= envelope[0].0 {
            return Some(line(envelope[0], envelope[1])(x));
        }
        if x >= envelope[n - 1].0 {
            return Some(line(envelope[n - 2], envelope[n - 1])(x));
        }
        let hi = envelope.partition_point(|&(px, _)| px < x);
        Some(line(envelope[hi - 1], envelope[hi])(x))
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
    fn default() -> Self {
        MeasuredCost::new(0.2)
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
    fn a_curve_interpolates_extends_and_never_falls() {
        let empty = CostCurve::default();
        assert_eq!(empty.at(3.0), None);
        let one = CostCurve::from_points([(4, 2.0)]);
        assert_eq!((one.at(1.0), one.at(9.0)), (Some(2.0), Some(2.0)));
        // 1 -> 1.0, 3 -> 2.0, 5 -> 1.5 (noise): read as 2.0 at 5.
        let c = CostCurve::from_points([(1, 1.0), (3, 2.0), (5, 1.5)]);
        assert_eq!(c.at(2.0), Some(1.5));
        assert_eq!(c.at(4.0), Some(2.0));
        assert_eq!(c.at(7.0), Some(2.0));
        // Below the first point the first slope (0.5 a row) goes on, down to zero.
        assert_eq!(c.at(0.0), Some(0.5));
        let steep = CostCurve::from_points([(2, 1.0), (3, 5.0)]);
        assert_eq!(steep.at(0.0), Some(0.0));
        assert_eq!(steep.at(5.0), Some(13.0));
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
