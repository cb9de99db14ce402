//! `specdraft.DevicePtr`: the Python face of [`crate::backend::DevicePtr`].
//!
//! It is frozen and hashable, like the Rust value it wraps: a bare address that means
//! something only together with the backend that produced it. Wherever the bindings take a
//! pointer they also accept a plain non-negative `int` (see [`PtrArg`]).

use crate::backend::DevicePtr;
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyInt;
use pyo3::Borrowed;

/// `DevicePtr(value=0)`: an address in a backend's device memory (frozen, hashable,
/// ordered). Wherever specdraft takes a pointer it also takes a plain non-negative `int`.
#[pyclass(
    name = "DevicePtr",
    module = "specdraft",
    frozen,
    eq,
    hash,
    ord,
    from_py_object
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PyDevicePtr(pub DevicePtr);

#[pymethods]
impl PyDevicePtr {
    #[new]
    #[pyo3(signature = (value = 0))]
    fn new(value: u64) -> Self {
        PyDevicePtr(DevicePtr(value))
    }

    /// The null address.
    #[classattr]
    #[pyo3(name = "NULL")]
    fn null() -> Self {
        PyDevicePtr(DevicePtr::NULL)
    }

    /// The raw address.
    #[getter]
    fn value(&self) -> u64 {
        self.0 .0
    }

    /// Whether this is `DevicePtr.NULL`.
    fn is_null(&self) -> bool {
        self.0.is_null()
    }

    /// The address `nbytes` further on (not bounds-checked here; the backend checks on use).
    fn offset(&self, nbytes: u64) -> PyResult<Self> {
        self.0
             .0
            .checked_add(nbytes)
            .map(|v| PyDevicePtr(DevicePtr(v)))
            .ok_or_else(|| {
                PyOverflowError::new_err(format!(
                    "DevicePtr {} + {nbytes} overflows a 64-bit address",
                    self.0
                ))
            })
    }

    fn __int__(&self) -> u64 {
        self.0 .0
    }

    fn __index__(&self) -> u64 {
        self.0 .0
    }

    fn __bool__(&self) -> bool {
        !self.0.is_null()
    }

    fn __repr__(&self) -> String {
        format!("DevicePtr({:#x})", self.0 .0)
    }
}

/// A pointer argument: a `DevicePtr` or a non-negative `int`.
#[derive(Clone, Copy)]
pub struct PtrArg(pub DevicePtr);

impl<'a, 'py> FromPyObject<'a, 'py> for PtrArg {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(p) = obj.cast::<PyDevicePtr>() {
            return Ok(PtrArg(p.get().0));
        }
        if obj.is_instance_of::<PyInt>() {
            return obj
                .extract::<u64>()
                .map(|v| PtrArg(DevicePtr(v)))
                .map_err(|_| {
                    let r = obj.repr().map(|r| r.to_string()).unwrap_or_default();
                    PyOverflowError::new_err(format!(
                        "{r} is not a device address (expected 0 <= address < 2**64)"
                    ))
                });
        }
        let ty = obj
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".into());
        Err(PyTypeError::new_err(format!(
            "expected a specdraft.DevicePtr or an int address, got {ty}"
        )))
    }
}

/// A Python `DevicePtr` for `p`.
pub fn py_ptr(py: Python<'_>, p: DevicePtr) -> PyResult<Bound<'_, PyDevicePtr>> {
    Bound::new(py, PyDevicePtr(p))
}
