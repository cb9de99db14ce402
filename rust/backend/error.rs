//! Errors of the backend layer.

use super::DevicePtr;
use thiserror::Error;

/// What went wrong in device memory, copies, streams or kernels.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum BackendError {
    /// The backend could not satisfy an allocation.
    #[error("out of device memory: asked for {requested} bytes ({tag}), {live_bytes} bytes live in {live_count} allocations")]
    OutOfMemory {
        /// Bytes asked for.
        requested: usize,
        /// The tag the allocation was asked for with (what it is for).
        tag: String,
        /// Bytes live in the backend's allocations at the time.
        live_bytes: usize,
        /// Number of live allocations at the time.
        live_count: usize,
    },
    /// A zero-byte allocation was asked for.
    #[error("allocation of zero bytes ({tag}) is not allowed")]
    ZeroSizedAlloc {
        /// The tag the allocation was asked for with (what it is for).
        tag: String,
    },
    /// `free` of a pointer that was allocated and already freed.
    #[error("double free of {ptr} (it was allocated as {tag:?} and is already freed)")]
    DoubleFree {
        /// The pointer freed twice.
        ptr: DevicePtr,
        /// The tag it was allocated with.
        tag: String,
    },
    /// `free` of a pointer this backend never returned.
    #[error("free of unknown pointer {ptr}: it is not the start of a live allocation")]
    UnknownPointer {
        /// The pointer that was passed to `free`.
        ptr: DevicePtr,
    },
    /// A copy, memset or kernel argument that does not lie inside one live allocation.
    #[error("{what}: range {ptr}+{nbytes} bytes is outside every live allocation{detail}")]
    OutOfBounds {
        /// The operation and argument that named the range.
        what: String,
        /// Start of the range.
        ptr: DevicePtr,
        /// Length of the range in bytes.
        nbytes: usize,
        /// The nearest allocation and how far the range overruns it, or empty when none applies.
        detail: String,
    },
    /// A stream id that was never created or is already destroyed.
    #[error("unknown stream {0}")]
    UnknownStream(u64),
    /// A kernel was given inconsistent sizes or arguments.
    #[error("{op}: {message}")]
    InvalidArgument {
        /// The kernel or call that refused its arguments.
        op: &'static str,
        /// Which argument was wrong and why.
        message: String,
    },
    /// A quantized CPU kernel refused its arguments (or a task of it failed).
    #[error("{op}: {source}")]
    Quant {
        /// The kernel that failed.
        op: &'static str,
        /// The quantized kernel's error.
        #[source]
        source: super::quant::QuantError,
    },
    /// The CUDA driver or device could not be used.
    #[error("CUDA unavailable: {0}")]
    CudaUnavailable(String),
    /// A driver call failed.
    #[error("CUDA driver error in {op}: {message}")]
    Driver {
        /// The driver call that failed.
        op: &'static str,
        /// The driver's error.
        message: String,
    },
}
