//! Per-sequence state through the adapter: allocating and freeing it, and the drafter KV
//! carried between turns (`take_drafter_kv`, `install_drafter_kv`, `free_drafter_kv`), with
//! the state queries (`drafter_rows`, `last_pair_key`).
//!
//! Each method runs the Rust path when the Python class does not override it, otherwise
//! calls Python with its arguments converted and checks what comes back.

use super::adapter::{held, PyProposer, M};
use super::backend::BackendLease;
use super::convert::{ret_bool, ret_opt_usize, ret_usize};
use super::state::with_rust_state;
use crate::backend::GpuBackend;
use crate::speculative::ProposerState;
use crate::Result;
use pyo3::prelude::*;

impl PyProposer {
    pub(super) fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        if !self.python(M::AllocState) {
            let st = self.fallback().alloc_state(gpu)?;
            return self.wrap_rust_state(st);
        }
        let mut lease = BackendLease::new(gpu);
        Python::attach(|py| {
            let g = self.obj_err(M::AllocState, lease.object(py))?;
            let r = self.call(py, M::AllocState, (g,), None)?;
            Ok(Self::hold(&r))
        })
    }

    pub(super) fn alloc_state_for(
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
            Ok(Self::hold(&r))
        })
    }

    pub(super) fn free_state(
        &self,
        gpu: &dyn GpuBackend,
        state: &mut dyn ProposerState,
    ) -> Result<()> {
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

    pub(super) fn drafter_rows(&self, state: &mut dyn ProposerState) -> usize {
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

    pub(super) fn last_pair_key(&self, state: &mut dyn ProposerState) -> Option<usize> {
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

    pub(super) fn take_drafter_kv(
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

    pub(super) fn install_drafter_kv(
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

    pub(super) fn free_drafter_kv(&self, blocks: &[u32]) {
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
}
