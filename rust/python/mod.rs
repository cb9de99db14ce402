//! Python bindings (feature `python`): the `specdraft._core` extension module.
//!
//! One file per job: [`errors`] (exception hierarchy), [`device_ptr`], [`backend`] (device
//! memory as numpy arrays) and [`cuda_backend`] (its CUDA subclass, present in every build),
//! [`allocator`] (KV blocks), [`model`] (config, levers, forward context views), [`state`] and
//! [`proposer`] (the `DraftProposer` base class), [`adapter`] (a Python proposer behind `dyn
//! DraftProposer`, its methods in the `adapter_*` files by group), [`rust_proposers`], [`mtp`]
//! (the MTP draft head), [`eagle3`] (the EAGLE-3 draft head), [`dflash`] (the DFlash draft
//! head), [`hybrid`] (a proposer made of proposers), [`conformance`], [`distributed`] (the
//! ranks' communicator) and [`distributed_mpi`] (its MPI form, over mpi4py), [`target_model`],
//! the engine ([`engine`], [`drafter_pool`], [`conversation`], [`generation`], [`grammar`],
//! [`serving`]), and [`testing`] (hooks for tests and the protocol benchmark, reached through
//! `specdraft.testing`).
//!
//! Invariants: nothing here panics across the boundary (every failure is an exception);
//! Rust work that may call back into Python runs with the interpreter released; no thread
//! waits on a Rust lock while attached.

mod adapter;
mod adapter_capabilities;
mod adapter_drafting;
mod adapter_impl;
mod adapter_lifecycle;
mod adapter_prefill;
mod allocator;
mod arrays;
mod backend;
mod conformance;
mod conversation;
mod convert;
mod cuda_backend;
mod device_ptr;
mod dflash;
mod distributed;
mod distributed_commands;
mod distributed_mpi;
mod draft_tree;
mod drafter_pool;
mod eagle3;
mod engine;
mod errors;
mod generation;
mod grammar;
mod hybrid;
mod model;
mod mtp;
mod proposer;
mod proposer_support;
mod ranks;
mod rust_proposers;
mod serving;
mod state;
mod stream;
mod target_model;
mod testing;

use pyo3::prelude::*;

#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<device_ptr::PyDevicePtr>()?;
    m.add_class::<backend::PyBackend>()?;
    m.add_class::<backend::PyCpuBackend>()?;
    m.add_class::<cuda_backend::PyCudaBackend>()?;
    m.add_function(wrap_pyfunction!(backend::default_backend, m)?)?;
    m.add_class::<allocator::PyBlockAllocator>()?;
    m.add_class::<model::PyModelConfig>()?;
    m.add_class::<model::PyModelLevers>()?;
    m.add_class::<model::PyBufferArena>()?;
    m.add_class::<model::PyForwardContext>()?;
    m.add_class::<state::PyProposerState>()?;
    m.add_class::<proposer::PyDraftProposer>()?;
    m.add_class::<proposer::PyDraftRunner>()?;
    m.add_class::<rust_proposers::PyPromptLookup>()?;
    m.add_class::<rust_proposers::PySuffixDecoding>()?;
    m.add_class::<conformance::PyViolation>()?;
    m.add_class::<conformance::PyConformanceReport>()?;
    m.add_class::<testing::PyDynProposer>()?;
    m.add_function(wrap_pyfunction!(conformance::check_proposer, m)?)?;
    m.add_function(wrap_pyfunction!(testing::_as_rust, m)?)?;
    m.add_function(wrap_pyfunction!(testing::_time_propose, m)?)?;
    m.add_class::<target_model::PyTargetModel>()?;
    m.add_function(wrap_pyfunction!(target_model::load_model, m)?)?;
    m.add_function(wrap_pyfunction!(target_model::gguf_metadata, m)?)?;
    m.add_class::<mtp::PyMtpHead>()?;
    m.add_class::<mtp::PyReferenceDraftRunner>()?;
    m.add_class::<eagle3::PyEagle3Head>()?;
    m.add_class::<hybrid::PyHybrid>()?;
    m.add_class::<dflash::PyDFlashHead>()?;
    m.add_function(wrap_pyfunction!(mtp::quantize_nvfp4, m)?)?;
    engine::register(m)?;
    m.add_class::<serving::PyServingEngine>()?;
    m.add_class::<distributed::PyCommunicator>()?;
    m.add(
        "PROTOCOL_METHODS",
        crate::speculative::ProtocolMethod::NAMES.to_vec(),
    )?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
