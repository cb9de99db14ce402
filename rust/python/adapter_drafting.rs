//! Drafting through the adapter: `propose`, its batched form and its width, its tree forms
//! (`propose_tree`, `propose_tree_batch`), the verify feedback (`after_verify`) and `read_deferred_draft_token`.
//!
//! Each method runs the Rust path when the Python class does not override it, otherwise
//! calls Python with its arguments converted and checks what comes back.

use super::adapter::{held, PyProposer, M};
use super::backend::BackendLease;
use super::convert::{ptr_list, ret_tokens, ret_usize};
use super::device_ptr::PyDevicePtr;
use super::draft_tree::{ret_tree, ret_trees};
use super::model::{PyBufferArena, PyModelConfig};
use super::state::{with_rust_state, with_rust_states};
use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig};
use crate::speculative::{DraftTree, ProposerState};
use crate::Result;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::sync::Arc;

// The methods take the protocol's arguments, as its signatures spell them.
#[allow(clippy::too_many_arguments)]
impl PyProposer {
    pub(super) fn propose(
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
        if !self.python(M::Propose) {
            return with_rust_state(state, M::Propose.name(), |s| {
                self.fallback().propose(
                    last_token,
                    target_hidden,
                    position,
                    num_drafts,
                    s,
                    ctx,
                    stream,
                    draft_embed_target,
                    grammar_bitmask,
                    target_hidden_stack,
                )
            });
        }
        let st = held(state, M::Propose)?;
        let m = M::Propose;
        Python::attach(|py| {
            let kwargs =
                self.propose_kwargs(py, draft_embed_target, grammar_bitmask, target_hidden_stack)?;
            let args = (
                last_token,
                PyDevicePtr(target_hidden),
                position,
                num_drafts,
                st.obj.bind(py),
                self.ctx_obj(py, ctx, m)?,
                stream,
            );
            let r = self.call(py, m, args, kwargs.as_ref())?;
            ret_tokens(&r, Some((num_drafts, "num_drafts")), ctx.config.vocab_size)
                .map_err(|e| self.bad_return(m, e))
        })
    }

    /// A Python `propose` that the class does not pair with its own `propose_tree` is asked
    /// for the chain (the protocol's default), so the Rust tree of the class it extends
    /// never bypasses it.
    pub(super) fn propose_tree(
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
    ) -> Result<DraftTree> {
        let m = M::ProposeTree;
        if !self.python(m) {
            if self.python(M::Propose) {
                let drafts = self.propose(
                    last_token,
                    target_hidden,
                    position,
                    budget,
                    state,
                    ctx,
                    stream,
                    draft_embed_target,
                    grammar_bitmask,
                    target_hidden_stack,
                )?;
                return Ok(DraftTree::chain(drafts));
            }
            return with_rust_state(state, m.name(), |s| {
                self.fallback().propose_tree(
                    last_token,
                    target_hidden,
                    position,
                    budget,
                    s,
                    ctx,
                    stream,
                    draft_embed_target,
                    grammar_bitmask,
                    target_hidden_stack,
                )
            });
        }
        let st = held(state, m)?;
        Python::attach(|py| {
            let kwargs =
                self.propose_kwargs(py, draft_embed_target, grammar_bitmask, target_hidden_stack)?;
            let args = (
                last_token,
                PyDevicePtr(target_hidden),
                position,
                budget,
                st.obj.bind(py),
                self.ctx_obj(py, ctx, m)?,
                stream,
            );
            let r = self.call(py, m, args, kwargs.as_ref())?;
            ret_tree(&r, budget, ctx.config.vocab_size).map_err(|e| self.bad_return(m, e))
        })
    }

