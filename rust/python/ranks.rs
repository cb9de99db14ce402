//! The Python side of multi-rank serving: a worker's loop and rank 0's shutdown, for
//! `SpecEngine.run_worker()` and `SpecEngine.close()`.

use super::errors::IntoPyResult;
use crate::engine::ranks::{run_worker_with, shutdown_workers};
use crate::model::{ModelLevers, TargetModel};
use crate::speculative::DraftProposer;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Serves rank 0 until it shuts the workers down, with the interpreter released, and
/// returns the worker's report as a dict. `proposer` runs rank 0's announced proposer
/// calls (a head whose experts are split across the ranks) under `levers`.
pub(super) fn serve<'py>(
    py: Python<'py>,
    model: Arc<TargetModel>,
    proposer: Option<Arc<dyn DraftProposer>>,
    levers: ModelLevers,
) -> PyResult<Bound<'py, PyDict>> {
    let report = py
        .detach(move || run_worker_with(&model, proposer.as_deref(), levers))
        .py()?;
    let d = PyDict::new(py);
    d.set_item("commands", report.commands)?;
    d.set_item("by_kind", report.by_kind)?;
    d.set_item("failed", report.failed)?;
    d.set_item("last_error", report.last_error)?;
    d.set_item("leftover_sequences", report.leftover_sequences)?;
    Ok(d)
}

/// Sends the workers the shutdown, once per `closed` flag; nothing on one rank or a worker.
pub(super) fn close(py: Python<'_>, model: &TargetModel, closed: &AtomicBool) -> PyResult<()> {
    if closed.swap(true, Ordering::SeqCst) {
        return Ok(());
    }
    py.detach(|| shutdown_workers(model)).py()
}
