//! What a proposer is through the adapter: `block_gamma`, `target_layer_ids`, `grows_trees`, `needs_comm`,
//! and the circuit binding (`circuit_draft`, `set_circuit_draft`).
//!
//! Each method runs the Rust path when the Python class does not override it, otherwise
//! calls Python with its arguments converted and checks what comes back.

use super::adapter::{PyProposer, M};
use super::convert::{ret_bool, ret_opt_usize, ret_usize_list, short_repr};
use super::model::{PyModelConfig, PyModelLevers};
use super::proposer::PyDraftRunner;
use crate::model::{ModelConfig, ModelLevers};
use crate::speculative::{DraftBinding, DraftRunner};
use pyo3::prelude::*;
use std::sync::Arc;

impl PyProposer {
    pub(super) fn block_gamma(&self) -> Option<usize> {
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

    pub(super) fn target_layer_ids(&self) -> Vec<usize> {
        let m = M::TargetLayerIds;
        if !self.python(m) {
            return self.fallback().target_layer_ids();
        }
        self.infallible(
            m,
            |py| {
                let r = self.call(py, m, (), None)?;
                ret_usize_list(&r).map_err(|e| self.bad_return(m, e))
            },
            || self.fallback().target_layer_ids(),
        )
    }

    /// A Python `propose_tree` grows trees; a Python `propose` without one drafts chains,
    /// whatever the class it extends grows.
    pub(super) fn grows_trees(&self) -> bool {
        let m = M::GrowsTrees;
        if !self.python(m) {
            if self.python(M::ProposeTree) {
                return true;
            }
            if self.python(M::Propose) {
                return false;
            }
            return self.fallback().grows_trees();
        }
        self.infallible(
            m,
            |py| {
                let r = self.call(py, m, (), None)?;
                ret_bool(&r).map_err(|e| self.bad_return(m, e))
            },
            || self.fallback().grows_trees(),
        )
    }

    pub(super) fn needs_comm(&self) -> bool {
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

    pub(super) fn circuit_draft(
        &self,
        config: &ModelConfig,
        levers: &ModelLevers,
    ) -> Option<DraftBinding> {
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
                        format!("{}; only Rust proposers can provide a draft binding, a Python one must return None", short_repr(&r)),
                    ))
                }
            },
            || None,
        )
    }

    pub(super) fn set_circuit_draft(&self, runner: Option<Arc<dyn DraftRunner>>) {
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
