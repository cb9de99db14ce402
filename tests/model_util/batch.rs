//! `propose_batch` for test proposers that batch by proposing each sequence in turn.

use specdraft::backend::DevicePtr;
use specdraft::model::ForwardContext;
use specdraft::speculative::{DraftProposer, ProposerState};
use specdraft::Result;

/// `prop`'s `propose` for each sequence of a batch, in order, each given `stacks[i]` as its
/// `target_hidden_stack` (none where `stacks` is `None`).
#[allow(clippy::too_many_arguments)]
pub fn propose_each(
    prop: &dyn DraftProposer,
    last: &[u32],
    hiddens: &[DevicePtr],
    positions: &[usize],
    n: usize,
    states: &mut [&mut dyn ProposerState],
    ctx: &ForwardContext<'_>,
    stream: u64,
    stacks: Option<&[DevicePtr]>,
) -> Result<Vec<Vec<u32>>> {
    let mut drafts = Vec::with_capacity(last.len());
    for (i, st) in states.iter_mut().enumerate() {
        let stack = stacks.map(|s| s[i]);
        drafts.push(prop.propose(
            last[i],
            hiddens[i],
            positions[i],
            n,
            &mut **st,
            ctx,
            stream,
            None,
            None,
            stack,
        )?);
    }
    Ok(drafts)
}
