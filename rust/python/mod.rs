//! Python bindings (feature `python`): the `specdraft._core` extension module.
//!
//! One file per job: [`errors`] (exception hierarchy), [`device_ptr`], [`backend`] (device
//! memory as numpy arrays) and `cuda_backend` (its CUDA subclass, feature `cuda`),
//! [`allocator`] (KV blocks), [`model`] (config, levers, forward context views), [`state`]
//! and [`proposer`] (the `DraftProposer` base class), [`adapter`] (a Python proposer behind
//! `dyn DraftProposer`), [`rust_proposers`], [`mtp`] (the MTP draft head), [`conformance`], and [`bench`] (helpers for
//! tests and the protocol benchmark).
//!
//! Invariants: nothing here panics across the boundary (every failure is an exception);
//! Rust work that may call back into Python runs with the interpreter released; no thread
//! waits on a Rust lock while attached.

mod adapter;
mod adapter_impl;
mod allocator;
mod arrays;
mod backend;
mod bench;
mod conformance;
mod convert;
#[cfg(feature = "cuda")]
mod cuda_backend;
mod device_ptr;
mod engine;
mod errors;
mod model;
mod mtp;
mod proposer;
mod rust_proposers;
mod state;
mod target_model;

use pyo3::prelude::*;

#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<device_ptr::PyDevicePtr>()?;
    m.add_class::<backend::PyBackend>()?;
    m.add_class::<backend::PyCpuBackend>()?;
    #[cfg(feature = "cuda")]
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
    m.add_class::<bench::PyDynProposer>()?;
    m.add_function(wrap_pyfunction!(conformance::check_proposer, m)?)?;
    m.add_function(wrap_pyfunction!(bench::_as_rust, m)?)?;
    m.add_function(wrap_pyfunction!(bench::_time_propose, m)?)?;
    m.add_class::<target_model::PyTargetModel>()?;
    m.add_function(wrap_pyfunction!(target_model::load_model, m)?)?;
    m.add_function(wrap_pyfunction!(target_model::gguf_metadata, m)?)?;
    m.add_class::<mtp::PyMtpHead>()?;
    m.add_function(wrap_pyfunction!(mtp::quantize_nvfp4, m)?)?;
    engine::register(m)?;
    m.add("PROTOCOL_METHODS", adapter::METHODS.to_vec())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
