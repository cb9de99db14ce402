//! `DraftProposer` for `Hybrid`: the catch-up, the drafting round and the verification
//! bookkeeping of the module documentation, and the provided methods forwarded to members.

use super::round::{RoundCall, RoundSeq};
use super::state::{HybridState, Scratch};
use super::Hybrid;
use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig};
use crate::speculative::error::bad;
use crate::speculative::{DraftProposer, ProposerError, ProposerState};
use std::sync::atomic::Ordering;

/// Length of the common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Hybrid {
    fn state<'s>(
        &self,
        state: &'s mut dyn ProposerState,
        method: &'static str,
    ) -> crate::Result<&'s mut HybridState> {
        let st =
            state
                .as_any_mut()
                .downcast_mut::<HybridState>()
                .ok_or(ProposerError::WrongState {
                    method,
                    expected: "HybridState",
                })?;
        if st.freed {
            return Err(bad(method, "the state was already freed".into()));
        }
        if st.members.len() != self.members.len() {
            return Err(bad(
                method,
                format!(
                    "the state holds {} member states; this hybrid has {} members",
                    st.members.len(),
                    self.members.len()
                ),
            ));
        }
        Ok(st)
    }

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

impl DraftProposer for Hybrid {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> crate::Result<Box<dyn ProposerState>> {
        self.alloc_state_for(gpu, usize::MAX)
    }

    fn alloc_state_for(
        &self,
        gpu: &dyn GpuBackend,
        budget_tokens: usize,
    ) -> crate::Result<Box<dyn ProposerState>> {
        let mut states: Vec<Box<dyn ProposerState>> = Vec::with_capacity(self.members.len());
        for (i, m) in self.members.iter().enumerate() {
            match m.proposer.alloc_state_for(gpu, budget_tokens) {
                Ok(s) => states.push(s),
                Err(e) => {
                    // Nothing made so far outlives the failure.
                    for (j, s) in states.iter_mut().enumerate() {
                        let _ = self.members[j].proposer.free_state(gpu, s.as_mut());
                    }
                    return Err(self.member_error("alloc_state_for", i, e));
                }
            }
        }
        Ok(Box::new(HybridState::new(states)))
    }

    fn propose(
        &self,
        last_token: u32,
        target_hidden: DevicePtr,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        draft_embed_target: Option<DevicePtr>,
        grammar_bitmask: Option<&[i32]>,
        target_hidden_stack: Option<DevicePtr>,
    ) -> crate::Result<Vec<u32>> {
        let mut seq = [RoundSeq {
            st: self.state(state, "propose")?,
            token: last_token,
            hidden: target_hidden,
            position,
            stack: target_hidden_stack.filter(|_| !self.layers.is_empty()),
        }];
        let extras = RoundCall {
            lone: true,
            want_conf: false,
            draft_embed_target,
            grammar_bitmask,
        };
        let mut out = self.draft_round("propose", &mut seq, num_drafts, ctx, stream, extras)?;
        Ok(out.pop().map(|(d, _)| d).unwrap_or_default())
    }

