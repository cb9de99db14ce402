//! Errors of the speculative layer.

use thiserror::Error;

/// A proposer failed or broke its contract.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ProposerError {
    /// A token id at or beyond the vocabulary.
    #[error("{method}: token id {token} is outside the vocabulary of {vocab_size}")]
    TokenOutOfVocab {
        method: &'static str,
        token: u64,
        vocab_size: usize,
    },
    /// A state of another proposer's type was passed in.
    #[error("{method}: the state is not a {expected} (it was made by another proposer)")]
    WrongState {
        method: &'static str,
        expected: &'static str,
    },
    /// Arguments that do not fit together (lengths, counts, sizes).
    #[error("{method}: {message}")]
    InvalidArgument {
        method: &'static str,
        message: String,
    },
    /// A proposer written in Python raised or returned something unusable.
    #[error("{method} of Python proposer {class}: {message}")]
    Python {
        method: String,
        class: String,
        message: String,
    },
    /// Any other failure inside a proposer.
    #[error("{method}: {message}")]
    Failed { method: String, message: String },
}
