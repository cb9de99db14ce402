//! The checker's guard: every proposer call runs through [`guarded`], so an error or a
//! panic becomes a violation in the report (with what the author should change) instead
//! of ending the check.

use super::ConformanceReport;
use crate::error::panic_message;
use std::panic::{catch_unwind, AssertUnwindSafe};

const FIX_ERROR: &str = "return Ok on valid input; an error here ends the sequence in the engine";
const FIX_PANIC: &str =
    "return an error instead of panicking; a panic would cross the FFI boundary";

/// Runs `f`, turning an error or a panic into a violation of `check`.
pub(super) fn guarded<T>(
    report: &mut ConformanceReport,
    check: &str,
    f: impl FnOnce() -> crate::Result<T>,
) -> Option<T> {
    report.ran(check);
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Some(v),
        Ok(Err(e)) => {
            report.violate(check, format!("returned an error: {e}"), FIX_ERROR);
            None
        }
        Err(panic) => {
            let what = panic_message(panic.as_ref()).unwrap_or("a non-string payload");
            report.violate(check, format!("panicked: {what}"), FIX_PANIC);
            None
        }
    }
}

/// Runs an infallible provided method, turning a panic into a violation.
pub(super) fn guarded_value<T>(
    report: &mut ConformanceReport,
    check: &str,
    f: impl FnOnce() -> T,
) -> Option<T> {
    guarded(report, check, || Ok(f()))
}
