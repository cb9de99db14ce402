//! `PyProposer`: a Python proposer behind `dyn DraftProposer`.
//!
//! When an object is wrapped, the adapter decides once which of the protocol's methods
//! ([`ProtocolMethod`](crate::speculative::ProtocolMethod)) its class overrides (its
//! attribute differs from `DraftProposer`'s). Only those call Python;
//! every other method runs in Rust: the Rust proposer the class extends (`PromptLookup`, ...)
//! or the protocol's default, without attaching to the interpreter at all.
//!
//! Python is entered only inside `Python::attach` for the call itself. A Python exception
//! becomes `ProposerError::Python` carrying the formatted traceback; a return value that
//! breaks the contract becomes the same error saying what came back. Methods whose Rust
//! signature cannot fail (`needs_comm`, ...) report the problem through
//! `sys.unraisablehook` and answer with the Rust default.

use super::convert::{as_items, ret_opt_usize, ret_tokens, ret_usize};
use super::device_ptr::PyDevicePtr;
use super::errors::ProposerError as PyProposerError;
use super::model::PyForwardContext;
use super::proposer::{PyDraftProposer, ABSTRACT};
use super::state::{with_rust_state, PyHeldState, PyProposerState};
use crate::backend::DevicePtr;
use crate::model::ForwardContext;
use crate::speculative::{DraftProposer, ProposerError, ProposerState};
use crate::Result;
use numpy::PyArray1;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use std::sync::Arc;

/// A protocol method, as the adapter names them.
pub(super) use crate::speculative::ProtocolMethod as M;

/// A Python proposer as a Rust `DraftProposer`.
pub struct PyProposer {
    obj: Py<PyAny>,
    class: String,
    /// The interned method name for each method the class overrides; `None` runs Rust.
    overrides: Vec<Option<Py<PyString>>>,
    /// The Rust proposer the class extends, if any.
    pub(super) rust: Option<Arc<dyn DraftProposer>>,
}

/// The Rust proposer for a Python `DraftProposer` instance: the Rust proposer itself when the
/// class overrides nothing, otherwise an adapter that calls the overridden methods.
pub fn wrap(obj: &Bound<'_, PyAny>) -> PyResult<Arc<dyn DraftProposer>> {
    let base = obj.cast::<PyDraftProposer>().map_err(|_| {
        PyTypeError::new_err(format!(
            "expected a proposer (an instance of a specdraft.DraftProposer subclass), got {}",
            super::backend::type_name(obj)
        ))
    })?;
    let py = obj.py();
    let cls = obj.get_type();
    let mine = overridden(obj)?;
    let overrides: Vec<Option<Py<PyString>>> = M::NAMES
        .iter()
        .map(|name| {
            mine.contains(name)
                .then(|| PyString::intern(py, name).unbind())
        })
        .collect();
    let rust = base.get().inner.clone();
    let class = cls
        .qualname()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    match &rust {
        Some(inner) if overrides.iter().all(Option::is_none) => return Ok(inner.clone()),
        Some(_) => {}
        None => {
            let missing: Vec<&str> = M::ALL[..M::REQUIRED]
                .iter()
                .filter(|m| overrides[m.index()].is_none())
                .map(|m| m.name())
                .collect();
            if !missing.is_empty() {
                return Err(PyProposerError::new_err(format!(
                    "Python proposer {class} does not define {}; a DraftProposer subclass must define alloc_state, propose and after_verify",
                    missing.join(", ")
                )));
            }
        }
    }
    Ok(Arc::new(PyProposer {
        obj: obj.clone().unbind(),
        class,
        overrides,
        rust,
    }))
}

