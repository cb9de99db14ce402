//! What a step costs, as the adaptive draft policy sees it: the wall time of the verify
//! forward against the rows it holds, and of drafting against the drafts asked of one
//! sequence, each measured on the running backend and refreshed as it runs.
//!
//! A [`CostCurve`] keeps a weighted mean of the measured seconds for each integer abscissa
//! (rows, or drafts asked) and reads the straight line fitted through those means by least
//! squares, each weighing its measurements (up to [`FIT_WEIGHT_CAP`]): on a shared, noisy
//! machine one point's noise would otherwise decide the slope between neighbours, which is
//! all the policy acts on. The slope is never negative and the cost never below zero; with
//! one point the curve is flat; with none it is unknown.
//!
//! Where the points bend upwards clearly enough, the curve reads a line with one knee
//! instead (see `cost_fit`).
//!
//! Measurements age by the curve's own clock (one tick a record, at whatever abscissa):
//! each keeps `keep` of its weight at every later record. So a point the engine stopped
//! visiting (the cost of many rows, measured early or while the machine was loaded) loses
//! its say in the fit and is replaced, not nudged, by its next measurement, and
//! [`CostCurve::age`] tells the policy how old the widest point is so it can measure it again.
//!
//! [`CostModel`] is the seam tests use: the engine records what it measured and reads a
//! snapshot ([`CostCurves`]) once a step, so a test model that ignores the records and
//! returns fixed curves makes the policy's choices exactly reproducible.

use super::cost_fit::{self, CostFit};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Most measurements one point weighs in the fit.
pub const FIT_WEIGHT_CAP: f64 = 16.0;

/// One abscissa's measurements: their weighted mean, their weight when last recorded, and
/// the curve's clock then.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Point {
    mean: f64,
    weight: f64,
    stamp: u64,
}

/// Measured cost (seconds) against an integer abscissa.
#[derive(Clone, Debug, PartialEq)]
pub struct CostCurve {
    points: BTreeMap<usize, Point>,
    /// Share of its weight a measurement keeps at each later record (1: never ages).
    keep: f64,
    /// Records so far.
    clock: u64,
}

impl Default for CostCurve {
    /// An empty curve whose measurements never age.
    fn default() -> Self {
        CostCurve::forgetting(0.0)
    }
}

impl CostCurve {
    /// An empty curve whose measurements lose `forget` (clamped to 0..1) of their weight at
    /// each later record: for a point measured at every record, a new measurement moves the
    /// mean by about `forget` of the difference.
    pub fn forgetting(forget: f64) -> Self {
        CostCurve {
            points: BTreeMap::new(),
            keep: 1.0 - forget.clamp(0.0, 1.0),
            clock: 0,
        }
    }

    /// A curve through fixed `(x, seconds)` points (a later duplicate `x` wins), each
    /// weighing one measurement, that never ages.
    pub fn from_points(points: impl IntoIterator<Item = (usize, f64)>) -> Self {
        CostCurve {
            points: points
                .into_iter()
                .map(|(x, mean)| {
                    let p = Point {
                        mean,
                        weight: 1.0,
                        stamp: 0,
                    };
                    (x, p)
                })
                .collect(),
            ..CostCurve::default()
        }
    }

    /// Folds a measurement into the mean at `x`, weighing one against the aged weight of
    /// the earlier ones there (at most `FIT_WEIGHT_CAP`).
    pub fn record(&mut self, x: usize, seconds: f64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        self.clock += 1;
        let clock = self.clock;
        let old = self.points.get(&x).map(|p| (p.mean, self.aged(p)));
        let (mean, weight) = match old {
            Some((m, w)) => ((w * m + seconds) / (w + 1.0), (w + 1.0).min(FIT_WEIGHT_CAP)),
            None => (seconds, 1.0),
        };
        self.points.insert(
            x,
            Point {
                mean,
                weight,
                stamp: clock,
            },
        );
    }

    /// `p`'s weight now.
    fn aged(&self, p: &Point) -> f64 {
        let age = self.clock.saturating_sub(p.stamp).min(i32::MAX as u64) as i32;
        p.weight * self.keep.powi(age)
    }