    fn propose_batch(
        &self,
        last_tokens: &[u32],
        target_hiddens: &[DevicePtr],
        positions: &[usize],
        num_drafts: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
        out_conf: Option<&mut Vec<Vec<f32>>>,
    ) -> crate::Result<Option<Vec<Vec<u32>>>> {
        let n = last_tokens.len();
        let stacks = ctx.target_hidden_stacks.filter(|_| !self.layers.is_empty());
        if stacks.is_none() && !self.layers.is_empty() {
            return Err(bad(
                "propose_batch",
                "this hybrid captures target layers: ctx.target_hidden_stacks must hold each sequence's rows".into(),
            ));
        }
        ProposerError::check_batch(
            "propose_batch",
            n,
            &[
                ("hiddens", target_hiddens.len()),
                ("captured row sets", stacks.map_or(n, <[DevicePtr]>::len)),
                ("positions", positions.len()),
                ("states", states.len()),
            ],
        )?;
        let mut seqs = Vec::with_capacity(n);
        for (s, state) in states.iter_mut().enumerate() {
            seqs.push(RoundSeq {
                st: self.state(&mut **state, "propose_batch")?,
                token: last_tokens[s],
                hidden: target_hiddens[s],
                position: positions[s],
                stack: stacks.map(|k| k[s]),
            });
        }
        let extras = RoundCall {
            want_conf: out_conf.is_some(),
            ..RoundCall::default()
        };
        let round =
            self.draft_round("propose_batch", &mut seqs, num_drafts, ctx, stream, extras)?;
        let (drafts, confs): (Vec<Vec<u32>>, Vec<Vec<f32>>) = round
            .into_iter()
            .map(|(d, c)| (d, c.unwrap_or_default()))
            .unzip();
        if let Some(out) = out_conf {
            *out = confs;
        }
        Ok(Some(drafts))
    }

    fn propose_batch_max(&self, buffers: &BufferArena, config: &ModelConfig) -> usize {
        self.members
            .iter()
            .map(|m| m.proposer.propose_batch_max(buffers, config))
            .max()
            .unwrap_or(1)
            .max(1)
    }

    fn after_verify(
        &self,
        num_accepted: usize,
        state: &mut dyn ProposerState,
        stream: u64,
    ) -> crate::Result<()> {
        let st = self.state(state, "after_verify")?;
        let Some(step) = st.step.take() else {
            return Err(bad(
                "after_verify",
                "no propose is waiting for its verify".into(),
            ));
        };
        let won: &[u32] = step.winner.map_or(&[], |w| &step.drafts[w]);
        if num_accepted > won.len() {
            return Err(bad(
                "after_verify",
                format!(
                    "{num_accepted} drafts accepted but the last propose returned {}",
                    won.len()
                ),
            ));
        }
        let committed = &won[..num_accepted];
        st.odds
            .settle(step.winner.map(|w| (w, won.len())), num_accepted);
        let mut first_error = None;
        for i in 0..self.members.len() {
            let accepted = match step.winner {
                Some(w) if w == i => num_accepted,
                _ => common_prefix(&step.drafts[i], committed),
            };
            let r = self.members[i]
                .proposer
                .after_verify(accepted, &mut *st.members[i], stream);
            if let Err(e) = r {
                first_error.get_or_insert(self.member_error("after_verify", i, e));
            }
            st.accepted[i] = accepted;
            st.missed[i] = committed[accepted..].to_vec();
            st.missed_from[i] = step.position + 1 + accepted;
        }
        st.last_position = Some(step.position);
        first_error.map_or(Ok(()), Err)
    }

    fn target_layer_ids(&self) -> Vec<usize> {
        self.layers.clone()
    }

    fn prefill_hidden_rows(&self, max_seq_len: usize) -> usize {
        self.members
            .iter()
            .map(|m| m.proposer.prefill_hidden_rows(max_seq_len))
            .max()
            .unwrap_or(max_seq_len)
    }

    fn needs_comm(&self) -> bool {
        self.members.iter().any(|m| m.proposer.needs_comm())
    }

    fn prefill_uses_shared_buffers(&self) -> bool {
        self.members
            .iter()
            .any(|m| m.proposer.prefill_uses_shared_buffers())
    }

