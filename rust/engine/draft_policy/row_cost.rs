//! What a step's verify rows cost, as the policy reads the measured curve, and the counts
//! that maximise a step's expected tokens per second at that cost.
//!
//! Invariants:
//! - A row is never read as cheaper than [`MIN_ROW_SHARE`] of the plain forward's cost a
//!   row, so noise cannot make a useless drafter look free.
//! - Past the fitted curve's knee (see `cost_fit`) rows are priced at its steeper slope,
//!   so a wide batch's drafts pay for what its last rows really cost.
//! - [`RowCost::best`] is a pure function of the cost and the outlooks: the counts of a
//!   step's sequences share one forward, so they are chosen together, one sequence at a
//!   time against the others' current choice, for at most [`ROUNDS`] rounds.
//! - A chosen count is never above its outlook's budget, and a count is changed only for
//!   a strictly better rate, so a tie keeps the smaller count.

use super::super::cost_fit::CostFit;
use super::super::cost_model::CostCurve;
use super::Outlook;

/// The least a verify row is taken to cost, as a share of the base forward's cost a row.
/// Measured: on a loaded machine the noise in the measured slope clamped it to zero, and
/// a drafter whose drafts were random then asked for a draft on most steps. 5% is below
/// the slopes measured on the default model on the CPU backend (a verify row adds about 6%
/// of a one-row forward's cost at 2 rows, about 20% past 8 rows) and above that noise.
pub(super) const MIN_ROW_SHARE: f64 = 0.05;
/// Rounds of choosing each sequence's count against the others'. Each round can only
/// raise the step's rate and a round that changes nothing ends the search; the cap only
/// bounds a plan's work (a judgement, not a measured figure).
const ROUNDS: usize = 4;

/// The verify cost the policy reads: the fitted cost at the step's base rows, plus
/// `per_row` for each row beyond them up to `knee` and `per_row_past` for each row past it
/// (the fitted curve's bend, see `cost_fit`; `knee` infinite where it has none).
#[derive(Clone, Copy)]
pub(super) struct RowCost {
    pub base_rows: f64,
    pub base_cost: f64,
    pub per_row: f64,
    pub knee: f64,
    pub per_row_past: f64,
}

/// A step's counts and what they add up to: expected tokens, expected verify rows and
/// drafting seconds.
pub(super) struct Choice {
    pub k: Vec<usize>,
    pub tokens: f64,
    pub rows: f64,
    pub draft: f64,
}

impl RowCost {
    /// The cost `verify`'s fit gives a step of `base_rows` plain rows and the rows added
    /// to it, each slope at least [`MIN_ROW_SHARE`] of the plain forward's cost a row.
    pub(super) fn measured(verify: &CostCurve, base_rows: usize) -> RowCost {
        let fit = verify.fit().unwrap_or(CostFit::flat(0.0));
        let base_cost = fit.at(base_rows as f64);
        let floor = MIN_ROW_SHARE * base_cost / base_rows as f64;
        RowCost::from_fit(fit, base_rows as f64, base_cost, floor)
    }

    /// The fitted verify cost from `base_rows` (where it is `base_cost`) on, neither slope
    /// below `floor`.
    fn from_fit(fit: CostFit, base_rows: f64, base_cost: f64, floor: f64) -> Self {
        let past = fit.slope_at(f64::INFINITY).max(floor);
        let knee = fit.knee.max(base_rows);
        RowCost {
            base_rows,
            base_cost,
            per_row: fit.slope_at(base_rows).max(floor),
            knee,
            per_row_past: past,
        }
    }

    /// The least a row is read to cost (see [`MIN_ROW_SHARE`]).
    pub(super) fn floor(&self) -> f64 {
        MIN_ROW_SHARE * self.base_cost / self.base_rows
    }

    fn verify(&self, rows: f64) -> f64 {
        let near = rows.min(self.knee) - self.base_rows;
        let past = (rows - self.knee).max(0.0);
        (self.base_cost + self.per_row * near + self.per_row_past * past).max(0.0)
    }

    /// The cost of one more row at `rows`.
    pub(super) fn marginal(&self, rows: f64) -> f64 {
        if rows >= self.knee {
            self.per_row_past
        } else {
            self.per_row
        }
    }

    /// Expected tokens per second.
    pub(super) fn rate(&self, tokens: f64, rows: f64, draft: f64) -> f64 {
        tokens / (self.verify(rows) + draft).max(1e-12)
    }

    /// The counts that maximise the step's rate, each sequence chosen against the others'
    /// current choice until none changes.
    pub(super) fn best(&self, outlooks: &[Outlook]) -> Choice {
        let mut c = Choice {
            k: vec![0; outlooks.len()],
            tokens: self.base_rows,
            rows: self.base_rows,
            draft: outlooks.iter().map(|o| o.draft[0]).sum(),
        };
        for _ in 0..ROUNDS {
            let mut changed = false;
            for (i, o) in outlooks.iter().enumerate() {
                c.tokens -= o.gain[c.k[i]];
                c.rows -= o.rows[c.k[i]];
                c.draft -= o.draft[c.k[i]];
                let mut best = 0;
                let mut best_rate = self.rate(c.tokens, c.rows, c.draft + o.draft[0]);
                for n in 1..o.gain.len() {
                    let r = self.rate(
                        c.tokens + o.gain[n],
                        c.rows + o.rows[n],
                        c.draft + o.draft[n],
                    );
                    if r > best_rate * (1.0 + 1e-9) {
                        best = n;
                        best_rate = r;
                    }
                }
                changed |= best != c.k[i];
                c.k[i] = best;
                c.tokens += o.gain[best];
                c.rows += o.rows[best];
                c.draft += o.draft[best];
            }
            if !changed {
                break;
            }
        }
        c
    }
}
