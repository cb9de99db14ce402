//! `specdraft.DraftProposer`: the base class of every proposer Python sees.
//!
//! The class holds the Rust proposer it stands for (`PromptLookup`, `MtpHead`, a wrapped
//! Python proposer, ...) or none, for a pure Python subclass. Each protocol method (the
//! names are [`ProtocolMethod`](crate::speculative::ProtocolMethod)'s; `specdraft`'s tests
//! check that the class defines every one) is defined once here and runs the Rust
//! implementation: the held proposer's, or the protocol's default when there is none. So
//! `super().method(...)` in a Python subclass runs Rust, and a Python subclass overrides
//! exactly the methods it defines. What the class stands on is `proposer_support`'s.
//!
//! Rust work runs with the interpreter released: the held proposer may be a wrapped Python
//! proposer that needs to attach again.

use super::adapter::overridden;
use super::convert::{binding_to_dict, bitmask_arg, ret_tokens};
use super::device_ptr::{PtrArg, PyDevicePtr};
use super::draft_tree::tree_to_py;
use super::errors::{IntoPyResult, ProposerError as PyProposerError};
use super::model::{PyBufferArena, PyForwardContext, PyModelConfig, PyModelLevers};
use super::proposer_support::{states_arg, with_gpu, with_states};
pub(crate) use super::proposer_support::{PyDraftRunner, ABSTRACT};
use super::state::{PyProposerState, StateSrc};
use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::ModelConfig;
use crate::speculative::{DraftProposer, DraftTree, ProposerState, ProtocolMethod as M};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::sync::Arc;

/// Base class of every draft proposer.
///
/// Subclass it and define at least `alloc_state`, `propose` and `after_verify` with
/// the argument names and order below. Every method you define is called from Rust; every
/// one you do not define runs the Rust default without entering Python. Calling a method
/// on the base (`super().method(...)`) runs the Rust implementation: the protocol's
/// default here, the Rust proposer's in a subclass of `PromptLookup`. The constructor
/// accepts and ignores any arguments, so subclasses define their own `__init__`.
///
/// State is any Python object your `alloc_state` returns (None for a proposer without
/// state). `propose` must return at most `num_drafts` token ids, each in
/// `0 <= id < ctx.config.vocab_size`. Its optional arguments (`draft_embed_target`,
/// `grammar_bitmask`, `target_hidden_stack`) are passed by keyword and only when set, so a
/// `propose` that never uses them may leave them out of its signature.
///
/// An exception in a method, or a return value that breaks the contract, becomes a
/// `ProposerError` naming the method and class and carrying the traceback. Methods that
/// cannot fail in Rust (`needs_comm`, `block_gamma`, ...) report through
/// `sys.unraisablehook` and answer with the Rust default instead.
#[pyclass(name = "DraftProposer", module = "specdraft", subclass, frozen)]
pub struct PyDraftProposer {
    /// The Rust proposer this object stands for; `None` for a pure Python subclass.
    pub inner: Option<Arc<dyn DraftProposer>>,
    /// The proposer's name, for messages and state reprs.
    pub name: String,
    /// The backend its weights live on, for a proposer that has device weights.
    pub home: Option<Arc<dyn GpuBackend>>,
}

impl PyDraftProposer {
    /// A base holding `inner`.
    pub fn holding(inner: Arc<dyn DraftProposer>, name: &str) -> Self {
        PyDraftProposer {
            inner: Some(inner),
            name: name.to_string(),
            home: None,
        }
    }

    /// The same base, noting that the proposer's weights live on `gpu`.
    pub fn on_backend(mut self, gpu: Arc<dyn GpuBackend>) -> Self {
        self.home = Some(gpu);
        self
    }

    fn target(&self) -> &dyn DraftProposer {
        match &self.inner {
            Some(p) => &**p,
            None => &ABSTRACT,
        }
    }

    fn wrap_state(&self, py: Python<'_>, state: Box<dyn ProposerState>) -> PyResult<Py<PyAny>> {
        Ok(Bound::new(py, PyProposerState::new(state, &self.name))?
            .into_any()
            .unbind())
    }
}

