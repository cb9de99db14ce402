//! What a caller asks the engine for and what it gets back.

use super::{GrammarMatcher, Metrics, SamplingParams};
use serde::Serialize;

/// One sequence to generate.
pub struct GenerateRequest {
    /// Prompt token ids (at least one, each inside the vocabulary, fewer than the
    /// model's context).
    pub prompt: Vec<u32>,
    /// Most tokens to generate (at least 1).
    pub max_tokens: usize,
    /// How the target's pick is made.
    pub sampling: SamplingParams,
    /// Constrains every emitted token, when given.
    pub grammar: Option<Box<dyn GrammarMatcher>>,
    /// End the sequence at the model's EOS tokens (on by default).
    pub stop_on_eos: bool,
}

impl GenerateRequest {
    /// Greedy generation of at most `max_tokens` tokens after `prompt`.
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> Self {
        GenerateRequest {
            prompt,
            max_tokens,
            sampling: SamplingParams::greedy(),
            grammar: None,
            stop_on_eos: true,
        }
    }

    /// The same request with other sampling parameters.
    pub fn with_sampling(mut self, sampling: SamplingParams) -> Self {
        self.sampling = sampling;
        self
    }

    /// The same request constrained by `grammar`.
    pub fn with_grammar(mut self, grammar: Box<dyn GrammarMatcher>) -> Self {
        self.grammar = Some(grammar);
        self
    }

    /// The same request, not stopping at EOS.
    pub fn ignore_eos(mut self) -> Self {
        self.stop_on_eos = false;
        self
    }
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// It emitted an EOS token, or its grammar ended.
    Stop,
    /// It reached `max_tokens`.
    Length,
    /// It reached the end of the model's context.
    Context,
    /// Its grammar allowed no further token.
    Grammar,
    /// An error ended it (see [`GenerateResult::error`]).
    Error,
    /// Its caller cancelled it (see [`GenerationRun::cancel`](super::GenerationRun::cancel)).
    Cancelled,
}

impl FinishReason {
    /// The lower-case name used in Python and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Context => "context",
            FinishReason::Grammar => "grammar",
            FinishReason::Error => "error",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// The outcome of one request.
#[derive(Debug)]
pub struct GenerateResult {
    /// Generated token ids (the EOS token included when it ended the sequence).
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish: FinishReason,
    /// This request's metrics.
    pub metrics: Metrics,
    /// The error that ended it, when `finish` is [`FinishReason::Error`].
    pub error: Option<crate::Error>,
}

/// The outcome of a [`generate`](super::SpecEngine::generate) call.
#[derive(Debug)]
pub struct Generation {
    /// One result per request, in request order.
    pub results: Vec<GenerateResult>,
    /// Metrics over all requests; its wall time is the whole call's.
    pub metrics: Metrics,
}
