//! `Hybrid`: a proposer made of proposers. Each step it drafts with the first member (in list
//! order) that has a confident draft, and forwards the protocol to every member so their
//! histories, states and drafter KV stay in step with the sequence.
//!
//! Retrieval drafters (`SuffixDecoding`, `PromptLookup`) draft grounded text best and return
//! nothing when nothing matches; learned heads (`MtpHead`, `Eagle3Head`) draft open text. So
//! `Hybrid([SuffixDecoding, head])` drafts by retrieval where the text repeats and by the head
//! elsewhere.
//!
//! One step, as the engine sees it (`propose` then `after_verify`):
//! - **Catch-up.** A member that did not win an earlier step has not seen the drafts the
//!   winner got accepted. Before anything else, each such token is replayed to it as the
//!   step it would have been had the engine committed one token then: `propose(token,
//!   hidden, position, 0)` and `after_verify(0)`, in order. A retrieval member so records the
//!   token (its history stays the sequence's); an MTP head writes the token's drafter row (a
//!   propose of 0 drafts keeps that row), so its KV has no gap. The hidden paired with a
//!   replayed token is the captured row of the target's last layer (its output is the final
//!   hidden before the norm, what `target_hidden` is) when the hybrid was told the target's
//!   layer count ([`Hybrid::new`]'s `target_layers`): the catch-up is then exact, the rows a
//!   head writes those it would have written had it seen every step. Without it there is no
//!   such row, and the replay pairs each token with the step's `target_hidden` (the row of the
//!   token the step drafts from: the nearest hidden there is), so the rows sit at the right
//!   positions from the right tokens, but from a hidden up to a few positions late. A member
//!   that names `target_layer_ids` is given its own captured rows, exact in both cases.
//!   Replaying through the required methods, rather than `catchup_drafter`, reaches every
//!   member alike (retrieval drafters and Python proposers write no drafter rows, but must
//!   see the tokens), and for the MTP head writes the same rows `catchup_drafter` would.
//! - **Drafting.** Members are asked in order for the step's drafts. A member has a confident
//!   draft when it returns at least its `min_drafts` (1 by default: retrieval drafters return
//!   none when nothing matches) and, in this sequence, its first drafts of that length (one,
//!   or more) have been accepted at least as often as those of every later member that may
//!   draft (`odds`: a short suffix match on open text loses to a learned head; until a step
//!   is measured the order decides; [`HybridChoice::First`] leaves it to the order alone).
//!   The first such member wins and its drafts are the hybrid's. Every
//!   later member still sees the step, with `propose(.., num_drafts = 0)`, so it records the
//!   token drafted from (the MTP head defers its one row to a batched write). A block drafter
//!   (`block_gamma() = Some(γ)`) is asked for at most `γ - 1` of the engine's drafts; the
//!   hybrid itself has no block size, so its draft count is the engine's `num_drafts`.
//! - **Verification.** `after_verify(a)` gives the winner `a`; each other member that
//!   returned drafts (short of its `min_drafts`) gets the length of the common prefix of its
//!   drafts with the winner's first `a`; a member asked for none gets 0. The winner's
//!   accepted drafts that a member did not get are what it catches up on next step.
//! - **Trees.** The hybrid grows trees (`grows_trees`) when any member does. `propose_tree`
//!   and `propose_tree_batch` run the same round, asking the members that grow trees for
//!   `propose_tree` / `propose_tree_batch` with the node budget (the others draft their
//!   chains); the winner's tree is the hybrid's. `after_verify_tree`
//!   gives the winner the accepted path, and every other member the longest path of its own
//!   tree that the accepted tokens follow: through `after_verify_tree` where its tree
//!   branches, `after_verify` with the path's length where it is a chain. So a drafter with
//!   KV keeps the accepted path's rows in a hybrid as it would alone, and `Hybrid([
//!   SuffixDecoding(trees), MtpHead(trees)])` grows the suffix trees on grounded text and the
//!   head's on open text.
//!
//! Capture: [`DraftProposer::target_layer_ids`] is the union of the members' ids (each
//! member's in its order, members in list order) followed by the target's last layer when
//! `target_layers` is given and no member names it. Each member receives the columns of its
//! own ids, in its own order, and only the rows of the tokens committed since its own
//! previous propose (a member whose catch-up replayed tokens has had those rows already).
//! `propose_batch` runs the same round for several sequences, asking each member that
//! batches once for every group of sequences that ask it the same count (`round`); its
//! widest batch is its widest member's.
//!
//! The provided methods: `alloc_state_for`, `prefill_drafter` (a member whose
//! `prefill_hidden_rows` is shorter than the prompt skips it, as the engine would skip its
//! prefill) and `free_state` (every member, even after one fails: the first error is
//! returned) go to every member; `catchup_batch` (under `mtp_kv_exact`) to each member whose
//! drafts were accepted, with those drafts; `needs_comm` and `prefill_uses_shared_buffers`
//! are true when any member's is; `read_deferred_draft_token` asks the latest winner.
//! Unsupported, answering the protocol's defaults: carried drafter KV (`take_drafter_kv`
//! gives `None`, so a new turn prefills every member afresh), `drafter_rows` / `last_pair_key`
//! (0 and `None`: unknown), `catchup_drafter` and the circuit executor.
//!
//! Invariants:
//! - Every member gets `after_verify` exactly once for each `propose` it was given, before its
//!   next `propose`; catch-up proposes are settled at once with `after_verify(0)`.
//! - Each member sees every token the hybrid was told of, at its position, in order: the
//!   prompt from `prefill_drafter`, each step's token drafted from, its own accepted drafts
//!   from `after_verify`, and the winner's accepted drafts from the catch-up.
//! - A member that fails fails the hybrid's call, with an error naming the method, the
//!   member's index and its name, and carrying the member's own error.