#[pymethods]
impl PyDraftProposer {
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(_args: &Bound<'_, pyo3::types::PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Self {
        PyDraftProposer {
            inner: None,
            name: "DraftProposer".into(),
            home: None,
        }
    }

    /// Allocates per-sequence state: any object, or None for a proposer without state.
    fn alloc_state(&self, py: Python<'_>, gpu: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let st = with_gpu(gpu, |g| py.detach(|| self.target().alloc_state(g)).py())?;
        self.wrap_state(py, st)
    }

    /// Proposes up to `num_drafts` tokens after `last_token` at `position`.
    ///
    /// `target_hidden` is the target's `[1, hidden_size]` bf16 hidden for
    /// `last_token`; `grammar_bitmask` (int32 words, token `t` allowed when bit
    /// `t % 32` of word `t // 32` is set) limits the drafts when given.
    #[pyo3(signature = (last_token, target_hidden, position, num_drafts, state, ctx, stream = 0, draft_embed_target = None, grammar_bitmask = None, target_hidden_stack = None))]
    #[allow(clippy::too_many_arguments)]
    fn propose(
        &self,
        py: Python<'_>,
        last_token: u32,
        target_hidden: PtrArg,
        position: usize,
        num_drafts: usize,
        state: &Bound<'_, PyAny>,
        ctx: &Bound<'_, PyForwardContext>,
        stream: u64,
        draft_embed_target: Option<PtrArg>,
        grammar_bitmask: Option<&Bound<'_, PyAny>>,
        target_hidden_stack: Option<PtrArg>,
    ) -> PyResult<Vec<u32>> {
        let ctx = ctx.get().to_rust();
        let mask = grammar_bitmask.map(bitmask_arg).transpose()?;
        let mut st = StateSrc::from_py(state);
        py.detach(|| {
            let mut g = st.lock(M::Propose.name())?;
            self.target().propose(
                last_token,
                target_hidden.0,
                position,
                num_drafts,
                g.as_state(),
                &ctx,
                stream,
                draft_embed_target.map(|p| p.0),
                mask.as_deref(),
                target_hidden_stack.map(|p| p.0),
            )
        })
        .py()
    }

    /// Trims the state after a verify that accepted `num_accepted` drafts.
    #[pyo3(signature = (num_accepted, state, stream = 0))]
    fn after_verify(
        &self,
        py: Python<'_>,
        num_accepted: usize,
        state: &Bound<'_, PyAny>,
        stream: u64,
    ) -> PyResult<()> {
        let mut st = StateSrc::from_py(state);
        py.detach(|| {
            let mut g = st.lock(M::AfterVerify.name())?;
            self.target()
                .after_verify(num_accepted, g.as_state(), stream)
        })
        .py()
    }

    /// `after_verify` after a `propose_tree` whose tree branched: `path` lists the accepted
    /// nodes, root side first. The default calls `after_verify(len(path), state, stream)`.
    #[pyo3(signature = (path, state, stream = 0))]
    fn after_verify_tree(
        &self,
        py: Python<'_>,
        path: Vec<usize>,
        state: &Bound<'_, PyAny>,
        stream: u64,
    ) -> PyResult<()> {
        let mut st = StateSrc::from_py(state);
        py.detach(|| {
            let mut g = st.lock(M::AfterVerifyTree.name())?;
            self.target().after_verify_tree(&path, g.as_state(), stream)
        })
        .py()
    }

    /// `alloc_state` given the sequence's token budget (`2**64 - 1`: unknown).
    fn alloc_state_for(
        &self,
        py: Python<'_>,
        gpu: &Bound<'_, PyAny>,
        budget_tokens: usize,
    ) -> PyResult<Py<PyAny>> {
        let st = with_gpu(gpu, |g| {
            py.detach(|| self.target().alloc_state_for(g, budget_tokens))
                .py()
        })?;
        self.wrap_state(py, st)
    }

