//! `SuffixDecoding`: model-free drafting from suffix trees (after SuffixDecoding, Oliaro et
//! al., arXiv 2411.04975), over the sequence's own prompt and output and over the outputs of
//! the sequences that went before it on the same proposer.
//!
//! To draft, the proposer matches the end of the history in each tree, and for every length
//! of the match follows the most frequent continuation while its empirical probability
//! stays at or above `min_token_prob`, with at most `max_spec_factor` drafts per matched
//! token; the chain with the highest expected accepted count wins (the shared tree only when
//! strictly better than the sequence's own). Built `with_trees`, it grows a tree instead
//! (`propose_tree`): the continuations most likely to be reached, best first, so a less
//! frequent continuation is verified beside the most frequent one.
//!
//! One file per job: `trie` (the counted suffix trie), `draft` (choosing a chain), `tree`
//! (choosing a tree), `shared` (the bounded store of finished outputs), `options` (the
//! knobs and their ranges), `proposer` (the `DraftProposer` methods).
//!
//! Invariants: drafts depend only on the sequence's history and on the outputs of sequences
//! already freed, so a re-propose from the same point and `propose_batch` give what
//! `propose` gives; a sequence's output enters the shared tree in `free_state`, after the
//! last `max_depth / 2` tokens of its prompt (so a repeated prompt drafts its earlier
//! output from its first generated token); the shared
//! tree never holds more than `max_tree_nodes` nodes once an output is stored; no device
//! memory is allocated.

mod draft;
mod options;
mod proposer;
mod shared;
mod state;
mod tree;
mod trie;

pub use options::{
    SuffixDecodingOptions, DEFAULT_MAX_DEPTH, DEFAULT_MAX_SPEC_FACTOR, DEFAULT_MAX_TREE_NODES,
    DEFAULT_MIN_TOKEN_PROB,
};
pub use proposer::SuffixDecoding;
pub use shared::SharedTreeStats;
pub use state::SuffixState;
