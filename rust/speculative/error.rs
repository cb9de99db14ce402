//! Errors of the speculative layer.

use thiserror::Error;

/// A proposer failed or broke its contract.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ProposerError {
    /// A token id at or beyond the vocabulary.
    #[error("{method}: token id {token} is outside the vocabulary of {vocab_size}")]
    TokenOutOfVocab {
        /// The proposer method that failed.
        method: &'static str,
        /// The offending token id.
        token: u64,
        /// The vocabulary size (valid ids are below it).
        vocab_size: usize,
    },
    /// A state of another proposer's type was passed in.
    #[error("{method}: the state is not a {expected} (it was made by another proposer)")]
    WrongState {
        /// The proposer method that failed.
        method: &'static str,
        /// The state type this proposer makes.
        expected: &'static str,
    },
    /// Arguments that do not fit together (lengths, counts, sizes).
    #[error("{method}: {message}")]
    InvalidArgument {
        /// The proposer method that failed.
        method: &'static str,
        /// Which arguments do not fit and why.
        message: String,
    },
    /// A proposer written in Python raised or returned something unusable.
    #[error("{method} of Python proposer {class}: {message}")]
    Python {
        /// The proposer method that failed.
        method: String,
        /// The Python proposer's class name.
        class: String,
        /// The Python exception or what was unusable in the result.
        message: String,
    },
    /// A member of a `Hybrid` failed: `source` is the member's own error.
    #[error("{method}: hybrid member {index} ({name}) failed: {source}")]
    Member {
        /// The hybrid's method that was running.
        method: &'static str,
        /// The member's place in the hybrid's list (0 first).
        index: usize,
        /// The member's name.
        name: String,
        /// What the member returned.
        source: Box<crate::Error>,
    },
    /// Any other failure inside a proposer.
    #[error("{method}: {message}")]
    Failed {
        /// The proposer method that failed.
        method: String,
        /// What went wrong.
        message: String,
    },
}

/// The error of a proposer method given an argument it cannot use
/// ([`ProposerError::InvalidArgument`]), as the crate's error: the one constructor the
/// proposer modules share.
pub(crate) fn bad(method: &'static str, message: String) -> crate::Error {
    ProposerError::InvalidArgument { method, message }.into()
}

impl ProposerError {
    /// Checks that a batched call of `method` over `n` sequences (one token each) was given
    /// one of each other argument per sequence: `parts` names each with its length.
    pub(crate) fn check_batch(
        method: &'static str,
        n: usize,
        parts: &[(&str, usize)],
    ) -> Result<(), ProposerError> {
        if parts.iter().all(|&(_, len)| len == n) {
            return Ok(());
        }
        let listed: Vec<String> = parts
            .iter()
            .map(|(name, len)| format!("{len} {name}"))
            .collect();
        let listed = match listed.split_last() {
            Some((last, [])) => last.clone(),
            Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
            None => String::new(),
        };
        Err(ProposerError::InvalidArgument {
            method,
            message: format!("{n} tokens, {listed}: one of each per sequence"),
        })
    }

    /// Checks that a batched call of `method` over `n` sequences is no wider than the
    /// proposer's `propose_batch_max`, `max`.
    pub(crate) fn check_width(
        method: &'static str,
        n: usize,
        max: usize,
    ) -> Result<(), ProposerError> {
        if n <= max {
            return Ok(());
        }
        Err(ProposerError::InvalidArgument {
            method,
            message: format!("{n} sequences; propose_batch_max is {max}"),
        })
    }
}