    /// The block size of a block-diffusion drafter; None for others. The engine asks
    /// `Some(γ)` for `γ - 1` drafts a step (at least 1), whatever its `num_drafts`.
    fn block_gamma(&self, py: Python<'_>) -> Option<usize> {
        py.detach(|| self.target().block_gamma())
    }

    /// The target layers whose hiddens this proposer fuses (default: none).
    ///
    /// Id `i` is the hidden after decoder layer `i` (0-based) before the final norm; EAGLE-3's
    /// "hidden entering layer k" is id `k - 1`. The engine checks the ids when it is built
    /// (each below the model's layer count, none twice) and then passes the captured rows,
    /// bf16 `[rows, len(ids) * hidden]`, as `propose`'s `target_hidden_stack` and as
    /// `ctx.target_hidden_stack` of `prefill_drafter`; such a proposer is proposed per
    /// sequence.
    fn target_layer_ids(&self, py: Python<'_>) -> Vec<usize> {
        py.detach(|| self.target().target_layer_ids())
    }

    /// Rows of the prefill hidden capture this proposer can use (default `max_seq_len`).
    fn prefill_hidden_rows(&self, py: Python<'_>, max_seq_len: usize) -> usize {
        py.detach(|| self.target().prefill_hidden_rows(max_seq_len))
    }

    /// Whether `propose_tree` grows branching trees (default False: its chain); under
    /// `SpecEngine(draft_shape="tree")` such a proposer is asked for a tree each step.
    fn grows_trees(&self, py: Python<'_>) -> bool {
        py.detach(|| self.target().grows_trees())
    }

    /// Whether the proposer's block is sharded across ranks (default False).
    fn needs_comm(&self, py: Python<'_>) -> bool {
        py.detach(|| self.target().needs_comm())
    }

    /// Whether the drafter prefill uses the shared scratch (default False).
    fn prefill_uses_shared_buffers(&self, py: Python<'_>) -> bool {
        py.detach(|| self.target().prefill_uses_shared_buffers())
    }

    /// Drafter KV rows held in `state`; 0 when unknown.
    fn drafter_rows(&self, py: Python<'_>, state: &Bound<'_, PyAny>) -> PyResult<usize> {
        let mut st = StateSrc::from_py(state);
        py.detach(|| {
            let mut g = st.lock(M::DrafterRows.name())?;
            Ok::<_, crate::Error>(self.target().drafter_rows(g.as_state()))
        })
        .py()
    }

    /// Sequence-space pair key of the newest drafter row; None when untracked.
    fn last_pair_key(&self, py: Python<'_>, state: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        let mut st = StateSrc::from_py(state);
        py.detach(|| {
            let mut g = st.lock(M::LastPairKey.name())?;
            Ok::<_, crate::Error>(self.target().last_pair_key(g.as_state()))
        })
        .py()
    }

