//! The policy's first steps, before the verify cost's slope is known.
//!
//! Invariants:
//! - With no verify cost measured, one sequence (the first with a budget) is asked for its
//!   whole budget and the others for none, so the step measures a few more rows than a
//!   plain one however wide the batch. A step of every sequence's budget would cost
//!   several plain steps at batch 8 (measured when cold start asked every sequence).
//! - With one row count measured, the next step measures the other end: that draft if the
//!   plain row count was measured, none otherwise. So two row counts are known before the
//!   policy relies on the cost's slope.
//! - From two measured row counts on, the cold start has nothing to say.

use super::super::cost_model::CostCurve;

/// The counts of a cold step for sequences with `budgets` in a step of `base_rows` plain
/// rows, or `None` once `verify` has two row counts measured.
pub(super) fn cold_counts(
    verify: &CostCurve,
    base_rows: usize,
    budgets: impl ExactSizeIterator<Item = usize>,
) -> Option<Vec<usize>> {
    let budgets: Vec<usize> = budgets.collect();
    let drafting = || {
        let mut k = vec![0; budgets.len()];
        if let Some(i) = budgets.iter().position(|&b| b > 0) {
            k[i] = budgets[i];
        }
        k
    };
    match verify.len() {
        0 => Some(drafting()),
        1 if verify.first_x() == Some(base_rows) => Some(drafting()),
        1 => Some(vec![0; budgets.len()]),
        _ => None,
    }
}
