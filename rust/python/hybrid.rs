//! `specdraft.Hybrid`: a proposer made of proposers, as a `specdraft.DraftProposer` subclass
//! whose base holds the Rust `Hybrid`, so every protocol method runs in Rust.
//!
//! Its members may be any proposers, Rust (`SuffixDecoding`, `MtpHead`, ...) or Python
//! subclasses of `DraftProposer`; each is wrapped once, as the engine wraps a proposer, and
//! the Python objects are kept for `.members`. The target's layer count for the exact
//! catch-up is `target_layers=`, or by default that of the target an `MtpHead` member was
//! loaded beside.

use super::adapter::wrap;
use super::errors::IntoPyResult;
use super::mtp::PyMtpHead;
use super::proposer::PyDraftProposer;
use crate::backend::GpuBackend;
use crate::speculative::{Hybrid, HybridChoice, HybridMember};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::sync::Arc;

/// A proposer made of proposers: each step it drafts with the first member (in list order)
/// that returns at least its `min_drafts` drafts and, under `choice="measured"` (the
/// default), whose first drafts of that length (one, or more) have been accepted in this
/// sequence at least as often as those of every later member; every member sees every step.
///
/// `Hybrid([SuffixDecoding(), head])` drafts by retrieval where the text repeats and by the
/// learned head elsewhere: a short suffix match on open text, right less often than the
/// head, gives way to it. Until a step is measured the order decides, and a member that has
/// stopped winning is tried again as its measurements fade. `choice="first"` is a fixed
/// priority: the first member with a confident draft wins. Members are asked in order until
/// one wins, and the members after it are still given the step with `num_drafts=0`. After
/// verification the winner gets the accepted count, a member whose drafts lost the length of
/// their common prefix with the accepted drafts, and the others 0; at the next step each
/// member first catches up on the accepted drafts it did not draft (one `propose` of 0 drafts
/// and one `after_verify(0)` per token), so its history and drafter KV follow the sequence.
///
/// It grows draft trees (`grows_trees()`) when a member does: members that grow trees are
/// asked `propose_tree` with the step's node budget, the others draft chains, the winner's
/// tree is the hybrid's, and after verification each member keeps the path of its own
/// drafts that the accepted tokens follow (`after_verify_tree` where its tree branched).
///
/// `target_layers` (the target's decoder layer count) makes that catch-up exact for members
/// that read `target_hidden` (the MTP head): the hybrid then also names the target's last
/// layer among its `target_layer_ids`, whose captured rows are the final hiddens of the
/// caught-up tokens. It defaults to the layer count of the target an `MtpHead` member was
/// loaded beside (`target=` or `load_draft_head`); without one, caught-up tokens are paired
/// with the step's `target_hidden`. `min_drafts` gives each member's threshold (default 1
/// each). A member that raises fails the call with a `ProposerError` naming the member's
/// index and class. Drafter KV is not carried between turns of a conversation.
#[pyclass(name = "Hybrid", module = "specdraft", extends = PyDraftProposer, subclass, frozen)]
pub struct PyHybrid {
    members: Vec<Py<PyAny>>,
    min_drafts: Vec<usize>,
    target_layers: Option<usize>,
    choice: HybridChoice,
}

fn parse_choice(choice: &str) -> PyResult<HybridChoice> {
    match choice {
        "measured" => Ok(HybridChoice::Measured),
        "first" => Ok(HybridChoice::First),
        other => Err(PyValueError::new_err(format!(
            "Hybrid: choice {other:?}: expected \"measured\" or \"first\""
        ))),
    }
}

fn choice_name(choice: HybridChoice) -> &'static str {
    match choice {
        HybridChoice::Measured => "measured",
        HybridChoice::First => "first",
    }
}

