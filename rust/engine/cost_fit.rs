//! Fitting a cost curve through its measured points: the straight line the policy has
//! always read, or a line with one knee where the points bend upwards.
//!
//! Points are `(x, mean seconds, weight)`, in order of `x`, each weighing its measurements
//! (see `cost_model`). Every fit's slopes are at least 0 and its cost is read as never
//! below 0; with one point it is flat; with none there is no fit.
//!
//! A verify forward's cost is not one line on every machine: rows are nearly free while a
//! step waits on its weights, then each costs its arithmetic once the kernels turn compute
//! bound. A straight line through such points overstates the first rows and understates the
//! later ones, so a wide batch drafts too much. [`fit`] therefore also tries a
//! line with one knee at a measured abscissa, steeper past it, and keeps it only where it
//! rests on at least [`BEND_MIN_POINTS`] points on each side and cuts the straight line's
//! weighted squared error to at most [`BEND_GAIN`] of it: a bend that noise alone could draw
//! is not taken.

/// Fewest measured abscissas on each side of a knee (at or below it, and above it).
pub const BEND_MIN_POINTS: usize = 2;

/// The share of the straight line's weighted squared error a bent fit must get under.
pub const BEND_GAIN: f64 = 0.5;

/// A fitted cost: `intercept + slope * x`, plus `bend * (x - knee)` past `knee` (`bend` 0
/// and `knee` infinite for a straight line). Every slope is at least 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostFit {
    /// The cost at 0.
    pub intercept: f64,
    /// The cost of one more unit up to `knee`.
    pub slope: f64,
    /// Where the slope steepens (a measured abscissa; infinite for a straight line).
    pub knee: f64,
    /// How much steeper it is past `knee`.
    pub bend: f64,
}

impl CostFit {
    /// A cost of `seconds` whatever `x`.
    pub fn flat(seconds: f64) -> Self {
        CostFit::straight(seconds, 0.0)
    }

    fn straight(intercept: f64, slope: f64) -> Self {
        CostFit {
            intercept,
            slope,
            knee: f64::INFINITY,
            bend: 0.0,
        }
    }

    fn raw(&self, x: f64) -> f64 {
        self.intercept + self.slope * x + self.bend * (x - self.knee).max(0.0)
    }

    /// The cost at `x`, never below zero.
    pub fn at(&self, x: f64) -> f64 {
        self.raw(x).max(0.0)
    }

    /// The cost of one more unit at `x`: the slope there (the steeper one from the knee on).
    pub fn slope_at(&self, x: f64) -> f64 {
        self.slope + if x >= self.knee { self.bend } else { 0.0 }
    }
}

/// The weighted least-squares line's `(intercept, slope)` through `points`.
pub(super) fn line(points: &[(f64, f64, f64)]) -> Option<(f64, f64)> {
    if points.is_empty() {
        return None;
    }
    let (mut sw, mut sx, mut sy) = (0.0, 0.0, 0.0);
    for &(x, y, w) in points {
        sw += w;
        sx += w * x;
        sy += w * y;
    }
    if sw <= 0.0 {
        // Every point aged to nothing (only when forgetting everything at once): the
        // plain mean of the means.
        let n = points.len() as f64;
        return Some((points.iter().map(|p| p.1).sum::<f64>() / n, 0.0));
    }
    let (mx, my) = (sx / sw, sy / sw);
    let (mut sxx, mut sxy) = (0.0, 0.0);
    for &(x, y, w) in points {
        let dx = x - mx;
        sxx += w * dx * dx;
        sxy += w * dx * (y - my);
    }
    let slope = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
    Some((my - slope * mx, slope))
}

/// The fit through `points` (see the module documentation): the straight line, or the
/// bent one where it is clearly better.
pub(super) fn fit(points: &[(f64, f64, f64)]) -> Option<CostFit> {
    let (intercept, slope) = line(points)?;
    let straight = CostFit::straight(intercept, slope);
    let error = |f: &CostFit| -> f64 {
        points
            .iter()
            .map(|&(x, y, w)| w * (y - f.raw(x)).powi(2))
            .sum()
    };
    let mut best = (BEND_GAIN * error(&straight), straight);
    let knees = BEND_MIN_POINTS - 1..points.len().saturating_sub(BEND_MIN_POINTS);
    for i in knees {
        let Some(bent) = fit_knee(points, points[i].0) else {
            continue;
        };
        if bent.slope >= 0.0 && bent.bend > 0.0 {
            let e = error(&bent);
            if e < best.0 {
                best = (e, bent);
            }
        }
    }
    Some(best.1)
}

