//! `AnnouncedProposer`: on rank 0 of a multi-rank model, the engine's wrapper around a
//! proposer whose `needs_comm` is true (a draft head whose experts are split across the
//! ranks). Before each call that runs the proposer's forward or changes a state, it sends
//! the workers a command carrying everything the call reads (the tokens, positions and the
//! target's hidden rows as bytes), so each worker runs the same call on its own shard of
//! the proposer and meets rank 0 in the same collectives.
//!
//! Invariants:
//! - A state is named by the address of its allocation, stable from `alloc_state_for` to
//!   `free_state`; the worker keeps one state per name, created by `ProposerAlloc` and
//!   dropped by `ProposerFree`.
//! - Announced: `alloc_state(_for)`, `prefill_drafter`, `catchup_drafter`, `propose` (the
//!   seed's `EP_CMD_MTP_PROPOSE`), `propose_batch` (one command for the whole group, so a
//!   batch's draft steps meet in one collective each, not one a sequence), `after_verify`
//!   and `free_state`. A `propose_batch` the proposer declines (`None`) must decline on
//!   every rank before running anything, as the same proposer does on the same inputs; the
//!   engine then proposes those sequences one by one, each announced. Every other method
//!   that would run a forward or move a state's KV is turned to its protocol fallback so
//!   the engine never calls it: no trees are grown, no drafter KV is taken or installed
//!   (no carry between turns), and `catchup_batch` (`mtp_kv_exact`) and a deferred draft
//!   embedding are refused with an error naming the multi-rank serve.
//! - Queries without side effects (widths, capacities, layer ids) go straight to the
//!   proposer, on rank 0 only.

use crate::backend::{DevicePtr, GpuBackend, GpuBackendExt};
use crate::distributed::{Command, Communicator};
use crate::model::ForwardContext;
use crate::speculative::{DraftProposer, DraftTree, ProposerError, ProposerState};
use crate::Result;
use std::sync::Arc;

/// A sharded proposer whose calls rank 0 announces to the workers.
pub(in crate::engine) struct AnnouncedProposer {
    pub(in crate::engine) inner: Arc<dyn DraftProposer>,
    pub(in crate::engine) comm: Arc<dyn Communicator>,
}

/// The name rank 0 gives `state` on the command channel: its allocation's address.
pub(in crate::engine) fn state_name(state: &dyn ProposerState) -> u64 {
    state as *const dyn ProposerState as *const () as usize as u64
}

/// The error of a call a multi-rank serve cannot make.
fn refused(method: &str, why: &str) -> crate::Error {
    ProposerError::Failed {
        method: method.to_string(),
        message: format!("not supported with a proposer sharded across ranks: {why}"),
    }
    .into()
}

impl AnnouncedProposer {
    fn send(&self, command: Command) -> Result<()> {
        Ok(self.comm.send_command(&command)?)
    }

    /// `rows` hidden rows at `hiddens`, as the bytes a command carries.
    fn rows(ctx: &ForwardContext<'_>, hiddens: DevicePtr, rows: usize) -> Result<Vec<u8>> {
        if rows == 0 {
            return Ok(Vec::new());
        }
        let bytes = rows * ctx.config.hidden_size * 2;
        Ok(ctx.gpu.download::<u8>(hiddens, bytes)?)
    }

    fn alloc_announced(
        &self,
        gpu: &dyn GpuBackend,
        budget: Option<usize>,
    ) -> Result<Box<dyn ProposerState>> {
        let state = match budget {
            Some(b) => self.inner.alloc_state_for(gpu, b)?,
            None => self.inner.alloc_state(gpu)?,
        };
        self.send(Command::ProposerAlloc {
            state: state_name(state.as_ref()),
            budget: budget.map_or(u64::MAX, |b| b as u64),
        })?;
        Ok(state)
    }

