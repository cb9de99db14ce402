//! `specdraft.CudaBackend` (feature `cuda`): the kernels of `cuda/` on an NVIDIA GPU, as a
//! `Backend` subclass.
//!
//! The object is a [`PyBackend`] owning an `Arc<CudaBackend>`, so every `Backend` method
//! (upload, download, the ledger) and every Rust caller that takes a backend works on it
//! unchanged. A machine without a CUDA driver or without the asked-for device raises
//! `BackendUnavailableError` carrying the Rust message; construction never panics.

use super::backend::{BackendRef, PyBackend};
use super::errors::IntoPyResult;
use crate::backend::{CudaBackend, GpuBackend};
use pyo3::prelude::*;
use std::sync::Arc;

/// An NVIDIA GPU behind the backend interface.
#[pyclass(name = "CudaBackend", module = "specdraft", extends = PyBackend, frozen)]
pub struct PyCudaBackend {
    device: usize,
}

impl PyCudaBackend {
    /// The subclass for `gpu` when it is a [`CudaBackend`], so a backend that Rust hands
    /// back to Python keeps its Python type.
    pub fn of(gpu: &dyn GpuBackend) -> Option<PyCudaBackend> {
        gpu.as_any()
            .downcast_ref::<CudaBackend>()
            .map(|c| PyCudaBackend {
                device: c.ordinal(),
            })
    }

    fn with_cuda<R>(
        slf: &Bound<'_, Self>,
        f: impl FnOnce(&CudaBackend) -> PyResult<R>,
    ) -> PyResult<R> {
        slf.as_super()
            .get()
            .with(|g| match g.as_any().downcast_ref::<CudaBackend>() {
                Some(cuda) => f(cuda),
                // Only `new` and `of` build this class, both around a CudaBackend.
                None => Err(super::errors::SpecdraftError::new_err(format!(
                    "backend {} is not a CUDA backend",
                    g.name()
                ))),
            })
    }
}

#[pymethods]
impl PyCudaBackend {
    /// Opens GPU `device` (0-based) and loads the kernels.
    #[new]
    #[pyo3(signature = (device = 0))]
    fn new(py: Python<'_>, device: usize) -> PyResult<PyClassInitializer<Self>> {
        // Driver start-up and module loading can take a while; other threads may run.
        let backend = py.detach(|| CudaBackend::new(device)).py()?;
        Ok(PyClassInitializer::from(PyBackend {
            inner: BackendRef::Owned(Arc::new(backend)),
        })
        .add_subclass(PyCudaBackend { device }))
    }

    /// The 0-based device ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    /// The device's name as the driver reports it.
    #[getter]
    fn device_name(slf: &Bound<'_, Self>) -> PyResult<String> {
        Self::with_cuda(slf, |c| c.device_name().py())
    }

    /// `(free, total)` device memory in bytes.
    fn memory_info(slf: &Bound<'_, Self>) -> PyResult<(usize, usize)> {
        Self::with_cuda(slf, |c| c.memory_info().py())
    }
}