mod catchup;
mod odds;
mod proposer;
mod round;
mod rows;
mod settle;
mod state;

pub use state::HybridState;

use super::{DraftProposer, ProposerError};
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

/// One member of a [`Hybrid`]: a proposer, the name errors give it, and how many drafts make
/// its draft confident.
#[derive(Clone)]
pub struct HybridMember {
    /// The proposer.
    pub proposer: Arc<dyn DraftProposer>,
    /// Its name in errors (its type, for instance).
    pub name: String,
    /// Drafts it must return to win a step (at least 1).
    pub min_drafts: usize,
}

impl HybridMember {
    /// `proposer`, called `name`, winning a step with any draft.
    pub fn new(name: impl Into<String>, proposer: Arc<dyn DraftProposer>) -> Self {
        HybridMember {
            proposer,
            name: name.into(),
            min_drafts: 1,
        }
    }

    /// The same member, winning a step only with at least `min_drafts` drafts.
    pub fn with_min_drafts(mut self, min_drafts: usize) -> Self {
        self.min_drafts = min_drafts;
        self
    }
}

impl std::fmt::Debug for HybridMember {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridMember")
            .field("name", &self.name)
            .field("min_drafts", &self.min_drafts)
            .finish()
    }
}

/// How a [`Hybrid`] picks the member whose drafts a step takes, among those with a draft of at
/// least their `min_drafts`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HybridChoice {
    /// The first in list order whose first drafts of that length have, in this sequence, been
    /// accepted at least as often as every later member's (the module documentation).
    #[default]
    Measured,
    /// The first in list order: a fixed priority.
    First,
}

/// A proposer that drafts with the first of its members that has a confident draft (see the
/// module documentation).
pub struct Hybrid {
    members: Vec<HybridMember>,
    choice: HybridChoice,
    /// The hybrid's `target_layer_ids`.
    layers: Vec<usize>,
    /// For each member, the columns of `layers` holding its own ids, in its order.
    columns: Vec<Vec<usize>>,
    /// The column of the target's last layer, when the catch-up is exact.
    final_column: Option<usize>,
    /// Each member's `block_gamma`, read once.
    gammas: Vec<Option<usize>>,
    /// Each member's `prefill_hidden_rows`, whatever the served length.
    prefill_caps: Vec<usize>,
    /// The member whose drafts the latest propose returned (`usize::MAX`: none).
    last_winner: AtomicUsize,
}

impl std::fmt::Debug for Hybrid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hybrid")
            .field("members", &self.members)
            .field("choice", &self.choice)
            .field("layers", &self.layers)
            .field("final_column", &self.final_column)
            .finish()
    }
}