/// The weighted least-squares fit of `a + b x + c max(0, x - knee)` to `(x, y, weight)`
/// points; `None` where the points cannot tell the three apart.
fn fit_knee(points: &[(f64, f64, f64)], knee: f64) -> Option<CostFit> {
    // The normal equations of the three regressors, augmented with the right-hand side and
    // solved by Gauss-Jordan elimination with partial pivoting (a 3x3 system: no
    // linear-algebra crate is worth its weight here).
    let mut m = [[0.0f64; 4]; 3];
    for &(x, y, w) in points {
        let r = [1.0, x, (x - knee).max(0.0), y];
        for (row, &ri) in m.iter_mut().zip(&r) {
            for (cell, &rj) in row.iter_mut().zip(&r) {
                *cell += w * ri * rj;
            }
        }
    }
    let tolerance = 1e-12 * (m[0][0] + m[1][1] + m[2][2]);
    for col in 0..3 {
        let pivot = (col..3).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
        m.swap(col, pivot);
        let lead = m[col];
        if lead[col].abs() <= tolerance {
            return None;
        }
        for (i, row) in m.iter_mut().enumerate() {
            if i != col {
                let f = row[col] / lead[col];
                for (cell, &l) in row.iter_mut().zip(&lead).skip(col) {
                    *cell -= f * l;
                }
            }
        }
    }
    Some(CostFit {
        intercept: m[0][3] / m[0][0],
        slope: m[1][3] / m[1][1],
        knee,
        bend: m[2][3] / m[2][2],
    })
}

#[cfg(test)]
/// A measured curve (tests): flat (0.01 s a row) up to 8 rows, then 0.1 s a row.
pub(super) const BENT: [(usize, f64); 10] = [
    (1, 1.0),
    (2, 1.01),
    (3, 1.02),
    (4, 1.03),
    (5, 1.04),
    (6, 1.05),
    (7, 1.06),
    (8, 1.07),
    (10, 1.27),
    (12, 1.47),
];

#[cfg(test)]
/// The least-squares line through [`BENT`] (numpy's `polyfit`).
pub(super) const BENT_LINE: (f64, f64) = (0.8887096774193551, 0.03677419354838708);

#[cfg(test)]
mod tests {
    use super::super::cost_model::CostCurve;
    use super::*;

    fn close(got: f64, want: f64) {
        assert!((got - want).abs() < 1e-9, "{got} against {want}");
    }

    #[test]
    fn a_curve_that_bends_upwards_is_read_with_its_knee() {
        let bent = CostCurve::from_points(BENT);
        let (a, b) = bent.line().unwrap();
        close(a, BENT_LINE.0);
        close(b, BENT_LINE.1);
        let f = bent.fit().unwrap();
        assert_eq!(f.knee, 8.0);
        close(f.intercept, 0.99);
        close(f.slope, 0.01);
        close(f.bend, 0.09);
        close(f.slope_at(4.0), 0.01);
        close(f.slope_at(9.0), 0.1);
        close(bent.at(4.0).unwrap(), 1.03);
        close(bent.at(12.0).unwrap(), 1.47);
        close(bent.at(16.0).unwrap(), 1.87);
        // A line with a wiggle a knee cannot explain (the best one leaves 99% of the error).
        let wiggle = CostCurve::from_points((1..=8).map(|x| {
            (
                x,
                1.0 + 0.25 * x as f64 + [-0.01, 0.01][usize::from(x % 2 == 0)],
            )
        }));
        let f = wiggle.fit().unwrap();
        assert_eq!((f.bend, f.knee), (0.0, f64::INFINITY));
        assert_eq!(wiggle.line(), Some((f.intercept, f.slope)));
        // Steep, then flat: a knee would fit it exactly, but downwards, so it stays straight.
        let concave =
            CostCurve::from_points([(1, 1.0), (2, 1.5), (3, 2.0), (4, 2.05), (5, 2.1), (6, 2.15)]);
        assert_eq!(concave.fit().unwrap().bend, 0.0);
        // Fewer than two points on each side of every knee: straight, however sharp the bend.
        let three = CostCurve::from_points([(1, 1.0), (2, 1.0), (3, 5.0)]);
        assert_eq!(three.fit().unwrap().bend, 0.0);
        let four = CostCurve::from_points([(1, 1.0), (2, 1.0), (3, 5.0), (4, 9.0)]);
        let f = four.fit().unwrap();
        assert_eq!(f.knee, 2.0);
        close(f.at(4.0), 9.0);
    }
}
