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
//!   backend (a verify row is taken to cost at least `MIN_ROW_SHARE` of the plain
//!   forward's cost a row, so noise cannot make a useless drafter look free); where the
//!   measured verify cost bends upwards, rows past its knee are priced at the steeper
//!   slope, so a wide batch's drafts pay for what its last rows really cost;
//! - the counts of a step's sequences share one forward, so they are chosen together,
//!   one sequence at a time against the others' current choice, until none changes.
//!
//! Estimates are decayed counts: a sequence's own (recent steps weigh most) shrunk
//! towards the engine's running figure for the same proposer, which starts optimistic.
//!
//! Invariants:
//! - The policy only changes how many drafts are asked for, never what is verified or
//!   emitted: greedy output is the same under either policy.
//! - A count is never above the sequence's budget. Asking for 0 still calls `propose`
//!   (with `num_drafts` 0), so a proposer that keeps the token history sees every token.
//! - Cold start drafts: with no verify cost measured one sequence (the first) is asked for
//!   its whole budget and the others for none, so the step measures a few more rows than a
//!   plain one however wide the batch (a step of every sequence's budget would cost several
//!   plain steps at batch 8); with one row count measured the next step measures the other
//!   end (that draft, or none), so the cost's slope is known before the policy relies on it.
//! - A sequence turned down to 0 after a step whose drafts all failed stays at 0 until a
//!   probe: it is probed with 1 draft after `PROBE_FIRST` idle steps,
//!   the wait doubling (up to `PROBE_MAX`) while probes fail, so it recovers when its text
//!   becomes predictable; no probe is made where even a sure draft would not pay. Where
//!   the engine's figures say a first draft pays, a sequence whose probes are not failing
//!   is probed after a single idle step (one rejection in a wide batch must not idle a good
//!   sequence for the whole wait: its estimate does not move while it is idle). A new
//!   sequence starts with the engine's wait (doubled by every failed probe, reset by every
//!   accepted one), so a drafter that is never right is not probed afresh each request.
//! - Probes where the engine's figures say a first draft does not pay, and refreshes
//!   (below), are exploration, paid from one engine-wide budget (a probe the engine's
//!   figures say pays is an expected gain and is not charged): each
//!   step earns [`EXPLORE_SHARE`] of its measured verify cost, in verify rows at the
//!   measured cost a row; one row can be banked. A probe needs and spends a row; a refresh
//!   needs one and spends all the rows it adds, into debt that later steps pay off. So over
//!   a run exploration costs about that share of the verify time at any batch width (the
//!   sequences of a wide batch would otherwise each probe on their own wait).
//! - The verify cost's measurements age (see `cost_model`). When the widest row count
//!   measured is [`REFRESH_AGE`] records old or more and the step would draft more at a
//!   cheaper cost a row (the fitted one halved once and again for every [`REFRESH_AGE`]
//!   records of that age, never below the floor), the step is planned at that cost, so the wide end of the
//!   line is measured again (at most once in [`REFRESH_AGE`] records). A drafter that would
//!   not pay even at the floor (one that is never right) is never refreshed for.
//! - Where `propose_batch` reports its confidence in each draft, the drafts of a step are
//!   cut where their calibrated chance of acceptance would not pay for their verify rows
//!   (see `draft_confidence`).
//! - Choices are a pure function of the cost curves and the recorded outcomes: with a
//!   fixed cost model ([`super::FixedCost`]) a run is exactly reproducible.
//! - A block drafter (`block_gamma()` is `Some`) drafts any count in one block forward, so
//!   its drafting cost is flat in the count: its drafting is recorded and read at 1 for any
//!   count from 1 (and at 0 for none), never along a per-draft slope.

use super::cost_fit::CostFit;
use super::cost_model::{CostCurve, CostModel, MeasuredCost};
use super::draft_confidence::Calibration;
use super::EngineError;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Acceptance assumed at the first draft position before anything is measured.
const COLD_ACCEPTANCE: f64 = 0.7;
/// Pseudo-observations of the prior behind each estimate.
const PRIOR_WEIGHT: f64 = 2.0;
/// Share of a sequence's counts kept at each of its drafting steps (about 7 steps count).
const SEQUENCE_KEEP: f64 = 0.85;
/// Share of the engine's counts kept at each observation (about 200 observations count).
const ENGINE_KEEP: f64 = 0.995;
/// Idle steps before the first probe of a sequence turned down to 0.
const PROBE_FIRST: usize = 4;
/// The longest wait between probes.
const PROBE_MAX: usize = 64;
/// The least a verify row is taken to cost, as a share of the base forward's cost a row.
const MIN_ROW_SHARE: f64 = 0.05;
/// Rounds of choosing each sequence's count against the others'.
const ROUNDS: usize = 4;
/// Verify records after which the widest measured row count is stale and, where cheaper
/// rows would change the choice, measured again (at most once in as many records).
const REFRESH_AGE: u64 = 32;
/// Share of each step's verify cost that exploration (probes, refreshes) may spend.
pub const EXPLORE_SHARE: f64 = 0.01;

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

