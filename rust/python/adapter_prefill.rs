//! Drafter KV from the target's hiddens through the adapter: `prefill_drafter`,
//! `catchup_drafter`, `catchup_batch`, and the prefill questions (`prefill_hidden_rows`,
//! `prefill_uses_shared_buffers`).
//!
//! Each method runs the Rust path when the Python class does not override it, otherwise
//! calls Python with its arguments converted and checks what comes back.

use super::adapter::{held, PyProposer, M};
use super::convert::{ptr_list, ret_bool, ret_usize};
use super::device_ptr::PyDevicePtr;
use super::state::{with_rust_state, with_rust_states};
use crate::backend::DevicePtr;
use crate::model::ForwardContext;
use crate::speculative::ProposerState;
use crate::Result;
use pyo3::prelude::*;
use pyo3::types::PyList;

// The methods take the protocol's arguments, as its signatures spell them.
#[allow(clippy::too_many_arguments)]
impl PyProposer {
    pub(super) fn prefill_drafter(
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

    pub(super) fn catchup_drafter(
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

    pub(super) fn catchup_batch(
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

    pub(super) fn prefill_hidden_rows(&self, max_seq_len: usize) -> usize {
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

    pub(super) fn prefill_uses_shared_buffers(&self) -> bool {
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
}