/// The layer count of the target an `MtpHead` among `members` was loaded beside.
fn target_layers_of(members: &[Bound<'_, PyAny>]) -> Option<usize> {
    members.iter().find_map(|m| {
        let head = m.cast::<PyMtpHead>().ok()?;
        let layers = head
            .get()
            .head()
            .target
            .as_ref()
            .map(|t| t.config().num_hidden_layers);
        layers
    })
}

/// The backend the members' weights live on (the first that names one); members on two
/// different backends cannot draft together.
fn home_of(members: &[Bound<'_, PyAny>]) -> PyResult<Option<Arc<dyn GpuBackend>>> {
    let mut home: Option<Arc<dyn GpuBackend>> = None;
    for (i, m) in members.iter().enumerate() {
        let Ok(base) = m.cast::<PyDraftProposer>() else {
            continue;
        };
        let Some(theirs) = &base.get().home else {
            continue;
        };
        match &home {
            None => home = Some(theirs.clone()),
            Some(h) if std::ptr::addr_eq(Arc::as_ptr(h), Arc::as_ptr(theirs)) => {}
            Some(h) => {
                return Err(PyValueError::new_err(format!(
                    "Hybrid: member {i}'s weights live on the {} backend, an earlier member's on another {} backend; load every member on one backend",
                    theirs.name(),
                    h.name()
                )))
            }
        }
    }
    Ok(home)
}

impl PyHybrid {
    /// The members, in the order they are asked (the engine looks for a drafter KV pool).
    pub(super) fn member_objects(&self) -> &[Py<PyAny>] {
        &self.members
    }
}

#[pymethods]
impl PyHybrid {
    #[new]
    #[pyo3(signature = (members, *, target_layers = None, min_drafts = None, choice = "measured"))]
    fn new(
        members: &Bound<'_, PyAny>,
        target_layers: Option<usize>,
        min_drafts: Option<Vec<usize>>,
        choice: &str,
    ) -> PyResult<PyClassInitializer<Self>> {
        let choice = parse_choice(choice)?;
        let objs: Vec<Bound<'_, PyAny>> = members.try_iter()?.collect::<PyResult<_>>()?;
        let mins = min_drafts.unwrap_or_else(|| vec![1; objs.len()]);
        if mins.len() != objs.len() {
            return Err(PyValueError::new_err(format!(
                "Hybrid: {} members but {} min_drafts; give one per member",
                objs.len(),
                mins.len()
            )));
        }
        let mut rust = Vec::with_capacity(objs.len());
        for (obj, &min) in objs.iter().zip(&mins) {
            let name = obj
                .get_type()
                .qualname()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".into());
            rust.push(HybridMember::new(name, wrap(obj)?).with_min_drafts(min));
        }
        let target_layers = target_layers.or_else(|| target_layers_of(&objs));
        let home = home_of(&objs)?;
        let hybrid = Hybrid::new(rust, target_layers).py()?.with_choice(choice);
        let mut base = PyDraftProposer::holding(Arc::new(hybrid), "Hybrid");
        if let Some(h) = home {
            base = base.on_backend(h);
        }
        Ok(PyClassInitializer::from(base).add_subclass(PyHybrid {
            members: objs.into_iter().map(Bound::unbind).collect(),
            min_drafts: mins,
            target_layers,
            choice,
        }))
    }

    /// The members, in the order they are asked (a new list each time).
    #[getter]
    fn members(&self, py: Python<'_>) -> Vec<Py<PyAny>> {
        self.members.iter().map(|m| m.clone_ref(py)).collect()
    }

    /// Drafts each member must return to win a step.
    #[getter]
    fn min_drafts(&self) -> Vec<usize> {
        self.min_drafts.clone()
    }

    /// The target's layer count the catch-up pairs tokens with (None: not exact).
    #[getter]
    fn target_layers(&self) -> Option<usize> {
        self.target_layers
    }

    /// How each step's member is picked: `"measured"` or `"first"`.
    #[getter]
    fn choice(&self) -> &'static str {
        choice_name(self.choice)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let names: Vec<String> = self
            .members
            .iter()
            .map(|m| Ok(m.bind(py).repr()?.to_string()))
            .collect::<PyResult<_>>()?;
        Ok(format!(
            "Hybrid([{}], target_layers={}, min_drafts={:?}, choice='{}')",
            names.join(", "),
            self.target_layers
                .map_or_else(|| "None".to_string(), |n| n.to_string()),
            self.min_drafts,
            choice_name(self.choice)
        ))
    }
}
