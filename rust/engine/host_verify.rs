//! Verdicts of the sequences of a forward that read their rows' logits on the host without
//! a grammar (sampled sequences, and greedy ones where the target makes no device picks),
//! for a verify step or a prefill's first tokens: one download for each run of adjacent
//! such rows, then every verdict computed side by side on rayon's pool.
//!
//! Why: a sampled verify row costs 0.1-0.3 ms on the host (the target's distribution, then
//! a draw), for each row up to the first rejection of every sampled sequence. At batch 8-16
//! with drafts that is milliseconds a step on the engine thread while the other cores wait,
//! and on a GPU it can be most of the step. Each sequence also downloaded its own rows,
//! a synchronisation each.
//!
//! Invariants:
//! - A verdict is a pure function of the sequence's rows, drafts (or tree), sampling
//!   parameters and its own random stream, so computing them together, in any order, gives
//!   exactly the verdicts computed one at a time, and each stream advances as it would.
//! - Sequences with a grammar are not taken: a matcher may be a Python object, and advances
//!   with each emitted token, so they verify on the engine thread as before.
//! - Only the rows each caller names are read. The verify step names a sequence's verify
//!   rows when they lie inside the forward's output (else the one-at-a-time path refuses
//!   it by name); a prefill names the last row of each sequence whose first token it picks,
//!   a chain of no drafts.

use super::sequence::EngineSequence;
use super::{
    verify, verify_tree_greedy, verify_tree_sampled, SamplingParams, TargetOutput, TreeVerdict,
    Verdict,
};
use crate::backend::{GpuBackend, GpuBackendExt};
use crate::speculative::DraftTree;
use crate::Result;
use rand::rngs::SmallRng;
use rayon::prelude::*;

/// A sequence's verdict from its downloaded rows: a chain's or a tree's.
pub(super) enum HostVerdict {
    Chain(Verdict),
    Tree(TreeVerdict),
}

/// One sequence's share of the work: its rows within the download and what its verdict
/// reads and advances.
struct Job<'a> {
    /// Its position in the chunk.
    at: usize,
    /// The downloaded run of rows holding its rows, its first row there, and its row count.
    logits: &'a [f32],
    first_row: usize,
    rows: usize,
    drafts: &'a [u32],
    tree: Option<&'a DraftTree>,
    sampling: &'a SamplingParams,
    rng: &'a mut SmallRng,
}

impl Job<'_> {
    fn verdict(&mut self, vocab: usize) -> Result<HostVerdict> {
        let rows: Vec<&[f32]> = self.logits
            [self.first_row * vocab..(self.first_row + self.rows) * vocab]
            .chunks(vocab)
            .collect();
        Ok(match self.tree {
            Some(tree) if self.sampling.is_greedy() => {
                HostVerdict::Tree(verify_tree_greedy(&rows, tree)?)
            }
            Some(tree) => HostVerdict::Tree(verify_tree_sampled(
                &rows,
                tree,
                self.sampling,
                self.rng,
                None,
            )?),
            None => HostVerdict::Chain(verify(
                &rows,
                self.drafts,
                None,
                self.sampling,
                self.rng,
                None,
            )?),
        })
    }
}

/// The verdicts of the sequences of `chunk` (`seqs` indices) that `ranges` gives logits rows
/// of `out` (position `k`: its first row and row count, the last verified token's row then
/// one a draft or node; `None`: not verified here), by chunk position, `None` for the
/// others. A failed download is every such sequence's error. The ranges must lie inside
/// `out.logits`.
pub(super) fn host_verdicts<K>(
    gpu: &dyn GpuBackend,
    out: &TargetOutput,
    vocab: usize,
    chunk: &[usize],
    ranges: &[Option<(usize, usize)>],
    seqs: &mut [EngineSequence<K>],
) -> Vec<Option<Result<HostVerdict>>> {
    let mut verdicts: Vec<Option<Result<HostVerdict>>> = (0..chunk.len()).map(|_| None).collect();
    let mut taken: Vec<(usize, usize, usize)> = ranges
        .iter()
        .enumerate()
        .filter_map(|(k, r)| r.map(|(first, rows)| (k, first, rows)))
        .collect();
    taken.sort_by_key(|&(_, first, _)| first);
    // Runs of adjacent rows, one download each: rows of sequences verified from device
    // picks are not downloaded.
    let mut runs: Vec<(usize, usize)> = Vec::new();
    let mut run_of = vec![0; chunk.len()];
    for &(k, start, rows) in &taken {
        match runs.last_mut() {
            Some(run) if run.1 == start => run.1 = start + rows,
            _ => runs.push((start, start + rows)),
        }
        run_of[k] = runs.len() - 1;
    }
    let mut downloaded = Vec::with_capacity(runs.len());
    for &(start, end) in &runs {
        match gpu.download::<f32>(out.logits.offset(start * vocab * 4), (end - start) * vocab) {
            Ok(l) => downloaded.push(l),
            Err(e) => {
                for &(k, _, _) in &taken {
                    verdicts[k] = Some(Err(e.clone().into()));
                }
                return verdicts;
            }
        }
    }
    let mut position_of = vec![None; seqs.len()];
    for &(k, first, rows) in &taken {
        position_of[chunk[k]] = Some((k, first, rows));
    }
    let mut jobs: Vec<Job<'_>> = seqs
        .iter_mut()
        .zip(position_of)
        .filter_map(|(s, at)| {
            let (at, first, rows) = at?;
            Some(Job {
                at,
                logits: &downloaded[run_of[at]],
                first_row: first - runs[run_of[at]].0,
                rows,
                drafts: &s.drafts[..(rows - 1).min(s.drafts.len())],
                tree: s.tree.as_ref(),
                sampling: &s.sampling,
                rng: &mut s.rng,
            })
        })
        .collect();
    let done: Vec<(usize, Result<HostVerdict>)> = if jobs.len() > 1 {
        jobs.par_iter_mut()
            .map(|j| (j.at, j.verdict(vocab)))
            .collect()
    } else {
        jobs.iter_mut().map(|j| (j.at, j.verdict(vocab))).collect()
    };
    for (at, v) in done {
        verdicts[at] = Some(v);
    }
    verdicts
}
