//! Rank 0's commands to its workers ([`Command`]) as Python dicts, both ways, for
//! `Communicator.send_command` / `recv_command`.
//!
//! Invariants: a dict that does not describe a command (a missing or unknown `"kind"`, a
//! missing field, a value of the wrong type) is a `ValueError` or `TypeError` naming the
//! field; `command_from_dict(command_to_dict(c)) == c` for every command.

use crate::distributed::{Command, SeqTokens};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

/// The command a dict describes; its keys must be exactly those of its `"kind"`.
pub(super) fn command_from_dict(d: &Bound<'_, PyDict>) -> PyResult<Command> {
    let kind: String = d
        .get_item("kind")?
        .ok_or_else(|| PyValueError::new_err("command: missing \"kind\""))?
        .extract()?;
    let allowed: &[&str] = match kind.as_str() {
        "prefill" => &["kind", "batch", "layers"],
        "verify" => &["kind", "batch", "layers", "trees"],
        "mtp_propose" => &[
            "kind",
            "state",
            "last_token",
            "position",
            "num_drafts",
            "hidden",
            "grammar",
        ],
        "mtp_propose_batch" => &[
            "kind",
            "states",
            "last_tokens",
            "positions",
            "num_drafts",
            "hidden",
            "confidences",
        ],
        "proposer_alloc" => &["kind", "state", "budget"],
        "proposer_prefill" => &["kind", "state", "tokens", "hidden"],
        "proposer_after_verify" => &["kind", "state", "accepted"],
        "proposer_catchup" => &["kind", "state", "tokens", "hidden", "row_base", "pos_base"],
        "proposer_free" => &["kind", "state"],
        "trim" => &["kind", "seq", "len"],
        "compact" => &["kind", "seq", "start", "rows"],
        "free" => &["kind", "seq"],
        "shutdown" => &["kind"],
        other => {
            return Err(PyValueError::new_err(format!(
                "command: unknown kind {other:?}; expected prefill, verify, mtp_propose, mtp_propose_batch, trim, compact, free, shutdown or a proposer_* call"
            )))
        }
    };
    for key in d.keys() {
        let key: String = key.extract()?;
        if !allowed.contains(&key.as_str()) {
            return Err(PyValueError::new_err(format!(
                "command {kind:?}: unexpected key {key:?}; its keys are {allowed:?}"
            )));
        }
    }
    let field = |name: &str| -> PyResult<Bound<'_, PyAny>> {
        d.get_item(name)?
            .ok_or_else(|| PyValueError::new_err(format!("command {kind:?}: missing {name:?}")))
    };
    // `layers` and `trees` may be left out: no capture, every sequence a chain.
    let optional = |name: &str| -> PyResult<Option<Bound<'_, PyAny>>> { d.get_item(name) };
    let batch = || -> PyResult<Vec<SeqTokens>> {
        let items: Vec<Bound<'_, PyDict>> = field("batch")?.extract()?;
        items
            .iter()
            .map(|item| {
                let get = |name: &str| {
                    item.get_item(name)?.ok_or_else(|| {
                        PyValueError::new_err(format!(
                            "command {kind:?}: a batch entry has no {name:?}"
                        ))
                    })
                };
                Ok(SeqTokens {
                    seq: get("seq")?.extract()?,
                    tokens: get("tokens")?.extract()?,
                })
            })
            .collect()
    };
    let layers =
        || -> PyResult<Vec<u32>> { optional("layers")?.map_or(Ok(Vec::new()), |v| v.extract()) };
    Ok(match kind.as_str() {
        "prefill" => Command::Prefill {
            batch: batch()?,
            layers: layers()?,
        },
        "verify" => Command::Verify {
            batch: batch()?,
            layers: layers()?,
            trees: optional("trees")?.map_or(Ok(Vec::new()), |v| v.extract())?,
        },
        "mtp_propose" => Command::MtpPropose {
            state: field("state")?.extract()?,
            last_token: field("last_token")?.extract()?,
            position: field("position")?.extract()?,
            num_drafts: field("num_drafts")?.extract()?,
            hidden: field("hidden")?.extract()?,
            grammar: optional("grammar")?.map_or(Ok(None), |v| v.extract())?,
        },
        "mtp_propose_batch" => Command::MtpProposeBatch {
            states: field("states")?.extract()?,
            last_tokens: field("last_tokens")?.extract()?,
            positions: field("positions")?.extract()?,
            num_drafts: field("num_drafts")?.extract()?,
            hidden: field("hidden")?.extract()?,
            confidences: field("confidences")?.extract()?,
        },
        "proposer_alloc" => Command::ProposerAlloc {
            state: field("state")?.extract()?,
            budget: field("budget")?.extract()?,
        },
        "proposer_prefill" => Command::ProposerPrefill {
            state: field("state")?.extract()?,
            tokens: field("tokens")?.extract()?,
            hidden: field("hidden")?.extract()?,
        },
        "proposer_after_verify" => Command::ProposerAfterVerify {
            state: field("state")?.extract()?,
            accepted: field("accepted")?.extract()?,
        },
        "proposer_catchup" => Command::ProposerCatchup {
            state: field("state")?.extract()?,
            tokens: field("tokens")?.extract()?,
            hidden: field("hidden")?.extract()?,
            row_base: field("row_base")?.extract()?,
            pos_base: field("pos_base")?.extract()?,
        },
        "proposer_free" => Command::ProposerFree {
            state: field("state")?.extract()?,
        },
        "trim" => Command::Trim {
            seq: field("seq")?.extract()?,
            len: field("len")?.extract()?,
        },
        "compact" => Command::Compact {
            seq: field("seq")?.extract()?,
            start: field("start")?.extract()?,
            rows: field("rows")?.extract()?,
        },
        "free" => Command::Free {
            seq: field("seq")?.extract()?,
        },
        _ => Command::Shutdown,
    })
}

