//! Draft trees across the boundary: what a Python `propose_tree` (or `propose_tree_batch`)
//! returns, checked into a [`DraftTree`] (or one per sequence), and a `DraftTree` as Python
//! sees one.
//!
//! Python's form is `(tokens, parents)` or `(tokens, parents, probs)`: a parent is an
//! earlier node's index, or -1 (or None) for a child of the last verified token. A return
//! value is refused with what came back when it is not that shape, or when the tree it
//! describes breaks [`DraftTree::fault`]'s contract.

use super::convert::{as_items, ret_tokens, short_repr};
use crate::speculative::DraftTree;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

const EXPECTED: &str = "a (tokens, parents) or (tokens, parents, probs) tuple";

/// One parent entry: an earlier node's index, or -1 / None for a root.
fn parent(obj: &Bound<'_, PyAny>, node: usize) -> Result<Option<usize>, String> {
    if obj.is_none() {
        return Ok(None);
    }
    let bad = || {
        format!(
            "parent {} for node {node}, expected an earlier node's index or -1",
            short_repr(obj)
        )
    };
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(bad());
    }
    match obj.extract::<i64>().map_err(|_| bad())? {
        -1 => Ok(None),
        p if p >= 0 => Ok(Some(p as usize)),
        _ => Err(bad()),
    }
}

/// What a Python `propose_tree` returned, as a tree of at most `budget` nodes over
/// `vocab_size` tokens.
pub fn ret_tree(
    obj: &Bound<'_, PyAny>,
    budget: usize,
    vocab_size: usize,
) -> Result<DraftTree, String> {
    let items = as_items(obj, EXPECTED)?;
    if !(2..=3).contains(&items.len()) {
        return Err(format!("{} items, expected {EXPECTED}", items.len()));
    }
    // The budget is checked on the tree, so the message names nodes, not ids.
    let tokens = ret_tokens(&items[0], None, vocab_size).map_err(|e| format!("tokens: {e}"))?;
    let parents = as_items(&items[1], "a list of parent indices")
        .map_err(|e| format!("parents: {e}"))?
        .iter()
        .enumerate()
        .map(|(i, p)| parent(p, i))
        .collect::<Result<Vec<_>, _>>()?;
    let probs = match items.get(2).filter(|p| !p.is_none()) {
        Some(p) => Some(
            p.extract::<Vec<f32>>()
                .map_err(|_| format!("probs {}, expected a list of floats", short_repr(p)))?,
        ),
        None => None,
    };
    let tree = DraftTree {
        tokens,
        parents,
        probs,
    };
    match tree.fault(budget, vocab_size) {
        Some(fault) => Err(format!("a tree with {fault}")),
        None => Ok(tree),
    }
}

/// What a Python `propose_tree_batch` returned: `None`, or one tree per each of `n`
/// sequences (see [`ret_tree`]).
pub fn ret_trees(
    obj: &Bound<'_, PyAny>,
    n: usize,
    budget: usize,
    vocab_size: usize,
) -> Result<Option<Vec<DraftTree>>, String> {
    if obj.is_none() {
        return Ok(None);
    }
    let items = as_items(obj, "None or one tree per sequence")?;
    if items.len() != n {
        return Err(format!("{} trees for {n} sequences", items.len()));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, t)| ret_tree(t, budget, vocab_size).map_err(|e| format!("for sequence {i}: {e}")))
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// `tree` as Python's `(tokens, parents)` or, with probabilities, `(tokens, parents, probs)`.
pub fn tree_to_py<'py>(py: Python<'py>, tree: DraftTree) -> PyResult<Bound<'py, PyTuple>> {
    let parents: Vec<i64> = tree
        .parents
        .iter()
        .map(|p| p.map_or(-1, |p| p as i64))
        .collect();
    match tree.probs {
        Some(probs) => (tree.tokens, parents, probs).into_pyobject(py),
        None => (tree.tokens, parents).into_pyobject(py),
    }
}
