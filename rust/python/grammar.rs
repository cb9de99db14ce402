//! Grammar matchers written in Python, behind the engine's [`GrammarMatcher`].
//!
//! A grammar is an object with a `matcher()` method returning a fresh matcher per sequence
//! (see `specdraft.grammar`), or a list of matchers, one per prompt; a matcher has
//! `fill_mask(mask)` (an int32 numpy array to fill in place), `advance(token)` and,
//! optionally, `is_finished()`. A matcher that raises ends its sequence with a
//! `GenerationError` carrying the Python traceback.

use super::adapter::format_traceback;
use super::backend::type_name;
use super::errors::request_error;
use crate::engine::{EngineError, GrammarMatcher};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyList};

/// A Python grammar matcher behind [`GrammarMatcher`].
struct PyGrammar {
    obj: Py<PyAny>,
    has_is_finished: bool,
}

fn grammar_err(py: Python<'_>, what: &str, e: &PyErr) -> crate::Error {
    EngineError::Grammar(format!("{what}: {}", format_traceback(py, e))).into()
}

impl GrammarMatcher for PyGrammar {
    fn fill_mask(&mut self, mask: &mut [i32]) -> crate::Result<()> {
        Python::attach(|py| {
            let mut run = || -> PyResult<()> {
                let arr = PyArray1::<i32>::zeros(py, mask.len(), false);
                self.obj.bind(py).call_method1("fill_mask", (&arr,))?;
                mask.copy_from_slice(arr.readonly().as_slice()?);
                Ok(())
            };
            run().map_err(|e| grammar_err(py, "fill_mask", &e))
        })
    }

    fn advance(&mut self, token: u32) -> crate::Result<()> {
        Python::attach(|py| {
            let ok = self.obj.bind(py).call_method1("advance", (token,));
            match ok {
                // A matcher may return False to refuse a token.
                Ok(v) if v.is_instance_of::<PyBool>() && !v.is_truthy().unwrap_or(true) => {
                    Err(EngineError::Grammar(format!(
                        "advance({token}): the matcher refused the token"
                    ))
                    .into())
                }
                Ok(_) => Ok(()),
                Err(e) => Err(grammar_err(py, "advance", &e)),
            }
        })
    }

    fn is_finished(&self) -> bool {
        if !self.has_is_finished {
            return false;
        }
        Python::attach(|py| {
            self.obj
                .bind(py)
                .call_method0("is_finished")
                .and_then(|v| v.is_truthy())
                .unwrap_or(false)
        })
    }
}

fn matcher(obj: Bound<'_, PyAny>) -> PyResult<Box<dyn GrammarMatcher>> {
    for m in ["fill_mask", "advance"] {
        if !obj.hasattr(m)? {
            return Err(PyTypeError::new_err(format!(
                "a grammar matcher needs fill_mask(mask) and advance(token); {} has no {m}",
                type_name(&obj)
            )));
        }
    }
    let has_is_finished = obj.hasattr("is_finished")?;
    Ok(Box::new(PyGrammar {
        obj: obj.unbind(),
        has_is_finished,
    }))
}

/// One matcher per prompt from `grammar` (a grammar with `matcher()`, or a list).
pub fn matchers(
    grammar: Option<&Bound<'_, PyAny>>,
    n: usize,
) -> PyResult<Vec<Option<Box<dyn GrammarMatcher>>>> {
    let Some(g) = grammar else {
        return Ok((0..n).map(|_| None).collect());
    };
    if let Ok(list) = g.cast::<PyList>() {
        if list.len() != n {
            return Err(request_error(format!(
                "grammar: {} matchers for {n} prompts (give one per prompt, or a grammar with matcher())",
                list.len()
            )));
        }
        return list.iter().map(|m| matcher(m).map(Some)).collect();
    }
    if g.hasattr("matcher")? {
        return (0..n)
            .map(|_| matcher(g.call_method0("matcher")?).map(Some))
            .collect();
    }
    if n == 1 {
        return Ok(vec![Some(matcher(g.clone())?)]);
    }
    Err(PyTypeError::new_err(
        "grammar must have a matcher() method, or be a list of matchers (one per prompt)",
    ))
}
