//! Proposer state across the language boundary.
//!
//! - [`PyProposerState`] (`specdraft.ProposerState`) is the opaque Python object around a
//!   `Box<dyn ProposerState>` made by a Rust proposer, so Python can hold it and pass it back.
//! - [`PyHeldState`] is the Rust `ProposerState` around whatever object a Python proposer's
//!   `alloc_state` returned, so the engine can hold it like any other state.
//!
//! A state belongs to one sequence. Locks are only ever *tried*: a state already in use (the
//! same state twice in one batch, or two threads at once) is an error, never a wait, so no
//! thread can block on a state lock while attached to the interpreter.

use crate::speculative::{ProposerError, ProposerState};
use crate::Result;
use pyo3::prelude::*;
use std::any::Any;
use std::sync::{Mutex, MutexGuard, TryLockError};

/// Per-sequence state of a Rust proposer, opaque to Python.
#[pyclass(name = "ProposerState", module = "specdraft", frozen)]
pub struct PyProposerState {
    inner: Mutex<Box<dyn ProposerState>>,
    owner: String,
}

impl PyProposerState {
    /// Wraps a state made by `owner`.
    pub fn new(state: Box<dyn ProposerState>, owner: &str) -> Self {
        PyProposerState {
            inner: Mutex::new(state),
            owner: owner.to_string(),
        }
    }

    pub(crate) fn try_lock(&self, method: &str) -> Result<MutexGuard<'_, Box<dyn ProposerState>>> {
        match self.inner.try_lock() {
            Ok(g) => Ok(g),
            // A panic inside a proposer poisons the lock; the state itself is still a value.
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(ProposerError::Failed {
                method: method.to_string(),
                message: format!(
                    "a state of {} is already in use by another call (a state belongs to one sequence: do not pass it twice in a batch or use it from two threads at once)",
                    self.owner
                ),
            }
            .into()),
        }
    }
}

#[pymethods]
impl PyProposerState {
    fn __repr__(&self) -> String {
        format!("<ProposerState of {}>", self.owner)
    }
}

/// A Python proposer's state object, held by Rust.
pub struct PyHeldState {
    /// What the Python `alloc_state` returned.
    pub obj: Py<PyAny>,
    /// The same object when it is a Rust proposer's state (for methods that run in Rust).
    pub rust: Option<Py<PyProposerState>>,
}

impl ProposerState for PyHeldState {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl PyHeldState {
    /// Holds `obj`, noting whether it wraps a Rust state.
    pub fn new(obj: &Bound<'_, PyAny>) -> Self {
        PyHeldState {
            obj: obj.clone().unbind(),
            rust: obj
                .cast::<PyProposerState>()
                .ok()
                .map(|s| s.clone().unbind()),
        }
    }
}

/// A state argument received from Python, ready to be locked without the interpreter.
pub enum StateSrc {
    /// A Rust proposer's state.
    Rust(Py<PyProposerState>),
    /// Any other object (a Python proposer's state).
    Python(PyHeldState),
}

impl StateSrc {
    /// Classifies a Python state argument.
    pub fn from_py(obj: &Bound<'_, PyAny>) -> Self {
        match obj.cast::<PyProposerState>() {
            Ok(s) => StateSrc::Rust(s.clone().unbind()),
            Err(_) => StateSrc::Python(PyHeldState::new(obj)),
        }
    }

    /// Locks the state for one Rust call.
    pub fn lock(&mut self, method: &str) -> Result<StateGuard<'_>> {
        Ok(match self {
            StateSrc::Rust(s) => StateGuard::Rust(s.get().try_lock(method)?),
            StateSrc::Python(h) => StateGuard::Python(h),
        })
    }
}

/// A locked state, usable as `&mut dyn ProposerState`.
pub enum StateGuard<'a> {
    /// A Rust proposer's state, locked.
    Rust(MutexGuard<'a, Box<dyn ProposerState>>),
    /// A Python proposer's state object.
    Python(&'a mut PyHeldState),
}

impl StateGuard<'_> {
    /// The state as the protocol takes it.
    pub fn as_state(&mut self) -> &mut dyn ProposerState {
        match self {
            StateGuard::Rust(g) => &mut ***g,
            StateGuard::Python(h) => &mut **h,
        }
    }
}

/// Runs `f` on the Rust state inside `state` when it wraps one, else on `state` itself.
///
/// This is how a Rust method of a Python subclass reaches the state its Rust base made.
pub fn with_rust_state<R>(
    state: &mut dyn ProposerState,
    method: &str,
    f: impl FnOnce(&mut dyn ProposerState) -> Result<R>,
) -> Result<R> {
    if let Some(held) = state.as_any_mut().downcast_mut::<PyHeldState>() {
        if let Some(rs) = &held.rust {
            let mut g = rs.get().try_lock(method)?;
            return f(&mut **g);
        }
    }
    f(state)
}

fn wraps_rust(state: &dyn ProposerState) -> bool {
    state
        .as_any()
        .downcast_ref::<PyHeldState>()
        .is_some_and(|h| h.rust.is_some())
}

enum Unwrapped<'a> {
    Locked(MutexGuard<'a, Box<dyn ProposerState>>),
    Plain(&'a mut dyn ProposerState),
}

/// [`with_rust_state`] for a batch of states.
pub fn with_rust_states<R>(
    states: &mut [&mut dyn ProposerState],
    method: &str,
    f: impl FnOnce(&mut [&mut dyn ProposerState]) -> Result<R>,
) -> Result<R> {
    let mut unwrapped = Vec::with_capacity(states.len());
    for s in states.iter_mut() {
        let s: &mut dyn ProposerState = &mut **s;
        if wraps_rust(s) {
            let shared: &dyn ProposerState = s;
            let rs = shared
                .as_any()
                .downcast_ref::<PyHeldState>()
                .and_then(|h| h.rust.as_ref())
                .ok_or_else(|| ProposerError::Failed {
                    method: method.to_string(),
                    message: "state changed while being unwrapped".into(),
                })?;
            unwrapped.push(Unwrapped::Locked(rs.get().try_lock(method)?));
        } else {
            unwrapped.push(Unwrapped::Plain(s));
        }
    }
    let mut refs: Vec<&mut dyn ProposerState> = unwrapped
        .iter_mut()
        .map(|u| match u {
            Unwrapped::Locked(g) => {
                let r: &mut dyn ProposerState = &mut ***g;
                r
            }
            Unwrapped::Plain(p) => {
                let r: &mut dyn ProposerState = &mut **p;
                r
            }
        })
        .collect();
    f(&mut refs)
}