fn invalid(message: String) -> ProposerError {
    ProposerError::InvalidArgument {
        method: "Hybrid::new",
        message,
    }
}

impl Hybrid {
    /// A hybrid of `members`, asked in this order.
    ///
    /// `target_layers`, the target's decoder layer count, makes the catch-up of members that
    /// read `target_hidden` exact: the hybrid then names layer `target_layers - 1` (whose
    /// output is the final hidden before the norm) among its `target_layer_ids`. `None` pairs
    /// replayed tokens with the step's `target_hidden` instead (see the module docs).
    ///
    /// Refuses no members, a member with `min_drafts` 0, `target_layers` 0, and a member
    /// that names a layer twice or one at or past `target_layers`.
    pub fn new(
        members: Vec<HybridMember>,
        target_layers: Option<usize>,
    ) -> std::result::Result<Self, ProposerError> {
        if members.is_empty() {
            return Err(invalid("a hybrid needs at least one member".into()));
        }
        if target_layers == Some(0) {
            return Err(invalid(
                "target_layers is 0: a target has at least one decoder layer".into(),
            ));
        }
        let mut layers: Vec<usize> = Vec::new();
        let mut columns = Vec::with_capacity(members.len());
        for (i, m) in members.iter().enumerate() {
            if m.min_drafts == 0 {
                return Err(invalid(format!(
                    "member {i} ({}) has min_drafts 0: a member wins with at least one draft",
                    m.name
                )));
            }
            let ids = m.proposer.target_layer_ids();
            let mut cols = Vec::with_capacity(ids.len());
            for (k, &id) in ids.iter().enumerate() {
                if ids[..k].contains(&id) {
                    return Err(invalid(format!(
                        "member {i} ({}) names target layer {id} twice",
                        m.name
                    )));
                }
                if let Some(n) = target_layers.filter(|&n| id >= n) {
                    return Err(invalid(format!(
                        "member {i} ({}) names target layer {id}, but the target has {n} layers",
                        m.name
                    )));
                }
                let col = match layers.iter().position(|&l| l == id) {
                    Some(c) => c,
                    None => {
                        layers.push(id);
                        layers.len() - 1
                    }
                };
                cols.push(col);
            }
            columns.push(cols);
        }
        let final_column = target_layers.map(|n| match layers.iter().position(|&l| l == n - 1) {
            Some(c) => c,
            None => {
                layers.push(n - 1);
                layers.len() - 1
            }
        });
        let gammas = members.iter().map(|m| m.proposer.block_gamma()).collect();
        let prefill_caps = members
            .iter()
            .map(|m| m.proposer.prefill_hidden_rows(usize::MAX))
            .collect();
        Ok(Hybrid {
            members,
            choice: HybridChoice::default(),
            layers,
            columns,
            final_column,
            gammas,
            prefill_caps,
            last_winner: AtomicUsize::new(usize::MAX),
        })
    }

    /// The same hybrid, picking each step's member by `choice`.
    pub fn with_choice(mut self, choice: HybridChoice) -> Self {
        self.choice = choice;
        self
    }

    /// How each step's member is picked.
    pub fn choice(&self) -> HybridChoice {
        self.choice
    }

    /// The members, in the order they are asked.
    pub fn members(&self) -> &[HybridMember] {
        &self.members
    }

    /// Whether replayed tokens are paired with the target's exact hiddens (the hybrid was
    /// given the target's layer count).
    pub fn exact_catchup(&self) -> bool {
        self.final_column.is_some()
    }

    /// Drafts member `i` is asked for when the step asks `n`: a block drafter at most
    /// `γ - 1` (at least 1).
    fn ask(&self, i: usize, n: usize) -> usize {
        match self.gammas[i] {
            Some(g) => n.min(g.saturating_sub(1).max(1)),
            None => n,
        }
    }

    /// Wraps member `i`'s error from `method`.
    fn member_error(&self, method: &'static str, i: usize, e: crate::Error) -> crate::Error {
        ProposerError::Member {
            method,
            index: i,
            name: self.members[i].name.clone(),
            source: Box::new(e),
        }
        .into()
    }
}
