//! What the policy believes about a proposer's drafts: decayed counts of acceptance and
//! fill by draft position, a sequence's own and the engine's, and the outlook they give of
//! asking a sequence for each count.
//!
//! Invariants:
//! - An estimate is a rate shrunk towards a prior by [`PRIOR_WEIGHT`] pseudo-observations:
//!   it is defined (and between 0 and 1) before anything is observed.
//! - A sequence's estimates are shrunk towards the engine's, so a new sequence starts from
//!   what the proposer has done for the others; the engine's start at [`COLD_ACCEPTANCE`].
//! - An outlook's gains and rows never decrease with the count: asking for more can add
//!   expected tokens and rows, never take them away.
//! - A proposer that returns fewer drafts than asked is charged only the rows it returned
//!   (the fill estimates), and says nothing about acceptance past what it returned.
//! - A tree of `k` nodes is credited with the nodes expected on its accepted path, read
//!   node by node in the proposer's order (`on_path`), not with `k` levels of depth: a
//!   tree's nodes share depths, so its acceptance by depth would credit each node with a
//!   level of its own. For a chain the two readings agree (node `j` is on the path exactly
//!   when the first `j + 1` drafts are accepted).

use super::super::cost_fit::CostFit;
use super::super::decayed_counts::DecayedCounts;
use super::super::draft_confidence::Calibration;
use std::time::Duration;

/// Acceptance assumed at the first draft position before anything is measured. Chosen high
/// on purpose (not measured): an engine that starts pessimistic never drafts, so never
/// learns otherwise; one that starts optimistic pays a few steps of drafts before its own
/// figures take over (about [`PRIOR_WEIGHT`] observations).
pub(super) const COLD_ACCEPTANCE: f64 = 0.7;
/// Pseudo-observations of the prior behind each estimate. Two: one observed step moves a
/// sequence's estimate a third of the way from its prior, so a single lucky or unlucky
/// step cannot swing it the whole way (a judgement, pinned by the policy tests' step
/// counts).
pub(super) const PRIOR_WEIGHT: f64 = 2.0;
/// Share of a sequence's counts kept at each of its drafting steps (about 7 steps count):
/// a sequence's text changes kind within a few dozen tokens (a quoted passage, then free
/// text), and its own figure should follow within a few steps.
pub(super) const SEQUENCE_KEEP: f64 = 0.85;
/// Share of the engine's counts kept at each observation (about 200 observations count):
/// the engine's figure is the proposer's typical behaviour across requests, the prior of
/// every new sequence, so it moves slowly.
pub(super) const ENGINE_KEEP: f64 = 0.995;

/// Acceptance and fill counts of one proposer (a sequence's, or the engine's).
#[derive(Clone, Debug, Default)]
pub(super) struct DraftCounts {
    /// Acceptance at a position given the earlier drafts were accepted.
    pub accept: DecayedCounts,
    /// Whether the proposer returned a draft at a position when asked for it.
    pub fill: DecayedCounts,
    /// Whether the node at a position (in the proposer's order) was on the accepted path,
    /// given it was returned.
    pub on_path: DecayedCounts,
}

impl DraftCounts {
    /// Decays the counts by `keep`, then records one step that asked for `asked`, got
    /// `returned` drafts and had `accepted` of them accepted: the nodes of `path` for a
    /// tree (increasing node indices), the first `accepted` for a chain (`path` `None`).
    pub(super) fn observe(
        &mut self,
        keep: f64,
        asked: usize,
        returned: usize,
        accepted: usize,
        path: Option<&[usize]>,
    ) {
        self.accept.decay(keep);
        self.fill.decay(keep);
        self.on_path.decay(keep);
        for j in 0..returned.min(accepted + 1) {
            self.accept.add(j, j < accepted);
        }
        for j in 0..asked.min(returned + 1) {
            self.fill.add(j, j < returned);
        }
        for j in 0..returned {
            let hit = path.map_or(j < accepted, |p| p.binary_search(&j).is_ok());
            self.on_path.add(j, hit);
        }
    }
}

/// The engine's running figures for its proposer, shared by every sequence.
#[derive(Debug, Default)]
pub(super) struct EngineFigures {
    pub counts: DraftCounts,
    /// How often drafts were accepted against the confidence the proposer reported.
    pub calibration: Calibration,
}