/// Decayed hit and try counts by draft position (index 0 is the first draft).
#[derive(Clone, Debug, Default)]
struct PositionCounts {
    hits: Vec<f64>,
    tries: Vec<f64>,
}

impl PositionCounts {
    fn decay(&mut self, keep: f64) {
        self.hits.iter_mut().for_each(|x| *x *= keep);
        self.tries.iter_mut().for_each(|x| *x *= keep);
    }

    fn add(&mut self, pos: usize, hit: bool) {
        if self.tries.len() <= pos {
            self.hits.resize(pos + 1, 0.0);
            self.tries.resize(pos + 1, 0.0);
        }
        self.tries[pos] += 1.0;
        if hit {
            self.hits[pos] += 1.0;
        }
    }

    /// The rate at `pos`, shrunk towards `prior` by [`PRIOR_WEIGHT`] pseudo-observations.
    fn estimate(&self, pos: usize, prior: f64) -> f64 {
        let hits = self.hits.get(pos).copied().unwrap_or(0.0);
        let tries = self.tries.get(pos).copied().unwrap_or(0.0);
        (hits + PRIOR_WEIGHT * prior) / (tries + PRIOR_WEIGHT)
    }

    /// Records one step that asked for `asked`, got `returned` and had `accepted` of
    /// them accepted: acceptance into `accept`, the proposer's returns into `fill`.
    fn observe(accept: &mut Self, fill: &mut Self, asked: usize, returned: usize, accepted: usize) {
        for j in 0..returned.min(accepted + 1) {
            accept.add(j, j < accepted);
        }
        for j in 0..asked.min(returned + 1) {
            fill.add(j, j < returned);
        }
    }
}

/// The engine's running figures for its proposer, shared by every sequence.
#[derive(Debug, Default)]
struct EnginePrior {
    accept: PositionCounts,
    fill: PositionCounts,
    /// The wait a new sequence starts with (0: [`PROBE_FIRST`]).
    probe_every: usize,
    /// How often drafts were accepted against the confidence the proposer reported.
    calibration: Calibration,
    /// Whether, at the last plan, the engine's acceptance at the first draft position paid
    /// for a verify row (see [`DraftPolicy::probe_due`]).
    engine_pays: bool,
    /// The verify curve's clock at the last refresh of its wide end.
    refreshed_at: u64,
    /// Verify rows exploration spent beyond what it earned (see the module documentation):
    /// at most one row is banked (0), and a refresh may leave a debt (above 1) that later
    /// steps pay off before the next probe.
    explore_owed: f64,
}

/// One sequence's policy state.
#[derive(Clone, Debug, Default)]
pub(super) struct SequenceDraftStats {
    accept: PositionCounts,
    fill: PositionCounts,
    /// Steps since the last one that asked for drafts.
    idle: usize,
    /// Idle steps before the next probe (0: not yet set, the engine's).
    probe_every: usize,
    pub(super) probing: bool,
    /// Whether the last step that asked for drafts got some and had none accepted.
    last_failed: bool,
    /// Turned down after drafts that failed: only a probe may ask for drafts, until one of
    /// its drafts is accepted.
    locked: bool,
    /// This step's choice, until it is observed.
    pub(super) asked: Option<usize>,
    /// Tokens one more verify row must bring this step to pay for itself.
    pub(super) min_gain: f64,
    /// The proposer's confidence in each draft sent to verification (empty: none given).
    confs: Vec<f32>,
    /// The sequence's drafting time when this step's choice was made.
    pub(super) draft_mark: Duration,
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
    prior: Arc<Mutex<EnginePrior>>,
}

impl Default for DraftPolicy {
    fn default() -> Self {
        DraftPolicy::new(
            DraftPolicyKind::default(),
            Arc::new(MeasuredCost::default()),
        )
    }
}

/// Cumulative expected tokens gained and rows added by asking for `k` drafts, `k` = 0..=budget.
struct Outlook {
    gain: Vec<f64>,
    rows: Vec<f64>,
    draft: Vec<f64>,
}

/// A step's counts and what they add up to: expected tokens, expected verify rows and
/// drafting seconds.
struct Choice {
    k: Vec<usize>,
    tokens: f64,
    rows: f64,
    draft: f64,
}

/// The verify cost the policy reads: the fitted cost at the step's base rows, plus
/// `per_row` for each row beyond them up to `knee` and `per_row_past` for each row past it
/// (the fitted curve's bend, see `cost_fit`; `knee` infinite where it has none).
#[derive(Clone, Copy)]
struct RowCost {
    base_rows: f64,
    base_cost: f64,
    per_row: f64,
    knee: f64,
    per_row_past: f64,
}

impl RowCost {
    /// The fitted verify cost from `base_rows` (where it is `base_cost`) on, neither slope
    /// below `floor`.
    fn from_fit(fit: CostFit, base_rows: f64, base_cost: f64, floor: f64) -> Self {
        let past = fit.slope_at(f64::INFINITY).max(floor);
        let knee = fit.knee.max(base_rows);
        RowCost {
            base_rows,
            base_cost,
            per_row: fit.slope_at(base_rows).max(floor),
            knee,
            per_row_past: past,
        }
    }

