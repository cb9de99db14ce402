//! The batch check: every sequence's twin is driven through `propose_batch`, whose drafts
//! must equal what per-sequence `propose` drafted for the original at the same point. A
//! proposer that names target layers gets each twin's captured rows, those its `propose`
//! would get, in `ctx.target_hidden_stacks`, as the engine passes them.

use super::driver::{guarded, Checker, Sequence};
use crate::backend::DevicePtr;
use crate::model::ForwardContext;
use crate::speculative::ProposerState;

/// Drives the twins through `propose_batch` and compares with the per-sequence drafts.
/// Returns false once the proposer says batching is unsupported.
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
    for group in live.chunks(width.min(live.len().max(1))) {
        let last: Vec<u32> = group
            .iter()
            .map(|&i| twins[i].1.truth[twins[i].1.pos])
            .collect();
        let hiddens: Vec<DevicePtr> = group
            .iter()
            .map(|&i| checker.hidden_for(&twins[i].1))
            .collect();
        let positions: Vec<usize> = group.iter().map(|&i| twins[i].1.pos).collect();
        let stacks: Option<Vec<DevicePtr>> = group
            .iter()
            .map(|&i| checker.stack_for(&twins[i].1))
            .collect();
        let mut taken: Vec<Box<dyn ProposerState>> = group
            .iter()
            .filter_map(|&i| twins[i].1.state.take())
            .collect();
        let mut conf = Vec::new();
        let ctx = &ForwardContext {
            target_hidden_stacks: stacks.as_deref(),
            ..checker.ctx.clone()
        };
        let result = {
            let mut states: Vec<&mut dyn ProposerState> = taken
                .iter_mut()
                .map(|s| -> &mut dyn ProposerState { &mut **s })
                .collect();
            guarded(&mut checker.report, "propose_batch", || {
                p.propose_batch(
                    &last,
                    &hiddens,
                    &positions,
                    n,
                    &mut states,
                    ctx,
                    0,
                    Some(&mut conf),
                )
            })
        };
        for (&i, s) in group.iter().zip(taken) {
            twins[i].1.state = Some(s);
        }
        let drafts = match result {
            Some(Some(d)) => d,
            Some(None) => {
                for (_, b) in twins.iter_mut() {
                    checker.end(b);
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
