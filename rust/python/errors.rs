//! The Python exception hierarchy and the mapping from [`crate::Error`] to it.
//!
//! Every Rust error crosses into Python as a subclass of `specdraft.SpecdraftError` carrying
//! the Rust message unchanged, so the text a Rust user sees and the text a Python user sees
//! are the same. Nothing here panics: an error is always turned into an exception.

use crate::backend::BackendError;
use crate::memory::MemoryError;
use crate::Error;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    specdraft,
    SpecdraftError,
    PyException,
    "Base class of every error specdraft raises."
);
create_exception!(
    specdraft,
    AllocationError,
    SpecdraftError,
    "Device memory or KV blocks: out of memory, double free, unknown pointer, out-of-bounds access, exhausted block pool."
);
create_exception!(
    specdraft,
    BackendUnavailableError,
    SpecdraftError,
    "A backend cannot be used on this machine: no CUDA driver, no such device, or kernels the device cannot load."
);
create_exception!(
    specdraft,
    ConfigError,
    SpecdraftError,
    "A model configuration or a lever setting could not be read or is inconsistent."
);
create_exception!(
    specdraft,
    CheckpointError,
    SpecdraftError,
    "A checkpoint (safetensors or GGUF) could not be loaded."
);
create_exception!(
    specdraft,
    ProposerError,
    SpecdraftError,
    "A proposer failed or broke the DraftProposer contract."
);

/// The exception for a backend error.
pub fn backend_err(e: &BackendError) -> PyErr {
    match e {
        BackendError::OutOfMemory { .. }
        | BackendError::ZeroSizedAlloc { .. }
        | BackendError::DoubleFree { .. }
        | BackendError::UnknownPointer { .. }
        | BackendError::OutOfBounds { .. } => AllocationError::new_err(e.to_string()),
        BackendError::CudaUnavailable(_) => BackendUnavailableError::new_err(e.to_string()),
        _ => SpecdraftError::new_err(e.to_string()),
    }
}

/// The exception for a memory-layer error.
pub fn memory_err(e: &MemoryError) -> PyErr {
    match e {
        MemoryError::Backend(b) => backend_err(b),
        MemoryError::UnknownSlot(_) => SpecdraftError::new_err(e.to_string()),
        _ => AllocationError::new_err(e.to_string()),
    }
}

/// The exception for any specdraft error.
pub fn to_pyerr(e: Error) -> PyErr {
    match &e {
        Error::Backend(b) => backend_err(b),
        Error::Memory(m) => memory_err(m),
        Error::Config(_) => ConfigError::new_err(e.to_string()),
        Error::Proposer(_) => ProposerError::new_err(e.to_string()),
        Error::Model(_) => CheckpointError::new_err(e.to_string()),
        #[allow(unreachable_patterns)]
        _ => SpecdraftError::new_err(e.to_string()),
    }
}

/// `Result<T, E>` to `PyResult<T>` for every error type of the crate.
pub trait IntoPyResult<T> {
    /// Converts the error into the matching Python exception.
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, Error> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_pyerr)
    }
}

impl<T> IntoPyResult<T> for Result<T, BackendError> {
    fn py(self) -> PyResult<T> {
        self.map_err(|e| backend_err(&e))
    }
}

impl<T> IntoPyResult<T> for Result<T, MemoryError> {
    fn py(self) -> PyResult<T> {
        self.map_err(|e| memory_err(&e))
    }
}

impl<T> IntoPyResult<T> for Result<T, crate::model::ConfigError> {
    fn py(self) -> PyResult<T> {
        self.map_err(|e| ConfigError::new_err(e.to_string()))
    }
}

impl<T> IntoPyResult<T> for Result<T, crate::speculative::ProposerError> {
    fn py(self) -> PyResult<T> {
        self.map_err(|e| ProposerError::new_err(e.to_string()))
    }
}

/// Registers the exception classes on the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("SpecdraftError", py.get_type::<SpecdraftError>())?;
    m.add("AllocationError", py.get_type::<AllocationError>())?;
    m.add(
        "BackendUnavailableError",
        py.get_type::<BackendUnavailableError>(),
    )?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("CheckpointError", py.get_type::<CheckpointError>())?;
    m.add("ProposerError", py.get_type::<ProposerError>())?;
    Ok(())
}
