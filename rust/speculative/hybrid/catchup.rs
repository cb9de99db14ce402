//! The hybrid's catch-up: the captured rows each member is given, and the replay of the
//! committed tokens a member has not seen (the module documentation's "Catch-up").
//!
//! Invariants:
//! - A member is given only the rows of the tokens committed since its own previous
//!   propose, in its own columns.
//! - Each missed token is replayed as a propose of 0 drafts and an `after_verify(0)` at its
//!   position, in order; a replay that fails leaves the tokens not yet replayed missed.

use super::state::HybridState;
use super::Hybrid;
use crate::backend::{DevicePtr, GpuBackend};
use crate::model::ForwardContext;
use crate::speculative::error::bad;

impl Hybrid {
    /// Member `i`'s captured rows for a propose at `position`, given the hybrid's `stack` of
    /// the rows since the hybrid's previous propose: the rows since the member's own.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rows_for(
        &self,
        i: usize,
        st: &mut HybridState,
        gpu: &dyn GpuBackend,
        stack: Option<DevicePtr>,
        position: usize,
        hidden: usize,
        stream: u64,
    ) -> crate::Result<Option<DevicePtr>> {
        let Some(stack) = stack else {
            return Ok(None);
        };
        let k = st
            .last_position
            .filter(|&p| p < position)
            .map_or(1, |p| position - p);
        let own = st.seen[i]
            .filter(|&p| p < position)
            .map_or(1, |p| position - p)
            .clamp(1, k);
        self.member_rows(
            i,
            gpu,
            stack,
            k - own,
            own,
            hidden,
            &mut st.scratch[i],
            stream,
        )
    }

    /// Gives each member the committed tokens it missed: one propose of 0 drafts and one
    /// `after_verify(0)` per token, at its position, paired with its captured row (the
    /// target's final hidden when the hybrid captures the last layer, else `target_hidden`).
    /// A replay that fails leaves the tokens not yet replayed missed, so a retry (the engine
    /// proposes one by one after a failed batch) replays exactly those.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn catch_up(
        &self,
        st: &mut HybridState,
        target_hidden: DevicePtr,
        position: usize,
        ctx: &ForwardContext<'_>,
        stream: u64,
        stack: Option<DevicePtr>,
    ) -> crate::Result<()> {
        for i in 0..self.members.len() {
            let tokens = st.missed[i].clone();
            let from = st.missed_from[i];
            for (j, &token) in tokens.iter().enumerate() {
                let replayed = self.replay(
                    i,
                    st,
                    token,
                    from + j,
                    target_hidden,
                    position,
                    ctx,
                    stream,
                    stack,
                );
                if let Err(e) = replayed {
                    st.missed[i].drain(..j);
                    st.missed_from[i] = from + j;
                    return Err(e);
                }
            }
            st.missed[i].clear();
        }
        Ok(())
    }

    /// Replays the committed `token` at `q` to member `i` (see [`Self::catch_up`]).
    #[allow(clippy::too_many_arguments)]
    fn replay(
        &self,
        i: usize,
        st: &mut HybridState,
        token: u32,
        q: usize,
        target_hidden: DevicePtr,
        position: usize,
        ctx: &ForwardContext<'_>,
        stream: u64,
        stack: Option<DevicePtr>,
    ) -> crate::Result<()> {
        if q >= position {
            return Err(bad(
                "propose",
                format!(
                    "position {position} is not past the committed token at {q} that member {i} ({}) has yet to see",
                    self.members[i].name
                ),
            ));
        }
        let gpu = ctx.gpu.as_ref();
        let hidden = ctx.config.hidden_size;
        // The row paired with the token at q, in the stack of rows since the last propose (q
        // is after that propose's position, so the row is there).
        let (h, rows) = match (stack, st.last_position) {
            (Some(s), Some(last)) if q > last => {
                let r = q - last - 1;
                let h = self.final_hidden(s, r, hidden).unwrap_or(target_hidden);
                let rows = self.member_rows(i, gpu, s, r, 1, hidden, &mut st.scratch[i], stream)?;
                (h, rows)
            }
            _ => (target_hidden, None),
        };
        let prop = self.members[i].proposer.as_ref();
        let state = &mut *st.members[i];
        let drafts = prop
            .propose(token, h, q, 0, state, ctx, stream, None, None, rows)
            .map_err(|e| self.member_error("propose", i, e))?;
        if !drafts.is_empty() {
            let message = format!("returned {} drafts, asked for 0", drafts.len());
            return Err(self.member_error("propose", i, bad("propose", message)));
        }
        prop.after_verify(0, state, stream)
            .map_err(|e| self.member_error("after_verify", i, e))?;
        st.seen[i] = Some(q);
        Ok(())
    }
}
