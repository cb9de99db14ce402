//! Errors of the engine layer.
//!
//! Two kinds, told apart by [`EngineError::is_request_error`]:
//! - a bad request (an empty or too-long prompt, ids outside the vocabulary, sampling
//!   parameters out of range): found before the request runs, nothing was computed;
//! - a failure while running: a step of the loop failed in a layer below (the target's
//!   forward, device memory, the proposer), which [`EngineError::Step`] wraps with the
//!   request and the stage while keeping the original error as its `source`, or the
//!   engine found a contract broken (drafts the protocol forbids, a target output of the
//!   wrong shape, a grammar that failed).

use thiserror::Error;

/// Where in a sequence's life a [`EngineError::Step`] failure happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Allocating the sequence's engine buffers and proposer state.
    Start,
    /// The target's forward over the prompt.
    TargetPrefill,
    /// `prefill_drafter` or `catchup_drafter` over the prompt.
    DrafterPrefill,
    /// Filling the grammar mask for a draft.
    GrammarMask,
    /// `propose`.
    Propose,
    /// The target's verify forward.
    Verify,
    /// Dropping the rejected rows from the target's KV.
    Trim,
    /// `after_verify`.
    AfterVerify,
    /// `catchup_batch` (exact drafter KV).
    Catchup,
    /// Releasing the sequence's state, buffers and KV.
    Release,
}

impl Stage {
    /// A short description, as used in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Start => "starting the sequence",
            Stage::TargetPrefill => "the target's prefill",
            Stage::DrafterPrefill => "the drafter's prefill",
            Stage::GrammarMask => "the grammar mask",
            Stage::Propose => "propose",
            Stage::Verify => "the target's verify forward",
            Stage::Trim => "trimming the rejected rows",
            Stage::AfterVerify => "after_verify",
            Stage::Catchup => "catchup_batch",
            Stage::Release => "releasing the sequence",
        }
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What went wrong while generating.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum EngineError {
    /// A request with no prompt tokens.
    #[error("request {request}: the prompt is empty (a sequence needs at least one token)")]
    EmptyPrompt {
        /// Index of the request in the call's request list.
        request: usize,
    },
    /// A prompt that leaves no room in the target's context.
    #[error("request {request}: the prompt has {len} tokens but the model's context holds {max_seq_len} (the prompt must be shorter than the context)")]
    PromptTooLong {
        /// Index of the request in the call's request list.
        request: usize,
        /// The prompt's length in tokens.
        len: usize,
        /// The target's context length in tokens.
        max_seq_len: usize,
    },
    /// A request whose prompt plus `max_tokens` is longer than the target's context, so it
    /// could never run to its `max_tokens`.
    #[error("request {request}: the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is {total} tokens, beyond the model's context of {max_seq_len} (lower max_tokens to at most {room} or shorten the prompt)", total = .prompt_len + .max_tokens, room = .max_seq_len.saturating_sub(*.prompt_len))]
    ExceedsContext {
        /// Index of the request in the call's request list.
        request: usize,
        /// The prompt's length in tokens.
        prompt_len: usize,
        /// The request's `max_tokens`.
        max_tokens: usize,
        /// The target's context length in tokens.
        max_seq_len: usize,
    },
    /// A prompt token outside the vocabulary.
    #[error("request {request}: prompt token {token} at index {index} is outside the vocabulary of {vocab_size}")]
    PromptTokenOutOfVocab {
        /// Index of the request in the call's request list.
        request: usize,
        /// The offending token id.
        token: u32,
        /// Its position in the prompt.
        index: usize,
        /// The target's vocabulary size (valid ids are below it).
        vocab_size: usize,
    },
    /// A request the target's whole KV pool could never hold.
    #[error("request {request}: the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) needs up to {rows} KV rows, but the target's KV pool holds {pool_rows} (lower max_tokens or give the model more KV blocks)")]
    NeverFits {
        /// Index of the request in the call's request list.
        request: usize,
        /// The prompt's length in tokens.
        prompt_len: usize,
        /// The request's `max_tokens`.
        max_tokens: usize,
        /// KV rows the request may need at most.
        rows: usize,
        /// KV rows the target's whole pool holds.
        pool_rows: usize,
    },
    /// The KV pool has no room for a request although none of the call's sequences runs:
    /// something outside the call holds its blocks.
    #[error("request {request}: the target's KV pool has {free} of {total} blocks free and this request needs {needed}, with no sequence of this call running to free any")]
    PoolHeldElsewhere {
        /// Index of the request in the call's request list.
        request: usize,
        /// KV blocks the request needs to start.
        needed: usize,
        /// KV blocks free in the pool.
        free: usize,
        /// KV blocks in the pool.
        total: usize,
    },
    /// The caller stopped the generation (closed a stream) before the request ended.
    #[error("request {request}: the generation was stopped before the request ended")]
    Stopped {
        /// Index of the request in the call's request list.
        request: usize,
    },
    /// Sampling parameters or engine settings that make no sense.
    #[error("invalid {what}: {message}")]
    InvalidArgument {
        /// The parameter or setting that was refused.
        what: &'static str,
        /// Why it was refused.
        message: String,
    },
    /// A stage of a running request failed in a layer below; `source` is that layer's
    /// error, unchanged. Its message is repeated here so a single line says everything.
    #[error("request {request}: {stage} failed: {source}")]
    Step {
        /// Index of the request in the call's request list.
        request: usize,
        /// The stage that failed.
        stage: Stage,
        #[source]
        /// The lower layer's error, unchanged.
        source: Box<crate::Error>,
    },
    /// A proposer returned drafts that break the protocol (too many, or out of vocabulary).
    #[error("{method} broke the protocol: {message}")]
    ProposerContract {
        /// The proposer method whose output broke the protocol.
        method: &'static str,
        /// What was wrong with the drafts.
        message: String,
    },
    /// The target returned output of the wrong shape.
    #[error("target forward: {0}")]
    TargetOutput(String),
    /// A running request has no target KV: the engine's own bookkeeping is broken.
    #[error("request {request}: the sequence holds no target KV (it was never started or is already released)")]
    NoKv {
        /// Index of the request in the call's request list.
        request: usize,
    },
    /// A grammar matcher failed or refused a token the engine emitted.
    #[error("grammar: {0}")]
    Grammar(String),
}

impl EngineError {
    /// Whether this is a bad request (found before anything ran) rather than a failure
    /// while running.
    pub fn is_request_error(&self) -> bool {
        matches!(
            self,
            EngineError::EmptyPrompt { .. }
                | EngineError::PromptTooLong { .. }
                | EngineError::ExceedsContext { .. }
                | EngineError::PromptTokenOutOfVocab { .. }
                | EngineError::InvalidArgument { .. }
        )
    }

    /// `error`, raised at `stage` of request `request`, wrapped with both; an engine error
    /// already says where it happened and is returned unchanged.
    pub fn at(request: usize, stage: Stage, error: crate::Error) -> crate::Error {
        match error {
            crate::Error::Engine(_) => error,
            other => EngineError::Step {
                request,
                stage,
                source: Box::new(other),
            }
            .into(),
        }
    }
}
