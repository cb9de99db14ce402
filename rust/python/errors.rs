//! The Python exception hierarchy and the mapping from [`crate::Error`] to it.
//!
//! Every Rust error crosses into Python as a subclass of `specdraft.SpecdraftError` carrying
//! the Rust message unchanged, so the text a Rust user sees and the text a Python user sees
//! are the same. The mapping matches every variant of every layer's error by name (no
//! catch-all), so a new variant does not compile until it is given its class.
//!
//! An error that wraps another (an engine step that failed in a layer below) is raised as
//! the class of what failed (an out-of-memory during `generate` is an `AllocationError`)
//! with the wrapped error, mapped the same way, as its `__cause__`. Nothing here panics: an
//! error is always turned into an exception.

use crate::backend::BackendError as RustBackendError;
use crate::distributed::DistributedError;
use crate::engine::EngineError;
use crate::memory::MemoryError;
use crate::model::ModelError;
use crate::Error;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

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
    "Device memory, KV blocks or the forward scratch failed.\n\nOut of memory, double free, unknown pointer, out-of-bounds access, an exhausted KV block pool."
);
create_exception!(
    specdraft,
    BackendUnavailableError,
    SpecdraftError,
    "A backend cannot be used on this machine.\n\nNo CUDA driver, no such device, kernels the device cannot load, a build without CUDA, or a backend handle lent for a call that has ended."
);
create_exception!(
    specdraft,
    BackendError,
    SpecdraftError,
    "A device operation failed.\n\nA driver call, a kernel given inconsistent arguments, an unknown stream."
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
    "A proposer failed or broke the DraftProposer contract.\n\nFor a Python proposer the message names the method and class and carries the Python traceback."
);
create_exception!(
    specdraft,
    GenerationError,
    SpecdraftError,
    "The engine failed while running a request.\n\nA target output of the wrong shape, a grammar matcher that failed or refused a token."
);

const REQUEST_ERROR_DOC: &str = "A request was refused before anything ran.\n\nAn empty or too-long prompt, token ids outside the vocabulary, sampling parameters out of range. Also a ValueError.";

/// `specdraft.RequestError`, made once: a subclass of both `SpecdraftError` and
/// `ValueError` (so `except ValueError` catches a bad argument, as Python code expects),
/// which `create_exception!` cannot express.
static REQUEST_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn request_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    let ty = REQUEST_ERROR.get_or_try_init(py, || -> PyResult<Py<PyType>> {
        let bases = (
            py.get_type::<SpecdraftError>(),
            py.get_type::<PyValueError>(),
        );
        let dict = PyDict::new(py);
        dict.set_item("__module__", "specdraft")?;
        dict.set_item("__doc__", REQUEST_ERROR_DOC)?;
        let made = py
            .get_type::<PyType>()
            .call1(("RequestError", bases, dict))?;
        Ok(made.cast_into::<PyType>()?.unbind())
    })?;
    Ok(ty.bind(py))
}

/// A `RequestError` with `message`.
pub fn request_error(message: impl Into<String>) -> PyErr {
    let message = message.into();
    Python::attach(|py| match request_error_type(py) {
        Ok(ty) => PyErr::from_type(ty.clone(), message),
        // Only fails if the interpreter cannot make a class; still raise something typed.
        Err(_) => PyValueError::new_err(message),
    })
}

/// The Python class of each kind of error.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Class {
    Allocation,
    BackendUnavailable,
    Backend,
    Config,
    Checkpoint,
    Proposer,
    Request,
    Generation,
}

fn backend_class(e: &RustBackendError) -> Class {
    match e {
        RustBackendError::OutOfMemory { .. }
        | RustBackendError::ZeroSizedAlloc { .. }
        | RustBackendError::DoubleFree { .. }
        | RustBackendError::UnknownPointer { .. }
        | RustBackendError::OutOfBounds { .. } => Class::Allocation,
        RustBackendError::CudaUnavailable(_) => Class::BackendUnavailable,
        RustBackendError::UnknownStream(_)
        | RustBackendError::InvalidArgument { .. }
        | RustBackendError::Quant { .. }
        | RustBackendError::Driver { .. } => Class::Backend,
    }
}