    /// Records so far (the clock measurements age by).
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Records since the widest abscissa was last measured; `None` when nothing was.
    pub fn age(&self) -> Option<u64> {
        let (_, p) = self.points.last_key_value()?;
        Some(self.clock.saturating_sub(p.stamp))
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

    /// Each measured abscissa's `(x, mean, weight in the fit)`, in order of `x`.
    fn weighted(&self) -> Vec<(f64, f64, f64)> {
        self.points
            .iter()
            .map(|(&x, p)| (x as f64, p.mean, self.aged(p).min(FIT_WEIGHT_CAP)))
            .collect()
    }

    /// The fitted straight line's `(intercept, slope)`; `None` when nothing was measured.
    pub fn line(&self) -> Option<(f64, f64)> {
        cost_fit::line(&self.weighted())
    }

    /// The fitted cost: the straight line, or the bent one where the points bend upwards
    /// clearly enough (see `cost_fit`); `None` when nothing was measured.
    pub fn fit(&self) -> Option<CostFit> {
        cost_fit::fit(&self.weighted())
    }

    /// The cost at `x` (see [`CostCurve::fit`]); `None` when nothing was measured.
    pub fn at(&self, x: f64) -> Option<f64> {
        self.fit().map(|f| f.at(x))
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

/// The measured cost model: ageing weighted means of what the engine records.
#[derive(Debug)]
pub struct MeasuredCost {
    curves: Mutex<CostCurves>,
}

impl MeasuredCost {
    /// Each measurement loses `weight` (clamped to 0.01..1) of its weight at every later
    /// record to its curve: about the last `1 / weight` records count, and a point not
    /// measured for many more than that is replaced by its next measurement.
    pub fn new(weight: f64) -> Self {
        let weight = weight.clamp(0.01, 1.0);
        MeasuredCost {
            curves: Mutex::new(CostCurves {
                verify: CostCurve::forgetting(weight),
                draft: CostCurve::forgetting(weight),
            }),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut CostCurves) -> R) -> R {
        // A poisoned lock only means another thread panicked mid-update of plain numbers.
        let mut guard = self.curves.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard)
    }
}

impl Default for MeasuredCost {
    /// About the last 20 records of each curve count: on a shared machine a step's time
    /// varies by tens of percent, more than one verify row costs, yet a point measured 60
    /// records ago keeps a tenth of its say.
    fn default() -> Self {
        MeasuredCost::new(0.05)
    }
}

impl CostModel for MeasuredCost {
    fn record_verify(&self, rows: usize, seconds: f64) {
        self.with(|c| c.verify.record(rows, seconds));
    }

    fn record_draft(&self, asked: usize, seconds: f64) {
        self.with(|c| c.draft.record(asked, seconds));
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
            w.record(2, 1.0);
        }
        w.record(4, 3.0);
        w.record(6, 3.0);
        // Weighted means x 3.2, y 1.8; sxx 12.8, sxy 7.2: slope 0.5625, intercept 0.
        let (a, b) = w.line().unwrap();
        assert!((b - 0.5625).abs() < 1e-12 && a.abs() < 1e-12, "{a} {b}");
    }

    #[test]
    fn records_age_by_the_curves_clock_and_bad_ones_are_ignored() {
        let m = MeasuredCost::new(0.5);
        m.record_verify(2, 4.0);
        m.record_verify(2, 1.0);
        m.record_verify(2, f64::NAN);
        m.record_verify(2, -1.0);
        m.record_draft(0, 0.25);
        let c = m.curves();
        // The first measurement kept half its weight: (0.5 * 4 + 1) / 1.5.
        assert_eq!(c.verify.at(2.0), Some(2.0));
        assert_eq!((c.verify.len(), c.verify.clock()), (1, 2));
        assert_eq!(c.draft.at(0.0), Some(0.25));
        let fixed = FixedCost(c.clone());
        fixed.record_verify(2, 100.0);
        assert_eq!(fixed.curves(), c);
    }

    #[test]
    fn a_point_left_alone_is_replaced_by_its_next_measurement() {
        let run = |forget: f64| {
            let mut c = CostCurve::forgetting(forget);
            // Many rows measured once, slow (early, or under load); then only one row.
            c.record(8, 10.0);
            for _ in 0..40 {
                c.record(1, 1.0);
                c.record(2, 1.25);
            }
            assert_eq!(c.age(), Some(80));
            c.record(8, 2.75);
            assert_eq!(c.age(), Some(0));
            c
        };
        // Ageing: the stale 10 s is all but gone, and the line runs through the fresh
        // figures (1 s + 0.25 s a row).
        let (a, b) = run(0.05).line().unwrap();
        assert!(
            (b - 0.25).abs() < 0.03 && (a - 0.75).abs() < 0.03,
            "{a} {b}"
        );
        // Without it, the old measurement still weighs as much as the new one.
        let (_, b) = run(0.0).line().unwrap();
        assert!(b > 0.4, "{b}");
        // A never-ageing curve keeps weighing every point; an empty one has no age.
        assert_eq!(CostCurve::default().age(), None);
    }
}
