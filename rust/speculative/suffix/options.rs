//! The knobs of `SuffixDecoding`, their defaults (vLLM's where vLLM has one) and their
//! ranges.

use super::trie::MAX_NODES;
use crate::speculative::ProposerError;

/// Strings of up to 24 tokens: vLLM's default tree depth for suffix decoding. The depth
/// bounds the matched suffix plus the drafts after it, and this trie spends up to one node
/// per stored token and depth, so a deeper tree costs memory for matches rarely that long:
/// over 65536 tokens that never repeat, a sequence's own tree holds 1.55M nodes, 90 MB
/// (`cargo bench --bench protocol`); text that repeats costs far less.
pub const DEFAULT_MAX_DEPTH: usize = 24;
/// Stop a chain before a draft reached with probability under 0.1 (vLLM's default).
pub const DEFAULT_MIN_TOKEN_PROB: f32 = 0.1;
/// A match of `L` tokens drafts at most `L` tokens (vLLM's default factor).
pub const DEFAULT_MAX_SPEC_FACTOR: f32 = 1.0;
/// About a million nodes in the shared tree: about 60 MB at the 58 bytes a node that
/// `cargo bench --bench protocol` measures, or some 50,000 output tokens of text that
/// repeats little.
pub const DEFAULT_MAX_TREE_NODES: usize = 1 << 20;

/// The knobs of [`SuffixDecoding`](super::SuffixDecoding).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SuffixDecodingOptions {
    /// Longest string the trees keep (2..=4096): the matched suffix plus its drafts.
    pub max_depth: usize,
    /// A draft is proposed only while the estimated probability of reaching it (the product
    /// of its continuation frequencies so far) is at least this (0..=1).
    pub min_token_prob: f32,
    /// A match of `L` tokens drafts at most `floor(L * max_spec_factor)` tokens (>= 0).
    pub max_spec_factor: f32,
    /// The shared tree's bound, in nodes and in stored output tokens; the oldest outputs are
    /// evicted beyond it. 0 keeps no outputs (each sequence drafts from its own history).
    pub max_tree_nodes: usize,
}

impl Default for SuffixDecodingOptions {
    fn default() -> Self {
        SuffixDecodingOptions {
            max_depth: DEFAULT_MAX_DEPTH,
            min_token_prob: DEFAULT_MIN_TOKEN_PROB,
            max_spec_factor: DEFAULT_MAX_SPEC_FACTOR,
            max_tree_nodes: DEFAULT_MAX_TREE_NODES,
        }
    }
}

impl SuffixDecodingOptions {
    /// Checks every option's range; the error names the first one out of range.
    pub fn check(&self) -> Result<(), ProposerError> {
        const M: &str = "SuffixDecoding::new";
        let o = self;
        if !(2..=4096).contains(&o.max_depth) {
            return Err(invalid(
                M,
                format!("max_depth must be in 2..=4096, got {}", o.max_depth),
            ));
        }
        if !(0.0..=1.0).contains(&o.min_token_prob) {
            return Err(invalid(
                M,
                format!("min_token_prob must be in [0, 1], got {}", o.min_token_prob),
            ));
        }
        if !(o.max_spec_factor.is_finite() && o.max_spec_factor >= 0.0) {
            return Err(invalid(
                M,
                format!(
                    "max_spec_factor must be finite and >= 0, got {}",
                    o.max_spec_factor
                ),
            ));
        }
        let most = MAX_NODES - o.max_depth;
        if o.max_tree_nodes > most {
            return Err(invalid(
                M,
                format!(
                    "max_tree_nodes must be at most {most}, got {}",
                    o.max_tree_nodes
                ),
            ));
        }
        Ok(())
    }
}

pub(super) fn invalid(method: &'static str, message: String) -> ProposerError {
    ProposerError::InvalidArgument { method, message }
}