    #[allow(clippy::too_many_arguments)]
    fn propose_announced(
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
    ) -> Result<Vec<u32>> {
        if draft_embed_target.is_some() {
            return Err(refused("propose", "a deferred draft embedding"));
        }
        self.send(Command::MtpPropose {
            state: state_name(state),
            last_token,
            position: position as u64,
            num_drafts: num_drafts as u32,
            hidden: Self::rows(ctx, target_hidden, 1)?,
            grammar: grammar_bitmask.map(<[i32]>::to_vec),
        })?;
        self.inner.propose(
            last_token,
            target_hidden,
            position,
            num_drafts,
            state,
            ctx,
            stream,
            None,
            grammar_bitmask,
            target_hidden_stack,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn propose_batch_announced(
        &self,
        last_tokens: &[u32],
        target_hiddens: &[DevicePtr],
        positions: &[usize],
        num_drafts: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
        out_conf: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        let mut hidden = Vec::new();
        for &row in target_hiddens {
            hidden.extend(Self::rows(ctx, row, 1)?);
        }
        self.send(Command::MtpProposeBatch {
            states: states.iter().map(|s| state_name(&**s)).collect(),
            last_tokens: last_tokens.to_vec(),
            positions: positions.iter().map(|&p| p as u64).collect(),
            num_drafts: num_drafts as u32,
            hidden,
            confidences: out_conf.is_some(),
        })?;
        self.inner.propose_batch(
            last_tokens,
            target_hiddens,
            positions,
            num_drafts,
            states,
            ctx,
            stream,
            out_conf,
        )
    }

    fn after_verify_announced(
        &self,
        num_accepted: usize,
        state: &mut dyn ProposerState,
        stream: u64,
    ) -> Result<()> {
        self.send(Command::ProposerAfterVerify {
            state: state_name(state),
            accepted: num_accepted as u32,
        })?;
        self.inner.after_verify(num_accepted, state, stream)
    }

    fn prefill_announced(
        &self,
        prompt_tokens: &[u32],
        hiddens: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<usize> {
        self.send(Command::ProposerPrefill {
            state: state_name(state),
            tokens: prompt_tokens.to_vec(),
            hidden: Self::rows(ctx, hiddens, prompt_tokens.len())?,
        })?;
        self.inner
            .prefill_drafter(prompt_tokens, hiddens, state, ctx, stream)
    }

    #[allow(clippy::too_many_arguments)]
    fn catchup_announced(
        &self,
        tokens: &[u32],
        hiddens: DevicePtr,
        row_base: usize,
        pos_base: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<usize> {
        self.send(Command::ProposerCatchup {
            state: state_name(state),
            tokens: tokens.to_vec(),
            hidden: Self::rows(ctx, hiddens, tokens.len())?,
            row_base: row_base as u64,
            pos_base: pos_base as u64,
        })?;
        self.inner
            .catchup_drafter(tokens, hiddens, row_base, pos_base, state, ctx, stream)
    }

    fn free_announced(&self, gpu: &dyn GpuBackend, state: &mut dyn ProposerState) -> Result<()> {
        self.send(Command::ProposerFree {
            state: state_name(state),
        })?;
        self.inner.free_state(gpu, state)
    }
}

/// Writes `impl DraftProposer for AnnouncedProposer` from the protocol's method list: the
/// methods named in the rules below are announced or turned to their fallback (see the
/// module documentation); every other one goes straight to the proposer.
macro_rules! announce_methods {
    ($($variant:ident => fn $name:ident ($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty,
        $answer:ident $(($default:expr))?;)+) => {
        #[allow(clippy::too_many_arguments, clippy::unused_unit, unused_variables)]
        impl DraftProposer for AnnouncedProposer {
            $(
                fn $name(&self, $($arg: $ty),*) -> $ret {
                    announce_methods!(@$name self $(, $arg)*)
                }
            )+
        }
    };
    (@alloc_state $s:ident, $gpu:ident) => { $s.alloc_announced($gpu, None) };
    (@alloc_state_for $s:ident, $gpu:ident, $budget:ident) => {
        $s.alloc_announced($gpu, Some($budget))
    };
    (@propose $s:ident $(, $a:ident)*) => { $s.propose_announced($($a),*) };
    (@after_verify $s:ident $(, $a:ident)*) => { $s.after_verify_announced($($a),*) };
    (@prefill_drafter $s:ident $(, $a:ident)*) => { $s.prefill_announced($($a),*) };
    (@catchup_drafter $s:ident $(, $a:ident)*) => { $s.catchup_announced($($a),*) };
    (@free_state $s:ident $(, $a:ident)*) => { $s.free_announced($($a),*) };
    (@propose_batch $s:ident $(, $a:ident)*) => { $s.propose_batch_announced($($a),*) };
    (@catchup_batch $s:ident $(, $a:ident)*) => {
        Err(refused("catchup_batch", "exact drafter rows (mtp_kv_exact)"))
    };
    (@grows_trees $s:ident $(, $a:ident)*) => { false };
    (@propose_tree $s:ident, $last:ident, $hidden:ident, $pos:ident, $budget:ident,
        $state:ident, $ctx:ident, $stream:ident, $embed:ident, $mask:ident, $stack:ident) => {
        $s.propose_announced($last, $hidden, $pos, $budget, $state, $ctx, $stream, $embed,
            $mask, $stack).map(DraftTree::chain)
    };
    (@after_verify_tree $s:ident $(, $a:ident)*) => {
        Err(refused("after_verify_tree", "draft trees"))
    };
    (@take_drafter_kv $s:ident $(, $a:ident)*) => { None };
    (@install_drafter_kv $s:ident $(, $a:ident)*) => { false };
    (@free_drafter_kv $s:ident $(, $a:ident)*) => { () };
    (@read_deferred_draft_token $s:ident $(, $a:ident)*) => {
        Err(refused("read_deferred_draft_token", "a deferred draft embedding"))
    };
    (@circuit_draft $s:ident $(, $a:ident)*) => { None };
    (@set_circuit_draft $s:ident $(, $a:ident)*) => { () };
    (@$name:ident $s:ident $(, $a:ident)*) => { $s.inner.$name($($a),*) };
}

crate::speculative::with_protocol_methods!(announce_methods);
