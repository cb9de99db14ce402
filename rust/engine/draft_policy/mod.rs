//! How many drafts to ask of each sequence each step.
//!
//! [`DraftPolicyKind::Fixed`] asks for the whole budget every step (`num_drafts`, less
//! what `max_tokens`, the context and a forward's rows leave room for).
//! [`DraftPolicyKind::Adaptive`] (the default) picks, for each sequence, the count (0 to
//! its budget) that maximises the step's expected tokens per second:
//! - expected tokens of asking `k`: `1 + sum_{j<=k} prod_{m<=j} f_m * p_m`, where `p_m` is
//!   the sequence's estimated acceptance at draft position `m` given the earlier drafts
//!   were accepted, and `f_m` the estimated chance that the proposer returns a draft at
//!   position `m` when asked (a lookup often returns fewer than asked);
//! - expected seconds: the verify cost at the step's expected rows plus each sequence's
//!   drafting cost at its count, both read from a [`CostModel`] measured on the running
//!   backend.
//!
//! A plan is made of pieces, each in its own file with its invariants and the reasons for
//! its constants:
//! - `estimates`: the decayed acceptance and fill counts (a sequence's own, shrunk towards
//!   the engine's) and the outlook they give of each count;
//! - `row_cost`: the verify cost as the policy reads it (a floor under a row's cost, the
//!   steeper slope past the curve's knee) and the counts that maximise a step's rate;
//! - `cold_start`: the first two steps, which measure the cost's two ends;
//! - `exploration`: the engine-wide budget that pays for learning, and the refresh of a
//!   stale verify cost;
//! - `probes`: how a sequence turned down gets drafts again.
//!
//! [`DraftPolicy::plan`] runs them in that order: cold start (which may decide alone),
//! the outlooks, the best counts at the measured cost, a refresh, then the probes.
//!
//! Invariants:
//! - The policy only changes how many drafts are asked for, never what is verified or
//!   emitted: greedy output is the same under either policy.
//! - A count is never above the sequence's budget. Asking for 0 still calls `propose`
//!   (with `num_drafts` 0), so a proposer that keeps the token history sees every token.
//! - Where `propose_batch` reports its confidence in each draft, the drafts of a step are
//!   cut where their calibrated chance of acceptance would not pay for their verify rows
//!   (see `draft_confidence`).
//! - Choices are a pure function of the cost curves and the recorded outcomes: with a
//!   fixed cost model ([`super::FixedCost`]) a run is exactly reproducible.
//! - A block drafter (`block_gamma()` is `Some`) drafts any count in one block forward, so
//!   its drafting cost is flat in the count: its drafting is recorded and read at 1 for any
//!   count from 1 (and at 0 for none), never along a per-draft slope.

mod cold_start;
mod estimates;
mod exploration;
mod probes;
mod row_cost;
#[cfg(test)]
mod tests;

use super::cost_model::{CostModel, MeasuredCost};
use super::EngineError;
use crate::speculative::DraftTree;
use cold_start::cold_counts;
pub(super) use estimates::SequenceDraftStats;
use estimates::{outlook, EngineFigures, Outlook, ENGINE_KEEP, SEQUENCE_KEEP};
use exploration::Exploration;
use probes::{EngineProbe, ProbeCandidate};
use row_cost::RowCost;
use std::sync::{Arc, Mutex};

/// Which rule picks the draft count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftPolicyKind {
    /// The count that maximises expected tokens per second (see the module documentation).
    #[default]
    Adaptive,
    /// Always the whole budget.
    Fixed,
}

impl DraftPolicyKind {
    /// The name used on the command line and in Python.
    pub fn as_str(self) -> &'static str {
        match self {
            DraftPolicyKind::Adaptive => "adaptive",
            DraftPolicyKind::Fixed => "fixed",
        }
    }
}

impl std::fmt::Display for DraftPolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for DraftPolicyKind {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self, EngineError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "adaptive" => Ok(DraftPolicyKind::Adaptive),
            "fixed" => Ok(DraftPolicyKind::Fixed),
            _ => Err(EngineError::InvalidArgument {
                what: "draft_policy",
                message: format!("{s:?} (expected \"adaptive\" or \"fixed\")"),
            }),
        }
    }
}

