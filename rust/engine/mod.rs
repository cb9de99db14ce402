//! The engine layer: the speculative decoding loop that drives a `DraftProposer` against a
//! target model, verification (greedy and lossless rejection sampling), grammar masks, and
//! acceptance metrics, and the scheduler in front of the loop (queueing, continuous
//! batching, preemption, chunked prefill).
//!
//! Invariants:
//! - Greedy output is token for token what plain greedy decoding of the target gives,
//!   whatever the proposer drafts (given a target whose rows do not depend on batching).
//! - Sampled output is distributed as plain sampling from the target (rejection sampling).
//! - Every emitted token is allowed by the sequence's grammar, when it has one.
//! - Whatever ends a sequence (EOS, length, an error), its proposer state, target KV and
//!   engine buffers are released: the backend's ledger returns to where it started.
//! - A bad request is refused before it runs ([`EngineError::is_request_error`]); a failure
//!   while running ends only its own sequence and keeps the layer's error as its source.
//!
//! [`testing`] holds `TableTarget`, a deterministic stand-in target for tests and examples.

mod conversation;
mod cost_fit;
mod cost_model;
mod decayed_counts;
mod draft_confidence;
mod draft_policy;
mod draw;
mod error;
mod grammar;
mod guard;
mod host_verify;
mod metrics;
mod model_target;
mod prefill;
pub mod ranks;
mod request;
mod scheduler;
mod seq_lifecycle;
mod sequence;
mod spec_engine;
mod stack;
mod step;
mod step_drafts;
mod step_propose;
mod step_tree;
mod target;
mod target_probs;
pub mod testing;
mod verify;
mod verify_tree;
mod verify_tree_sampled;

pub use conversation::{CarriedKv, Conversation};
pub use cost_fit::CostFit;
pub use cost_model::{CostCurve, CostCurves, CostModel, FixedCost, MeasuredCost};
pub use draft_policy::DraftPolicyKind;
pub use draw::sample_from;
pub use error::{EngineError, Stage};
pub use grammar::GrammarMatcher;
pub use metrics::Metrics;
pub use request::{FinishReason, GenerateRequest, GenerateResult, Generation};
pub use scheduler::{GenerationRun, ServeUpdate, StreamUpdate};
pub use spec_engine::{drafter_pool_probe, mtp_pool_probe, DrafterPoolProbe, SpecEngine};
pub use step_tree::DraftShape;
pub use target::{KvPoolStatus, Target, TargetOutput};
pub use target_probs::target_probs;
pub use verify::{argmax, verify, verify_picks, SamplingParams, Verdict};
pub use verify_tree::{verify_tree_greedy, verify_tree_picks, TreeVerdict};
pub use verify_tree_sampled::verify_tree_sampled;
