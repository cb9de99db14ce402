//! Shared by the conformance-checker tests: asserting that a report names a violation.

use specdraft::speculative::conformance::ConformanceReport;

/// Asserts that `report` holds a violation of `check` whose message mentions `words`, and
/// that it says how to fix it.
pub fn assert_reported(report: &ConformanceReport, check: &str, words: &str) {
    let hit = report
        .violations
        .iter()
        .find(|v| v.check == check && v.message.contains(words));
    assert!(
        hit.is_some(),
        "expected [{check}] mentioning {words:?}, got:\n{report}"
    );
    assert!(!hit.unwrap().fix.is_empty());
}
