//! The checker's guard: every proposer call runs through [`guarded`], so an error or a
//! panic becomes a violation in the report (with what the author should change) instead
//! of ending the check.

use super::ConformanceReport;
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
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string payload".into());
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
