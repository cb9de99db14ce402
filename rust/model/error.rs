//! Errors of the model layer beyond configuration: reading checkpoints and misusing a
//! loaded model.
//!
//! Every variant about a checkpoint names the file and, where one is involved, the tensor,
//! so a user can tell which part of which file is wrong without a debugger.

use thiserror::Error;

/// What went wrong while loading weights or running the target model.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ModelError {
    /// The file could not be opened, mapped or listed.
    #[error("cannot read {path}: {message}")]
    Io {
        /// The file's path as given.
        path: String,
        /// The operating system's reason.
        message: String,
    },
    /// The file is not a well-formed checkpoint of its format (bad magic, cut short,
    /// inconsistent header).
    #[error("{path} is not a valid {format} file: {message}")]
    Format {
        /// The file's path as given.
        path: String,
        /// The checkpoint format it was read as (e.g. "GGUF", "safetensors").
        format: &'static str,
        /// What about the file is malformed.
        message: String,
    },
    /// A size, count, offset or length in a file's header is out of range: it overflows, is
    /// more than the rest of the file could hold, or is beyond what this crate accepts. It is
    /// refused before anything is allocated for it.
    #[error("{path}: {field} is {value}, out of range: {reason}")]
    OutOfRange {
        /// The file's path as given.
        path: String,
        /// The header field that holds the bad value.
        field: String,
        /// The value as read from the file.
        value: String,
        /// Which bound it breaks.
        reason: String,
    },
    /// A tensor's data runs past the end of the file.
    #[error("tensor {tensor:?} in {path} is truncated: it needs bytes {start}..{end} but the file has {file_len}")]
    Truncated {
        /// The file's path as given.
        path: String,
        /// The tensor's name in the checkpoint.
        tensor: String,
        /// Byte offset in the file where the tensor's data starts.
        start: usize,
        /// Byte offset one past the tensor's last byte.
        end: usize,
        /// The file's length in bytes.
        file_len: usize,
    },
    /// A tensor the model needs is absent.
    #[error("tensor {tensor:?} is missing from {path}")]
    MissingTensor {
        /// The file's path as given.
        path: String,
        /// The name of the tensor that was looked for.
        tensor: String,
    },
    /// A tensor has another shape than the configuration implies.
    #[error("tensor {tensor:?} in {path} has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The file's path as given.
        path: String,
        /// The tensor's name in the checkpoint.
        tensor: String,
        /// The shape the configuration implies, outermost dimension first.
        expected: Vec<usize>,
        /// The shape the file records, outermost dimension first.
        found: Vec<usize>,
    },
    /// A tensor's element type is one this crate cannot read.
    #[error("tensor {tensor:?} in {path} has type {dtype}, which is not supported (supported: {supported})")]
    UnsupportedType {
        /// The file's path as given.
        path: String,
        /// The tensor's name in the checkpoint.
        tensor: String,
        /// The element type the file records for it.
        dtype: String,
        /// The element types this crate reads, for the message.
        supported: &'static str,
    },
    /// A forward or sequence call was given input that breaks its contract.
    #[error("{op}: {message}")]
    InvalidInput {
        /// The call that refused its input.
        op: &'static str,
        /// Which part of the contract the input breaks.
        message: String,
    },
}

impl ModelError {
    /// Whether the error is about the contents of a checkpoint (as opposed to a call's input).
    pub fn is_checkpoint(&self) -> bool {
        !matches!(self, ModelError::InvalidInput { .. })
    }

    pub(crate) fn invalid(op: &'static str, message: impl Into<String>) -> ModelError {
        ModelError::InvalidInput {
            op,
            message: message.into(),
        }
    }
}
