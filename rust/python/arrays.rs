//! numpy arrays <-> device bytes: dtype and shape arguments, the bytes to store for an
//! array, and typed arrays from downloaded bytes.
//!
//! Data crosses as raw bytes in C order and native byte order; bf16, which numpy lacks,
//! travels as float32 (converted, round to nearest even) or as uint16 bit patterns.

use super::backend::type_name;
use crate::backend::Dtype;
use half::bf16;
use numpy::{PyArray1, PyArrayMethods, PyUntypedArray};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyString;

/// A dtype argument: a name (`"bf16"`, `"float32"`, ...) or a numpy dtype.
pub(super) fn dtype_arg(obj: &Bound<'_, PyAny>) -> PyResult<Dtype> {
    let name: String = match obj.cast::<PyString>() {
        Ok(s) => s.to_str()?.to_string(),
        Err(_) => {
            let np = obj.py().import("numpy")?;
            np.call_method1("dtype", (obj,))?
                .getattr("name")?
                .extract()?
        }
    };
    Dtype::parse(&name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown dtype {name:?}; expected one of bf16, f16/float16, f32/float32, u32/uint32, i32/int32, u8/uint8"
        ))
    })
}

pub(super) fn shape_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    if let Ok(n) = obj.extract::<usize>() {
        return Ok(vec![n]);
    }
    obj.extract::<Vec<usize>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "shape must be a non-negative int or a sequence of them, got {}",
            type_name(obj)
        ))
    })
}

/// The bytes to store for `array`, with the dtype they are stored as.
pub(super) fn array_bytes(
    array: &Bound<'_, PyAny>,
    want: Option<Dtype>,
    what: &str,
) -> PyResult<(Dtype, Vec<u8>)> {
    let py = array.py();
    let arr = array.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} expects a numpy array (float32, float16, uint32, int32 or uint8), got {}",
            type_name(array)
        ))
    })?;
    let dt = arr.getattr("dtype")?;
    let name: String = dt.getattr("name")?.extract()?;
    if !dt.getattr("isnative")?.extract::<bool>()? {
        return Err(PyValueError::new_err(format!(
            "{what}: the array's {name} data is not in native byte order; use array.astype(array.dtype.newbyteorder('='))"
        )));
    }
    let np = py.import("numpy")?;
    let flat = np
        .call_method1("ascontiguousarray", (arr,))?
        .call_method1("reshape", (-1,))?;
    let have = match name.as_str() {
        "uint16" => None,
        other => Some(Dtype::parse(other).ok_or_else(|| {
            PyTypeError::new_err(format!(
                "{what}: arrays of {other} are not supported; use float32, float16, uint32, int32 or uint8 (or float32 with dtype='bf16')"
            ))
        })?),
    };
    match (want, have) {
        (Some(Dtype::Bf16), Some(Dtype::F32)) => {
            let a = flat.cast::<PyArray1<f32>>()?.readonly();
            let v: Vec<bf16> = a.as_slice()?.iter().map(|&x| bf16::from_f32(x)).collect();
            Ok((Dtype::Bf16, bytemuck::cast_slice(&v).to_vec()))
        }
        // Raw bf16 bit patterns.
        (Some(Dtype::Bf16), None) => Ok((Dtype::Bf16, raw_bytes(&flat)?)),
        (None, Some(h)) => Ok((h, raw_bytes(&flat)?)),
        (Some(w), Some(h)) if w == h => Ok((h, raw_bytes(&flat)?)),
        (Some(w), _) => Err(PyValueError::new_err(format!(
            "{what}: dtype={:?} does not match the array's {name} (only float32 data, or uint16 bit patterns, can be stored as bf16)",
            w.name()
        ))),
        (None, None) => Err(PyTypeError::new_err(format!(
            "{what}: a uint16 array is taken only with dtype='bf16' (as raw bf16 bit patterns)"
        ))),
    }
}

pub(super) fn raw_bytes(flat: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    let bytes = flat.call_method1("view", ("uint8",))?;
    let a = bytes.cast::<PyArray1<u8>>()?.readonly();
    Ok(a.as_slice()?.to_vec())
}

/// `bytes` reinterpreted as elements of `T` (copied, so alignment does not matter).
pub(super) fn pod_vec<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    let n = bytes.len() / std::mem::size_of::<T>();
    let mut v = vec![T::zeroed(); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut v)
        .copy_from_slice(&bytes[..n * std::mem::size_of::<T>()]);
    v
}

pub(super) fn typed_array<'py, T: numpy::Element + bytemuck::Pod>(
    py: Python<'py>,
    bytes: &[u8],
) -> Bound<'py, PyAny> {
    PyArray1::<T>::from_vec(py, pod_vec::<T>(bytes)).into_any()
}
