//! One sequence's bookkeeping inside the engine loop.
//!
//! Invariants:
//! - `tokens` is the prompt followed by every emitted token; the last one is not yet in the
//!   target's KV, so `kv` holds `tokens.len() - 1` tokens between steps.
//! - `hidden_rows` holds the hidden rows of the sequence's last forward (engine-owned
//!   copies, so a proposer that reuses the target's scratch cannot clobber them); row
//!   `hidden_row` is the hidden whose logits picked the last token. When the proposer names
//!   target layers, `stack` holds the captured rows of every token committed since its last
//!   propose (see `stack`), the last of them paired with the last token.
//! - Every resource (`kv`, `state`, `hidden_rows`, the prefill capture, carried blocks) is released
//!   exactly once, by the engine's `release`, whatever ended the sequence; a preempted
//!   sequence gives them up early (`preempt`) and takes fresh ones when it is readmitted.
//! - While `admitted`, the target KV holds `tokens[..prefilled]` during the prefill and
//!   `tokens[..len - 1]` once `prefilled == prefill_end`; a waiting sequence holds nothing
//!   but its tokens, its sampler and its grammar, which preemption keeps as they are.

use super::draft_policy::SequenceDraftStats;
use super::error::Stage;
use super::stack::StackRows;
use super::{CarriedKv, EngineError, FinishReason, GrammarMatcher, Metrics, SamplingParams};
use crate::backend::DevicePtr;
use crate::speculative::ProposerState;
use rand::rngs::SmallRng;
use std::time::Instant;

/// What the drafter still has to learn about the prompt before its first propose.
pub(super) enum DrafterPrefill {
    /// `prefill_drafter` over the whole prompt.
    Prefill,
    /// `catchup_drafter` for the prompt rows after carried drafter KV.
    Catchup { row_base: usize, pos_base: usize },
}

/// A drafter prefill waiting to run, with the captured target hiddens it needs.
pub(super) struct PendingPrefill {
    pub kind: DrafterPrefill,
    /// The first prefill row whose hidden it needs (`tokens[0]`'s position).
    pub first_row: usize,
    /// The tokens it covers.
    pub tokens: Vec<u32>,
    /// Engine-owned BF16 `[tokens.len(), hidden]` copy of the paired target hiddens.
    pub hiddens: DevicePtr,
    /// Engine-owned BF16 `[tokens.len(), n * hidden]` copy of the paired captured rows, when
    /// the proposer names target layers.
    pub stack: Option<DevicePtr>,
}

/// A grammar slot as the `Option<&mut dyn GrammarMatcher>` that `verify` takes (the
/// trait-object lifetime shortened to the borrow's).
pub(super) fn grammar_of(
    g: &mut Option<Box<dyn GrammarMatcher>>,
) -> Option<&mut dyn GrammarMatcher> {
    match g {
        Some(g) => Some(g.as_mut()),
        None => None,
    }
}

/// The sequences of `seqs` whose indices `group` names, borrowed together, in the order
/// they stand in `seqs` (whatever the order of `group`).
pub(super) fn members_mut<'a, K>(
    seqs: &'a mut [EngineSequence<K>],
    group: impl IntoIterator<Item = usize>,
) -> impl Iterator<Item = &'a mut EngineSequence<K>> + 'a {
    let mut member = vec![false; seqs.len()];
    for i in group {
        member[i] = true;
    }
    seqs.iter_mut()
        .zip(member)
        .filter_map(|(s, m)| m.then_some(s))
}

