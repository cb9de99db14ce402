//! Each member's measured odds, per sequence, that its first draft is accepted: what decides
//! which of two members with a draft a step takes.
//!
//! Why: a retrieval drafter returns a draft whenever some suffix of the text matches, however
//! short the match. On open text those drafts are right far less often than a learned head's
//! (on the bench's open prompts, one sequence at a time: 16 of `SuffixDecoding`'s 81 drafts
//! accepted, 149 of `smollm2-mtp`'s 299), so taking the first member with any draft lost to
//! the head alone. A member takes the step only when its odds are at least those of every
//! later member that may draft.
//!
//! A member's own odds are kept apart for a draft of one token and for longer ones (its rivals
//! are judged by their odds over all lengths, their drafts not yet known): a retrieval drafter's
//! longer drafts come from longer matches, and are right far more often.
//!
//! Invariants:
//! - An estimate is `(hits + PRIOR_WEIGHT * PRIOR) / (tries + PRIOR_WEIGHT)`, within [0, 1].
//! - Every member starts at the same estimate, so until a step is measured the first member
//!   with a draft wins, as it would with no odds at all.
//! - Every count shrinks by `KEEP` at each step some member drafts, so a member that stops
//!   taking steps drifts back to the prior and is tried again: text that starts repeating is
//!   found. Steps without drafts (the draft policy's pauses) leave the odds as they are.

/// The estimate a member starts at. Any value works that every member shares; one half says
/// nothing either way.
const PRIOR: f64 = 0.5;
/// Pseudo-observations of the prior: two misses in a row take a member to 0.25, enough to hand
/// the next step to a head measured near one half.
const PRIOR_WEIGHT: f64 = 2.0;
/// Share of every count kept at each drafted step: the odds remember about the last 30
/// measured steps, so a member that fell to none of three drafts right is tried again after
/// roughly 80 steps (its estimate back near one half).
const KEEP: f64 = 0.97;
/// Draft lengths kept apart: one draft, and two or more.
const LENGTHS: usize = 2;

fn length_class(drafts: usize) -> usize {
    drafts.clamp(1, LENGTHS) - 1
}

/// `hits` in `tries`, shrunk towards [`PRIOR`] by [`PRIOR_WEIGHT`] pseudo-observations.
fn shrunk(hits: f64, tries: f64) -> f64 {
    (hits + PRIOR_WEIGHT * PRIOR) / (tries + PRIOR_WEIGHT)
}

/// One sequence's odds for every member.
#[derive(Clone, Debug)]
pub(super) struct MemberOdds {
    /// `[member][length class]`: first drafts accepted, decayed.
    hits: Vec<[f64; LENGTHS]>,
    /// `[member][length class]`: steps taken, decayed.
    tries: Vec<[f64; LENGTHS]>,
}

impl MemberOdds {
    pub fn new(members: usize) -> Self {
        MemberOdds {
            hits: vec![[0.0; LENGTHS]; members],
            tries: vec![[0.0; LENGTHS]; members],
        }
    }

    /// The estimated chance that member `i`'s first draft is accepted when it drafts `drafts`
    /// tokens.
    pub fn estimate(&self, i: usize, drafts: usize) -> f64 {
        let c = length_class(drafts);
        shrunk(self.hits[i][c], self.tries[i][c])
    }

    /// The estimated chance that member `i`'s first draft is accepted, whatever its length: a
    /// rival's odds, whose draft is not yet known.
    pub fn overall(&self, i: usize) -> f64 {
        shrunk(self.hits[i].iter().sum(), self.tries[i].iter().sum())
    }

    /// Whether member `i`, with `drafts` drafts, takes the step ahead of the members after it:
    /// its odds for a draft of that length are at least every later member's overall odds
    /// (ties go to the earlier member, in the order the caller chose). Every later member is a
    /// rival: a step that asks one member for drafts asks each member it reaches for some.
    pub fn wins(&self, i: usize, drafts: usize) -> bool {
        let own = self.estimate(i, drafts);
        (i + 1..self.hits.len()).all(|j| self.overall(j) <= own)
    }

    /// Settles a step whose `winner` (member, drafts) had `accepted` drafts accepted: every
    /// count shrinks, then the winner counts its first draft. A step nobody drafted changes
    /// nothing.
    pub fn settle(&mut self, winner: Option<(usize, usize)>, accepted: usize) {
        let Some((w, drafts)) = winner.filter(|&(_, d)| d > 0) else {
            return;
        };
        for counts in self.hits.iter_mut().chain(self.tries.iter_mut()) {
            for c in counts.iter_mut() {
                *c *= KEEP;
            }
        }
        let c = length_class(drafts);
        self.tries[w][c] += 1.0;
        if accepted > 0 {
            self.hits[w][c] += 1.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_odds_leave_the_step_to_the_first_member() {
        let odds = MemberOdds::new(2);
        assert!(odds.wins(0, 1));
        assert!(odds.wins(0, 3));
    }

    #[test]
    fn a_member_whose_first_drafts_miss_yields_to_the_next_and_is_tried_again_later() {
        let mut odds = MemberOdds::new(2);
        for _ in 0..3 {
            odds.settle(Some((0, 1)), 0);
        }
        assert!(!odds.wins(0, 1));
        // Its longer drafts are measured apart and still win.
        assert!(odds.wins(0, 3));
        let mut steps = 0;
        while !odds.wins(0, 1) {
            odds.settle(Some((1, 3)), 1);
            odds.settle(Some((1, 3)), 0);
            steps += 2;
            assert!(steps < 1000, "the member is never tried again");
        }
        // The head is right half the time; the member comes back once its misses fade.
        assert!((20..200).contains(&steps), "{steps}");
    }

    #[test]
    fn estimates_follow_the_counts_and_stay_within_bounds() {
        let mut odds = MemberOdds::new(1);
        assert_eq!(odds.estimate(0, 2), PRIOR);
        odds.settle(Some((0, 2)), 2);
        let expected = (1.0 + PRIOR_WEIGHT * PRIOR) / (1.0 + PRIOR_WEIGHT);
        assert!((odds.estimate(0, 5) - expected).abs() < 1e-12);
        assert_eq!(odds.estimate(0, 1), PRIOR);
        // Overall, the one measured step counts whatever its length.
        assert!((odds.overall(0) - expected).abs() < 1e-12);
        for _ in 0..500 {
            odds.settle(Some((0, 1)), 1);
        }
        assert!(odds.estimate(0, 1) <= 1.0 && odds.estimate(0, 1) > 0.9);
    }
}