impl EngineFigures {
    /// The engine's acceptance of a single draft: the first position of a chain, or a
    /// tree's first node (`trees`).
    pub(super) fn first_acceptance(&self, trees: bool) -> f64 {
        let counts = &self.counts;
        if trees {
            counts.on_path.rate(0, COLD_ACCEPTANCE, PRIOR_WEIGHT)
        } else {
            counts.accept.rate(0, COLD_ACCEPTANCE, PRIOR_WEIGHT)
        }
    }
}

/// One sequence's policy state.
#[derive(Clone, Debug, Default)]
pub(in crate::engine) struct SequenceDraftStats {
    pub(super) counts: DraftCounts,
    pub(in crate::engine) probe: super::probes::SequenceProbe,
    /// This step's choice, until it is observed.
    pub(in crate::engine) asked: Option<usize>,
    /// Tokens one more verify row must bring this step to pay for itself.
    pub(in crate::engine) min_gain: f64,
    /// The proposer's confidence in each draft sent to verification (empty: none given).
    pub(super) confs: Vec<f32>,
    /// The branching draft tree sent to verification, when the proposer gave its nodes'
    /// probabilities.
    pub(super) sent_tree: Option<crate::speculative::DraftTree>,
    /// The sequence's drafting time when this step's choice was made.
    pub(in crate::engine) draft_mark: Duration,
    /// The accepted path of this step's draft tree (`None` for a chain), until it is
    /// observed.
    pub(in crate::engine) tree_path: Option<Vec<usize>>,
}

/// Cumulative expected tokens gained and rows added by asking for `k` drafts, `k` =
/// 0..=budget, and the drafting seconds of each count.
pub(super) struct Outlook {
    pub gain: Vec<f64>,
    pub rows: Vec<f64>,
    pub draft: Vec<f64>,
}

impl Outlook {
    /// The same outlook with only the counts below `n`.
    pub(super) fn up_to(&self, n: usize) -> Outlook {
        Outlook {
            gain: self.gain[..n].to_vec(),
            rows: self.rows[..n].to_vec(),
            draft: self.draft[..n].to_vec(),
        }
    }
}

/// What asking a sequence (its counts `own`, budget `budget`) for each count would gain and
/// cost, its drafting read from `draft_fit` (none measured: free) at `abscissa(count)`; a
/// count is a tree's node budget where `trees` holds.
pub(super) fn outlook(
    own: &DraftCounts,
    budget: usize,
    engine: &DraftCounts,
    trees: bool,
    draft_fit: Option<CostFit>,
    abscissa: impl Fn(usize) -> usize,
) -> Outlook {
    let n = budget;
    let (mut gain, mut rows) = (vec![0.0; n + 1], vec![0.0; n + 1]);
    let (mut engine_p, mut engine_f) = (COLD_ACCEPTANCE, 1.0);
    let (mut p, mut f) = (0.0, 0.0);
    let (mut reach_row, mut reach_gain) = (1.0, 1.0);
    // A node's cold chance of being on the path: a chain's at its position.
    let (mut cold_node, mut first_node) = (1.0, 0.0);
    for j in 0..n {
        engine_p = engine.accept.rate(j, engine_p, PRIOR_WEIGHT);
        engine_f = engine.fill.rate(j, engine_f, PRIOR_WEIGHT);
        // Past the first position the sequence's own figure at the position before counts
        // as much as the engine's at this one.
        let (prior_p, prior_f) = if j == 0 {
            (engine_p, engine_f)
        } else {
            ((engine_p + p) / 2.0, (engine_f + f) / 2.0)
        };
        p = own.accept.rate(j, prior_p, PRIOR_WEIGHT);
        f = own.fill.rate(j, prior_f, PRIOR_WEIGHT);
        reach_row *= f;
        reach_gain *= f * p;
        let node_gain = if trees {
            cold_node *= COLD_ACCEPTANCE;
            let engine_r = engine.on_path.rate(j, cold_node, PRIOR_WEIGHT);
            // Past the first node the sequence's own first node counts as much as the
            // engine's figure: a sequence asked for small trees never sees its deeper
            // nodes, and must not be held to other sequences' figures for them.
            let prior_r = if j == 0 {
                engine_r
            } else {
                (engine_r + first_node) / 2.0
            };
            let r = own.on_path.rate(j, prior_r, PRIOR_WEIGHT);
            if j == 0 {
                first_node = r;
            }
            reach_row * r
        } else {
            reach_gain
        };
        rows[j + 1] = rows[j] + reach_row;
        gain[j + 1] = gain[j] + node_gain;
    }
    let draft = (0..=n)
        .map(|k| draft_fit.map_or(0.0, |f| f.at(abscissa(k) as f64)))
        .collect();
    Outlook { gain, rows, draft }
}