/// One request's sequence as the engine tracks it, over the target's per-sequence KV `K`.
pub(super) struct EngineSequence<K> {
    /// The request's index in its `generate` call (for messages).
    pub request: usize,
    pub kv: Option<K>,
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub rng: SmallRng,
    pub grammar: Option<Box<dyn GrammarMatcher>>,
    pub stop_on_eos: bool,
    pub state: Option<Box<dyn ProposerState>>,
    pub hidden_rows: DevicePtr,
    pub hidden_row: usize,
    /// The captured rows for the next propose (empty without capture).
    pub stack: StackRows,
    pub pending: Option<PendingPrefill>,
    pub drafts: Vec<u32>,
    /// This step's draft tree when the proposer grew one that branches (`drafts` then holds
    /// its tokens in node order); `None` for a chain.
    pub tree: Option<crate::speculative::DraftTree>,
    /// Where the policy cut nodes from the proposer's tree: the proposer's index of each
    /// node of `tree`.
    pub tree_nodes: Option<Vec<usize>>,
    /// Whether `propose` ran this step (so `after_verify` is owed).
    pub proposed: bool,
    /// Position of the first accepted draft of the last verify (for `catchup_batch`).
    pub catchup_pos: usize,
    pub finish: Option<FinishReason>,
    pub error: Option<crate::Error>,
    pub metrics: Metrics,
    pub started: Instant,
    pub carry_in: Option<CarriedKv>,
    pub carry_out: Option<CarriedKv>,
    pub released: bool,
    /// Whether it holds its resources and takes part in steps (sequences wait in the queue
    /// for a slot and for KV blocks, and go back to it when preempted).
    pub admitted: bool,
    /// Tokens of `tokens[..prefill_end]` the target KV holds so far.
    pub prefilled: usize,
    /// Tokens the (re)prefill puts in the target KV: the prompt, or after a preemption
    /// every token but the last.
    pub prefill_end: usize,
    /// Rows it may append to the target KV this step (the scheduler's grant).
    pub row_cap: usize,
    /// When it last joined the queue (at the call's start, or when preempted).
    pub queued_at: Instant,
    /// Generated tokens already handed to a stream.
    pub streamed: usize,
    /// The draft policy's estimates for this sequence.
    pub draft_stats: SequenceDraftStats,
}

impl<K> EngineSequence<K> {
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    pub fn last_token(&self) -> u32 {
        self.tokens.last().copied().unwrap_or(0)
    }

    /// Position of the last token (the next verify's first row).
    pub fn last_pos(&self) -> usize {
        self.tokens.len().saturating_sub(1)
    }

    /// The proposer state, likewise.
    pub fn state_mut(&mut self) -> Option<&mut dyn ProposerState> {
        match &mut self.state {
            Some(s) => Some(s.as_mut()),
            None => None,
        }
    }

    /// Admitted, prefilled and not finished: it takes part in decode steps.
    pub fn active(&self) -> bool {
        self.admitted && self.prefilled >= self.prefill_end && self.finish.is_none()
    }

    /// Admitted and not finished, with prompt rows still to prefill.
    pub fn prefilling(&self) -> bool {
        self.admitted && self.prefilled < self.prefill_end && self.finish.is_none()
    }

    /// Ends its wait in the queue (the time is added to its queue time).
    pub fn leave_queue(&mut self) {
        self.metrics.queue_time += self.queued_at.elapsed();
    }

    /// Records the first emitted token's time, once.
    pub fn mark_first_token(&mut self) {
        if self.metrics.first_tokens == 0 && self.generated() > 0 {
            self.metrics.time_to_first_token = self.started.elapsed();
            self.metrics.first_tokens = 1;
        }
    }

    pub fn live(&self) -> bool {
        self.finish.is_none()
    }

    /// A prefill chunk of `rows` rows completes this sequence's prefill on its first
    /// admission: that chunk's last row picks its first token (a recomputation after a
    /// preemption picked it before).
    pub fn first_token_due(&self, rows: usize) -> bool {
        self.live() && self.generated() == 0 && self.prefilled + rows == self.prefill_end
    }

    /// Ends the sequence with `error` (the first error wins).
    pub fn fail(&mut self, error: crate::Error) {
        if self.error.is_none() {
            self.error = Some(error);
        }
        self.finish = Some(FinishReason::Error);
    }

    /// Ends the sequence with `error`, raised at `stage` (see [`EngineError::at`]).
    pub fn fail_at(&mut self, stage: Stage, error: crate::Error) {
        self.fail(EngineError::at(self.request, stage, error));
    }

    /// The target KV, which every started sequence holds until it is released.
    pub fn kv_mut(&mut self) -> Result<&mut K, EngineError> {
        let request = self.request;
        self.kv.as_mut().ok_or(EngineError::NoKv { request })
    }

    /// Appends emitted tokens, stopping at EOS, `max_tokens` or the end of the context.
    /// Returns how many were kept.
    pub fn emit(&mut self, tokens: &[u32], eos: &[u32], max_seq_len: usize) -> usize {
        let mut kept = 0;
        for &t in tokens {
            if self.finish.is_some() {
                break;
            }
            self.tokens.push(t);
            kept += 1;
            if self.stop_on_eos && eos.contains(&t) {
                self.finish = Some(FinishReason::Stop);
            } else if self.generated() >= self.max_tokens {
                self.finish = Some(FinishReason::Length);
            } else if self.tokens.len() >= max_seq_len {
                self.finish = Some(FinishReason::Context);
            }
        }
        if self.finish.is_none() && self.grammar.as_ref().is_some_and(|g| g.is_finished()) {
            self.finish = Some(FinishReason::Stop);
        }
        kept
    }
}