/// `cmd` as the dict [`command_from_dict`] reads back.
pub(super) fn command_to_dict<'py>(py: Python<'py>, cmd: &Command) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("kind", cmd.kind())?;
    let batch_list = |batch: &[SeqTokens]| -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for s in batch {
            let item = PyDict::new(py);
            item.set_item("seq", s.seq)?;
            item.set_item("tokens", s.tokens.clone())?;
            list.append(item)?;
        }
        Ok(list)
    };
    match cmd {
        Command::Prefill { batch, layers } => {
            d.set_item("batch", batch_list(batch)?)?;
            d.set_item("layers", layers.clone())?;
        }
        Command::Verify {
            batch,
            layers,
            trees,
        } => {
            d.set_item("batch", batch_list(batch)?)?;
            d.set_item("layers", layers.clone())?;
            d.set_item("trees", trees.clone())?;
        }
        Command::MtpPropose {
            state,
            last_token,
            position,
            num_drafts,
            hidden,
            grammar,
        } => {
            d.set_item("state", state)?;
            d.set_item("last_token", last_token)?;
            d.set_item("position", position)?;
            d.set_item("num_drafts", num_drafts)?;
            d.set_item("hidden", PyBytes::new(py, hidden))?;
            d.set_item("grammar", grammar.clone())?;
        }
        Command::MtpProposeBatch {
            states,
            last_tokens,
            positions,
            num_drafts,
            hidden,
            confidences,
        } => {
            d.set_item("states", states.clone())?;
            d.set_item("last_tokens", last_tokens.clone())?;
            d.set_item("positions", positions.clone())?;
            d.set_item("num_drafts", num_drafts)?;
            d.set_item("hidden", PyBytes::new(py, hidden))?;
            d.set_item("confidences", confidences)?;
        }
        Command::ProposerAlloc { state, budget } => {
            d.set_item("state", state)?;
            d.set_item("budget", budget)?;
        }
        Command::ProposerPrefill {
            state,
            tokens,
            hidden,
        } => {
            d.set_item("state", state)?;
            d.set_item("tokens", tokens.clone())?;
            d.set_item("hidden", PyBytes::new(py, hidden))?;
        }
        Command::ProposerAfterVerify { state, accepted } => {
            d.set_item("state", state)?;
            d.set_item("accepted", accepted)?;
        }
        Command::ProposerCatchup {
            state,
            tokens,
            hidden,
            row_base,
            pos_base,
        } => {
            d.set_item("state", state)?;
            d.set_item("tokens", tokens.clone())?;
            d.set_item("hidden", PyBytes::new(py, hidden))?;
            d.set_item("row_base", row_base)?;
            d.set_item("pos_base", pos_base)?;
        }
        Command::ProposerFree { state } => d.set_item("state", state)?,
        Command::Trim { seq, len } => {
            d.set_item("seq", seq)?;
            d.set_item("len", len)?;
        }
        Command::Compact { seq, start, rows } => {
            d.set_item("seq", seq)?;
            d.set_item("start", start)?;
            d.set_item("rows", rows.clone())?;
        }
        Command::Free { seq } => d.set_item("seq", seq)?,
        Command::Shutdown => {}
    }
    Ok(d)
}