    /// A Python `propose` or `propose_tree` that the class does not pair with its own
    /// `propose_tree_batch` is asked per sequence, never bypassed by the Rust batch.
    pub(super) fn propose_tree_batch(
        &self,
        last_tokens: &[u32],
        target_hiddens: &[DevicePtr],
        positions: &[usize],
        budget: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<Option<Vec<DraftTree>>> {
        let m = M::ProposeTreeBatch;
        if !self.python(m) {
            if self.python(M::Propose) || self.python(M::ProposeTree) {
                return Ok(None);
            }
            return with_rust_states(states, m.name(), |s| {
                self.fallback().propose_tree_batch(
                    last_tokens,
                    target_hiddens,
                    positions,
                    budget,
                    s,
                    ctx,
                    stream,
                )
            });
        }
        let helds = states
            .iter_mut()
            .map(|s| held(&mut **s, m))
            .collect::<Result<Vec<_>>>()?;
        Python::attach(|py| {
            let args = (
                last_tokens.to_vec(),
                self.obj_err(m, ptr_list(py, target_hiddens))?,
                positions.to_vec(),
                budget,
                self.obj_err(m, PyList::new(py, helds.iter().map(|h| h.obj.bind(py))))?,
                self.ctx_obj(py, ctx, m)?,
                stream,
            );
            let r = self.call(py, m, args, None)?;
            ret_trees(&r, last_tokens.len(), budget, ctx.config.vocab_size)
                .map_err(|e| self.bad_return(m, e))
        })
    }

    pub(super) fn after_verify(
        &self,
        num_accepted: usize,
        state: &mut dyn ProposerState,
        stream: u64,
    ) -> Result<()> {
        if !self.python(M::AfterVerify) {
            return with_rust_state(state, M::AfterVerify.name(), |s| {
                self.fallback().after_verify(num_accepted, s, stream)
            });
        }
        let st = held(state, M::AfterVerify)?;
        Python::attach(|py| {
            self.call(
                py,
                M::AfterVerify,
                (num_accepted, st.obj.bind(py), stream),
                None,
            )?;
            Ok(())
        })
    }

    /// A Python `after_verify` without its own `after_verify_tree` learns the path's length,
    /// as the protocol's default tells it.
    pub(super) fn after_verify_tree(
        &self,
        path: &[usize],
        state: &mut dyn ProposerState,
        stream: u64,
    ) -> Result<()> {
        let m = M::AfterVerifyTree;
        if !self.python(m) {
            if self.python(M::AfterVerify) {
                return self.after_verify(path.len(), state, stream);
            }
            return with_rust_state(state, m.name(), |s| {
                self.fallback().after_verify_tree(path, s, stream)
            });
        }
        let st = held(state, m)?;
        Python::attach(|py| {
            self.call(py, m, (path.to_vec(), st.obj.bind(py), stream), None)?;
            Ok(())
        })
    }

    pub(super) fn propose_batch(
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
        let m = M::ProposeBatch;
        if !self.python(m) {
            if self.python(M::Propose) {
                // The batched Rust path would bypass the Python `propose`.
                return Ok(None);
            }
            return with_rust_states(states, m.name(), |s| {
                self.fallback().propose_batch(
                    last_tokens,
                    target_hiddens,
                    positions,
                    num_drafts,
                    s,
                    ctx,
                    stream,
                    out_conf,
                )
            });
        }
        let helds = states
            .iter_mut()
            .map(|s| held(&mut **s, m))
            .collect::<Result<Vec<_>>>()?;
        let n = last_tokens.len();
        Python::attach(|py| {
            let conf_list = out_conf.is_some().then(|| PyList::empty(py));
            let kwargs = match &conf_list {
                Some(l) => {
                    let d = PyDict::new(py);
                    self.obj_err(m, d.set_item("out_conf", l))?;
                    Some(d)
                }
                None => None,
            };
            let args = (
                last_tokens.to_vec(),
                self.obj_err(m, ptr_list(py, target_hiddens))?,
                positions.to_vec(),
                num_drafts,
                self.obj_err(m, PyList::new(py, helds.iter().map(|h| h.obj.bind(py))))?,
                self.ctx_obj(py, ctx, m)?,
                stream,
            );
            let r = self.call(py, m, args, kwargs.as_ref())?;
            let Some(drafts) = self.batch_drafts(&r, n, num_drafts, ctx.config.vocab_size)? else {
                return Ok(None);
            };
            if let (Some(out), Some(list)) = (out_conf, conf_list) {
                *out = list.extract::<Vec<Vec<f32>>>().map_err(|_| {
                    self.error(
                        m,
                        "out_conf must be filled with one list of floats per sequence".into(),
                    )
                })?;
            }
            Ok(Some(drafts))
        })
    }

    pub(super) fn propose_batch_max(&self, buffers: &BufferArena, config: &ModelConfig) -> usize {
        let m = M::ProposeBatchMax;
        if !self.python(m) {
            if self.python(M::Propose) && !self.python(M::ProposeBatch) {
                return 1;
            }
            return self.fallback().propose_batch_max(buffers, config);
        }
        self.infallible(
            m,
            |py| {
                // The Python view shows the arena's size; its buffers stay with the caller.
                let b = PyBufferArena {
                    inner: Arc::new(BufferArena::empty(buffers.max_rows())),
                };
                let c = PyModelConfig {
                    inner: Arc::new(config.clone()),
                };
                let r = self.call(py, m, (b, c), None)?;
                ret_usize(&r).map_err(|e| self.bad_return(m, e))
            },
            || 1,
        )
    }

    pub(super) fn read_deferred_draft_token(&self, gpu: &dyn GpuBackend) -> Result<u32> {
        let m = M::ReadDeferredDraftToken;
        if !self.python(m) {
            return self.fallback().read_deferred_draft_token(gpu);
        }
        let mut lease = BackendLease::new(gpu);
        Python::attach(|py| {
            let g = self.obj_err(m, lease.object(py))?;
            let r = self.call(py, m, (g,), None)?;
            let v = ret_usize(&r).map_err(|e| self.bad_return(m, e))?;
            u32::try_from(v)
                .map_err(|_| self.bad_return(m, format!("{v}, which does not fit a u32 token id")))
        })
    }
}
