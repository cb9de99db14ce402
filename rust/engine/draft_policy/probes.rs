//! Probes: how a sequence the policy turned down gets drafts again.
//!
//! A sequence's own estimate does not move while it asks for nothing, so without probes a
//! sequence turned down once would stay at 0 for good, even when its text turns
//! predictable. A probe asks it for one draft.
//!
//! Invariants:
//! - A sequence turned down to 0 after a step whose drafts all failed is locked: only a
//!   probe may ask it for drafts until one of its drafts is accepted (otherwise the
//!   engine's figures, other sequences' successes, would soon talk its thin evidence round
//!   outside the exploration budget).
//! - It is probed after [`PROBE_FIRST`] idle steps, the wait doubling (up to
//!   [`PROBE_MAX`]) while probes fail and reset by an accepted draft. A new sequence starts
//!   with the engine's wait, so a drafter that is never right is not probed afresh by
//!   every request.
//! - Where the engine's figures say a first draft pays (see [`EngineProbe::engine_pays`])
//!   a probe is an expected gain, not exploration: it is not charged, and it is due after a
//!   single idle step while the sequence's probes are not failing. Elsewhere a probe needs
//!   one sure draft to pay and a row of the exploration budget.
//! - A probe is one draft, never more, and never where even a sure draft would not pay.

use super::row_cost::{Choice, RowCost};
use super::Outlook;

/// Idle steps before the first probe of a sequence turned down to 0. Short: in the
/// simulated four-sequence batch of the policy tests (drafts accepted 3 times in 4, a row
/// 15% of a plain step) a turned-down sequence idled on 72% of its steps while probes
/// waited longer; the exploration budget, not this wait, bounds what probes cost.
pub(super) const PROBE_FIRST: usize = 4;
/// The longest wait between probes: a drafter that fails every probe is still tried about
/// once in 64 steps, so a sequence whose text turns predictable late recovers within a
/// few dozen tokens (the exploration budget keeps this cheap at any batch width).
pub(super) const PROBE_MAX: usize = 64;

/// A sequence's probe state.
#[derive(Clone, Debug, Default)]
pub(in crate::engine) struct SequenceProbe {
    /// Steps since the last one that asked for drafts.
    idle: usize,
    /// Idle steps before the next probe (0: not yet set, the engine's).
    every: usize,
    /// Whether this step's drafts are a probe.
    pub(in crate::engine) probing: bool,
    /// Whether the last step that asked for drafts got some and had none accepted.
    last_failed: bool,
    /// Turned down after drafts that failed: only a probe may ask for drafts, until one of
    /// its drafts is accepted.
    pub(super) locked: bool,
}

/// The engine's probe state, shared by its sequences.
#[derive(Debug, Default)]
pub(super) struct EngineProbe {
    /// The wait a new sequence starts with (0: [`PROBE_FIRST`]).
    every: usize,
    /// Whether, at the last plan, the engine's acceptance at the first draft position paid
    /// for a verify row.
    pub engine_pays: bool,
}

impl SequenceProbe {
    /// Idle steps before this sequence is probed.
    pub(super) fn wait(&self, engine: &EngineProbe) -> usize {
        match (self.every, engine.every) {
            (0, 0) => PROBE_FIRST,
            (0, engine) => engine,
            (own, _) => own,
        }
    }

    /// Whether this sequence is due a probe if it is turned down to 0 this step: idle for
    /// its probe wait, or for one step where the engine's figures said at the last plan
    /// that a first draft pays and its probes are not failing (wait not doubled).
    pub(super) fn due(&self, engine: &EngineProbe) -> bool {
        let wait = self.wait(engine);
        self.idle >= wait || (self.idle >= 1 && wait <= PROBE_FIRST && engine.engine_pays)
    }

    /// Records a step that asked for no drafts.
    pub(super) fn idled(&mut self) {
        self.idle += 1;
        self.locked |= self.last_failed;
    }

    /// Records a step that asked for drafts, got `returned` and had `accepted` of them
    /// accepted; a probe's outcome sets the wait of the sequences to come.
    pub(super) fn drafted(&mut self, engine: &mut EngineProbe, returned: usize, accepted: usize) {
        let probe = std::mem::take(&mut self.probing);
        self.idle = 0;
        // A proposer that returned nothing said nothing about acceptance.
        self.last_failed = returned > 0 && accepted == 0;
        self.locked &= accepted == 0;
        if accepted > 0 || probe {
            let wait = if accepted > 0 {
                PROBE_FIRST
            } else {
                (self.wait(engine) * 2).min(PROBE_MAX)
            };
            self.every = wait;
            if probe {
                engine.every = wait;
            }
        }
    }
}

/// One sequence the probes may reach: its budget, probe state and outlook.
pub(super) struct ProbeCandidate<'a> {
    pub budget: usize,
    pub probe: &'a SequenceProbe,
    pub outlook: &'a Outlook,
}

/// Gives a due sequence left at 0 in `choice` one draft where it pays (see the module
/// invariants), spending rows of `credit` for the probes that are exploration. `first` is
/// the engine's acceptance at the first draft position.
pub(super) fn place(
    engine: &mut EngineProbe,
    cost: &RowCost,
    choice: &mut Choice,
    candidates: &[ProbeCandidate<'_>],
    first: f64,
    credit: &mut f64,
) {
    let c = choice;
    let engine_pays =
        cost.rate(c.tokens + first, c.rows + 1.0, c.draft) > cost.rate(c.tokens, c.rows, c.draft);
    engine.engine_pays = engine_pays;
    for (i, cand) in candidates.iter().enumerate() {
        if c.k[i] != 0 || cand.budget == 0 || !cand.probe.due(engine) {
            continue;
        }
        let o = cand.outlook;
        let now = cost.rate(c.tokens, c.rows, c.draft);
        let with = |gain: f64| {
            cost.rate(
                c.tokens + gain,
                c.rows + 1.0,
                c.draft - o.draft[0] + o.draft[1],
            )
        };
        let free = engine_pays && with(first) > now;
        if free || (*credit >= 1.0 && with(1.0) > now) {
            if !free {
                *credit -= 1.0;
            }
            c.k[i] = 1;
            c.tokens += first;
            c.rows += 1.0;
            c.draft += o.draft[1] - o.draft[0];
        }
    }
}
