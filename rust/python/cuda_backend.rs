//! `specdraft.CudaBackend`: the kernels of `cuda/` on an NVIDIA GPU, as a `Backend`
//! subclass.
//!
//! The class exists in every build, so code can name it unconditionally: built with
//! feature `cuda`, the object is a [`PyBackend`] owning an `Arc<CudaBackend>`, and every
//! `Backend` method (upload, download, the ledger) and every Rust caller that takes a
//! backend works on it unchanged; built without it, construction raises
//! `BackendUnavailableError` saying so. A machine without a CUDA driver or without the
//! asked-for device raises the same error carrying the Rust message; construction never
//! panics.

#[cfg(feature = "cuda")]
use super::backend::BackendRef;
use super::backend::PyBackend;
use super::errors::IntoPyResult;
#[cfg(not(feature = "cuda"))]
use crate::backend::BackendError;
#[cfg(feature = "cuda")]
use crate::backend::CudaBackend;
use crate::backend::GpuBackend;
use pyo3::prelude::*;
#[cfg(feature = "cuda")]
use std::sync::Arc;

/// `CudaBackend(device=0)`: an NVIDIA GPU running the kernels compiled into the package.
///
/// Opens GPU `device` (0-based) and loads the kernels. Raises `BackendUnavailableError`
/// when there is no CUDA driver, no such device, or the package was built without CUDA.
#[pyclass(name = "CudaBackend", module = "specdraft", extends = PyBackend, frozen)]
pub struct PyCudaBackend {
    device: usize,
}

/// The error of a build without CUDA.
#[cfg(not(feature = "cuda"))]
fn not_built() -> BackendError {
    BackendError::CudaUnavailable(
        "this build of specdraft has no CUDA support (it was built without the `cuda` feature); \
         install a wheel built with it, or use CpuBackend"
            .into(),
    )
}

impl PyCudaBackend {
    /// The subclass for `gpu` when it is a CUDA backend, so a backend that Rust hands back
    /// to Python keeps its Python type.
    pub fn of(gpu: &dyn GpuBackend) -> Option<PyCudaBackend> {
        #[cfg(feature = "cuda")]
        {
            gpu.as_any()
                .downcast_ref::<CudaBackend>()
                .map(|c| PyCudaBackend {
                    device: c.ordinal(),
                })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = gpu;
            None
        }
    }

    #[cfg(feature = "cuda")]
    fn with_cuda<R>(
        slf: &Bound<'_, Self>,
        f: impl FnOnce(&CudaBackend) -> PyResult<R>,
    ) -> PyResult<R> {
        // Only `new` and `of` build this class, both around a CudaBackend.
        slf.as_super()
            .get()
            .with_concrete("CudaBackend", "a CUDA", f)
    }
}

#[pymethods]
impl PyCudaBackend {
    #[new]
    #[pyo3(signature = (device = 0))]
    fn new(py: Python<'_>, device: usize) -> PyResult<PyClassInitializer<Self>> {
        #[cfg(feature = "cuda")]
        {
            // Driver start-up and module loading can take a while; other threads may run.
            let backend = py.detach(|| CudaBackend::new(device)).py()?;
            Ok(PyClassInitializer::from(PyBackend {
                inner: BackendRef::Owned(Arc::new(backend)),
            })
            .add_subclass(PyCudaBackend { device }))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (py, device);
            Err(not_built()).py()
        }
    }

    /// The 0-based device ordinal.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    /// The device's name as the driver reports it.
    #[getter]
    fn device_name(slf: &Bound<'_, Self>) -> PyResult<String> {
        #[cfg(feature = "cuda")]
        {
            Self::with_cuda(slf, |c| c.device_name().py())
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = slf;
            Err(not_built()).py()
        }
    }

    /// `(free, total)` device memory in bytes.
    fn memory_info(slf: &Bound<'_, Self>) -> PyResult<(usize, usize)> {
        #[cfg(feature = "cuda")]
        {
            Self::with_cuda(slf, |c| c.memory_info().py())
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = slf;
            Err(not_built()).py()
        }
    }
}