    fn catchup_batch(
        &self,
        tokens: &[Vec<u32>],
        hiddens: &[Vec<DevicePtr>],
        first_pos: &[usize],
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> crate::Result<usize> {
        let n = tokens.len();
        ProposerError::check_batch(
            "catchup_batch",
            n,
            &[
                ("hidden lists", hiddens.len()),
                ("first positions", first_pos.len()),
                ("states", states.len()),
            ],
        )?;
        let gpu = ctx.gpu.as_ref();
        let hidden = ctx.config.hidden_size;
        let stack = ctx.target_hidden_stack.filter(|_| !self.layers.is_empty());
        let mut written = 0;
        for (s, state) in states.iter_mut().enumerate() {
            let st = self.state(&mut **state, "catchup_batch")?;
            if hiddens[s].len() != tokens[s].len() {
                return Err(bad(
                    "catchup_batch",
                    format!(
                        "sequence {s}: {} tokens but {} hiddens",
                        tokens[s].len(),
                        hiddens[s].len()
                    ),
                ));
            }
            // The accepted drafts of each member: its first `accepted` of them.
            for i in 0..self.members.len() {
                let a = st.accepted[i].min(tokens[s].len());
                if a == 0 {
                    continue;
                }
                let rows = match stack {
                    Some(k) => {
                        self.member_rows(i, gpu, k, 0, a, hidden, &mut st.scratch[i], stream)?
                    }
                    None => None,
                };
                let ctx_i = ForwardContext {
                    target_hidden_stack: rows,
                    ..ctx.clone()
                };
                written += self.members[i]
                    .proposer
                    .catchup_batch(
                        &[tokens[s][..a].to_vec()],
                        &[hiddens[s][..a].to_vec()],
                        &[first_pos[s]],
                        &mut [&mut *st.members[i]],
                        &ctx_i,
                        stream,
                    )
                    .map_err(|e| self.member_error("catchup_batch", i, e))?;
            }
        }
        Ok(written)
    }

    fn prefill_drafter(
        &self,
        prompt_tokens: &[u32],
        hiddens: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> crate::Result<usize> {
        let st = self.state(state, "prefill_drafter")?;
        let gpu = ctx.gpu.as_ref();
        let hidden = ctx.config.hidden_size;
        let stack = ctx.target_hidden_stack.filter(|_| !self.layers.is_empty());
        let p = prompt_tokens.len();
        let mut gathered = Scratch::default();
        let mut run = || -> crate::Result<usize> {
            let mut written = 0;
            for i in 0..self.members.len() {
                if p > self.prefill_caps[i] {
                    continue;
                }
                let rows = match stack {
                    Some(k) => self.member_rows(i, gpu, k, 0, p, hidden, &mut gathered, stream)?,
                    None => None,
                };
                let ctx_i = ForwardContext {
                    target_hidden_stack: rows,
                    ..ctx.clone()
                };
                written += self.members[i]
                    .proposer
                    .prefill_drafter(prompt_tokens, hiddens, &mut *st.members[i], &ctx_i, stream)
                    .map_err(|e| self.member_error("prefill_drafter", i, e))?;
            }
            Ok(written)
        };
        let ran = run();
        let freed = gathered.free(gpu);
        let written = ran?;
        freed?;
        let last = p.checked_sub(1);
        st.seen.iter_mut().for_each(|s| *s = last);
        st.last_position = last;
        st.missed.iter_mut().for_each(Vec::clear);
        st.step = None;
        Ok(written)
    }

    fn read_deferred_draft_token(&self, gpu: &dyn GpuBackend) -> crate::Result<u32> {
        match self.last_winner.load(Ordering::Relaxed) {
            usize::MAX => Ok(0),
            i => self.members[i]
                .proposer
                .read_deferred_draft_token(gpu)
                .map_err(|e| self.member_error("read_deferred_draft_token", i, e)),
        }
    }

    fn free_state(&self, gpu: &dyn GpuBackend, state: &mut dyn ProposerState) -> crate::Result<()> {
        let st = self.state(state, "free_state")?;
        st.freed = true;
        let mut first_error = None;
        for (i, s) in st.members.iter_mut().enumerate() {
            if let Err(e) = self.members[i].proposer.free_state(gpu, s.as_mut()) {
                first_error.get_or_insert(self.member_error("free_state", i, e));
            }
        }
        for s in st.scratch.iter_mut() {
            if let Err(e) = s.free(gpu) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}