    /// Moves the drafter KV blocks out of `state`: `(blocks, rows, last_pair_key)`.
    #[allow(clippy::type_complexity)]
    fn take_drafter_kv(
        &self,
        py: Python<'_>,
        state: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(Vec<u32>, usize, Option<usize>)>> {
        let mut st = StateSrc::from_py(state);
        py.detach(|| {
            let mut g = st.lock(M::TakeDrafterKv.name())?;
            Ok::<_, crate::Error>(self.target().take_drafter_kv(g.as_state()))
        })
        .py()
    }

    /// Installs carried blocks into a fresh state; False when unsupported.
    #[pyo3(signature = (state, blocks, rows, last_pair_key = None))]
    fn install_drafter_kv(
        &self,
        py: Python<'_>,
        state: &Bound<'_, PyAny>,
        blocks: Vec<u32>,
        rows: usize,
        last_pair_key: Option<usize>,
    ) -> PyResult<bool> {
        let mut st = StateSrc::from_py(state);
        py.detach(|| {
            let mut g = st.lock(M::InstallDrafterKv.name())?;
            Ok::<_, crate::Error>(self.target().install_drafter_kv(
                g.as_state(),
                blocks,
                rows,
                last_pair_key,
            ))
        })
        .py()
    }

    /// Releases drafter KV blocks no state owns.
    fn free_drafter_kv(&self, py: Python<'_>, blocks: Vec<u32>) {
        py.detach(|| self.target().free_drafter_kv(&blocks))
    }

    /// Appends drafter rows from `(tokens, hiddens)` pairs; returns the rows written.
    #[pyo3(signature = (tokens, hiddens, row_base, pos_base, state, ctx, stream = 0))]
    #[allow(clippy::too_many_arguments)]
    fn catchup_drafter(
        &self,
        py: Python<'_>,
        tokens: Vec<u32>,
        hiddens: PtrArg,
        row_base: usize,
        pos_base: usize,
        state: &Bound<'_, PyAny>,
        ctx: &Bound<'_, PyForwardContext>,
        stream: u64,
    ) -> PyResult<usize> {
        let ctx = ctx.get().to_rust();
        let mut st = StateSrc::from_py(state);
        py.detach(|| {
            let mut g = st.lock(M::CatchupDrafter.name())?;
            self.target().catchup_drafter(
                &tokens,
                hiddens.0,
                row_base,
                pos_base,
                g.as_state(),
                &ctx,
                stream,
            )
        })
        .py()
    }

    /// Drafts for several sequences at once; None when unsupported.
    ///
    /// When `out_conf` is a list it is filled with one list per sequence: the
    /// probability of each of its drafts, or an empty list where none is reported.
    /// A Python subclass that overrides `propose` but not `propose_batch` is proposed
    /// per sequence, so its `propose` is never bypassed.
    #[pyo3(signature = (last_tokens, target_hiddens, positions, num_drafts, states, ctx, stream = 0, out_conf = None))]
    #[allow(clippy::too_many_arguments)]
    fn propose_batch(
        &self,
        py: Python<'_>,
        last_tokens: Vec<u32>,
        target_hiddens: Vec<PtrArg>,
        positions: Vec<usize>,
        num_drafts: usize,
        states: &Bound<'_, PyAny>,
        ctx: &Bound<'_, PyForwardContext>,
        stream: u64,
        out_conf: Option<&Bound<'_, PyList>>,
    ) -> PyResult<Option<Vec<Vec<u32>>>> {
        let ctx = ctx.get().to_rust();
        let hiddens: Vec<DevicePtr> = target_hiddens.iter().map(|p| p.0).collect();
        let mut srcs = states_arg(states)?;
        let want_conf = out_conf.is_some();
        let (drafts, conf) = py
            .detach(|| {
                with_states(&mut srcs, M::ProposeBatch, |refs| {
                    let mut conf = Vec::new();
                    let drafts = self.target().propose_batch(
                        &last_tokens,
                        &hiddens,
                        &positions,
                        num_drafts,
                        refs,
                        &ctx,
                        stream,
                        want_conf.then_some(&mut conf),
                    )?;
                    Ok((drafts, conf))
                })
            })
            .py()?;
        if let Some(list) = out_conf {
            list.call_method0("clear")?;
            for c in conf {
                list.append(c)?;
            }
        }
        Ok(drafts)
    }

    /// The widest batch `propose_batch` accepts; 1 means per-sequence only.
    ///
    /// A Python override sees a view with the arena's `max_rows` (no slots).
    fn propose_batch_max(
        &self,
        py: Python<'_>,
        buffers: &Bound<'_, PyBufferArena>,
        config: &Bound<'_, PyModelConfig>,
    ) -> usize {
        let buffers: Arc<BufferArena> = buffers.get().inner.clone();
        let config: Arc<ModelConfig> = config.get().inner.clone();
        py.detach(|| self.target().propose_batch_max(&buffers, &config))
    }

    /// Proposes a tree of at most `budget` draft tokens after `last_token`:
    /// `(tokens, parents)` or `(tokens, parents, probs)`, each parent an earlier node's
    /// index or -1 for a child of `last_token`. The other arguments are `propose`'s.
    ///
    /// The default is the chain of `budget` drafts from `propose`; a Python class that
    /// defines `propose` gets the chain of its own `propose`.
    #[pyo3(signature = (last_token, target_hidden, position, budget, state, ctx, stream = 0, draft_embed_target = None, grammar_bitmask = None, target_hidden_stack = None))]
    #[allow(clippy::too_many_arguments)]
    fn propose_tree<'py>(
        slf: &Bound<'py, Self>,
        last_token: u32,
        target_hidden: PtrArg,
        position: usize,
        budget: usize,
        state: &Bound<'py, PyAny>,
        ctx: &Bound<'py, PyForwardContext>,
        stream: u64,
        draft_embed_target: Option<PtrArg>,
        grammar_bitmask: Option<&Bound<'py, PyAny>>,
        target_hidden_stack: Option<PtrArg>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let me = slf.get();
        let rust_ctx = ctx.get().to_rust();
        if me.inner.is_none() || overridden(slf.as_any())?.contains(&M::Propose.name()) {
            let kwargs = PyDict::new(py);
            if let Some(p) = draft_embed_target {
                kwargs.set_item("draft_embed_target", PyDevicePtr(p.0))?;
            }
            if let Some(mask) = grammar_bitmask {
                kwargs.set_item("grammar_bitmask", mask)?;
            }
            if let Some(p) = target_hidden_stack {
                kwargs.set_item("target_hidden_stack", PyDevicePtr(p.0))?;
            }
            let args = (
                last_token,
                PyDevicePtr(target_hidden.0),
                position,
                budget,
                state,
                ctx,
                stream,
            );
            let r = slf.call_method(M::Propose.name(), args, Some(&kwargs))?;
            let drafts = ret_tokens(&r, Some((budget, "budget")), rust_ctx.config.vocab_size)
                .map_err(|e| PyProposerError::new_err(format!("propose returned {e}")))?;
            return tree_to_py(py, DraftTree::chain(drafts));
        }
        let mask = grammar_bitmask.map(bitmask_arg).transpose()?;
        let mut st = StateSrc::from_py(state);
        let tree = py
            .detach(|| {
                let mut g = st.lock(M::ProposeTree.name())?;
                me.target().propose_tree(
                    last_token,
                    target_hidden.0,
                    position,
                    budget,
                    g.as_state(),
                    &rust_ctx,
                    stream,
                    draft_embed_target.map(|p| p.0),
                    mask.as_deref(),
                    target_hidden_stack.map(|p| p.0),
                )
            })
            .py()?;
        tree_to_py(py, tree)
    }

