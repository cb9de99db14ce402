//! The conformance report: which checks ran and every contract a proposer broke.

use std::fmt;

/// One broken contract.
#[derive(Clone, Debug, PartialEq)]
pub struct Violation {
    /// The check that found it (`"propose: draft count"`, `"free_state: leak"`, ...).
    pub check: String,
    /// What happened.
    pub message: String,
    /// What the proposer's author should change.
    pub fix: String,
}

/// The outcome of [`check_proposer`](super::check_proposer).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConformanceReport {
    /// The label of the proposer checked.
    pub proposer: String,
    /// Names of the checks that ran.
    pub checks_run: Vec<String>,
    /// Every broken contract found.
    pub violations: Vec<Violation>,
}

impl ConformanceReport {
    /// Whether no contract was broken.
    pub fn is_ok(&self) -> bool {
        self.violations.is_empty()
    }

    pub(super) fn ran(&mut self, check: &str) {
        if !self.checks_run.iter().any(|c| c == check) {
            self.checks_run.push(check.to_string());
        }
    }

    pub(super) fn violate(&mut self, check: &str, message: impl Into<String>, fix: &str) {
        let message = message.into();
        // The same failure repeated every step says nothing new.
        if !self
            .violations
            .iter()
            .any(|v| v.check == check && v.message == message)
        {
            self.violations.push(Violation {
                check: check.to_string(),
                message,
                fix: fix.to_string(),
            });
        }
    }
}

impl fmt::Display for ConformanceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_ok() {
            return write!(
                f,
                "{}: all {} checks passed",
                self.proposer,
                self.checks_run.len()
            );
        }
        writeln!(
            f,
            "{}: {} broken contract(s) in {} checks",
            self.proposer,
            self.violations.len(),
            self.checks_run.len()
        )?;
        for v in &self.violations {
            writeln!(f, "- [{}] {}\n  fix: {}", v.check, v.message, v.fix)?;
        }
        Ok(())
    }
}
