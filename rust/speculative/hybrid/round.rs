//! The hybrid's drafting round, for one sequence (`propose`) or several (`propose_batch`):
//! each sequence's members catch up on the tokens they missed, then the members are asked in
//! list order. A sequence asks a member for drafts until one wins it (see the module
//! documentation) and for 0 after; each member's drafts, won or not, are kept for
//! `after_verify`.
//!
//! Batching: the sequences that ask a member for the same count are asked in one
//! `propose_batch` of that member when it batches (`propose_batch_max() > 1`), each with its
//! own captured rows in `ctx.target_hidden_stacks`; a member that declines (`None`), or a
//! lone sequence, is asked with `propose`, one sequence at a time. Either way every sequence
//! sees the same calls in the same order as a `propose` of its own would make, so a batch
//! drafts what its sequences would draft one by one.
//!
//! Trees: a round serving `propose_tree` or `propose_tree_batch` asks each member that grows
//! trees (`grows_trees()`, read at each call) for its drafts with `propose_tree` /
//! `propose_tree_batch`, with the step's node budget as the count; every other member, and
//! every member asked for none, is asked as in a chain round, so a member that grows no
//! trees drafts its chain.
//!
//! Invariants:
//! - A member's drafts are never more than it was asked for, and a member's tree is
//!   well-formed; otherwise the call fails, naming the member.
//! - Only a lone sequence carries a draft embedding or a grammar mask (as `propose_batch`
//!   does not), and only to the members it asks for drafts.
//! - A batch asked for confidences (`out_conf`) reports, for each sequence, those its
//!   winning member reported with its drafts, one a draft (members are asked for theirs
//!   only then), and an empty list where the winner reported none (it was asked
//!   with `propose`, or its `propose_batch` gave none or not one a draft): the engine
//!   calibrates what it is told against what is accepted, so a member's figures are never
//!   made up. A lone sequence of a batch is asked through its members' `propose_batch`
//!   where they batch, so it too gets its winner's confidences.

use super::state::{HybridState, Step};
use super::{Hybrid, HybridChoice};
use crate::backend::DevicePtr;
use crate::model::ForwardContext;
use crate::speculative::error::bad;
use crate::speculative::{DraftTree, ProposerError, ProposerState};
use std::sync::atomic::Ordering;

/// One sequence of a round: its state and `propose`'s arguments.
pub(super) struct RoundSeq<'s> {
    pub st: &'s mut HybridState,
    pub token: u32,
    pub hidden: DevicePtr,
    pub position: usize,
    /// The hybrid's captured rows since its previous propose (`None` without layers).
    pub stack: Option<DevicePtr>,
}

/// One member's answer for one sequence: its drafts (a chain unless the round asks for
/// trees) and, where it reported them through `propose_batch`, its confidence in each. A
/// round returns its winner's for each sequence (none drafted: empty, `None`).
pub(super) type Answer = (DraftTree, Option<Vec<f32>>);

/// What the call a round serves asks of it: a lone `propose`'s extras (a batch carries
/// none), or a batch's confidences.
#[derive(Clone, Copy, Default)]
pub(super) struct RoundCall<'m> {
    /// Whether the round is a lone `propose`.
    pub lone: bool,
    /// Whether the caller asked for confidences (`out_conf`): members are asked for theirs
    /// only then.
    pub want_conf: bool,
    /// Whether the round serves `propose_tree` / `propose_tree_batch`: members asked for
    /// drafts are asked for trees.
    pub tree: bool,
    pub draft_embed_target: Option<DevicePtr>,
    pub grammar_bitmask: Option<&'m [i32]>,
}

