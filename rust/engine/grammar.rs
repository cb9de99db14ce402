//! `GrammarMatcher`: an optional per-sequence source of token masks (constrained decoding).
//!
//! The engine asks the matcher for the mask of allowed next tokens before every pick
//! (the target's choice is masked with it), hands that mask to `propose` as
//! `grammar_bitmask`, and advances the matcher with every token it emits, so every emitted
//! token is one the grammar allowed at its position. Masks use the protocol's format (see
//! [`bitmask_allows`](crate::speculative::bitmask_allows)): llguidance's format exactly,
//! so a matcher backed by llguidance fills them without conversion.

use crate::Result;

/// A grammar's state for one sequence.
pub trait GrammarMatcher: Send {
    /// Writes the mask of tokens allowed next into `mask` (`ceil(vocab / 32)` words, already
    /// zeroed by the engine).
    fn fill_mask(&mut self, mask: &mut [i32]) -> Result<()>;
    /// Consumes `token`, which the last mask allowed.
    fn advance(&mut self, token: u32) -> Result<()>;
    /// Whether the grammar has ended (for instance after its stop token); the engine then
    /// ends the sequence.
    fn is_finished(&self) -> bool {
        false
    }
}
