//! Errors of the engine layer: bad requests, proposers that break their contract inside
//! the loop, grammar failures.

use thiserror::Error;

/// What went wrong while generating.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum EngineError {
    /// A request with no prompt tokens.
    #[error("request {request}: the prompt is empty (a sequence needs at least one token)")]
    EmptyPrompt { request: usize },
    /// A prompt that leaves no room in the target's context.
    #[error("request {request}: the prompt has {len} tokens but the model's context holds {max_seq_len} (the prompt must be shorter than the context)")]
    PromptTooLong {
        request: usize,
        len: usize,
        max_seq_len: usize,
    },
    /// A prompt token outside the vocabulary.
    #[error("request {request}: prompt token {token} at index {index} is outside the vocabulary of {vocab_size}")]
    PromptTokenOutOfVocab {
        request: usize,
        token: u32,
        index: usize,
        vocab_size: usize,
    },
    /// Sampling parameters or engine settings that make no sense.
    #[error("invalid {what}: {message}")]
    InvalidArgument { what: &'static str, message: String },
    /// A proposer returned drafts that break the protocol (too many, or out of vocabulary).
    #[error("{method} broke the protocol: {message}")]
    ProposerContract {
        method: &'static str,
        message: String,
    },
    /// The target's forward (or trim, or free) failed.
    #[error("target: {0}")]
    Target(String),
    /// The target returned output of the wrong shape.
    #[error("target forward: {0}")]
    TargetOutput(String),
    /// A grammar matcher failed or refused a token the engine emitted.
    #[error("grammar: {0}")]
    Grammar(String),
}
