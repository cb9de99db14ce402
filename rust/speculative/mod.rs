//! The speculative layer: the `DraftProposer` protocol, its proposers (`MtpHead`,
//! `Eagle3Head`, `DFlashHead`, `PromptLookup`, `SuffixDecoding`, and `Hybrid`, made of
//! others), `DelegatingProposer` for wrappers of a proposer, and the conformance checker
//! that drives any proposer through the whole lifecycle.
//!
//! Invariants every proposer in this module keeps (and [`conformance::check_proposer`]
//! checks for any proposer):
//! - `propose` returns at most `num_drafts` ids, each inside the vocabulary, each allowed by
//!   the grammar mask when one is given.
//! - `propose_batch`, when supported, returns what per-sequence `propose` would.
//! - `propose_tree` returns a tree of at most `budget` nodes, each node's parent before it,
//!   each token inside the vocabulary and allowed by the grammar mask.
//! - after `take_drafter_kv`, a state behaves as freshly allocated.
//! - `free_state` returns every device allocation `alloc_state` made.

pub mod conformance;
mod delegating;
pub mod dflash;
mod draft_binding;
mod draft_tree;
pub mod eagle3;
mod error;
mod grammar;
pub mod hybrid;
pub mod mtp;
mod prompt_lookup;
mod protocol;
mod protocol_methods;
pub mod suffix;

pub use delegating::DelegatingProposer;
pub use dflash::{DFlashHead, DFlashState};
pub use draft_binding::{DraftBinding, DraftRunner, WeightSlot};
pub use draft_tree::{DraftTree, TreeFault};
pub use eagle3::{Eagle3Head, Eagle3State};
pub use error::ProposerError;
pub use grammar::{bitmask_allows, bitmask_words};
pub use hybrid::{Hybrid, HybridChoice, HybridMember, HybridState};
pub use mtp::{MtpHead, MtpQuantization, MtpState, MtpWeights};
pub use prompt_lookup::{
    match_confidence, PromptLookup, PromptLookupState, CONFIDENCE_MATCH, DEFAULT_MAX_NGRAM,
    DEFAULT_MIN_NGRAM,
};
pub use protocol::{DraftProposer, ProposerState};
pub(crate) use protocol_methods::with_protocol_methods;
pub use protocol_methods::ProtocolMethod;
pub use suffix::{SuffixDecoding, SuffixDecodingOptions, SuffixState};