    fn verify(&self, rows: f64) -> f64 {
        let near = rows.min(self.knee) - self.base_rows;
        let past = (rows - self.knee).max(0.0);
        (self.base_cost + self.per_row * near + self.per_row_past * past).max(0.0)
    }

    /// The cost of one more row at `rows`.
    fn marginal(&self, rows: f64) -> f64 {
        if rows >= self.knee {
            self.per_row_past
        } else {
            self.per_row
        }
    }

    /// Expected tokens per second.
    fn rate(&self, tokens: f64, rows: f64, draft: f64) -> f64 {
        tokens / (self.verify(rows) + draft).max(1e-12)
    }

    /// The counts that maximise the step's rate, each sequence chosen against the others'
    /// current choice until none changes.
    fn best(&self, outlooks: &[Outlook]) -> Choice {
        let mut c = Choice {
            k: vec![0; outlooks.len()],
            tokens: self.base_rows,
            rows: self.base_rows,
            draft: outlooks.iter().map(|o| o.draft[0]).sum(),
        };
        for _ in 0..ROUNDS {
            let mut changed = false;
            for (i, o) in outlooks.iter().enumerate() {
                c.tokens -= o.gain[c.k[i]];
                c.rows -= o.rows[c.k[i]];
                c.draft -= o.draft[c.k[i]];
                let mut best = 0;
                let mut best_rate = self.rate(c.tokens, c.rows, c.draft + o.draft[0]);
                for n in 1..o.gain.len() {
                    let r = self.rate(
                        c.tokens + o.gain[n],
                        c.rows + o.rows[n],
                        c.draft + o.draft[n],
                    );
                    if r > best_rate * (1.0 + 1e-9) {
                        best = n;
                        best_rate = r;
                    }
                }
                changed |= best != c.k[i];
                c.k[i] = best;
                c.tokens += o.gain[best];
                c.rows += o.rows[best];
                c.draft += o.draft[best];
            }
            if !changed {
                break;
            }
        }
        c
    }
}