fn distributed_class(e: &DistributedError) -> Class {
    match e {
        // A rank that died or hung is the backend failing, as a device would.
        DistributedError::Timeout { .. }
        | DistributedError::Broken { .. }
        | DistributedError::Mpi { .. }
        | DistributedError::Nccl { .. }
        | DistributedError::BadCommand { .. } => Class::Backend,
        DistributedError::InvalidArgument { .. } => Class::Request,
        DistributedError::Unavailable { .. } => Class::BackendUnavailable,
    }
}

fn memory_class(e: &MemoryError) -> Class {
    match e {
        MemoryError::Backend(b) => backend_class(b),
        MemoryError::Exhausted { .. }
        | MemoryError::InvalidBlock { .. }
        | MemoryError::NotAllocated { .. }
        | MemoryError::InvalidSize(_)
        | MemoryError::UnknownSlot(_) => Class::Allocation,
    }
}

fn model_class(e: &ModelError) -> Class {
    match e {
        ModelError::Io { .. }
        | ModelError::Format { .. }
        | ModelError::OutOfRange { .. }
        | ModelError::Truncated { .. }
        | ModelError::MissingTensor { .. }
        | ModelError::ShapeMismatch { .. }
        | ModelError::UnsupportedType { .. } => Class::Checkpoint,
        // A loaded model called with input that breaks its contract: a bad argument.
        ModelError::InvalidInput { .. } => Class::Request,
    }
}

fn engine_class(e: &EngineError) -> Class {
    match e {
        EngineError::EmptyPrompt { .. }
        | EngineError::PromptTooLong { .. }
        | EngineError::ExceedsContext { .. }
        | EngineError::PromptTokenOutOfVocab { .. }
        | EngineError::InvalidArgument { .. } => Class::Request,
        // What failed decides the class; a "bad argument" found mid-run is the engine's
        // failure, not the caller's request.
        EngineError::Step { source, .. } => match class_of(source) {
            Class::Request => Class::Generation,
            other => other,
        },
        EngineError::ProposerContract { .. } => Class::Proposer,
        EngineError::NeverFits { .. } | EngineError::PoolHeldElsewhere { .. } => Class::Allocation,
        EngineError::TargetOutput(_)
        | EngineError::NoKv { .. }
        | EngineError::Grammar(_)
        | EngineError::Stopped { .. } => Class::Generation,
    }
}

fn class_of(e: &Error) -> Class {
    match e {
        Error::Backend(b) => backend_class(b),
        Error::Distributed(d) => distributed_class(d),
        Error::Memory(m) => memory_class(m),
        Error::Config(_) => Class::Config,
        Error::Model(m) => model_class(m),
        Error::Proposer(_) => Class::Proposer,
        Error::Engine(g) => engine_class(g),
    }
}

fn new_err(class: Class, message: String) -> PyErr {
    match class {
        Class::Allocation => AllocationError::new_err(message),
        Class::BackendUnavailable => BackendUnavailableError::new_err(message),
        Class::Backend => BackendError::new_err(message),
        Class::Config => ConfigError::new_err(message),
        Class::Checkpoint => CheckpointError::new_err(message),
        Class::Proposer => ProposerError::new_err(message),
        Class::Request => request_error(message),
        Class::Generation => GenerationError::new_err(message),
    }
}

/// The error that `e` wraps, when it wraps one.
fn wrapped(e: &Error) -> Option<&Error> {
    match e {
        Error::Engine(EngineError::Step { source, .. }) => Some(source),
        _ => None,
    }
}

/// The exception for any specdraft error, with the errors it wraps as its `__cause__`
/// chain.
pub fn to_pyerr(e: &Error) -> PyErr {
    let err = new_err(class_of(e), e.to_string());
    if let Some(inner) = wrapped(e) {
        Python::attach(|py| err.set_cause(py, Some(to_pyerr(inner))));
    }
    err
}

/// `Result<T, E>` to `PyResult<T>` for every error type of the crate.
pub trait IntoPyResult<T> {
    /// Converts the error into the matching Python exception.
    fn py(self) -> PyResult<T>;
}

impl<T, E: Into<Error>> IntoPyResult<T> for Result<T, E> {
    fn py(self) -> PyResult<T> {
        self.map_err(|e| to_pyerr(&e.into()))
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
    m.add("BackendError", py.get_type::<BackendError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("CheckpointError", py.get_type::<CheckpointError>())?;
    m.add("ProposerError", py.get_type::<ProposerError>())?;
    m.add("RequestError", request_error_type(py)?)?;
    m.add("GenerationError", py.get_type::<GenerationError>())?;
    Ok(())
}
