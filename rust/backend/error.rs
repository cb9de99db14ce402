//! Errors of the backend layer.

use super::DevicePtr;
use thiserror::Error;

/// What went wrong in device memory, copies, streams or kernels.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum BackendError {
    /// The backend could not satisfy an allocation.
    #[error("out of device memory: asked for {requested} bytes ({tag}), {live_bytes} bytes live in {live_count} allocations")]
    OutOfMemory {
        requested: usize,
        tag: String,
        live_bytes: usize,
        live_count: usize,
    },
    /// A zero-byte allocation was asked for.
    #[error("allocation of zero bytes ({tag}) is not allowed")]
    ZeroSizedAlloc { tag: String },
    /// `free` of a pointer that was allocated and already freed.
    #[error("double free of {ptr} (it was allocated as {tag:?} and is already freed)")]
    DoubleFree { ptr: DevicePtr, tag: String },
    /// `free` of a pointer this backend never returned.
    #[error("free of unknown pointer {ptr}: it is not the start of a live allocation")]
    UnknownPointer { ptr: DevicePtr },
    /// A copy, memset or kernel argument that does not lie inside one live allocation.
    #[error("{what}: range {ptr}+{nbytes} bytes is outside every live allocation{detail}")]
    OutOfBounds {
        what: String,
        ptr: DevicePtr,
        nbytes: usize,
        detail: String,
    },
    /// A stream id that was never created or is already destroyed.
    #[error("unknown stream {0}")]
    UnknownStream(u64),
    /// A kernel was given inconsistent sizes or arguments.
    #[error("{op}: {message}")]
    InvalidArgument { op: &'static str, message: String },
    /// A quantized CPU kernel refused its arguments (or a task of it failed).
    #[error("{op}: {source}")]
    Quant {
        op: &'static str,
        #[source]
        source: super::quant::QuantError,
    },
    /// The CUDA driver or device could not be used.
    #[error("CUDA unavailable: {0}")]
    CudaUnavailable(String),
    /// A driver call failed.
    #[error("CUDA driver error in {op}: {message}")]
    Driver { op: &'static str, message: String },
}
