//! `Conversation`: multi-turn generation that carries the drafter's KV between turns.
//!
//! Each turn's prompt is the whole history so far (earlier prompts and replies) plus the
//! new tokens, so the drafter KV taken at the end of a turn (`take_drafter_kv`) describes a
//! prefix of the next prompt. The next turn installs it into the fresh state
//! (`install_drafter_kv`) and only catches the drafter up on the new rows
//! (`catchup_drafter`); if the proposer declines, the engine frees the blocks
//! (`free_drafter_kv`) and prefills the drafter from scratch. A carried entry that is
//! replaced, reset or dropped is freed the same way, so nothing outlives the conversation.

use super::{GenerateRequest, GenerateResult, SpecEngine, Target};
use crate::Result;

/// Drafter KV blocks moved out of a finished sequence's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CarriedKv {
    /// The blocks, in row order.
    pub blocks: Vec<u32>,
    /// Drafter rows they hold.
    pub rows: usize,
    /// Sequence-space pair key of the newest row.
    pub last_pair_key: Option<usize>,
}

/// A chat session on one engine.
pub struct Conversation<T: Target> {
    engine: SpecEngine<T>,
    history: Vec<u32>,
    carried: Option<CarriedKv>,
}

impl<T: Target> Conversation<T> {
    /// An empty conversation on `engine`.
    pub fn new(engine: SpecEngine<T>) -> Self {
        Conversation {
            engine,
            history: Vec::new(),
            carried: None,
        }
    }

    /// Every token so far: prompts and replies.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// The drafter KV carried into the next turn, if any.
    pub fn carried(&self) -> Option<&CarriedKv> {
        self.carried.as_ref()
    }

    /// Sends one turn: `request.prompt` holds the turn's new tokens, which are appended to
    /// the history; the whole history is the prompt, and the reply is appended too. Every
    /// other field of `request` (max_tokens, sampling, grammar, stop_on_eos) applies as in
    /// [`SpecEngine::generate`]. A bad request is refused before anything runs and changes
    /// nothing; a failure while running leaves the history as it was and drops any carried
    /// drafter KV.
    pub fn send(&mut self, mut request: GenerateRequest) -> Result<GenerateResult> {
        let mut prompt = self.history.clone();
        prompt.extend_from_slice(&request.prompt);
        request.prompt = prompt;
        self.engine.check_request(0, &request)?;
        self.engine.check_fits(0, &request)?;
        let carry_in = vec![self.carried.take()];
        let prompt = request.prompt.clone();
        let (mut generation, mut carry_out) = self.engine.run(vec![request], carry_in, true);
        let result = generation.results.pop().ok_or_else(|| {
            crate::Error::from(super::EngineError::InvalidArgument {
                what: "conversation",
                message: "the engine returned no result".into(),
            })
        })?;
        self.carried = carry_out.pop().flatten();
        if let Some(error) = result.error {
            self.free_carried();
            return Err(error);
        }
        self.history = prompt;
        self.history.extend_from_slice(&result.tokens);
        Ok(result)
    }

    /// Appends `tokens` to the history without generating (for instance the tokens a chat
    /// template puts after a reply to close the turn). The carried drafter KV still
    /// describes a prefix of the history; the next turn catches the drafter up on the rest.
    pub fn append(&mut self, tokens: &[u32]) {
        self.history.extend_from_slice(tokens);
    }

    /// Forgets the history and frees any carried drafter KV.
    pub fn reset(&mut self) {
        self.history.clear();
        self.free_carried();
    }

    fn free_carried(&mut self) {
        if let (Some(kv), Some(p)) = (self.carried.take(), self.engine.proposer()) {
            p.free_drafter_kv(&kv.blocks);
        }
    }
}

impl<T: Target> Drop for Conversation<T> {
    fn drop(&mut self) {
        self.free_carried();
    }
}
