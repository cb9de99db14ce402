//! Asking the proposer for a step's drafts: a group of sequences at once (`propose_batch`,
//! and for trees `propose_tree_batch` in `step_tree`) or one sequence alone (`propose`,
//! `propose_tree`), and checking what comes back against the protocol.
//!
//! Invariants:
//! - A call's time is its sequences' drafting time: a group's split evenly among its
//!   members.
//! - A sequence is marked as proposed exactly when its call answered, so `after_verify`
//!   follows every successful propose and nothing else.
//! - A failed lone call ends its sequence; a failed, unsupported or misshapen group call
//!   ends nothing: its members propose alone instead.
//! - Drafts that break the protocol (more than asked, outside the vocabulary) end their
//!   sequence and are never verified; otherwise the first `budget` are kept.

use super::error::Stage;
use super::sequence::{members_mut, EngineSequence};
use super::{EngineError, SpecEngine, Target};
use crate::backend::{DevicePtr, DEFAULT_STREAM};
use crate::model::ForwardContext;
use crate::speculative::{bitmask_words, DraftProposer, ProposerState};
use crate::Result;
use std::time::Instant;

/// What a lone propose reads of its sequence.
pub(super) struct LoneInputs<'m> {
    pub last: u32,
    /// The sequence's row of `hidden_rows` paired with its last token.
    pub hidden: DevicePtr,
    pub position: usize,
    /// The grammar's mask for the next position, under a grammar.
    pub mask: Option<&'m [i32]>,
    /// The captured rows since the last propose, where the engine captures.
    pub stack: Option<DevicePtr>,
}

/// What a batched propose reads of each member of its group, in the group's order.
pub(super) struct GroupInputs {
    pub last: Vec<u32>,
    /// Each member's row of `hidden_rows` paired with its last token.
    pub hiddens: Vec<DevicePtr>,
    pub positions: Vec<usize>,
}

impl<T: Target> SpecEngine<T> {
    /// One batched call for `group` (ascending indices into `seqs`), given what each
    /// member proposes from and each one's state; `None` when the caller should propose per
    /// sequence instead (unsupported, failed, or not one answer per member). Each member is
    /// charged an equal share of the call's time.
    pub(super) fn run_group<A>(
        &self,
        group: &[usize],
        seqs: &mut [EngineSequence<T::KvSequence>],
        ctx: &ForwardContext<'_>,
        call: impl FnOnce(
            &GroupInputs,
            &mut [&mut dyn ProposerState],
            &ForwardContext<'_>,
        ) -> Result<Option<Vec<A>>>,
    ) -> Option<Vec<A>> {
        let hb = self.row_bytes();
        let inputs = GroupInputs {
            last: group.iter().map(|&i| seqs[i].last_token()).collect(),
            hiddens: group
                .iter()
                .map(|&i| seqs[i].hidden_rows.offset(seqs[i].hidden_row * hb))
                .collect(),
            positions: group.iter().map(|&i| seqs[i].last_pos()).collect(),
        };
        let stacks: Option<Vec<DevicePtr>> =
            group.iter().map(|&i| seqs[i].stack.for_propose()).collect();
        let ctx = &ForwardContext {
            target_hidden_stacks: stacks.as_deref(),
            ..ctx.clone()
        };
        let t = Instant::now();
        let result = {
            let mut states: Vec<&mut dyn ProposerState> = members_mut(seqs, group.iter().copied())
                .filter_map(|s| s.state_mut())
                .collect();
            if states.len() != group.len() {
                return None;
            }
            call(&inputs, &mut states, ctx)
        };
        let share = t.elapsed() / group.len() as u32;
        match result {
            Ok(Some(answers)) if answers.len() == group.len() => {
                for &i in group {
                    seqs[i].metrics.draft_time += share;
                    seqs[i].proposed = true;
                }
                Some(answers)
            }
            _ => None,
        }
    }

