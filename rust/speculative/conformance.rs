//! Conformance checking.
