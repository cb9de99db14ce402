//! The `DraftProposer` implementation of [`PyProposer`]: for each method, the Rust path when
//! the Python class does not override it, otherwise the call into Python with its arguments
//! converted and its result checked.

use super::adapter::{held, PyProposer, M};
use super::backend::BackendLease;
use super::convert::{ptr_list, ret_bool, ret_opt_usize, ret_tokens, ret_usize};
use super::device_ptr::PyDevicePtr;
use super::model::{PyBufferArena, PyModelConfig, PyModelLevers};
use super::proposer::PyDraftRunner;
use super::state::{with_rust_state, with_rust_states};
use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelConfig, ModelLevers};
use crate::speculative::{DraftBinding, DraftProposer, DraftRunner, ProposerState};
use crate::Result;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::sync::Arc;

impl DraftProposer for PyProposer {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        if !self.python(M::AllocState) {
            let st = self.fallback().alloc_state(gpu)?;
            return self.wrap_rust_state(st);
        }
        let mut lease = BackendLease::new(gpu);
        Python::attach(|py| {
            let g = self.obj_err(M::AllocState, lease.object(py))?;
            let r = self.call(py, M::AllocState, (g,), None)?;
            self.hold(&r, M::AllocState)
        })
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
    ) -> Result<Vec<u32>> {
        if !self.python(M::Propose) {
            return with_rust_state(state, "propose", |s| {
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

    fn after_verify(
        &self,
        num_accepted: usize,
        state: &mut dyn ProposerState,
        stream: u64,
    ) -> Result<()> {
        if !self.python(M::AfterVerify) {
            return with_rust_state(state, "after_verify", |s| {
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

    fn alloc_state_for(
        &self,
        gpu: &dyn GpuBackend,
        budget_tokens: usize,
    ) -> Result<Box<dyn ProposerState>> {
        if !self.python(M::AllocStateFor) {
            if self.python(M::AllocState) || self.rust.is_none() {
                return self.alloc_state(gpu);
            }
            let st = self.fallback().alloc_state_for(gpu, budget_tokens)?;
            return self.wrap_rust_state(st);
        }
        let mut lease = BackendLease::new(gpu);
        Python::attach(|py| {
            let g = self.obj_err(M::AllocStateFor, lease.object(py))?;
            let r = self.call(py, M::AllocStateFor, (g, budget_tokens), None)?;
            self.hold(&r, M::AllocStateFor)
        })
    }

    fn block_gamma(&self) -> Option<usize> {
        if !self.python(M::BlockGamma) {
            return self.fallback().block_gamma();
        }
        self.infallible(
            M::BlockGamma,
            |py| {
                let r = self.call(py, M::BlockGamma, (), None)?;
                ret_opt_usize(&r).map_err(|e| self.bad_return(M::BlockGamma, e))
            },
            || self.fallback().block_gamma(),
        )
    }

    fn prefill_hidden_rows(&self, max_seq_len: usize) -> usize {
        if !self.python(M::PrefillHiddenRows) {
            return self.fallback().prefill_hidden_rows(max_seq_len);
        }
        self.infallible(
            M::PrefillHiddenRows,
            |py| {
                let r = self.call(py, M::PrefillHiddenRows, (max_seq_len,), None)?;
                ret_usize(&r).map_err(|e| self.bad_return(M::PrefillHiddenRows, e))
            },
            || self.fallback().prefill_hidden_rows(max_seq_len),
        )
    }

    fn needs_comm(&self) -> bool {
        if !self.python(M::NeedsComm) {
            return self.fallback().needs_comm();
        }
        self.infallible(
            M::NeedsComm,
            |py| {
                let r = self.call(py, M::NeedsComm, (), None)?;
                ret_bool(&r).map_err(|e| self.bad_return(M::NeedsComm, e))
            },
            || self.fallback().needs_comm(),
        )
    }

    fn prefill_uses_shared_buffers(&self) -> bool {
        let m = M::PrefillUsesSharedBuffers;
        if !self.python(m) {
            return self.fallback().prefill_uses_shared_buffers();
        }
        self.infallible(
            m,
            |py| {
                let r = self.call(py, m, (), None)?;
                ret_bool(&r).map_err(|e| self.bad_return(m, e))
            },
            || self.fallback().prefill_uses_shared_buffers(),
        )
    }

    fn drafter_rows(&self, state: &mut dyn ProposerState) -> usize {
        let m = M::DrafterRows;
        self.state_query(
            m,
            state,
            |p, s| p.drafter_rows(s),
            |py, st| {
                let r = self.call(py, m, (st,), None)?;
                ret_usize(&r).map_err(|e| self.bad_return(m, e))
            },
            || 0,
        )
    }

    fn last_pair_key(&self, state: &mut dyn ProposerState) -> Option<usize> {
        let m = M::LastPairKey;
        self.state_query(
            m,
            state,
            |p, s| p.last_pair_key(s),
            |py, st| {
                let r = self.call(py, m, (st,), None)?;
                ret_opt_usize(&r).map_err(|e| self.bad_return(m, e))
            },
            || None,
        )
    }

    fn take_drafter_kv(
        &self,
        state: &mut dyn ProposerState,
    ) -> Option<(Vec<u32>, usize, Option<usize>)> {
        let m = M::TakeDrafterKv;
        self.state_query(
            m,
            state,
            |p, s| p.take_drafter_kv(s),
            |py, st| {
                let r = self.call(py, m, (st,), None)?;
                self.taken_kv(&r)
            },
            || None,
        )
    }

    fn install_drafter_kv(
        &self,
        state: &mut dyn ProposerState,
        blocks: Vec<u32>,
        rows: usize,
        last_pair_key: Option<usize>,
    ) -> bool {
        let m = M::InstallDrafterKv;
        if !self.python(m) {
            let r = with_rust_state(state, m.name(), |s| {
                Ok(self
                    .fallback()
                    .install_drafter_kv(s, blocks, rows, last_pair_key))
            });
            return r.unwrap_or_else(|e| {
                Python::attach(|py| self.unraisable(py, e));
                false
            });
        }
        let st = match held(state, m) {
            Ok(st) => st,
            Err(e) => {
                Python::attach(|py| self.unraisable(py, e));
                return false;
            }
        };
        self.infallible(
            m,
            |py| {
                let r = self.call(py, m, (st.obj.bind(py), blocks, rows, last_pair_key), None)?;
                ret_bool(&r).map_err(|e| self.bad_return(m, e))
            },
            || false,
        )
    }

    fn free_drafter_kv(&self, blocks: &[u32]) {
        let m = M::FreeDrafterKv;
        if !self.python(m) {
            return self.fallback().free_drafter_kv(blocks);
        }
        self.infallible(
            m,
            |py| {
                self.call(py, m, (blocks.to_vec(),), None)?;
                Ok(())
            },
            || (),
        )
    }

    fn catchup_drafter(
        &self,
        tokens: &[u32],
        hiddens: DevicePtr,
        row_base: usize,
        pos_base: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<usize> {
        let m = M::CatchupDrafter;
        if !self.python(m) {
            return with_rust_state(state, m.name(), |s| {
                self.fallback()
                    .catchup_drafter(tokens, hiddens, row_base, pos_base, s, ctx, stream)
            });
        }
        let st = held(state, m)?;
        Python::attach(|py| {
            let args = (
                tokens.to_vec(),
                PyDevicePtr(hiddens),
                row_base,
                pos_base,
                st.obj.bind(py),
                self.ctx_obj(py, ctx, m)?,
                stream,
            );
            let r = self.call(py, m, args, None)?;
            ret_usize(&r).map_err(|e| self.bad_return(m, e))
        })
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

    fn propose_batch_max(&self, buffers: &BufferArena, config: &ModelConfig) -> usize {
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

    fn catchup_batch(
        &self,
        tokens: &[Vec<u32>],
        hiddens: &[Vec<DevicePtr>],
        first_pos: &[usize],
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<usize> {
        let m = M::CatchupBatch;
        if !self.python(m) {
            return with_rust_states(states, m.name(), |s| {
                self.fallback()
                    .catchup_batch(tokens, hiddens, first_pos, s, ctx, stream)
            });
        }
        let helds = states
            .iter_mut()
            .map(|s| held(&mut **s, m))
            .collect::<Result<Vec<_>>>()?;
        Python::attach(|py| {
            let hid = PyList::empty(py);
            for h in hiddens {
                self.obj_err(m, ptr_list(py, h).and_then(|l| hid.append(l)))?;
            }
            let args = (
                tokens.to_vec(),
                hid,
                first_pos.to_vec(),
                self.obj_err(m, PyList::new(py, helds.iter().map(|h| h.obj.bind(py))))?,
                self.ctx_obj(py, ctx, m)?,
                stream,
            );
            let r = self.call(py, m, args, None)?;
            ret_usize(&r).map_err(|e| self.bad_return(m, e))
        })
    }

    fn prefill_drafter(
        &self,
        prompt_tokens: &[u32],
        hiddens: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<usize> {
        let m = M::PrefillDrafter;
        if !self.python(m) {
            return with_rust_state(state, m.name(), |s| {
                self.fallback()
                    .prefill_drafter(prompt_tokens, hiddens, s, ctx, stream)
            });
        }
        let st = held(state, m)?;
        Python::attach(|py| {
            let args = (
                prompt_tokens.to_vec(),
                PyDevicePtr(hiddens),
                st.obj.bind(py),
                self.ctx_obj(py, ctx, m)?,
                stream,
            );
            let r = self.call(py, m, args, None)?;
            ret_usize(&r).map_err(|e| self.bad_return(m, e))
        })
    }

    fn read_deferred_draft_token(&self, gpu: &dyn GpuBackend) -> Result<u32> {
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

    fn free_state(&self, gpu: &dyn GpuBackend, state: &mut dyn ProposerState) -> Result<()> {
        let m = M::FreeState;
        if !self.python(m) {
            return with_rust_state(state, m.name(), |s| self.fallback().free_state(gpu, s));
        }
        let st = held(state, m)?;
        let mut lease = BackendLease::new(gpu);
        Python::attach(|py| {
            let g = self.obj_err(m, lease.object(py))?;
            self.call(py, m, (g, st.obj.bind(py)), None)?;
            Ok(())
        })
    }

    fn circuit_draft(&self, config: &ModelConfig, levers: &ModelLevers) -> Option<DraftBinding> {
        let m = M::CircuitDraft;
        if !self.python(m) {
            return self.fallback().circuit_draft(config, levers);
        }
        self.infallible(
            m,
            |py| {
                let c = PyModelConfig {
                    inner: Arc::new(config.clone()),
                };
                let r = self.call(py, m, (c, PyModelLevers(*levers)), None)?;
                if r.is_none() {
                    Ok(None)
                } else {
                    Err(self.bad_return(
                        m,
                        format!("{}; only Rust proposers can provide a draft binding, a Python one must return None", super::convert::short_repr(&r)),
                    ))
                }
            },
            || None,
        )
    }

    fn set_circuit_draft(&self, runner: Option<Arc<dyn DraftRunner>>) {
        let m = M::SetCircuitDraft;
        if !self.python(m) {
            return self.fallback().set_circuit_draft(runner);
        }
        self.infallible(
            m,
            |py| {
                let r: Option<Py<PyDraftRunner>> = match runner {
                    Some(inner) => Some(
                        Py::new(py, PyDraftRunner { inner })
                            .map_err(|e| self.error(m, e.to_string()))?,
                    ),
                    None => None,
                };
                self.call(py, m, (r,), None)?;
                Ok(())
            },
            || (),
        )
    }
}
