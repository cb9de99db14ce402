//! `check_proposer`: drives any proposer through the whole lifecycle on the CPU backend with
//! synthetic inputs and reports every broken contract, with what to fix.
//!
//! The checker plays the engine: it allocates state with a token budget, prefills the
//! drafter with a prompt and its hiddens, then alternates `propose` and a simulated verify
//! against a known continuation, calling `after_verify` with the accepted count. Alongside it
//! runs a twin of every sequence through `propose_batch` (alone once the proposer says it
//! does not batch) and compares the drafts, probes the grammar mask, asks every sequence for
//! a tree and its twin for the same tree through `propose_tree_batch`, asks one sequence for
//! trees (with and without a mask) and checks their shape, moves drafter KV out and back in, and finally checks that `free_state`
//! returned every byte. Proposers must be deterministic given the same state and inputs.
//! A proposer that names `target_layer_ids` is given synthetic captured rows as the engine
//! gives them: `ctx.target_hidden_stack` at its prefill, and at each propose the rows of the
//! tokens committed since the previous one as `target_hidden_stack`.
//!
//! It never panics: a proposer that panics or errors is reported, and the check goes on with
//! the sequences that still work.

mod batch;
mod driver;
mod guard;
mod kv_carry;
mod report;
mod synthetic;
mod tree;

pub use report::{ConformanceReport, Violation};

use crate::backend::{CpuBackend, GpuBackend};
use crate::speculative::DraftProposer;
use std::sync::Arc;

/// The synthetic setting a proposer is checked in.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckOptions {
    /// Name used in the report.
    pub label: String,
    /// Vocabulary size of the synthetic model.
    pub vocab_size: usize,
    /// Hidden size of the synthetic model (a multiple of 16).
    pub hidden_size: usize,
    /// Sequences driven at once.
    pub num_sequences: usize,
    /// Drafts asked for per propose.
    pub num_drafts: usize,
    /// Propose/verify rounds per sequence.
    pub steps: usize,
    /// Seed of the synthetic prompts, continuations and hiddens.
    pub seed: u64,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions {
            label: "proposer".to_string(),
            vocab_size: 64,
            hidden_size: 64,
            num_sequences: 3,
            num_drafts: 4,
            steps: 8,
            seed: 0,
        }
    }
}

/// Checks `proposer` on a fresh CPU backend.
pub fn check_proposer(proposer: &dyn DraftProposer, options: &CheckOptions) -> ConformanceReport {
    check_proposer_on(proposer, Arc::new(CpuBackend::new()), options)
}

/// Checks `proposer` on `gpu`. Leaks are measured as allocations that appear on `gpu`
/// during the check and are still live at its end, so nothing else should allocate on
/// `gpu` meanwhile.
pub fn check_proposer_on(
    proposer: &dyn DraftProposer,
    gpu: Arc<dyn GpuBackend>,
    options: &CheckOptions,
) -> ConformanceReport {
    driver::run(proposer, gpu, options)
}