/// What the engine's sequences share: the proposer's figures, the probe state and the
/// exploration account.
#[derive(Debug, Default)]
struct EngineState {
    figures: EngineFigures,
    probe: EngineProbe,
    exploration: Exploration,
}

/// One sequence the policy chooses for: its budget and its state.
pub(super) struct Candidate<'a> {
    pub budget: usize,
    pub stats: &'a SequenceDraftStats,
}

/// The policy an engine runs, with its cost model and running figures (shared by the
/// engine's clones).
#[derive(Clone)]
pub(super) struct DraftPolicy {
    pub kind: DraftPolicyKind,
    pub cost: Arc<dyn CostModel>,
    /// Whether the proposer drafts a whole block in one forward (see the module docs).
    pub block_drafter: bool,
    shared: Arc<Mutex<EngineState>>,
}

impl Default for DraftPolicy {
    fn default() -> Self {
        DraftPolicy::new(
            DraftPolicyKind::default(),
            Arc::new(MeasuredCost::default()),
        )
    }
}

impl DraftPolicy {
    pub fn new(kind: DraftPolicyKind, cost: Arc<dyn CostModel>) -> Self {
        DraftPolicy {
            kind,
            cost,
            block_drafter: false,
            shared: Arc::new(Mutex::new(EngineState::default())),
        }
    }

    /// The same policy for a block drafter (`true`) or one that drafts token by token.
    pub fn for_block_drafter(mut self, block: bool) -> Self {
        self.block_drafter = block;
        self
    }

