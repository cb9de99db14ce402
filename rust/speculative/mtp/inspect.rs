//! Views of the head's drafter KV for tests and debugging: one row's keys and values, and
//! the rows a chain drafting given tokens writes (the reference a tree's kept path is
//! held to).
//!
//! Invariant: `write_chain_rows` runs the draft loop's forward row by row exactly as
//! `propose` does (the first row from the target hidden, each later one from the head's
//! own output hidden of the row before), only with the tokens given instead of the argmax
//! picks, so over `propose`'s own drafts it writes `propose`'s rows.

use super::bad;
use super::forward::{Depth, HiddenKind, Row};
use super::head::MtpHead;
use crate::backend::{DevicePtr, Dtype, GpuBackend, GpuBackendExt};
use crate::speculative::ProposerState;

impl MtpHead {
    /// The keys then the values (BF16 bits) of drafter row `row` of `state`.
    #[doc(hidden)]
    pub fn drafter_kv_row(
        &self,
        gpu: &dyn GpuBackend,
        state: &mut dyn ProposerState,
        row: usize,
    ) -> crate::Result<Vec<u16>> {
        let st = self.state_mut(state, "drafter_kv_row")?;
        let slot = st.slot(row).filter(|_| row < st.rows()).ok_or_else(|| {
            bad(
                "drafter_kv_row",
                format!("row {row} of a state of {} rows", st.rows()),
            )
        })?;
        let n = self.spec.config.kv_cache_width();
        let at = |cache: DevicePtr| cache.offset(slot as usize * n * Dtype::Bf16.size());
        let mut out = gpu.download::<u16>(at(self.kv.k), n)?;
        out.extend(gpu.download::<u16>(at(self.kv.v), n)?);
        Ok(out)
    }

    /// Writes, verified, the rows of a chain that drafted `drafts` from `token` at
    /// `position` (target hidden `hidden`): one row for `token` and one for each draft.
    /// Returns the logits (over the draft vocabulary) of the last row.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub fn write_chain_rows(
        &self,
        gpu: &dyn GpuBackend,
        state: &mut dyn ProposerState,
        token: u32,
        hidden: DevicePtr,
        position: usize,
        drafts: &[u32],
        stream: u64,
    ) -> crate::Result<Vec<f32>> {
        let st = self.state_mut(state, "write_chain_rows")?;
        if position == 0 {
            return Err(bad(
                "write_chain_rows",
                "position must be at least 1".into(),
            ));
        }
        st.settle_before(&self.kv, position)?;
        self.flush_deferred(gpu, &mut [&mut *st], stream)?;
        let sc = self.lock_scratch();
        let mut input = (token, hidden);
        for step in 0..=drafts.len() {
            if st.reserve(gpu, &self.kv, 1)? == 0 {
                return Err(bad(
                    "write_chain_rows",
                    "no room for the chain's rows".into(),
                ));
            }
            let row = st.rows();
            let r = Row {
                token: input.0,
                hidden: input.1,
                position: position + step,
                seq: 0,
                slot: st.slot(row).unwrap_or(0),
                ctx_len: row + 1,
            };
            let kind = if step == 0 {
                HiddenKind::Target
            } else {
                HiddenKind::Chain
            };
            let tables = [(st.table, st.capacity_blocks)];
            self.spec
                .forward_rows(gpu, &sc, &[r], &tables, kind, Depth::Logits, stream)?;
            st.pair_keys.push(position + step - 1);
            if let Some(&next) = drafts.get(step) {
                input = (next, self.spec.chain_hidden(&sc, 0));
            }
        }
        st.pending = 0;
        Ok(gpu.download::<f32>(sc.logits, self.spec.draft_vocab)?)
    }
}
