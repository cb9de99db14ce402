//! `DraftProposer` for `Hybrid`: the catch-up, the drafting round and the verification
//! bookkeeping of the module documentation, and the provided methods forwarded to members.

use super::round::{RoundCall, RoundSeq};
use super::settle::path_fault;
use super::state::{HybridState, Scratch};
use super::Hybrid;
use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig};
use crate::speculative::error::bad;
use crate::speculative::{DraftProposer, DraftTree, ProposerError, ProposerState};
use std::sync::atomic::Ordering;

impl Hybrid {
    pub(super) fn state<'s>(
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
            draft_embed_target,
            grammar_bitmask,
            ..RoundCall::default()
        };
        let mut out = self.draft_round("propose", &mut seq, num_drafts, ctx, stream, extras)?;
        Ok(out.pop().map(|(d, _)| d.tokens).unwrap_or_default())
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
        let extras = RoundCall {
            want_conf: out_conf.is_some(),
            ..RoundCall::default()
        };
        let batch = (last_tokens, target_hiddens, positions);
        let round = self.batch_round(
            "propose_batch",
            batch,
            num_drafts,
            states,
            ctx,
            stream,
            extras,
        )?;
        let (drafts, confs): (Vec<Vec<u32>>, Vec<Vec<f32>>) = round
            .into_iter()
            .map(|(d, c)| (d.tokens, c.unwrap_or_default()))
            .unzip();
        if let Some(out) = out_conf {
            *out = confs;
        }
        Ok(Some(drafts))
    }

    fn propose_tree(
        &self,
        last_token: u32,
        target_hidden: DevicePtr,
        position: usize,
        budget: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        draft_embed_target: Option<DevicePtr>,
        grammar_bitmask: Option<&[i32]>,
        target_hidden_stack: Option<DevicePtr>,
    ) -> crate::Result<DraftTree> {
        let mut seq = [RoundSeq {
            st: self.state(state, "propose_tree")?,
            token: last_token,
            hidden: target_hidden,
            position,
            stack: target_hidden_stack.filter(|_| !self.layers.is_empty()),
        }];
        let extras = RoundCall {
            lone: true,
            tree: true,
            draft_embed_target,
            grammar_bitmask,
            ..RoundCall::default()
        };
        let mut out = self.draft_round("propose_tree", &mut seq, budget, ctx, stream, extras)?;
        Ok(out.pop().map(|(t, _)| t).unwrap_or_default())
    }

    fn propose_tree_batch(
        &self,
        last_tokens: &[u32],
        target_hiddens: &[DevicePtr],
        positions: &[usize],
        budget: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> crate::Result<Option<Vec<DraftTree>>> {
        let extras = RoundCall {
            tree: true,
            ..RoundCall::default()
        };
        let batch = (last_tokens, target_hiddens, positions);
        let round = self.batch_round(
            "propose_tree_batch",
            batch,
            budget,
            states,
            ctx,
            stream,
            extras,
        )?;
        Ok(Some(round.into_iter().map(|(t, _)| t).collect()))
    }

    fn grows_trees(&self) -> bool {
        self.members.iter().any(|m| m.proposer.grows_trees())
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
        let step = Self::pending(st, "after_verify")?;
        let path: Vec<usize> = (0..num_accepted).collect();
        if let Some(fault) = path_fault(step.winner.map(|w| &step.drafts[w]), &path, false) {
            return Err(bad("after_verify", fault));
        }
        self.settle(st, step, &path, stream)
    }

    fn after_verify_tree(
        &self,
        path: &[usize],
        state: &mut dyn ProposerState,
        stream: u64,
    ) -> crate::Result<()> {
        let st = self.state(state, "after_verify_tree")?;
        let step = Self::pending(st, "after_verify_tree")?;
        if let Some(fault) = path_fault(step.winner.map(|w| &step.drafts[w]), path, true) {
            return Err(bad("after_verify_tree", fault));
        }
        self.settle(st, step, path, stream)
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
