//! Tallies of three-token sampled generations, by the path each took through speculative
//! decoding, and their chi-square fits against the target's conditional distributions.
//!
//! A generation `x0 x1 x2` after a fixed prompt is tallied four ways: `x0` given the prompt,
//! `x1` given `x0`, and `x2` given `x0 x1`, split by the path of the step that drafted for
//! `x1` (its first draft accepted, so `x2` came out of the same verification; rejected, so
//! `x2` came out of the next step; or no draft at all). Every test that uses these supplies
//! the target's logits for a context; the expected distribution is then
//! [`reference`](super::reference), written from the definitions, never the engine's sampler.
//!
//! Invariant: a tally's counts per context have exactly `vocab` cells.
#![allow(dead_code)]

use super::{chi_square, critical_value, reference, Fit, ALPHA};
use specdraft::engine::{Metrics, SamplingParams};
use std::collections::BTreeMap;

/// Counts of the next token, per context (the tokens generated before it).
pub type Table = BTreeMap<Vec<u32>, Vec<u64>>;

/// What became of the first draft of the step that produced the second token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// Accepted: the third token came out of the same verification.
    Accepted,
    /// Rejected: the second token is the correction, the third came from the next step.
    Rejected,
    /// The step drafted nothing.
    Undrafted,
}

impl Path {
    /// The path of a three-token generation whose drafts were clamped to what one step could
    /// verify (at most one draft after the first token, none after the second), read from its
    /// metrics; panics, naming the metrics, where they fit no path.
    pub fn of(m: &Metrics) -> Path {
        let first_drafted = m.drafted_at.first().copied().unwrap_or(0);
        let path = match (m.drafted, m.accepted, first_drafted) {
            (0, 0, 0) => Path::Undrafted,
            (1, 1, 1) => Path::Accepted,
            (1, 0, 1) => Path::Rejected,
            _ => panic!("a three-token generation drafts at most once: {m:?}"),
        };
        let steps = if path == Path::Accepted { 1 } else { 2 };
        assert_eq!(m.verify_steps, steps, "{path:?}: {m:?}");
        path
    }
}

/// The four tallies of many generations.
pub struct Tables {
    pub vocab: usize,
    pub first: Table,
    pub second: Table,
    pub third_after_accept: Table,
    pub third_after_reject: Table,
    pub third_undrafted: Table,
}

impl Tables {
    pub fn new(vocab: usize) -> Self {
        Tables {
            vocab,
            first: Table::new(),
            second: Table::new(),
            third_after_accept: Table::new(),
            third_after_reject: Table::new(),
            third_undrafted: Table::new(),
        }
    }

    fn tally(vocab: usize, table: &mut Table, context: &[u32], next: u32) {
        assert!(
            (next as usize) < vocab,
            "token {next} outside the vocabulary"
        );
        table
            .entry(context.to_vec())
            .or_insert_with(|| vec![0; vocab])[next as usize] += 1;
    }

    /// Tallies one generation `x` (three tokens) that took `path`.
    pub fn add(&mut self, x: &[u32], path: Path) {
        assert_eq!(x.len(), 3, "{x:?}");
        let v = self.vocab;
        Self::tally(v, &mut self.first, &[], x[0]);
        Self::tally(v, &mut self.second, &x[..1], x[1]);
        let third = match path {
            Path::Accepted => &mut self.third_after_accept,
            Path::Rejected => &mut self.third_after_reject,
            Path::Undrafted => &mut self.third_undrafted,
        };
        Self::tally(v, third, &x[..2], x[2]);
    }

    /// Generations tallied in `table`.
    pub fn count(table: &Table) -> u64 {
        table.values().flatten().sum()
    }
}

/// The summed chi-square of every context's counts against the target's distribution there;
/// `logits_for(context)` gives the target's logits after the prompt and `context`.
pub fn fit(logits_for: &mut dyn FnMut(&[u32]) -> Vec<f32>, s: &SamplingParams, t: &Table) -> Fit {
    let mut total = Fit::empty();
    for (context, counts) in t {
        let p = reference(&logits_for(context), s);
        let f = chi_square(counts, &p).unwrap_or_else(|e| panic!("after {context:?}: {e}"));
        total.add(&f);
    }
    total
}

/// Asserts the fit passes on at least `min_df` degrees of freedom.
pub fn check(what: &str, f: &Fit, min_df: usize) {
    assert!(
        f.df >= min_df && f.passes(),
        "{what}: chi2 {} on {} df (critical {}, at least {min_df} df wanted)",
        f.statistic,
        f.df,
        critical_value(f.df.max(1), ALPHA)
    );
}
