//! What `specdraft.DraftProposer` stands on: the protocol's defaults for an object that holds
//! no Rust proposer ([`ABSTRACT`], whose required methods say that a Python proposer must
//! define them), the opaque `specdraft.DraftRunner`, and the argument helpers of its methods
//! (a list of states locked together, a backend argument).
//!
//! Invariant: `with_states` locks every state before running anything, so a method on a
//! batch either sees all its states or fails naming the method, having run nothing.

use super::backend::{backend_arg, PyBackend};
use super::state::StateSrc;
use crate::backend::{DevicePtr, GpuBackend};
use crate::model::ForwardContext;
use crate::speculative::{
    DraftProposer, DraftRunner, ProposerError, ProposerState, ProtocolMethod as M,
};
use crate::Result;
use pyo3::prelude::*;
use std::sync::Arc;

/// The protocol's defaults, for a class that holds no Rust proposer. Its required methods
/// say that a Python proposer must define them.
pub(crate) struct Abstract;

fn abstract_method(method: &'static str) -> crate::Error {
    ProposerError::InvalidArgument {
        method,
        message: "DraftProposer does not implement it: a proposer must define alloc_state, propose and after_verify".into(),
    }
    .into()
}

impl DraftProposer for Abstract {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Err(abstract_method("alloc_state"))
    }

    fn propose(
        &self,
        _last_token: u32,
        _target_hidden: DevicePtr,
        _position: usize,
        _num_drafts: usize,
        _state: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _stream: u64,
        _draft_embed_target: Option<DevicePtr>,
        _grammar_bitmask: Option<&[i32]>,
        _target_hidden_stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        Err(abstract_method("propose"))
    }

    fn after_verify(&self, _n: usize, _state: &mut dyn ProposerState, _stream: u64) -> Result<()> {
        Err(abstract_method("after_verify"))
    }
}

/// The protocol's defaults, shared by every object that holds no Rust proposer.
pub(crate) static ABSTRACT: Abstract = Abstract;

/// A draft runner: what `set_circuit_draft` runs in place of a draft head's own forward.
/// Made by specdraft (see `ReferenceDraftRunner`); opaque to Python.
#[pyclass(name = "DraftRunner", module = "specdraft", subclass, frozen)]
pub struct PyDraftRunner {
    pub inner: Arc<dyn DraftRunner>,
}

pub(super) fn states_arg(states: &Bound<'_, PyAny>) -> PyResult<Vec<StateSrc>> {
    states
        .try_iter()?
        .map(|s| Ok(StateSrc::from_py(&s?)))
        .collect()
}

/// Locks every state of `srcs` for `method`, then runs `f` on them together.
pub(super) fn with_states<R>(
    srcs: &mut [StateSrc],
    method: M,
    f: impl FnOnce(&mut [&mut dyn ProposerState]) -> Result<R>,
) -> Result<R> {
    let mut guards = srcs
        .iter_mut()
        .map(|s| s.lock(method.name()))
        .collect::<Result<Vec<_>>>()?;
    let mut refs: Vec<&mut dyn ProposerState> = guards.iter_mut().map(|g| g.as_state()).collect();
    f(&mut refs)
}

pub(super) fn with_gpu<R>(
    gpu: &Bound<'_, PyAny>,
    f: impl FnOnce(&dyn GpuBackend) -> PyResult<R>,
) -> PyResult<R> {
    let b: Bound<'_, PyBackend> = backend_arg(gpu)?;
    b.get().with(f)
}