    /// Where drafting `asked` tokens sits on the drafting cost curve: the count itself, or
    /// for a block drafter 1 for any count from 1 (one block forward drafts them all).
    pub fn draft_abscissa(&self, asked: usize) -> usize {
        if self.block_drafter {
            asked.min(1)
        } else {
            asked
        }
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, EngineState> {
        // Plain counters: a panic elsewhere cannot leave them inconsistent.
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Idle steps before `stats`' sequence is probed.
    #[cfg(test)]
    fn probe_wait(&self, stats: &SequenceDraftStats) -> usize {
        stats.probe.wait(&self.shared().probe)
    }

    /// Whether `stats`' sequence is due a probe if it is turned down to 0 this step (see
    /// `probes`).
    pub fn probe_due(&self, stats: &SequenceDraftStats) -> bool {
        stats.probe.due(&self.shared().probe)
    }

    /// The count for each candidate (`other_rows` rows of this step's forward belong to
    /// sequences that do not draft; a count is a tree's node budget where `trees` holds),
    /// and the tokens one more verify row must bring at those counts (0 where the policy
    /// does not judge rows: fixed, or costs not yet known).
    pub fn plan(
        &self,
        candidates: &[Candidate<'_>],
        other_rows: usize,
        trees: bool,
    ) -> (Vec<usize>, f64) {
        if self.kind == DraftPolicyKind::Fixed || candidates.is_empty() {
            return (candidates.iter().map(|c| c.budget).collect(), 0.0);
        }
        let curves = self.cost.curves();
        let base_rows = other_rows + candidates.len();
        let budgets = candidates.iter().map(|c| c.budget);
        if let Some(k) = cold_counts(&curves.verify, base_rows, budgets) {
            return (k, 0.0);
        }
        let mut shared = self.shared();
        let state = &mut *shared;
        // One drafting curve for the proposer, so one fit serves every sequence.
        let draft_fit = curves.draft.fit();
        let outlooks: Vec<Outlook> = candidates
            .iter()
            .map(|c| {
                outlook(
                    &c.stats.counts,
                    c.budget,
                    &state.figures.counts,
                    trees,
                    draft_fit,
                    |k| self.draft_abscissa(k),
                )
            })
            .collect();
        // A sequence turned down after drafts that failed comes back only through a probe.
        let choosable: Vec<Outlook> = candidates
            .iter()
            .zip(&outlooks)
            .map(|(c, o)| {
                o.up_to(if c.stats.probe.locked {
                    1
                } else {
                    o.gain.len()
                })
            })
            .collect();
        let cost = RowCost::measured(&curves.verify, base_rows);
        let choice = cost.best(&choosable);
        let mut credit = state.exploration.earn(&cost);
        let (cost, mut choice) =
            state
                .exploration
                .refresh(&curves.verify, cost, choice, &choosable, &mut credit);
        let probed: Vec<ProbeCandidate<'_>> = candidates
            .iter()
            .zip(&outlooks)
            .map(|(c, o)| ProbeCandidate {
                budget: c.budget,
                probe: &c.stats.probe,
                outlook: o,
            })
            .collect();
        let first = state.figures.first_acceptance(trees);
        probes::place(
            &mut state.probe,
            &cost,
            &mut choice,
            &probed,
            first,
            &mut credit,
        );
        state.exploration.settle(credit);
        let c = &choice;
        let min_gain = cost.marginal(c.rows) * cost.rate(c.tokens, c.rows, c.draft);
        (choice.k, min_gain)
    }

    /// Cuts `drafts` where the proposer's calibrated confidence (`confs`, one a draft) says
    /// the rest would not pay this step, and keeps the confidences of those sent on.
    pub fn trim(
        &self,
        stats: &mut SequenceDraftStats,
        drafts: &mut Vec<u32>,
        confs: Option<&[f32]>,
    ) {
        stats.confs.clear();
        let Some(confs) = confs.filter(|c| c.len() >= drafts.len()) else {
            return;
        };
        if self.kind == DraftPolicyKind::Fixed {
            return;
        }
        let keep = self
            .shared()
            .figures
            .calibration
            .keep(&confs[..drafts.len()], stats.min_gain);
        drafts.truncate(keep);
        stats.confs.extend_from_slice(&confs[..keep]);
    }

    /// Cuts the nodes of `tree` whose calibrated chance of being reached and accepted says
    /// they would not pay this step (see [`Calibration::keep_tree`]), and keeps the
    /// probabilities of those sent on. Returns the tree to verify and, when nodes were cut,
    /// the index in `tree` of each node kept. A tree without probabilities, or under the
    /// fixed policy, is sent whole.
    ///
    /// [`Calibration::keep_tree`]: super::draft_confidence::Calibration::keep_tree
    pub fn trim_tree(
        &self,
        stats: &mut SequenceDraftStats,
        tree: DraftTree,
    ) -> (DraftTree, Option<Vec<usize>>) {
        stats.confs.clear();
        stats.sent_tree = None;
        let has_probs = tree.probs.as_ref().is_some_and(|p| p.len() == tree.len());
        if !has_probs || self.kind == DraftPolicyKind::Fixed || tree.is_empty() {
            return (tree, None);
        }
        let kept = self
            .shared()
            .figures
            .calibration
            .keep_tree(&tree, stats.min_gain);
        let (tree, nodes) = if kept.iter().all(|&k| k) {
            (tree, None)
        } else {
            let (t, nodes) = tree.keep(&kept);
            (t, Some(nodes))
        };
        if tree.is_chain() {
            stats.confs = tree.probs.clone().unwrap_or_default();
        } else {
            stats.sent_tree = Some(tree.clone());
        }
        (tree, nodes)
    }

    /// Records the outcome of a step in which `stats`' sequence asked for its chosen count,
    /// got `returned` drafts and had `accepted` of them accepted (the nodes of
    /// `stats.tree_path` where it verified a tree).
    pub fn observe(&self, stats: &mut SequenceDraftStats, returned: usize, accepted: usize) {
        let Some(asked) = stats.asked.take() else {
            return;
        };
        let confs = std::mem::take(&mut stats.confs);
        let sent_tree = stats.sent_tree.take();
        let path = stats.tree_path.take();
        if asked == 0 {
            stats.probe.idled();
            return;
        }
        let mut shared = self.shared();
        let state = &mut *shared;
        let path = path.as_deref();
        stats
            .counts
            .observe(SEQUENCE_KEEP, asked, returned, accepted, path);
        let figures = &mut state.figures;
        figures
            .counts
            .observe(ENGINE_KEEP, asked, returned, accepted, path);
        let judged = returned.min(confs.len());
        if judged > 0 {
            figures.calibration.observe(&confs[..judged], accepted);
        }
        if let (Some(tree), Some(path)) = (&sent_tree, path) {
            figures.calibration.observe_tree(tree, path);
        }
        stats.probe.drafted(&mut state.probe, returned, accepted);
    }
}
