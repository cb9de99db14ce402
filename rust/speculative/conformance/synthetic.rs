//! The synthetic world the checker drives a proposer through: the model configuration it
//! is shown, the token sequences the "target" verifies against (a repeating motif with
//! mutations, so history-based proposers both match and miss), and each sequence's place.
//!
//! Invariant: every synthetic token is inside the checked vocabulary.

use super::CheckOptions;
use crate::backend::DevicePtr;
use crate::model::ModelConfig;
use crate::speculative::ProposerState;
use rand::rngs::SmallRng;
use rand::Rng;

/// One synthetic sequence: the prompt and the continuation the "target" will verify against.
pub(super) struct Sequence {
    pub(super) truth: Vec<u32>,
    pub(super) prompt_len: usize,
    pub(super) hiddens: DevicePtr,
    /// The captured rows `[total, n * hidden]`, paired row for row with `hiddens`, when the
    /// proposer names `target_layer_ids`.
    pub(super) stack: Option<DevicePtr>,
    pub(super) state: Option<Box<dyn ProposerState>>,
    /// Position of the last verified token.
    pub(super) pos: usize,
    /// Position of the last token whose captured row an earlier call delivered: the next
    /// propose's stack holds the rows of the tokens after it, up to `pos`.
    pub(super) delivered: usize,
}

pub(super) fn synthetic_tokens(
    rng: &mut SmallRng,
    vocab: usize,
    prompt_len: usize,
    total: usize,
) -> Vec<u32> {
    let motif_len = rng.random_range(3..=6);
    let motif: Vec<u32> = (0..motif_len)
        .map(|_| rng.random_range(0..vocab as u32))
        .collect();
    let mut tokens = Vec::with_capacity(total);
    for i in 0..total {
        // Mostly a repeating motif (so history-based proposers find matches), with a
        // mutation every so often (so some drafts are rejected).
        if i >= prompt_len / 2 && rng.random_range(0..7) == 0 {
            tokens.push(rng.random_range(0..vocab as u32));
        } else {
            tokens.push(motif[i % motif_len]);
        }
    }
    tokens
}

pub(super) fn synthetic_config(options: &CheckOptions) -> ModelConfig {
    let mut config = ModelConfig::tiny(options.vocab_size);
    config.hidden_size = options.hidden_size;
    config.head_dim = 16;
    config.num_attention_heads = options.hidden_size / 16;
    config.num_key_value_heads = 1;
    config.intermediate_size = options.hidden_size * 2;
    config
}

pub(super) fn options_problem(options: &CheckOptions) -> Option<String> {
    if options.vocab_size < 8 || options.vocab_size > 1 << 20 {
        return Some(format!(
            "vocab_size must be in 8..=1048576, got {}",
            options.vocab_size
        ));
    }
    if options.hidden_size == 0 || !options.hidden_size.is_multiple_of(16) {
        return Some(format!(
            "hidden_size must be a positive multiple of 16, got {}",
            options.hidden_size
        ));
    }
    if options.num_sequences == 0 || options.num_drafts == 0 || options.steps == 0 {
        return Some("num_sequences, num_drafts and steps must be at least 1".into());
    }
    None
}