    /// Proposes a tree of at most `budget` nodes for each sequence at once: a list of
    /// trees in `propose_tree`'s form, or None when unsupported (then each sequence is
    /// asked `propose_tree`). No grammar mask: a sequence under a grammar proposes alone.
    ///
    /// A Python subclass that overrides `propose` or `propose_tree` but not this gets
    /// None, so its own method is never bypassed.
    #[pyo3(signature = (last_tokens, target_hiddens, positions, budget, states, ctx, stream = 0))]
    #[allow(clippy::too_many_arguments)]
    fn propose_tree_batch<'py>(
        slf: &Bound<'py, Self>,
        last_tokens: Vec<u32>,
        target_hiddens: Vec<PtrArg>,
        positions: Vec<usize>,
        budget: usize,
        states: &Bound<'py, PyAny>,
        ctx: &Bound<'py, PyForwardContext>,
        stream: u64,
    ) -> PyResult<Option<Vec<Bound<'py, PyTuple>>>> {
        let py = slf.py();
        let me = slf.get();
        let overrides = overridden(slf.as_any())?;
        let per_sequence = [M::Propose.name(), M::ProposeTree.name()];
        if me.inner.is_none() || per_sequence.iter().any(|m| overrides.contains(m)) {
            return Ok(None);
        }
        let ctx = ctx.get().to_rust();
        let hiddens: Vec<DevicePtr> = target_hiddens.iter().map(|p| p.0).collect();
        let mut srcs = states_arg(states)?;
        let trees = py
            .detach(|| {
                with_states(&mut srcs, M::ProposeTreeBatch, |refs| {
                    me.target().propose_tree_batch(
                        &last_tokens,
                        &hiddens,
                        &positions,
                        budget,
                        refs,
                        &ctx,
                        stream,
                    )
                })
            })
            .py()?;
        trees
            .map(|ts| ts.into_iter().map(|t| tree_to_py(py, t)).collect())
            .transpose()
    }

    /// Appends one drafter row per accepted draft, for several sequences.
    #[pyo3(signature = (tokens, hiddens, first_pos, states, ctx, stream = 0))]
    #[allow(clippy::too_many_arguments)]
    fn catchup_batch(
        &self,
        py: Python<'_>,
        tokens: Vec<Vec<u32>>,
        hiddens: Vec<Vec<PtrArg>>,
        first_pos: Vec<usize>,
        states: &Bound<'_, PyAny>,
        ctx: &Bound<'_, PyForwardContext>,
        stream: u64,
    ) -> PyResult<usize> {
        let ctx = ctx.get().to_rust();
        let hiddens: Vec<Vec<DevicePtr>> = hiddens
            .iter()
            .map(|h| h.iter().map(|p| p.0).collect())
            .collect();
        let mut srcs = states_arg(states)?;
        py.detach(|| {
            with_states(&mut srcs, M::CatchupBatch, |refs| {
                self.target()
                    .catchup_batch(&tokens, &hiddens, &first_pos, refs, &ctx, stream)
            })
        })
        .py()
    }

    /// Prefills the drafter over the prompt; returns the drafter rows written.
    #[pyo3(signature = (prompt_tokens, hiddens, state, ctx, stream = 0))]
    fn prefill_drafter(
        &self,
        py: Python<'_>,
        prompt_tokens: Vec<u32>,
        hiddens: PtrArg,
        state: &Bound<'_, PyAny>,
        ctx: &Bound<'_, PyForwardContext>,
        stream: u64,
    ) -> PyResult<usize> {
        let ctx = ctx.get().to_rust();
        let mut st = StateSrc::from_py(state);
        py.detach(|| {
            let mut g = st.lock(M::PrefillDrafter.name())?;
            self.target()
                .prefill_drafter(&prompt_tokens, hiddens.0, g.as_state(), &ctx, stream)
        })
        .py()
    }

    /// The draft token the last propose with `draft_embed_target` left on the device.
    fn read_deferred_draft_token(&self, py: Python<'_>, gpu: &Bound<'_, PyAny>) -> PyResult<u32> {
        with_gpu(gpu, |g| {
            py.detach(|| self.target().read_deferred_draft_token(g))
                .py()
        })
    }

    /// Frees per-sequence state: every `DevicePtr` `alloc_state` allocated.
    fn free_state(
        &self,
        py: Python<'_>,
        gpu: &Bound<'_, PyAny>,
        state: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let mut st = StateSrc::from_py(state);
        with_gpu(gpu, |g| {
            py.detach(|| {
                let mut guard = st.lock(M::FreeState.name())?;
                self.target().free_state(g, guard.as_state())
            })
            .py()
        })
    }

    /// The draft head as the circuit executor binds it (a dict; see `DraftBinding` in the
    /// Rust docs); None for most proposers. A Python proposer must return None.
    fn circuit_draft<'py>(
        &self,
        py: Python<'py>,
        config: &Bound<'py, PyModelConfig>,
        levers: PyModelLevers,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let config = config.get().inner.clone();
        let b = py.detach(|| self.target().circuit_draft(&config, &levers.0));
        b.map(|b| binding_to_dict(py, &b)).transpose()
    }

    /// Runs `runner` in place of the draft head's own forward (None: its own again).
    fn set_circuit_draft(&self, py: Python<'_>, runner: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let runner = match runner {
            None => None,
            Some(r) => Some(
                r.cast::<PyDraftRunner>()
                    .map_err(|_| {
                        PyProposerError::new_err(
                            "set_circuit_draft takes None or a DraftRunner made by specdraft",
                        )
                    })?
                    .get()
                    .inner
                    .clone(),
            ),
        };
        py.detach(|| self.target().set_circuit_draft(runner));
        Ok(())
    }
}