impl DraftPolicy {
    pub fn new(kind: DraftPolicyKind, cost: Arc<dyn CostModel>) -> Self {
        DraftPolicy {
            kind,
            cost,
            block_drafter: false,
            prior: Arc::new(Mutex::new(EnginePrior::default())),
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

    fn prior(&self) -> std::sync::MutexGuard<'_, EnginePrior> {
        // Plain counters: a panic elsewhere cannot leave them inconsistent.
        self.prior.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Idle steps before `stats`' sequence is probed.
    pub fn probe_wait(&self, stats: &SequenceDraftStats) -> usize {
        match (stats.probe_every, self.prior().probe_every) {
            (0, 0) => PROBE_FIRST,
            (0, engine) => engine,
            (own, _) => own,
        }
    }

    /// Whether `stats`' sequence is due a probe if it is turned down to 0 this step: idle
    /// for its probe wait, or for one step where the engine's figures said at the last plan
    /// that a first draft pays and its probes are not failing (wait not doubled).
    pub fn probe_due(&self, stats: &SequenceDraftStats) -> bool {
        let wait = self.probe_wait(stats);
        stats.idle >= wait || (stats.idle >= 1 && wait <= PROBE_FIRST && self.prior().engine_pays)
    }

    /// The count for each candidate (`other_rows` rows of this step's forward belong to
    /// sequences that do not draft), and the tokens one more verify row must bring at those
    /// counts (0 where the policy does not judge rows: fixed, or costs not yet known).
    pub fn plan(&self, candidates: &[Candidate<'_>], other_rows: usize) -> (Vec<usize>, f64) {
        let budgets = || (candidates.iter().map(|c| c.budget).collect(), 0.0);
        if self.kind == DraftPolicyKind::Fixed || candidates.is_empty() {
            return budgets();
        }
        let curves = self.cost.curves();
        let base_rows = other_rows + candidates.len();
        // Cold start: the first sequence with a budget drafts it all, the others none.
        let cold = || {
            let mut k = vec![0; candidates.len()];
            if let Some(i) = candidates.iter().position(|c| c.budget > 0) {
                k[i] = candidates[i].budget;
            }
            (k, 0.0)
        };
        match curves.verify.len() {
            0 => return cold(),
            1 if curves.verify.first_x() == Some(base_rows) => return cold(),
            1 => return (vec![0; candidates.len()], 0.0),
            _ => {}
        }
        let outlooks: Vec<Outlook> = {
            let prior = self.prior();
            // One drafting curve for the proposer, so one fit serves every sequence.
            let draft_fit = curves.draft.fit();
            candidates
                .iter()
                .map(|c| outlook(c, &prior, draft_fit, |k| self.draft_abscissa(k)))
                .collect()
        };
        // A sequence turned down after drafts that failed comes back only through a probe:
        // otherwise the engine's figures (other sequences' successes) would soon talk its
        // thin evidence round into drafting again, outside the exploration budget.
        let choosable: Vec<Outlook> = candidates
            .iter()
            .zip(&outlooks)
            .map(|(c, o)| {
                let n = if c.stats.locked { 1 } else { o.gain.len() };
                Outlook {
                    gain: o.gain[..n].to_vec(),
                    rows: o.rows[..n].to_vec(),
                    draft: o.draft[..n].to_vec(),
                }
            })
            .collect();
        // The fitted curve, its slopes no less than MIN_ROW_SHARE of the base forward's cost a
        // row: measurement noise on a loaded machine can flatten the slope to nothing, and
        // then any drafter, however rarely right, would look free.
        let fit = curves.verify.fit().unwrap_or(CostFit::flat(0.0));
        let base_cost = fit.at(base_rows as f64);
        let floor = MIN_ROW_SHARE * base_cost / base_rows as f64;
        let mut cost = RowCost::from_fit(fit, base_rows as f64, base_cost, floor);
        let mut c = cost.best(&choosable);
        // Exploration's allowance: this step earns its share of the verify cost, in rows at
        // the measured cost a row; one row can be banked.
        let mut credit = {
            let mut prior = self.prior();
            let earned = EXPLORE_SHARE * base_cost / cost.per_row.max(1e-12);
            prior.explore_owed = (prior.explore_owed - earned).max(0.0);
            1.0 - prior.explore_owed
        };
        // Refresh: once the widest row count measured is stale, a step that cheaper rows
        // would fill with more drafts is taken as if they were that cheap, so the wide end
        // of the line is measured again instead of holding the policy back for good.
        if let Some(cheap) = self.refresh(&curves.verify, cost, floor) {
            let alt = cheap.best(&choosable);
            if alt.k.iter().sum::<usize>() > c.k.iter().sum::<usize>() && credit >= 1.0 {
                // Paid in full, into debt if need be: it measures many rows at once.
                credit -= alt.rows - c.rows;
                self.prior().refreshed_at = curves.verify.clock();
                (cost, c) = (cheap, alt);
            }
        }
        // Probes: a sequence idle long enough gets one draft. Where the engine's figures say
        // a first draft pays (other sequences' drafts are accepted often enough), a probe is
        // an expected gain, not exploration: it is free, and due after one idle step while
        // the sequence's probes are not failing. Otherwise one rejection in a wide batch,
        // where a row must bring more, idles a good sequence for the whole probe wait (its
        // estimate does not move while it is idle) or until the budget pays for its probe.
        // Elsewhere a probe needs one sure draft to pay and exploration to afford its row.
        let engine_first = self.prior().accept.estimate(0, COLD_ACCEPTANCE);
        let engine_pays = cost.rate(c.tokens + engine_first, c.rows + 1.0, c.draft)
            > cost.rate(c.tokens, c.rows, c.draft);
        self.prior().engine_pays = engine_pays;
        for (i, (cand, o)) in candidates.iter().zip(&outlooks).enumerate() {
            if c.k[i] != 0 || cand.budget == 0 || !self.probe_due(cand.stats) {
                continue;
            }
            let now = cost.rate(c.tokens, c.rows, c.draft);
            let with = |gain: f64| {
                cost.rate(
                    c.tokens + gain,
                    c.rows + 1.0,
                    c.draft - o.draft[0] + o.draft[1],
                )
            };
            let free = engine_pays && with(engine_first) > now;
            if free || (credit >= 1.0 && with(1.0) > now) {
                if !free {
                    credit -= 1.0;
                }
                c.k[i] = 1;
                c.tokens += engine_first;
                c.rows += 1.0;
                c.draft += o.draft[1] - o.draft[0];
            }
        }
        self.prior().explore_owed = 1.0 - credit;
        let min_gain = cost.marginal(c.rows) * cost.rate(c.tokens, c.rows, c.draft);
        (c.k, min_gain)
    }

    /// The cheaper row cost a refresh of `verify`'s wide end supposes, when one is due:
    /// halved once, and once more for every [`REFRESH_AGE`] records the widest point has
    /// gone unmeasured (the staler the line, the further off it may be), never below
    /// `floor`. A bench engine runs a few hundred steps, so the first refresh must already
    /// suppose rows several times cheaper.
    fn refresh(&self, verify: &CostCurve, cost: RowCost, floor: f64) -> Option<RowCost> {
        let age = verify.age().filter(|&age| age >= REFRESH_AGE)?;
        let rested = verify.clock().saturating_sub(self.prior().refreshed_at) >= REFRESH_AGE;
        let halvings = (1.0 + age as f64 / REFRESH_AGE as f64).min(64.0);
        let cheaper = 0.5f64.powf(halvings);
        rested.then(|| RowCost {
            per_row: (cost.per_row * cheaper).max(floor),
            per_row_past: (cost.per_row_past * cheaper).max(floor),
            ..cost
        })
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
            .prior()
            .calibration
            .keep(&confs[..drafts.len()], stats.min_gain);
        drafts.truncate(keep);
        stats.confs.extend_from_slice(&confs[..keep]);
    }

    /// Records the outcome of a step in which `stats`' sequence asked for its chosen count,
    /// got `returned` drafts and had `accepted` of them accepted.
    pub fn observe(&self, stats: &mut SequenceDraftStats, returned: usize, accepted: usize) {
        let Some(asked) = stats.asked.take() else {
            return;
        };
        let confs = std::mem::take(&mut stats.confs);
        if asked == 0 {
            stats.idle += 1;
            stats.locked |= stats.last_failed;
            return;
        }
        let probe = std::mem::take(&mut stats.probing);
        stats.idle = 0;
        // A proposer that returned nothing said nothing about acceptance.
        stats.last_failed = returned > 0 && accepted == 0;
        stats.locked &= accepted == 0;
        stats.accept.decay(SEQUENCE_KEEP);
        stats.fill.decay(SEQUENCE_KEEP);
        PositionCounts::observe(
            &mut stats.accept,
            &mut stats.fill,
            asked,
            returned,
            accepted,
        );
        {
            let mut prior = self.prior();
            let EnginePrior {
                accept,
                fill,
                calibration,
                ..
            } = &mut *prior;
            accept.decay(ENGINE_KEEP);
            fill.decay(ENGINE_KEEP);
            PositionCounts::observe(accept, fill, asked, returned, accepted);
            let judged = returned.min(confs.len());
            if judged > 0 {
                calibration.observe(&confs[..judged], accepted);
            }
        }
        if accepted > 0 || probe {
            let wait = if accepted > 0 {
                PROBE_FIRST
            } else {
                (self.probe_wait(stats) * 2).min(PROBE_MAX)
            };
            stats.probe_every = wait;
            if probe {
                self.prior().probe_every = wait;
            }
        }
    }
}

/// What asking `candidate` for each count would gain and cost, its drafting read from
/// `draft_fit` (none measured: free) at `abscissa(count)`.
fn outlook(
    candidate: &Candidate<'_>,
    prior: &EnginePrior,
    draft_fit: Option<CostFit>,
    abscissa: impl Fn(usize) -> usize,
) -> Outlook {
    let s = candidate.stats;
    let n = candidate.budget;
    let (mut gain, mut rows) = (vec![0.0; n + 1], vec![0.0; n + 1]);
    let (mut engine_p, mut engine_f) = (COLD_ACCEPTANCE, 1.0);
    let (mut p, mut f) = (0.0, 0.0);
    let (mut reach_row, mut reach_gain) = (1.0, 1.0);
    for j in 0..n {
        engine_p = prior.accept.estimate(j, engine_p);
        engine_f = prior.fill.estimate(j, engine_f);
        // Past the first position the sequence's own figure at the position before counts
        // as much as the engine's at this one.
        let (prior_p, prior_f) = if j == 0 {
            (engine_p, engine_f)
        } else {
            ((engine_p + p) / 2.0, (engine_f + f) / 2.0)
        };
        p = s.accept.estimate(j, prior_p);
        f = s.fill.estimate(j, prior_f);
        reach_row *= f;
        reach_gain *= f * p;
        rows[j + 1] = rows[j] + reach_row;
        gain[j + 1] = gain[j] + reach_gain;
    }
    let draft = (0..=n)
        .map(|k| draft_fit.map_or(0.0, |f| f.at(abscissa(k) as f64)))
        .collect();
    Outlook { gain, rows, draft }
}

#[cfg(test)]
mod tests {
    use super::super::cost_model::{CostCurve, CostCurves, FixedCost};
    use super::*;

    fn policy(verify: &[(usize, f64)]) -> DraftPolicy {
        let curves = CostCurves {
            verify: CostCurve::from_points(verify.iter().copied()),
            draft: CostCurve::default(),
        };
        DraftPolicy::new(DraftPolicyKind::Adaptive, Arc::new(FixedCost(curves)))
    }

    fn fresh(budgets: &[usize]) -> (Vec<SequenceDraftStats>, Vec<usize>) {
        (
            vec![SequenceDraftStats::default(); budgets.len()],
            budgets.to_vec(),
        )
    }

    fn choose(
        p: &DraftPolicy,
        stats: &[SequenceDraftStats],
        budgets: &[usize],
        others: usize,
    ) -> Vec<usize> {
        let c: Vec<Candidate<'_>> = stats
            .iter()
            .zip(budgets)
            .map(|(stats, &budget)| Candidate { budget, stats })
            .collect();
        p.plan(&c, others).0
    }

    #[test]
    fn cold_start_drafts_then_measures_the_other_end() {
        let (stats, budgets) = fresh(&[4, 2]);
        // Nothing measured: the first sequence's whole budget, none for the others (a few
        // rows more than a plain step, however wide the batch).
        assert_eq!(choose(&policy(&[]), &stats, &budgets, 1), vec![4, 0]);
        // The first sequence with a budget is the one asked.
        assert_eq!(choose(&policy(&[]), &stats, &[0, 2], 1), vec![0, 2]);
        // Measured only at the drafting row count: a plain step next.
        assert_eq!(
            choose(&policy(&[(7, 1.0)]), &stats, &budgets, 1),
            vec![0, 0]
        );
        // Measured only at the plain row count (3 = 2 drafting + 1 other): draft.
        assert_eq!(
            choose(&policy(&[(3, 1.0)]), &stats, &budgets, 1),
            vec![4, 0]
        );
        let fixed = DraftPolicy::new(DraftPolicyKind::Fixed, Arc::new(FixedCost::default()));
        assert_eq!(choose(&fixed, &stats, &budgets, 0), vec![4, 2]);
    }

    #[test]
    fn the_count_follows_acceptance_against_the_row_cost() {
        // One row 1.0 s, each more 0.25 s: a draft pays when accepted more than 1 in 4.
        let p = policy(&[(1, 1.0), (2, 1.25)]);
        let mut stats = SequenceDraftStats::default();
        // Always accepted: the whole budget.
        for _ in 0..6 {
            stats.asked = Some(4);
            p.observe(&mut stats, 4, 4);
        }
        assert_eq!(choose(&p, std::slice::from_ref(&stats), &[4], 0), vec![4]);
        // A fresh policy and a sequence whose first draft is always rejected: none.
        let p = policy(&[(1, 1.0), (2, 1.25)]);
        let mut stats = SequenceDraftStats::default();
        for _ in 0..6 {
            stats.asked = Some(4);
            p.observe(&mut stats, 4, 0);
        }
        assert_eq!(choose(&p, std::slice::from_ref(&stats), &[4], 0), vec![0]);
        // Idle long enough, it is probed with one draft; a failed probe doubles the wait.
        for _ in 0..PROBE_FIRST {
            stats.asked = Some(0);
            p.observe(&mut stats, 0, 0);
        }
        assert_eq!(choose(&p, std::slice::from_ref(&stats), &[4], 0), vec![1]);
        stats.asked = Some(1);
        stats.probing = true;
        p.observe(&mut stats, 1, 0);
        assert_eq!(p.probe_wait(&stats), 2 * PROBE_FIRST);
        // A new sequence starts with the wait the failed probe left.
        assert_eq!(
            p.probe_wait(&SequenceDraftStats::default()),
            2 * PROBE_FIRST
        );
        assert_eq!(choose(&p, std::slice::from_ref(&stats), &[4], 0), vec![0]);
    }

    #[test]
    fn a_sequence_turned_down_after_failing_comes_back_only_through_a_probe() {
        // One row 1 s, each more 0.25 s. Another sequence's drafts are always accepted, so
        // the engine's figures are excellent.
        let p = policy(&[(1, 1.0), (2, 1.25)]);
        let mut good = SequenceDraftStats::default();
        for _ in 0..50 {
            good.asked = Some(4);
            p.observe(&mut good, 4, 4);
        }
        // This one's single drafting step failed. Shrunk towards the engine's figures its
        // estimate would still say draft (2/3 at the first position against the 1 in 4 a row
        // needs), so one decline is forced by hand, as the policy makes it in a wide batch.
        let mut weak = SequenceDraftStats {
            asked: Some(2),
            ..SequenceDraftStats::default()
        };
        p.observe(&mut weak, 2, 0);
        assert!(choose(&p, std::slice::from_ref(&weak), &[4], 0)[0] > 0);
        weak.asked = Some(0);
        p.observe(&mut weak, 0, 0);
        // Turned down after a failure, where the engine's figures say drafts pay: exactly
        // one draft after a single idle step (a probe that is expected to pay).
        assert!(p.probe_due(&weak));
        assert_eq!(choose(&p, std::slice::from_ref(&weak), &[4], 0), vec![1]);
        // A failed probe keeps it shut and doubles its wait, so it is probed only after the
        // whole of that wait; an accepted one lets the policy choose again.
        weak.asked = Some(1);
        weak.probing = true;
        p.observe(&mut weak, 1, 0);
        assert_eq!(p.probe_wait(&weak), 2 * PROBE_FIRST);
        for _ in 0..2 * PROBE_FIRST {
            assert_eq!(choose(&p, std::slice::from_ref(&weak), &[4], 0), vec![0]);
            weak.asked = Some(0);
            p.observe(&mut weak, 0, 0);
        }
        assert_eq!(choose(&p, std::slice::from_ref(&weak), &[4], 0), vec![1]);
        weak.asked = Some(1);
        p.observe(&mut weak, 1, 1);
        assert!(choose(&p, std::slice::from_ref(&weak), &[4], 0)[0] > 0);
    }

    #[test]
    fn probes_spend_no_more_than_the_exploration_share_of_the_verify_cost() {
        // One row 1 s, each more 0.25 s; eight sequences whose drafts always fail.
        let p = policy(&[(1, 1.0), (2, 1.25)]);
        let mut stats = vec![SequenceDraftStats::default(); 8];
        for s in &mut stats {
            s.asked = Some(4);
            p.observe(s, 4, 0);
        }
        let steps = 400;
        let mut probes = 0;
        for _ in 0..steps {
            let k = choose(&p, &stats, &[4; 8], 0);
            for (s, &k) in stats.iter_mut().zip(&k) {
                s.probing = k > 0 && p.probe_due(s);
                s.asked = Some(k);
                p.observe(s, k, 0);
            }
            assert!(k.iter().all(|&k| k <= 1), "{k:?}");
            probes += k.iter().sum::<usize>();
        }
        // A plain step (8 rows) costs 0.75 + 8 * 0.25 = 2.75 s, so each earns 1% of it:
        // 0.11 rows at 0.25 s a row; one row may be banked at the start.
        let allowed = 1.0 + steps as f64 * EXPLORE_SHARE * 2.75 / 0.25;
        assert!(
            probes as f64 <= allowed,
            "{probes} probes, {allowed} allowed"
        );
        // Yet the sequences are still probed now and then, so they could recover.
        assert!(
            probes as f64 >= allowed / 2.0,
            "{probes} probes, {allowed} allowed"
        );
    }

    #[test]
    fn a_block_drafter_pays_one_block_forward_whatever_the_count() {
        // A verify row costs 0.1 s on a 1 s step; drafting costs 1 s a draft when read along
        // the count. Drafts are always accepted.
        let curves = || CostCurves {
            verify: CostCurve::from_points([(1, 1.0), (2, 1.1)]),
            draft: CostCurve::from_points((0..=4).map(|k| (k, k as f64))),
        };
        let accepted = |p: &DraftPolicy| {
            let mut stats = SequenceDraftStats::default();
            for _ in 0..6 {
                stats.asked = Some(4);
                p.observe(&mut stats, 4, 4);
            }
            stats
        };
        // Token by token, 4 drafts would cost 4 s of drafting for 4 tokens: none pays.
        let p = DraftPolicy::new(DraftPolicyKind::Adaptive, Arc::new(FixedCost(curves())));
        assert_eq!(choose(&p, &[accepted(&p)], &[4], 0), vec![0]);
        // One block forward (1 s) drafts all 4: the whole budget pays.
        let p = DraftPolicy::new(DraftPolicyKind::Adaptive, Arc::new(FixedCost(curves())))
            .for_block_drafter(true);
        assert_eq!(choose(&p, &[accepted(&p)], &[4], 0), vec![4]);
        assert_eq!(
            (0..=5).map(|k| p.draft_abscissa(k)).collect::<Vec<_>>(),
            [0, 1, 1, 1, 1, 1]
        );
    }

    #[test]
    fn a_flat_measured_cost_does_not_make_a_useless_drafter_free() {
        // Noise flattened the measured slope: rows look free. A drafter rejected 50 times
        // running still gets nothing, since a row costs at least a share of a plain row.
        let p = policy(&[(1, 1.0), (2, 1.0), (3, 0.9)]);
        let mut stats = SequenceDraftStats::default();
        for _ in 0..50 {
            stats.asked = Some(4);
            p.observe(&mut stats, 4, 0);
        }
        assert_eq!(choose(&p, std::slice::from_ref(&stats), &[4], 0), vec![0]);
    }

    #[test]
    fn rows_past_the_knee_of_a_bent_cost_are_priced_at_its_steeper_slope() {
        use super::super::cost_fit::{BENT, BENT_LINE};
        // Eight sequences whose first drafts are accepted about half the time. A plain step
        // (8 rows) sits at the knee of the measured curve, past which a row costs 0.1 s
        // against 1.07 s for 8 tokens: a draft then pays only when accepted more than about
        // 3 times in 4. The straight line through the same points (0.037 s a row from
        // 1.18 s) would pay for one accepted 1 time in 4.
        let half = |p: &DraftPolicy| {
            let mut stats = SequenceDraftStats::default();
            for step in 0..40 {
                stats.asked = Some(1);
                p.observe(&mut stats, 1, step % 2);
            }
            vec![stats; 8]
        };
        let bent = policy(&BENT);
        let k = choose(&bent, &half(&bent), &[4; 8], 0);
        assert_eq!(k, vec![0; 8]);
        let (a, b) = BENT_LINE;
        let straight = policy(&[(1, a + b), (2, a + 2.0 * b)]);
        let k = choose(&straight, &half(&straight), &[4; 8], 0);
        assert!(k.iter().all(|&k| k > 0), "{k:?}");
        // Below the knee the flat part holds: one sequence (1 row) drafts there.
        let k = choose(&bent, &half(&bent)[..1], &[4], 0);
        assert!(k[0] > 0, "{k:?}");
        // Four sequences (4 rows) take the cheap rows up to the knee, one first draft each,
        // and none past it, where a second draft (about 0.3 tokens, worth 0.08 s) would cost
        // 0.1 s; read as cheap everywhere, each would be asked for all 4.
        let k = choose(&bent, &half(&bent)[..4], &[4; 4], 0);
        assert_eq!(k, vec![1; 4]);
    }

    #[test]
    fn a_proposer_that_returns_nothing_costs_no_rows() {
        // A row costs half a plain step, drafting is free. A proposer that returns 4 right
        // drafts one step in 4 and none otherwise pays: counted as 4 rows every step for an
        // expected 1 token it would not (3 s for 2 tokens against 1 s for 1).
        let p = policy(&[(1, 1.0), (2, 1.5)]);
        let mut stats = SequenceDraftStats::default();
        for step in 0..40 {
            stats.asked = Some(4);
            if step % 4 == 0 {
                p.observe(&mut stats, 4, 4);
            } else {
                p.observe(&mut stats, 0, 0);
            }
        }
        assert!(choose(&p, std::slice::from_ref(&stats), &[4], 0)[0] > 0);
    }

    #[test]
    fn a_stale_wide_cost_is_measured_again_only_where_drafts_could_pay() {
        // Early, under load, 5 rows took 10 s; since then only plain 1 s steps ran.
        let setup = || {
            let cost = Arc::new(MeasuredCost::new(0.05));
            cost.record_verify(5, 10.0);
            for _ in 0..REFRESH_AGE - 1 {
                cost.record_verify(1, 1.0);
            }
            let p = DraftPolicy::new(DraftPolicyKind::Adaptive, cost.clone());
            (cost, p)
        };
        let observed = |p: &DraftPolicy, accepted: usize| {
            let mut stats = SequenceDraftStats::default();
            for _ in 0..6 {
                stats.asked = Some(4);
                p.observe(&mut stats, 4, accepted);
            }
            stats
        };
        // Runs `steps` steps of one sequence whose verify really costs `per_row` a row
        // beyond 1 s and whose drafts are all accepted (`right`) or all rejected; returns
        // the counts asked.
        let run = |cost: &MeasuredCost,
                   p: &DraftPolicy,
                   stats: &mut SequenceDraftStats,
                   right: bool,
                   per_row: f64,
                   steps: u64| {
            (0..steps)
                .map(|_| {
                    let k = choose(p, std::slice::from_ref(stats), &[4], 0)[0];
                    cost.record_verify(1 + k, 1.0 + per_row * k as f64);
                    stats.probing = k > 0 && p.probe_due(stats);
                    stats.asked = Some(k);
                    p.observe(stats, k, if right { k } else { 0 });
                    k
                })
                .collect::<Vec<usize>>()
        };
        // Always right, rows cheap (0.25 s) in truth: nothing before the wide end is
        // REFRESH_AGE records old, a refresh within two more REFRESH_AGE, and from then
        // on the line is right again and the whole budget is asked.
        let (cost, p) = setup();
        let mut oracle = observed(&p, 4);
        assert_eq!(choose(&p, std::slice::from_ref(&oracle), &[4], 0), vec![0]);
        let asks = run(&cost, &p, &mut oracle, true, 0.25, 3 * REFRESH_AGE);
        let first = asks.iter().position(|&k| k > 0).expect("never refreshed");
        assert!(first > 0 && first <= 2 * REFRESH_AGE as usize, "{asks:?}");
        assert!(asks[first + 30..].iter().all(|&k| k == 4), "{asks:?}");
        // Rows as dear as the old figure said: refreshed at most once in REFRESH_AGE
        // records, and otherwise left at none.
        let (cost, p) = setup();
        let mut oracle = observed(&p, 4);
        let asks = run(&cost, &p, &mut oracle, true, 2.25, 10 * REFRESH_AGE);
        let drafting = asks.iter().filter(|&&k| k > 0).count();
        assert!((1..=10).contains(&drafting), "{drafting} of {}", asks.len());
        // Never right: no refresh, however stale; only the one-draft probes, ever rarer.
        let (cost, p) = setup();
        let mut random = observed(&p, 0);
        let asks = run(&cost, &p, &mut random, false, 0.25, 10 * REFRESH_AGE);
        let probes = asks.iter().filter(|&&k| k > 0).count();
        assert!(asks.iter().all(|&k| k <= 1) && probes <= 20, "{asks:?}");
    }

    /// Runs `steps` steps of `width` sequences whose drafts are each accepted with chance
    /// `p` (the first rejection ends a step's run) under a fixed cost of `per_row` seconds a
    /// verify row beyond a 1 s plain step of `width` rows; returns the steps that asked for
    /// no drafts and the steps in all.
    fn idle_steps(width: usize, p: f64, per_row: f64, steps: usize) -> (usize, usize) {
        use rand::{Rng, SeedableRng};
        let plain = 1.0 - per_row * width as f64;
        let policy = policy(&[
            (width, 1.0),
            (width + 1, plain + per_row * (width + 1) as f64),
        ]);
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let mut stats = vec![SequenceDraftStats::default(); width];
        let mut idle = 0;
        for _ in 0..steps {
            let k = choose(&policy, &stats, &vec![4; width], 0);
            for (s, &k) in stats.iter_mut().zip(&k) {
                s.probing = k > 0 && policy.probe_due(s);
                s.asked = Some(k);
                let accepted = (0..k).take_while(|_| rng.random_bool(p)).count();
                policy.observe(s, k, accepted);
                idle += usize::from(k == 0);
            }
        }
        (idle, steps * width)
    }

    #[test]
    fn a_good_drafter_in_a_wide_batch_is_not_shut_out_by_one_rejection() {
        // Four sequences, drafts accepted 3 times in 4, a verify row 15% of a plain step's
        // cost (so a first draft pays when accepted more than about 2 times in 3). A
        // rejection can turn a sequence down (its estimate is near the bar), but the
        // engine's figures say a draft pays, so it is probed back after one idle step
        // rather than after the probe wait and the exploration budget: it asks for drafts
        // on most steps (when a turned-down sequence waited for those, 72% of them idled).
        let (idle, all) = idle_steps(4, 0.75, 0.15, 300);
        assert!(idle * 3 <= all, "{idle} idle of {all}");
        // A drafter that is never right is still turned down on nearly every step.
        let (idle, all) = idle_steps(4, 0.0, 0.1, 300);
        assert!(idle * 20 >= all * 19, "{idle} idle of {all}");
    }
}
