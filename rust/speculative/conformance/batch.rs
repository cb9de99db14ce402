//! The batch check: every sequence's twin is driven through `propose_batch`, whose drafts
//! must equal what per-sequence `propose` drafted for the original at the same point. A
//! proposer that names target layers gets each twin's captured rows, those its `propose`
//! would get, in `ctx.target_hidden_stacks`, as the engine passes them.

use super::driver::Checker;
use super::guard::guarded;
use super::report::ConformanceReport;
use super::synthetic::Sequence;
use crate::backend::DevicePtr;
use crate::model::ForwardContext;
use crate::speculative::ProposerState;

/// Drives the twins through `propose_batch` and compares with the per-sequence drafts.
/// Returns false once the proposer says batching is unsupported; the twins that were not
/// batched that step then propose alone, as they do from then on ([`lone_step`]), so they
/// stay in step with the originals.
pub(super) fn batch_step(
    checker: &mut Checker<'_>,
    twins: &mut [(Sequence, Sequence)],
    per_seq: &[Option<Vec<u32>>],
    width: usize,
) -> bool {
    let (p, n) = (checker.proposer, checker.options.num_drafts);
    let live: Vec<usize> = (0..twins.len())
        .filter(|&i| twins[i].1.state.is_some() && per_seq[i].is_some())
        .collect();
    let groups: Vec<&[usize]> = live.chunks(width.min(live.len().max(1))).collect();
    for (g, &group) in groups.iter().enumerate() {
        let mut conf = Vec::new();
        let result = call_group(checker, twins, group, |report, x, states, ctx| {
            guarded(report, "propose_batch", || {
                p.propose_batch(
                    &x.last,
                    &x.hiddens,
                    &x.positions,
                    n,
                    states,
                    ctx,
                    0,
                    Some(&mut conf),
                )
            })
        });
        let drafts = match result {
            Some(Some(d)) => d,
            Some(None) => {
                // Unsupported: this group and the rest propose alone, to stay in step.
                for &i in groups[g..].iter().copied().flatten() {
                    lone_step(checker, &mut twins[i].1);
                }
                return false;
            }
            None => {
                for &i in group {
                    checker.end(&mut twins[i].1);
                }
                continue;
            }
        };
        if drafts.len() != group.len() {
            checker.report.violate(
                "propose_batch",
                format!(
                    "returned drafts for {} sequences, asked for {}",
                    drafts.len(),
                    group.len()
                ),
                "return one draft list per sequence, in order",
            );
            for &i in group {
                checker.end(&mut twins[i].1);
            }
            continue;
        }
        // A sequence's list is empty (nothing reported) or holds one probability a draft.
        let bad_list = |(c, d): (&Vec<f32>, &Vec<u32>)| {
            (!c.is_empty() && c.len() != d.len()) || c.iter().any(|x| !(0.0..=1.0).contains(x))
        };
        if !conf.is_empty()
            && (conf.len() != drafts.len() || conf.iter().zip(&drafts).any(bad_list))
        {
            checker.report.violate(
                "propose_batch: out_conf",
                "out_conf does not hold, for each sequence, one probability in [0, 1] per draft or an empty list",
                "fill out_conf[i][k] with the probability of drafts[i][k], or leave out_conf[i] empty",
            );
        }
        for (&i, d) in group.iter().zip(&drafts) {
            if Some(d) != per_seq[i].as_ref() {
                checker.report.violate(
                    "propose_batch vs propose",
                    format!("sequence {i}: propose_batch drafted {d:?}, propose drafted {:?}", per_seq[i].as_deref().unwrap_or(&[])),
                    "propose_batch must return exactly what per-sequence propose returns (or Ok(None) if unsupported)",
                );
            }
            let k = checker.judge("propose_batch", &twins[i].1, d, None);
            checker.advance(&mut twins[i].1, k);
        }
    }
    true
}

/// One per-sequence `propose` and simulated verify for `seq`.
pub(super) fn lone_step(checker: &mut Checker<'_>, seq: &mut Sequence) {
    if let Some(drafts) = checker.propose_one(seq, None) {
        let k = checker.judge("propose", seq, &drafts, None);
        checker.advance(seq, k);
    }
}

/// What a batched propose reads of each member of its group, in the group's order.
pub(super) struct GroupInputs {
    pub last: Vec<u32>,
    pub hiddens: Vec<DevicePtr>,
    pub positions: Vec<usize>,
}

/// Runs `call` over the twins (`.1`) of `group`: their inputs, their states (lent for the
/// call and put back after), and a context carrying their captured rows in
/// `ctx.target_hidden_stacks`, as the engine passes them.
pub(super) fn call_group<R>(
    checker: &mut Checker<'_>,
    twins: &mut [(Sequence, Sequence)],
    group: &[usize],
    call: impl FnOnce(
        &mut ConformanceReport,
        &GroupInputs,
        &mut [&mut dyn ProposerState],
        &ForwardContext<'_>,
    ) -> R,
) -> R {
    let seq = |i: usize| &twins[i].1;
    let inputs = GroupInputs {
        last: group.iter().map(|&i| seq(i).truth[seq(i).pos]).collect(),
        hiddens: group.iter().map(|&i| checker.hidden_for(seq(i))).collect(),
        positions: group.iter().map(|&i| seq(i).pos).collect(),
    };
    let stacks: Option<Vec<DevicePtr>> = group.iter().map(|&i| checker.stack_for(seq(i))).collect();
    let mut taken: Vec<Box<dyn ProposerState>> = group
        .iter()
        .filter_map(|&i| twins[i].1.state.take())
        .collect();
    let ctx = &ForwardContext {
        target_hidden_stacks: stacks.as_deref(),
        ..checker.ctx.clone()
    };
    let result = {
        let mut states: Vec<&mut dyn ProposerState> = taken
            .iter_mut()
            .map(|s| -> &mut dyn ProposerState { &mut **s })
            .collect();
        call(&mut checker.report, &inputs, &mut states, ctx)
    };
    for (&i, s) in group.iter().zip(taken) {
        twins[i].1.state = Some(s);
    }
    result
}
