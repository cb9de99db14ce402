//! The engine layer: the speculative decoding loop that drives a `DraftProposer` against a
//! target model, verification (greedy and lossless rejection sampling), grammar masks, and
//! acceptance metrics.
//!
//! Invariants:
//! - Greedy output is token for token what plain greedy decoding of the target gives,
//!   whatever the proposer drafts (given a target whose rows do not depend on batching).
//! - Sampled output is distributed as plain sampling from the target (rejection sampling).
//! - Every emitted token is allowed by the sequence's grammar, when it has one.
//! - Whatever ends a sequence (EOS, length, an error), its proposer state, target KV and
//!   engine buffers are released: the backend's ledger returns to where it started.

mod conversation;
#[allow(clippy::module_inception)]
mod engine;
mod error;
mod grammar;
mod metrics;
mod model_target;
mod prefill;
mod request;
mod sequence;
mod step;
mod table_target;
mod target;
mod verify;

pub use conversation::{CarriedKv, Conversation};
pub use engine::SpecEngine;
pub use error::EngineError;
pub use grammar::GrammarMatcher;
pub use metrics::Metrics;
pub use request::{FinishReason, GenerateRequest, GenerateResult, Generation};
pub use table_target::{decode_hidden, TableSeq, TableTarget};
pub use target::{Target, TargetOutput};
pub use verify::{argmax, sample_from, target_probs, verify, SamplingParams, Verdict};