/// The protocol methods `obj`'s class defines itself (in Python), in protocol order.
pub fn overridden(obj: &Bound<'_, PyAny>) -> PyResult<Vec<&'static str>> {
    let cls = obj.get_type();
    let base_ty = obj.py().get_type::<PyDraftProposer>();
    let mut out = Vec::new();
    for name in M::NAMES {
        if !cls.getattr(name)?.is(&base_ty.getattr(name)?) {
            out.push(name);
        }
    }
    Ok(out)
}

/// The formatted traceback of `err`, as Python prints it.
pub fn format_traceback(py: Python<'_>, err: &PyErr) -> String {
    let formatted = py.import("traceback").and_then(|tb| {
        let lines = tb.call_method1(
            "format_exception",
            (err.get_type(py), err.value(py), err.traceback(py)),
        )?;
        let parts: Vec<String> = lines.extract()?;
        Ok(parts.concat())
    });
    match formatted {
        Ok(text) => text.trim_end().to_string(),
        Err(_) => err.to_string(),
    }
}

pub(super) fn held(state: &mut dyn ProposerState, m: M) -> Result<&PyHeldState> {
    state.as_any().downcast_ref::<PyHeldState>().ok_or_else(|| {
        ProposerError::WrongState {
            method: m.name(),
            expected: "state returned by this Python proposer's alloc_state",
        }
        .into()
    })
}

impl PyProposer {
    pub(super) fn python(&self, m: M) -> bool {
        self.overrides[m.index()].is_some()
    }

    pub(super) fn fallback(&self) -> &dyn DraftProposer {
        match &self.rust {
            Some(p) => &**p,
            None => &ABSTRACT,
        }
    }

    pub(super) fn error(&self, m: M, message: String) -> crate::Error {
        ProposerError::Python {
            method: m.name().to_string(),
            class: self.class.clone(),
            message,
        }
        .into()
    }

    pub(super) fn bad_return(&self, m: M, what: String) -> crate::Error {
        self.error(m, format!("{} returned {what}", m.name()))
    }

    /// Calls the Python override of `m`.
    pub(super) fn call<'py>(
        &self,
        py: Python<'py>,
        m: M,
        args: impl pyo3::call::PyCallArgs<'py>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> Result<Bound<'py, PyAny>> {
        let name = self.overrides[m.index()]
            .as_ref()
            .ok_or_else(|| self.error(m, "not overridden".into()))?
            .bind(py);
        self.obj
            .bind(py)
            .call_method(name, args, kwargs)
            .map_err(|e| self.error(m, format_traceback(py, &e)))
    }

    /// Reports a failure of a method that cannot return an error.
    pub(super) fn unraisable(&self, py: Python<'_>, err: crate::Error) {
        PyProposerError::new_err(format!("{err} (the Rust default was used instead)"))
            .write_unraisable(py, Some(self.obj.bind(py)));
    }

    /// Runs an infallible method's override, falling back to `default` on failure.
    pub(super) fn infallible<T>(
        &self,
        _m: M,
        f: impl for<'py> FnOnce(Python<'py>) -> Result<T>,
        default: impl FnOnce() -> T,
    ) -> T {
        Python::attach(|py| match f(py) {
            Ok(v) => v,
            Err(e) => {
                self.unraisable(py, e);
                default()
            }
        })
    }

    /// Holds what a Python `alloc_state` returned: any object, `None` included (a
    /// proposer without per-sequence state), which is passed back to each method as is.
    pub(super) fn hold(obj: &Bound<'_, PyAny>) -> Box<dyn ProposerState> {
        Box::new(PyHeldState::new(obj))
    }

    pub(super) fn wrap_rust_state(
        &self,
        state: Box<dyn ProposerState>,
    ) -> Result<Box<dyn ProposerState>> {
        Python::attach(|py| {
            let obj = Bound::new(py, PyProposerState::new(state, &self.class))
                .map_err(|e| self.error(M::AllocState, e.to_string()))?;
            Ok(Box::new(PyHeldState::new(obj.as_any())) as Box<dyn ProposerState>)
        })
    }

    pub(super) fn ctx_obj<'py>(
        &self,
        py: Python<'py>,
        ctx: &ForwardContext<'_>,
        m: M,
    ) -> Result<Bound<'py, PyForwardContext>> {
        Bound::new(py, PyForwardContext::from_ctx(ctx)).map_err(|e| self.error(m, e.to_string()))
    }

    pub(super) fn obj_err<T>(&self, m: M, r: PyResult<T>) -> Result<T> {
        r.map_err(|e| self.error(m, e.to_string()))
    }

    /// An infallible method that takes a state: in Rust unless overridden; any failure is
    /// reported as unraisable and answered with `default`.
    pub(super) fn state_query<T>(
        &self,
        m: M,
        state: &mut dyn ProposerState,
        rust: impl FnOnce(&dyn DraftProposer, &mut dyn ProposerState) -> T,
        python: impl for<'py> FnOnce(Python<'py>, &Bound<'py, PyAny>) -> Result<T>,
        default: impl FnOnce() -> T,
    ) -> T {
        if !self.python(m) {
            return match with_rust_state(state, m.name(), |s| Ok(rust(self.fallback(), s))) {
                Ok(v) => v,
                Err(e) => {
                    Python::attach(|py| self.unraisable(py, e));
                    default()
                }
            };
        }
        match held(state, m) {
            Ok(st) => self.infallible(m, |py| python(py, st.obj.bind(py)), default),
            Err(e) => {
                Python::attach(|py| self.unraisable(py, e));
                default()
            }
        }
    }

    /// Checks what a Python `take_drafter_kv` returned.
    #[allow(clippy::type_complexity)]
    pub(super) fn taken_kv(
        &self,
        r: &Bound<'_, PyAny>,
    ) -> Result<Option<(Vec<u32>, usize, Option<usize>)>> {
        let m = M::TakeDrafterKv;
        if r.is_none() {
            return Ok(None);
        }
        let expected = "None or a (blocks, rows, last_pair_key) tuple";
        let items = as_items(r, expected).map_err(|e| self.bad_return(m, e))?;
        if items.len() != 3 {
            return Err(self.bad_return(m, format!("{} items, expected {expected}", items.len())));
        }
        let blocks: Vec<u32> = items[0]
            .extract()
            .map_err(|_| self.bad_return(m, "blocks that are not a list of block ids".into()))?;
        let rows = ret_usize(&items[1]).map_err(|e| self.bad_return(m, format!("rows {e}")))?;
        let key = ret_opt_usize(&items[2])
            .map_err(|e| self.bad_return(m, format!("last_pair_key {e}")))?;
        Ok(Some((blocks, rows, key)))
    }

    /// The keyword arguments of a Python `propose`: only the optional ones that are set.
    pub(super) fn propose_kwargs<'py>(
        &self,
        py: Python<'py>,
        draft_embed_target: Option<DevicePtr>,
        grammar_bitmask: Option<&[i32]>,
        target_hidden_stack: Option<DevicePtr>,
    ) -> Result<Option<Bound<'py, PyDict>>> {
        if draft_embed_target.is_none()
            && grammar_bitmask.is_none()
            && target_hidden_stack.is_none()
        {
            return Ok(None);
        }
        let d = PyDict::new(py);
        let r: PyResult<()> = (|| {
            if let Some(p) = draft_embed_target {
                d.set_item("draft_embed_target", PyDevicePtr(p))?;
            }
            if let Some(mask) = grammar_bitmask {
                d.set_item("grammar_bitmask", PyArray1::from_slice(py, mask))?;
            }
            if let Some(p) = target_hidden_stack {
                d.set_item("target_hidden_stack", PyDevicePtr(p))?;
            }
            Ok(())
        })();
        self.obj_err(M::Propose, r)?;
        Ok(Some(d))
    }

    /// Checks what a Python `propose_batch` returned for `n` sequences.
    pub(super) fn batch_drafts(
        &self,
        r: &Bound<'_, PyAny>,
        n: usize,
        num_drafts: usize,
        vocab_size: usize,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        let m = M::ProposeBatch;
        if r.is_none() {
            return Ok(None);
        }
        let expected = "None or one list of token ids per sequence";
        let rows = as_items(r, expected).map_err(|e| self.bad_return(m, e))?;
        if rows.len() != n {
            return Err(self.bad_return(
                m,
                format!("{} lists of drafts for {n} sequences", rows.len()),
            ));
        }
        let mut drafts = Vec::with_capacity(n);
        for (i, row) in rows.iter().enumerate() {
            let d = ret_tokens(row, Some((num_drafts, "num_drafts")), vocab_size)
                .map_err(|e| self.bad_return(m, format!("for sequence {i}: {e}")))?;
            drafts.push(d);
        }
        Ok(Some(drafts))
    }
}