impl Hybrid {
    /// The round for `seqs` (see the module doc): the drafts each returns, with their
    /// confidences.
    pub(super) fn draft_round(
        &self,
        method: &'static str,
        seqs: &mut [RoundSeq<'_>],
        num_drafts: usize,
        ctx: &ForwardContext<'_>,
        stream: u64,
        extras: RoundCall<'_>,
    ) -> crate::Result<Vec<Answer>> {
        for q in seqs.iter_mut() {
            if q.st.step.is_some() {
                return Err(bad(
                    method,
                    "the previous propose was not followed by after_verify".into(),
                ));
            }
            self.catch_up(q.st, q.hidden, q.position, ctx, stream, q.stack)?;
        }
        let n = seqs.len();
        let gpu = ctx.gpu.as_ref();
        let hidden = ctx.config.hidden_size;
        let mut winners: Vec<Option<usize>> = vec![None; n];
        let mut drafts: Vec<Vec<DraftTree>> = vec![Vec::with_capacity(self.members.len()); n];
        let mut confs: Vec<Vec<Option<Vec<f32>>>> = vec![Vec::with_capacity(self.members.len()); n];
        for i in 0..self.members.len() {
            let asks: Vec<usize> = winners
                .iter()
                .map(|w| w.map_or(self.ask(i, num_drafts), |_| 0))
                .collect();
            let mut rows = Vec::with_capacity(n);
            for q in seqs.iter_mut() {
                rows.push(self.rows_for(i, q.st, gpu, q.stack, q.position, hidden, stream)?);
            }
            let got = self.ask_member(i, seqs, &asks, &rows, ctx, stream, extras)?;
            for (s, (d, c)) in got.into_iter().enumerate() {
                let q = &mut seqs[s];
                q.st.seen[i] = Some(q.position);
                if d.len() > asks[s] {
                    let message =
                        format!("returned {} drafts, asked for at most {}", d.len(), asks[s]);
                    return Err(self.member_error(method, i, bad(method, message)));
                }
                if let Some(fault) = d.fault(asks[s], ctx.config.vocab_size) {
                    let message = format!("returned a tree with {fault}");
                    return Err(self.member_error(method, i, bad(method, message)));
                }
                if winners[s].is_none()
                    && asks[s] > 0
                    && d.len() >= self.members[i].min_drafts
                    && (self.choice == HybridChoice::First || q.st.odds.wins(i, d.len()))
                {
                    winners[s] = Some(i);
                }
                drafts[s].push(d);
                confs[s].push(c);
            }
        }
        let mut out = Vec::with_capacity(n);
        let rounds = seqs.iter_mut().zip(winners).zip(drafts).zip(confs);
        for (((q, winner), drafts), mut confs) in rounds {
            out.push(winner.map_or((DraftTree::default(), None), |w| {
                (drafts[w].clone(), confs[w].take())
            }));
            self.last_winner
                .store(winner.unwrap_or(usize::MAX), Ordering::Relaxed);
            q.st.step = Some(Step {
                position: q.position,
                drafts,
                winner,
            });
        }
        Ok(out)
    }

    /// The round for a batched call (`propose_batch`, `propose_tree_batch`) named `method`:
    /// checks one of each argument per sequence, and each sequence's captured rows where the
    /// hybrid captures layers.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn batch_round(
        &self,
        method: &'static str,
        (last_tokens, target_hiddens, positions): (&[u32], &[DevicePtr], &[usize]),
        count: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
        extras: RoundCall<'_>,
    ) -> crate::Result<Vec<Answer>> {
        let n = last_tokens.len();
        let stacks = ctx.target_hidden_stacks.filter(|_| !self.layers.is_empty());
        if stacks.is_none() && !self.layers.is_empty() {
            return Err(bad(
                method,
                "this hybrid captures target layers: ctx.target_hidden_stacks must hold each sequence's rows".into(),
            ));
        }
        ProposerError::check_batch(
            method,
            n,
            &[
                ("hiddens", target_hiddens.len()),
                ("captured row sets", stacks.map_or(n, <[DevicePtr]>::len)),
                ("positions", positions.len()),
                ("states", states.len()),
            ],
        )?;
        let mut seqs = Vec::with_capacity(n);
        for (s, state) in states.iter_mut().enumerate() {
            seqs.push(RoundSeq {
                st: self.state(&mut **state, method)?,
                token: last_tokens[s],
                hidden: target_hiddens[s],
                position: positions[s],
                stack: stacks.map(|k| k[s]),
            });
        }
        self.draft_round(method, &mut seqs, count, ctx, stream, extras)
    }

