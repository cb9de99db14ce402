//! `specdraft.check_proposer`: the conformance checker for any proposer, Rust or Python.
//!
//! The check runs with the interpreter released, so a Python proposer is driven exactly as
//! the engine drives it: through `dyn DraftProposer`, attaching only for its own methods.

use super::adapter::wrap;
use super::backend::{backend_arg, type_name};
use super::errors::request_error;
use super::proposer::PyDraftProposer;
use crate::backend::{CpuBackend, GpuBackend};
use crate::speculative::conformance::{
    check_proposer_on, CheckOptions, ConformanceReport, Violation,
};
use pyo3::prelude::*;
use std::sync::Arc;

/// One broken contract: which check, what happened, how to fix it.
#[pyclass(
    name = "Violation",
    module = "specdraft",
    frozen,
    get_all,
    skip_from_py_object
)]
#[derive(Clone)]
pub struct PyViolation {
    /// The check that failed.
    pub check: String,
    /// What happened.
    pub message: String,
    /// What to change.
    pub fix: String,
}

#[pymethods]
impl PyViolation {
    fn __repr__(&self) -> String {
        format!(
            "Violation(check={:?}, message={:?})",
            self.check, self.message
        )
    }

    fn __str__(&self) -> String {
        format!("[{}] {}\n    fix: {}", self.check, self.message, self.fix)
    }
}

impl From<&Violation> for PyViolation {
    fn from(v: &Violation) -> Self {
        PyViolation {
            check: v.check.clone(),
            message: v.message.clone(),
            fix: v.fix.clone(),
        }
    }
}

/// What `check_proposer` found; true when no contract was broken.
#[pyclass(name = "ConformanceReport", module = "specdraft", frozen)]
pub struct PyConformanceReport {
    inner: ConformanceReport,
}

#[pymethods]
impl PyConformanceReport {
    /// The proposer's name.
    #[getter]
    fn proposer(&self) -> String {
        self.inner.proposer.clone()
    }

    /// The names of the checks that ran.
    #[getter]
    fn checks_run(&self) -> Vec<String> {
        self.inner.checks_run.clone()
    }

    /// Every broken contract.
    #[getter]
    fn violations(&self) -> Vec<PyViolation> {
        self.inner
            .violations
            .iter()
            .map(PyViolation::from)
            .collect()
    }

    /// Whether no contract was broken.
    #[getter]
    fn ok(&self) -> bool {
        self.inner.is_ok()
    }

    fn __bool__(&self) -> bool {
        self.inner.is_ok()
    }

    fn __str__(&self) -> String {
        self.inner.to_string()
    }

    fn __repr__(&self) -> String {
        format!(
            "<ConformanceReport {}: {} checks, {} violations>",
            self.inner.proposer,
            self.inner.checks_run.len(),
            self.inner.violations.len()
        )
    }
}

/// Refuses to check a proposer whose weights live on another backend than `gpu`: its
/// kernels would read them through a backend that does not hold them.
fn check_home(proposer: &Bound<'_, PyAny>, gpu: &Arc<dyn GpuBackend>, given: bool) -> PyResult<()> {
    let Ok(base) = proposer.cast::<PyDraftProposer>() else {
        return Ok(());
    };
    let Some(home) = &base.get().home else {
        return Ok(());
    };
    // The data addresses: vtable pointers of one type may differ between codegen units.
    if std::ptr::addr_eq(Arc::as_ptr(home), Arc::as_ptr(gpu)) {
        return Ok(());
    }
    let class = type_name(proposer);
    let which = if given {
        format!("the {} backend passed as gpu=", gpu.name())
    } else {
        format!("a fresh {} backend (no gpu= was given)", gpu.name())
    };
    Err(request_error(format!(
        "check_proposer: this {class}'s weights live on the {} backend it was loaded on, but the \
         check would run on {which}; pass that backend: check_proposer(proposer, gpu=<the backend \
         given to {class}.from_checkpoint>)",
        home.name()
    )))
}

/// Drives `proposer` through the whole lifecycle and reports every broken contract.
///
/// The proposer is driven as the engine would drive it, on synthetic inputs; each
/// violation says what to fix. Runs on `gpu` (a fresh CPU backend by default); nothing
/// else should allocate on it meanwhile, since allocations still live at the end are
/// reported as leaks. A proposer whose weights live on a backend (`MtpHead`) must be
/// checked on that backend: pass it as `gpu=`, else `RequestError` says so.
#[pyfunction]
#[pyo3(signature = (proposer, *, gpu = None, label = None, vocab_size = None, hidden_size = None, num_sequences = None, num_drafts = None, steps = None, seed = None))]
#[allow(clippy::too_many_arguments)]
pub fn check_proposer(
    py: Python<'_>,
    proposer: &Bound<'_, PyAny>,
    gpu: Option<&Bound<'_, PyAny>>,
    label: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    num_sequences: Option<usize>,
    num_drafts: Option<usize>,
    steps: Option<usize>,
    seed: Option<u64>,
) -> PyResult<PyConformanceReport> {
    let given = gpu.is_some();
    let rust = wrap(proposer)?;
    let d = CheckOptions::default();
    let class = proposer
        .get_type()
        .qualname()
        .map(|n| n.to_string())
        .unwrap_or(d.label.clone());
    let options = CheckOptions {
        label: label.unwrap_or(class),
        vocab_size: vocab_size.unwrap_or(d.vocab_size),
        hidden_size: hidden_size.unwrap_or(d.hidden_size),
        num_sequences: num_sequences.unwrap_or(d.num_sequences),
        num_drafts: num_drafts.unwrap_or(d.num_drafts),
        steps: steps.unwrap_or(d.steps),
        seed: seed.unwrap_or(d.seed),
    };
    let gpu: Arc<dyn GpuBackend> = match gpu {
        Some(g) => backend_arg(g)?.get().arc()?,
        None => Arc::new(CpuBackend::new()),
    };
    check_home(proposer, &gpu, given)?;
    let report = py.detach(|| check_proposer_on(&*rust, gpu, &options));
    Ok(PyConformanceReport { inner: report })
}
