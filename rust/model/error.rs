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
    Io { path: String, message: String },
    /// The file is not a well-formed checkpoint of its format (bad magic, cut short,
    /// inconsistent header).
    #[error("{path} is not a valid {format} file: {message}")]
    Format {
        path: String,
        format: &'static str,
        message: String,
    },
    /// A size, count, offset or length in a file's header is out of range: it overflows, is
    /// more than the rest of the file could hold, or is beyond what this crate accepts. It is
    /// refused before anything is allocated for it.
    #[error("{path}: {field} is {value}, out of range: {reason}")]
    OutOfRange {
        path: String,
        field: String,
        value: String,
        reason: String,
    },
    /// A tensor's data runs past the end of the file.
    #[error("tensor {tensor:?} in {path} is truncated: it needs bytes {start}..{end} but the file has {file_len}")]
    Truncated {
        path: String,
        tensor: String,
        start: usize,
        end: usize,
        file_len: usize,
    },
    /// A tensor the model needs is absent.
    #[error("tensor {tensor:?} is missing from {path}")]
    MissingTensor { path: String, tensor: String },
    /// A tensor has another shape than the configuration implies.
    #[error("tensor {tensor:?} in {path} has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        path: String,
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// A tensor's element type is one this crate cannot read.
    #[error("tensor {tensor:?} in {path} has type {dtype}, which is not supported (supported: {supported})")]
    UnsupportedType {
        path: String,
        tensor: String,
        dtype: String,
        supported: &'static str,
    },
    /// A forward or sequence call was given input that breaks its contract.
    #[error("{op}: {message}")]
    InvalidInput { op: &'static str, message: String },
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