    /// Member `i`'s drafts for every sequence of `seqs`, `asks[s]` of sequence `s`, each
    /// given its rows `rows[s]`: batched where the member batches (a group of one too when
    /// the round is a batch, for its confidences), else one by one.
    #[allow(clippy::too_many_arguments)]
    fn ask_member(
        &self,
        i: usize,
        seqs: &mut [RoundSeq<'_>],
        asks: &[usize],
        rows: &[Option<DevicePtr>],
        ctx: &ForwardContext<'_>,
        stream: u64,
        extras: RoundCall<'_>,
    ) -> crate::Result<Vec<Answer>> {
        let prop = self.members[i].proposer.as_ref();
        // A tree round asks for trees only of a member that grows them: read once a member.
        let extras = RoundCall {
            tree: extras.tree && prop.grows_trees(),
            ..extras
        };
        let n = seqs.len();
        let mut got: Vec<Option<Answer>> = vec![None; n];
        // A lone `propose` carries extras a batch cannot; a batch's lone sequence has none.
        let batch_max = if extras.lone {
            1
        } else {
            prop.propose_batch_max(&ctx.buffers, &ctx.config)
        };
        if batch_max > 1 {
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by_key(|&s| (asks[s], s));
            for run in order.chunk_by(|&a, &b| asks[a] == asks[b]) {
                for group in run.chunks(batch_max) {
                    let batch = self.member_batch(
                        i,
                        seqs,
                        group,
                        asks[group[0]],
                        rows,
                        ctx,
                        stream,
                        extras,
                    )?;
                    for (&s, answer) in group.iter().zip(batch.into_iter().flatten()) {
                        got[s] = Some(answer);
                    }
                }
            }
        }
        let mut out = Vec::with_capacity(n);
        for (s, q) in seqs.iter_mut().enumerate() {
            if let Some(answer) = got[s].take() {
                out.push(answer);
                continue;
            }
            let ask = asks[s];
            let lone = if ask > 0 {
                extras
            } else {
                RoundCall::default()
            };
            let state = &mut *q.st.members[i];
            let (embed, mask) = (lone.draft_embed_target, lone.grammar_bitmask);
            let d = if extras.tree && ask > 0 {
                prop.propose_tree(
                    q.token, q.hidden, q.position, ask, state, ctx, stream, embed, mask, rows[s],
                )
                .map_err(|e| self.member_error("propose_tree", i, e))?
            } else {
                let d = prop
                    .propose(
                        q.token, q.hidden, q.position, ask, state, ctx, stream, embed, mask,
                        rows[s],
                    )
                    .map_err(|e| self.member_error("propose", i, e))?;
                DraftTree::chain(d)
            };
            out.push((d, None));
        }
        Ok(out)
    }

    /// One `propose_batch` of member `i` for the sequences `group` of `seqs`, all asked
    /// `ask`, with the confidences it reported for each where `extras.want_conf` (kept only
    /// where they hold one a draft); one `propose_tree_batch` instead where `extras.tree`
    /// (the round asks this member for trees) and `ask` is not 0. `None` when the member declines or answers for another
    /// count of sequences.
    #[allow(clippy::too_many_arguments)]
    fn member_batch(
        &self,
        i: usize,
        seqs: &mut [RoundSeq<'_>],
        group: &[usize],
        ask: usize,
        rows: &[Option<DevicePtr>],
        ctx: &ForwardContext<'_>,
        stream: u64,
        extras: RoundCall<'_>,
    ) -> crate::Result<Option<Vec<Answer>>> {
        let tokens: Vec<u32> = group.iter().map(|&s| seqs[s].token).collect();
        let hiddens: Vec<DevicePtr> = group.iter().map(|&s| seqs[s].hidden).collect();
        let positions: Vec<usize> = group.iter().map(|&s| seqs[s].position).collect();
        let stacks: Option<Vec<DevicePtr>> = group.iter().map(|&s| rows[s]).collect();
        let ctx = &ForwardContext {
            target_hidden_stacks: stacks.as_deref(),
            ..ctx.clone()
        };
        let mut member = vec![false; seqs.len()];
        for &s in group {
            member[s] = true;
        }
        let mut states: Vec<&mut dyn ProposerState> = seqs
            .iter_mut()
            .enumerate()
            .filter(|(s, _)| member[*s])
            .map(|(_, q)| -> &mut dyn ProposerState { &mut *q.st.members[i] })
            .collect();
        let prop = self.members[i].proposer.as_ref();
        if extras.tree && ask > 0 {
            let trees = prop
                .propose_tree_batch(&tokens, &hiddens, &positions, ask, &mut states, ctx, stream)
                .map_err(|e| self.member_error("propose_tree_batch", i, e))?;
            let trees = trees.filter(|t| t.len() == group.len());
            return Ok(trees.map(|t| t.into_iter().map(|t| (t, None)).collect()));
        }
        let mut confs = Vec::new();
        let drafts = prop
            .propose_batch(
                &tokens,
                &hiddens,
                &positions,
                ask,
                &mut states,
                ctx,
                stream,
                extras.want_conf.then_some(&mut confs),
            )
            .map_err(|e| self.member_error("propose_batch", i, e))?;
        let Some(drafts) = drafts.filter(|d| d.len() == group.len()) else {
            return Ok(None);
        };
        let mut confs = confs.into_iter();
        let answers = drafts
            .into_iter()
            .map(|d| {
                let c = confs.next().filter(|c| c.len() == d.len() && !d.is_empty());
                (DraftTree::chain(d), c)
            })
            .collect();
        Ok(Some(answers))
    }
}
