//! Argument and return-value conversions shared by the proposer bindings.
//!
//! Return values of Python proposers are validated here, and every refusal says what came
//! back and what was expected ("propose returned 7 ids but num_drafts is 4").

use super::backend::type_name;
use super::device_ptr::PyDevicePtr;
use crate::backend::DevicePtr;
use crate::speculative::DraftBinding;
use numpy::{PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySequence, PyString, PyTuple};

/// A grammar bitmask argument: int32 words as a list or a numpy array (int32 or uint32, any
/// shape; it is flattened).
pub fn bitmask_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
    let py = obj.py();
    let np = py.import("numpy")?;
    let mut a = np.call_method1("asarray", (obj,))?;
    let kind: String = a.getattr("dtype")?.getattr("name")?.extract()?;
    if kind == "uint32" {
        a = a.call_method1("view", ("int32",))?;
    } else if kind != "int32" {
        a = a.call_method1("astype", ("int32",))?;
    }
    let flat = np
        .call_method1("ascontiguousarray", (a,))?
        .call_method1("reshape", (-1,))?;
    let arr = flat.cast::<numpy::PyArray1<i32>>()?.readonly();
    Ok(arr.as_slice()?.to_vec())
}

/// `repr(obj)`, shortened for a message.
pub fn short_repr(obj: &Bound<'_, PyAny>) -> String {
    let r = obj
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unprintable>".into());
    if r.chars().count() > 60 {
        let head: String = r.chars().take(57).collect();
        format!("{head}...")
    } else {
        r
    }
}

fn what(obj: &Bound<'_, PyAny>) -> String {
    format!("{} ({})", short_repr(obj), type_name(obj))
}

/// A list-like of items (list, tuple, numpy array, any sequence but str/bytes).
pub fn as_items<'py>(
    obj: &Bound<'py, PyAny>,
    expected: &str,
) -> Result<Vec<Bound<'py, PyAny>>, String> {
    if let Ok(l) = obj.cast::<PyList>() {
        return Ok(l.iter().collect());
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return Ok(t.iter().collect());
    }
    if let Ok(a) = obj.cast::<numpy::PyUntypedArray>() {
        if a.ndim() != 1 {
            return Err(format!(
                "{}, a {}-dimensional array, expected {expected}",
                what(obj),
                a.ndim()
            ));
        }
        let list = obj.call_method0("tolist").map_err(|e| e.to_string())?;
        let list = list.cast::<PyList>().map_err(|e| e.to_string())?;
        return Ok(list.iter().collect());
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(format!("{}, expected {expected}", what(obj)));
    }
    match obj.cast::<PySequence>() {
        Ok(s) => {
            let n = s.len().map_err(|e| e.to_string())?;
            (0..n)
                .map(|i| s.get_item(i).map_err(|e| e.to_string()))
                .collect()
        }
        Err(_) => Err(format!("{}, expected {expected}", what(obj))),
    }
}

/// A non-negative integer return value.
pub fn ret_usize(obj: &Bound<'_, PyAny>) -> Result<usize, String> {
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(format!("{}, expected a non-negative int", what(obj)));
    }
    obj.extract::<usize>()
        .map_err(|_| format!("{}, expected a non-negative int", what(obj)))
}

/// A list-like of non-negative integers (layer ids, ...).
pub fn ret_usize_list(obj: &Bound<'_, PyAny>) -> Result<Vec<usize>, String> {
    let items = as_items(obj, "a list of non-negative ints")?;
    items
        .iter()
        .enumerate()
        .map(|(i, it)| ret_usize(it).map_err(|e| format!("{e} at index {i}")))
        .collect()
}

/// `None` or a non-negative integer.
pub fn ret_opt_usize(obj: &Bound<'_, PyAny>) -> Result<Option<usize>, String> {
    if obj.is_none() {
        return Ok(None);
    }
    ret_usize(obj).map(Some).map_err(|e| format!("{e} or None"))
}

/// A `bool` return value.
pub fn ret_bool(obj: &Bound<'_, PyAny>) -> Result<bool, String> {
    obj.extract::<bool>()
        .map_err(|_| format!("{}, expected True or False", what(obj)))
}

/// Token ids: a sequence of ints, each in `0..vocab_size`, at most `limit` of them
/// (`limit_name` names the limit in the message).
pub fn ret_tokens(
    obj: &Bound<'_, PyAny>,
    limit: Option<(usize, &str)>,
    vocab_size: usize,
) -> Result<Vec<u32>, String> {
    let items = as_items(obj, "a list of token ids")?;
    if let Some((limit, name)) = limit {
        if items.len() > limit {
            return Err(format!("{} ids but {name} is {limit}", items.len()));
        }
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        if it.is_instance_of::<pyo3::types::PyBool>() {
            return Err(format!(
                "{} at index {i}, expected an int token id",
                what(it)
            ));
        }
        let v: i64 = it
            .extract()
            .map_err(|_| format!("{} at index {i}, expected an int token id", what(it)))?;
        if v < 0 {
            return Err(format!("a negative token id {v} at index {i}"));
        }
        if v as u64 >= vocab_size as u64 {
            return Err(format!(
                "token id {v} at index {i}, outside the vocabulary of {vocab_size}"
            ));
        }
        out.push(v as u32);
    }
    Ok(out)
}

/// `DevicePtr`s as Python objects.
pub fn ptr_list<'py>(py: Python<'py>, ptrs: &[DevicePtr]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, ptrs.iter().map(|&p| PyDevicePtr(p)))
}

/// A draft binding as a dict (weights as a list of dicts).
pub fn binding_to_dict<'py>(py: Python<'py>, b: &DraftBinding) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("kind", &b.kind)?;
    let weights = PyList::empty(py);
    for w in &b.weights {
        let wd = PyDict::new(py);
        wd.set_item("name", &w.name)?;
        wd.set_item("ptr", PyDevicePtr(w.ptr))?;
        wd.set_item("dtype", w.dtype.name())?;
        wd.set_item("shape", &w.shape)?;
        wd.set_item("block_scale", w.block_scale.map(PyDevicePtr))?;
        wd.set_item("global_scale", w.global_scale)?;
        weights.append(wd)?;
    }
    d.set_item("weights", weights)?;
    d.set_item("hidden_size", b.hidden_size)?;
    d.set_item("num_attention_heads", b.num_attention_heads)?;
    d.set_item("num_key_value_heads", b.num_key_value_heads)?;
    d.set_item("head_dim", b.head_dim)?;
    d.set_item("rope_theta", b.rope_theta)?;
    d.set_item("rms_norm_eps", b.rms_norm_eps)?;
    d.set_item("vocab_size", b.vocab_size)?;
    d.set_item("draft_vocab_size", b.draft_vocab_size)?;
    d.set_item("kv_block_size", b.kv_block_size)?;
    d.set_item("kv_num_blocks", b.kv_num_blocks)?;
    d.set_item("k_cache", PyDevicePtr(b.k_cache))?;
    d.set_item("v_cache", PyDevicePtr(b.v_cache))?;
    Ok(d)
}