    /// One `propose_batch` call for `group`; false when the caller should propose per
    /// sequence instead (see [`SpecEngine::run_group`]).
    pub(super) fn propose_group(
        &self,
        prop: &dyn DraftProposer,
        group: &[usize],
        budgets: &[usize],
        seqs: &mut [EngineSequence<T::KvSequence>],
        ctx: &ForwardContext<'_>,
    ) -> bool {
        let n_max = group.iter().map(|&i| budgets[i]).max().unwrap_or(0);
        let mut confs = Vec::new();
        let want_conf = self.wants_confidence();
        let answers = self.run_group(group, seqs, ctx, |x, states, ctx| {
            prop.propose_batch(
                &x.last,
                &x.hiddens,
                &x.positions,
                n_max,
                states,
                ctx,
                DEFAULT_STREAM,
                want_conf.then_some(&mut confs),
            )
        });
        let Some(drafts) = answers else {
            return false;
        };
        for (k, (&i, d)) in group.iter().zip(drafts).enumerate() {
            let seq = &mut seqs[i];
            self.take_drafts(seq, d, budgets[i], n_max, "propose_batch");
            self.trim_drafts(seq, confs.get(k).map(Vec::as_slice));
        }
        true
    }

    /// One call for `seq` alone (`propose` or `propose_tree`), given what it proposes from
    /// (`None` for the grammar mask when it has no grammar) and its state; `None` when it
    /// cannot propose (no state) or the call failed, which ends it. The call's time is the
    /// sequence's drafting time.
    pub(super) fn run_lone<A>(
        &self,
        seq: &mut EngineSequence<T::KvSequence>,
        ctx: &ForwardContext<'_>,
        call: impl FnOnce(LoneInputs<'_>, &mut dyn ProposerState) -> Result<A>,
    ) -> Option<A> {
        let hidden = seq.hidden_rows.offset(seq.hidden_row * self.row_bytes());
        let mut mask = None;
        if let Some(g) = seq.grammar.as_deref_mut() {
            let mut words = vec![0i32; bitmask_words(ctx.config.vocab_size)];
            if let Err(e) = g.fill_mask(&mut words) {
                seq.fail_at(Stage::GrammarMask, e);
                return None;
            }
            mask = Some(words);
        }
        let inputs = LoneInputs {
            last: seq.last_token(),
            hidden,
            position: seq.last_pos(),
            mask: mask.as_deref(),
            stack: seq.stack.for_propose(),
        };
        let state = seq.state.as_deref_mut()?;
        let t = Instant::now();
        let result = call(inputs, state);
        seq.metrics.draft_time += t.elapsed();
        match result {
            Ok(answer) => {
                seq.proposed = true;
                Some(answer)
            }
            Err(e) => {
                seq.fail_at(Stage::Propose, e);
                None
            }
        }
    }

    pub(super) fn propose_one(
        &self,
        prop: &dyn DraftProposer,
        seq: &mut EngineSequence<T::KvSequence>,
        budget: usize,
        ctx: &ForwardContext<'_>,
    ) {
        let drafts = self.run_lone(seq, ctx, |x, state| {
            prop.propose(
                x.last,
                x.hidden,
                x.position,
                budget,
                state,
                ctx,
                DEFAULT_STREAM,
                None,
                x.mask,
                x.stack,
            )
        });
        if let Some(d) = drafts {
            self.take_drafts(seq, d, budget, budget, "propose");
        }
    }

    /// Checks a proposer's drafts against the protocol and keeps the first `budget`.
    pub(super) fn take_drafts(
        &self,
        seq: &mut EngineSequence<T::KvSequence>,
        mut drafts: Vec<u32>,
        budget: usize,
        asked: usize,
        method: &'static str,
    ) {
        let vocab = self.target.config().vocab_size;
        if drafts.len() > asked {
            seq.fail(
                EngineError::ProposerContract {
                    method,
                    message: format!(
                        "returned {} drafts, asked for at most {asked}",
                        drafts.len()
                    ),
                }
                .into(),
            );
        } else if let Some(&bad) = drafts.iter().find(|&&t| t as usize >= vocab) {
            seq.fail(
                EngineError::ProposerContract {
                    method,
                    message: format!("draft token {bad} is outside the vocabulary of {vocab}"),
                }
                .into(),
            );
        } else {
            drafts.truncate(budget);
            seq.drafts = drafts;
        }
    }
}
