//! Exploration: the verify rows the policy spends to learn rather than to gain, and the
//! refresh of a stale verify cost.
//!
//! Invariants:
//! - Probes that are exploration (see `probes`) and refreshes are paid from one
//!   engine-wide budget: each step earns [`EXPLORE_SHARE`] of its measured verify cost, in
//!   verify rows at the measured cost a row; one row can be banked. A probe needs and
//!   spends a row; a refresh needs one and spends all the rows it adds, into debt that
//!   later steps pay off. Over a run exploration therefore costs about that share of the
//!   verify time at any batch width (the sequences of a wide batch would otherwise each
//!   explore on their own).
//! - The verify cost's measurements age (see `cost_model`). When the widest row count
//!   measured is [`REFRESH_AGE`] records old or more and the step would draft more at a
//!   cheaper cost a row (the fitted one halved once and again for every [`REFRESH_AGE`]
//!   records of that age, never below the floor), the step is planned at that cost, so
//!   the wide end of the line is measured again, at most once in [`REFRESH_AGE`] records.
//!   A drafter that would not pay even at the floor (one that is never right) is never
//!   refreshed for.

use super::super::cost_model::CostCurve;
use super::row_cost::{Choice, RowCost};
use super::Outlook;

/// Share of each step's verify cost that exploration (probes, refreshes) may spend.
/// Measured by its test: eight sequences whose drafts always fail spend no more than this
/// share of 400 steps' verify cost on probes, and at least half of it, so they could
/// still recover; at 1% a drafter that is never right costs about 1% at any batch width.
pub(super) const EXPLORE_SHARE: f64 = 0.01;
/// Verify records after which the widest measured row count is stale and, where cheaper
/// rows would change the choice, measured again (at most once in as many records). A
/// bench engine runs a few hundred steps, so an early measurement taken under load must be
/// corrected within a few dozen: the refresh test has an oracle held at no drafts by such
/// a figure draft its whole budget again within `2 * REFRESH_AGE` steps.
pub(super) const REFRESH_AGE: u64 = 32;

/// The engine's exploration account.
#[derive(Debug, Default)]
pub(super) struct Exploration {
    /// The verify curve's clock at the last refresh of its wide end.
    refreshed_at: u64,
    /// Verify rows spent beyond what was earned: at most one row is banked (0), and a
    /// refresh may leave a debt (above 1) that later steps pay off before the next probe.
    owed: f64,
}

impl Exploration {
    /// Earns this step's share at `cost` and returns the rows exploration may spend now
    /// (below 1: none; hand what is left to [`Exploration::settle`]).
    pub(super) fn earn(&mut self, cost: &RowCost) -> f64 {
        let earned = EXPLORE_SHARE * cost.base_cost / cost.per_row.max(1e-12);
        self.owed = (self.owed - earned).max(0.0);
        1.0 - self.owed
    }

    /// Records what is left of this step's credit after its exploration.
    pub(super) fn settle(&mut self, credit: f64) {
        self.owed = 1.0 - credit;
    }

    /// Plans the step at a cheaper row cost where a refresh of `verify`'s wide end is due,
    /// would draft more and `credit` affords a row; the refresh's added rows are paid from
    /// `credit`, into debt if need be (it measures many rows at once). Otherwise `cost` and
    /// `choice` come back as they were.
    pub(super) fn refresh(
        &mut self,
        verify: &CostCurve,
        cost: RowCost,
        choice: Choice,
        outlooks: &[Outlook],
        credit: &mut f64,
    ) -> (RowCost, Choice) {
        let Some(cheap) = self.cheaper(verify, cost) else {
            return (cost, choice);
        };
        let alt = cheap.best(outlooks);
        if alt.k.iter().sum::<usize>() > choice.k.iter().sum::<usize>() && *credit >= 1.0 {
            *credit -= alt.rows - choice.rows;
            self.refreshed_at = verify.clock();
            return (cheap, alt);
        }
        (cost, choice)
    }

    /// The cheaper row cost a refresh of `verify`'s wide end supposes, when one is due:
    /// halved once, and once more for every [`REFRESH_AGE`] records the widest point has
    /// gone unmeasured (the staler the line, the further off it may be), never below the
    /// floor. A bench engine runs a few hundred steps, so the first refresh must already
    /// suppose rows several times cheaper.
    fn cheaper(&self, verify: &CostCurve, cost: RowCost) -> Option<RowCost> {
        let age = verify.age().filter(|&age| age >= REFRESH_AGE)?;
        let rested = verify.clock().saturating_sub(self.refreshed_at) >= REFRESH_AGE;
        let halvings = (1.0 + age as f64 / REFRESH_AGE as f64).min(64.0);
        let cheaper = 0.5f64.powf(halvings);
        let floor = cost.floor();
        rested.then(|| RowCost {
            per_row: (cost.per_row * cheaper).max(floor),
            per_row_past: (cost.per_row_past * cheaper).max(floor),
            ..cost
        })
    }
}
