//! `specdraft.Backend` / `specdraft.CpuBackend`: device memory as numpy arrays.
//!
//! A Python backend object wraps either an owned `Arc<dyn GpuBackend>` (one the user
//! created, or one a `ForwardContext` shares) or a *lease*: a `&dyn GpuBackend` that a Rust
//! caller lent to a Python proposer for the length of one call. A lease is cleared when the
//! call returns, after which every method raises instead of touching freed memory.
//!
//! A process-wide registry maps backend addresses to the Python objects that wrap them
//! (weakly), so a backend the user created reaches their proposer as the very same object.
//! The registry lock is held only for map operations, never while calling Python.

use super::arrays::{array_bytes, dtype_arg, pod_vec, shape_arg, typed_array};
use super::device_ptr::{py_ptr, PtrArg, PyDevicePtr};
use super::errors::{request_error, BackendUnavailableError, IntoPyResult};
use crate::backend::{BackendError, CpuBackend, Dtype, GpuBackend, DEFAULT_STREAM};
use half::bf16;
use numpy::PyArray1;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyTuple, PyWeakrefMethods, PyWeakrefReference};
use std::sync::{Arc, Mutex, RwLock, Weak};

/// A `&dyn GpuBackend` with its lifetime erased; only dereferenced while its lease is open.
#[derive(Clone, Copy)]
struct RawGpu(*const dyn GpuBackend);

// SAFETY: the pointee is `Send + Sync` (a `GpuBackend`); the pointer is only dereferenced
// while the lease that owns it is open, i.e. while the borrow it came from is alive.
unsafe impl Send for RawGpu {}
unsafe impl Sync for RawGpu {}

/// The slot a leased backend handle reads its pointer from.
pub struct LeaseSlot {
    gpu: RwLock<Option<RawGpu>>,
    name: String,
}

/// What a Python backend object stands for.
pub enum BackendRef {
    /// A backend kept alive by this object.
    Owned(Arc<dyn GpuBackend>),
    /// A backend lent for one call.
    Leased(Arc<LeaseSlot>),
}

/// A GPU backend: device memory, copies, and the allocation ledger.
///
/// Instances come from `CpuBackend()` (or `CudaBackend(...)`). A backend lent to a
/// proposer for one call by a Rust caller is a `Backend` that raises
/// `BackendUnavailableError` when used after that call; a backend you created reaches
/// your proposer as itself.
#[pyclass(name = "Backend", module = "specdraft", subclass, frozen, weakref)]
pub struct PyBackend {
    pub inner: BackendRef,
}

/// `CpuBackend(memory_limit=None, threads=None)`: the CPU reference backend, host memory
/// behind the backend interface. `memory_limit` caps its live bytes the way a device's
/// memory would; `threads` (at least 1) sets how many threads its kernels run on, one per
/// core by default.
#[pyclass(name = "CpuBackend", module = "specdraft", extends = PyBackend, frozen)]
pub struct PyCpuBackend;

fn addr_of(gpu: &dyn GpuBackend) -> usize {
    gpu as *const dyn GpuBackend as *const () as usize
}

struct Entry {
    addr: usize,
    object: Py<PyWeakrefReference>,
    backend: Weak<dyn GpuBackend>,
}

static REGISTRY: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

fn registry() -> std::sync::MutexGuard<'static, Vec<Entry>> {
    // Every update is a single push/retain, so a poisoned lock still guards a valid list.
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records `obj` as the Python object of its (owned) backend.
fn register(obj: &Bound<'_, PyBackend>) -> PyResult<()> {
    let BackendRef::Owned(arc) = &obj.get().inner else {
        return Ok(());
    };
    let addr = addr_of(&**arc);
    let known = {
        let reg = registry();
        reg.iter()
            .find(|e| e.addr == addr)
            .map(|e| e.object.clone_ref(obj.py()))
    };
    if let Some(weak) = known {
        if weak.bind(obj.py()).upgrade().is_some_and(|o| o.is(obj)) {
            return Ok(());
        }
    }
    let weak = PyWeakrefReference::new(obj.as_any())?.unbind();
    let mut dropped = Vec::new();
    {
        let mut reg = registry();
        let mut i = 0;
        while i < reg.len() {
            let dead = reg[i].backend.strong_count() == 0;
            if dead || reg[i].addr == addr {
                dropped.push(reg.swap_remove(i));
            } else {
                i += 1;
            }
        }
        reg.push(Entry {
            addr,
            object: weak,
            backend: Arc::downgrade(arc),
        });
    }
    // Python references are released after the lock is let go.
    drop(dropped);
    Ok(())
}

/// The registered Python object of the backend at `gpu`, if it is still alive.
fn lookup<'py>(py: Python<'py>, gpu: &dyn GpuBackend) -> Option<Bound<'py, PyAny>> {
    let addr = addr_of(gpu);
    let found = {
        let reg = registry();
        reg.iter()
            .find(|e| e.addr == addr)
            .map(|e| (e.object.clone_ref(py), e.backend.clone()))
    };
    let (weak, backend) = found?;
    if let Some(obj) = weak.bind(py).upgrade() {
        return Some(obj);
    }
    // The Python wrapper died but the backend lives on (a model or engine holds it).
    let arc = backend.upgrade()?;
    owned_object(py, arc).ok()
}

/// A new Python object owning `arc` (a `CpuBackend` or `CudaBackend` when it is one),
/// registered.
fn owned_object(py: Python<'_>, arc: Arc<dyn GpuBackend>) -> PyResult<Bound<'_, PyAny>> {
    let is_cpu = arc.as_any().is::<CpuBackend>();
    let cuda = super::cuda_backend::PyCudaBackend::of(&*arc);
    let base = PyBackend {
        inner: BackendRef::Owned(arc),
    };
    if let Some(sub) = cuda {
        let obj: Bound<'_, PyBackend> =
            Bound::new(py, PyClassInitializer::from(base).add_subclass(sub))?.into_super();
        register(&obj)?;
        return Ok(obj.into_any());
    }
    let obj: Bound<'_, PyBackend> = if is_cpu {
        Bound::new(
            py,
            PyClassInitializer::from(base).add_subclass(PyCpuBackend),
        )?
        .into_super()
    } else {
        Bound::new(py, base)?
    };
    register(&obj)?;
    Ok(obj.into_any())
}

/// The best backend this build and machine offer: a `CudaBackend` on GPU 0 when the
/// package is built with feature `cuda` and a driver and device work, else a `CpuBackend`.
#[pyfunction]
pub fn default_backend(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let arc = py.detach(crate::backend::default_backend);
    owned_object(py, arc)
}

/// The Python object for a shared backend: the registered one, or a new owner.
pub fn backend_from_arc<'py>(
    py: Python<'py>,
    arc: &Arc<dyn GpuBackend>,
) -> PyResult<Bound<'py, PyAny>> {
    match lookup(py, &**arc) {
        Some(obj) => Ok(obj),
        None => owned_object(py, arc.clone()),
    }
}

/// A `&dyn GpuBackend` handed to Python for one call. Dropping it closes the lease, so a
/// handle Python kept raises instead of reaching a backend that may be gone.
pub struct BackendLease<'a> {
    gpu: &'a dyn GpuBackend,
    slot: Option<Arc<LeaseSlot>>,
}

impl<'a> BackendLease<'a> {
    /// A lease on `gpu` (nothing is created until Python needs an object).
    pub fn new(gpu: &'a dyn GpuBackend) -> Self {
        BackendLease { gpu, slot: None }
    }

    /// The Python object for the leased backend: the user's own object when the backend is
    /// registered, otherwise a handle valid until this lease is dropped.
    pub fn object<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        if let Some(obj) = lookup(py, self.gpu) {
            return Ok(obj);
        }
        // SAFETY: only the lifetime is erased; the pointer is cleared in `drop`, before the
        // borrow it came from ends, and every use goes through the slot's lock.
        let raw: *const (dyn GpuBackend + 'static) = unsafe {
            std::mem::transmute::<*const (dyn GpuBackend + '_), *const (dyn GpuBackend + 'static)>(
                self.gpu as *const dyn GpuBackend,
            )
        };
        let slot = Arc::new(LeaseSlot {
            gpu: RwLock::new(Some(RawGpu(raw))),
            name: self.gpu.name(),
        });
        self.slot = Some(slot.clone());
        Ok(Bound::new(
            py,
            PyBackend {
                inner: BackendRef::Leased(slot),
            },
        )?
        .into_any())
    }
}

impl Drop for BackendLease<'_> {
    fn drop(&mut self) {
        if let Some(slot) = &self.slot {
            *slot.gpu.write().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }
}

/// A backend argument from Python: the object, registered so Rust callers can hand it back.
pub fn backend_arg<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBackend>> {
    let b = obj.cast::<PyBackend>().map_err(|_| {
        PyTypeError::new_err(format!(
            "expected a specdraft backend (CpuBackend, ...), got {}",
            type_name(obj)
        ))
    })?;
    register(b)?;
    Ok(b.clone())
}

/// The Python type name of `obj`, for messages.
pub fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

impl PyBackend {
    /// [`Self::with`] on the concrete backend type `T` behind this object; `class` (the Python
    /// class, which is only ever built around a `T`) and `kind` name it in the error otherwise.
    pub fn with_concrete<T: 'static, R>(
        &self,
        class: &'static str,
        kind: &str,
        f: impl FnOnce(&T) -> PyResult<R>,
    ) -> PyResult<R> {
        self.with(|g| match g.as_any().downcast_ref::<T>() {
            Some(backend) => f(backend),
            None => Err(BackendError::InvalidArgument {
                op: class,
                message: format!("backend {} is not {kind} backend", g.name()),
            })
            .py(),
        })
    }

    /// Runs `f` on the backend; a closed lease raises.
    pub fn with<R>(&self, f: impl FnOnce(&dyn GpuBackend) -> PyResult<R>) -> PyResult<R> {
        match &self.inner {
            BackendRef::Owned(arc) => f(&**arc),
            BackendRef::Leased(slot) => {
                let guard = slot.gpu.read().unwrap_or_else(|e| e.into_inner());
                match *guard {
                    // SAFETY: the lease is open, so the borrow the pointer came from is alive.
                    Some(raw) => f(unsafe { &*raw.0 }),
                    None => Err(BackendUnavailableError::new_err(format!(
                        "this {} backend handle was lent to a proposer for one call and is no longer valid; \
                         keep the backend you created (or ctx.gpu) instead of the gpu argument",
                        slot.name
                    ))),
                }
            }
        }
    }

    /// The shared backend, when this object owns one.
    pub fn arc(&self) -> PyResult<Arc<dyn GpuBackend>> {
        match &self.inner {
            BackendRef::Owned(arc) => Ok(arc.clone()),
            BackendRef::Leased(slot) => Err(BackendUnavailableError::new_err(format!(
                "this {} backend handle is lent for one call and cannot be kept; use the backend you created",
                slot.name
            ))),
        }
    }
}

#[pymethods]
impl PyBackend {
    /// A short name: `"cpu"`, `"cuda:0"`.
    #[getter]
    fn name(&self) -> PyResult<String> {
        self.with(|g| Ok(g.name()))
    }

    /// Allocates `nbytes` zeroed bytes recorded under `tag`.
    #[pyo3(signature = (nbytes, tag = "python"))]
    fn alloc(&self, py: Python<'_>, nbytes: usize, tag: &str) -> PyResult<Py<PyDevicePtr>> {
        let p = self.with(|g| g.alloc(nbytes, tag).py())?;
        Ok(py_ptr(py, p)?.unbind())
    }

    /// Frees an allocation; a double free or an unknown pointer raises `AllocationError`.
    fn free(&self, ptr: PtrArg) -> PyResult<()> {
        self.with(|g| g.free(ptr.0).py())
    }

    /// Allocates a buffer holding `array`'s elements (flattened in C order).
    ///
    /// Arrays of float32, float16, uint32, int32 and uint8 are stored as they are;
    /// `dtype="bf16"` stores float32 data as bf16 (round to nearest even), or a uint16
    /// array as raw bf16 bit patterns.
    #[pyo3(signature = (array, tag = "python", dtype = None))]
    fn upload(
        &self,
        py: Python<'_>,
        array: &Bound<'_, PyAny>,
        tag: &str,
        dtype: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyDevicePtr>> {
        let want = dtype.map(dtype_arg).transpose()?;
        let (_, bytes) = array_bytes(array, want, "upload")?;
        let p = self.with(|g| {
            let p = g.alloc(bytes.len().max(1), tag).py()?;
            if let Err(e) = g.copy_htod(p, &bytes, DEFAULT_STREAM) {
                // Just allocated by us: the free cannot fail.
                let _ = g.free(p);
                return Err(e).py();
            }
            Ok(p)
        })?;
        Ok(py_ptr(py, p)?.unbind())
    }

    /// Writes `array`'s elements at `ptr` (bounds-checked; same dtypes as `upload`).
    #[pyo3(signature = (ptr, array, dtype = None))]
    fn write(
        &self,
        ptr: PtrArg,
        array: &Bound<'_, PyAny>,
        dtype: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let want = dtype.map(dtype_arg).transpose()?;
        let (_, bytes) = array_bytes(array, want, "write")?;
        self.with(|g| g.copy_htod(ptr.0, &bytes, DEFAULT_STREAM).py())
    }

    /// Reads `shape` elements of `dtype` at `ptr` into a new numpy array.
    ///
    /// bf16 comes back as float32, or as its uint16 bit patterns with `raw=True`. A range
    /// outside one live allocation raises `AllocationError`.
    #[pyo3(signature = (ptr, dtype, shape, raw = false))]
    fn download<'py>(
        &self,
        py: Python<'py>,
        ptr: PtrArg,
        dtype: &Bound<'py, PyAny>,
        shape: &Bound<'py, PyAny>,
        raw: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let dtype = dtype_arg(dtype)?;
        let shape = shape_arg(shape)?;
        let nbytes = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| PyValueError::new_err(format!("download: shape {shape:?} overflows")))?;
        let bytes = self.with(|g| {
            // Checked before the host buffer exists, so a huge out-of-bounds shape raises
            // instead of exhausting host memory.
            g.ledger().check_range(ptr.0, nbytes, "download").py()?;
            let mut bytes = vec![0u8; nbytes];
            g.copy_dtoh(&mut bytes, ptr.0, DEFAULT_STREAM).py()?;
            Ok(bytes)
        })?;
        let flat = match dtype {
            Dtype::Bf16 if raw => typed_array::<u16>(py, &bytes),
            Dtype::Bf16 => {
                let v: Vec<f32> = pod_vec::<u16>(&bytes)
                    .into_iter()
                    .map(|b| bf16::from_bits(b).to_f32())
                    .collect();
                PyArray1::from_vec(py, v).into_any()
            }
            Dtype::F16 => typed_array::<u16>(py, &bytes).call_method1("view", ("float16",))?,
            Dtype::F32 => typed_array::<f32>(py, &bytes),
            Dtype::U32 => typed_array::<u32>(py, &bytes),
            Dtype::I32 => typed_array::<i32>(py, &bytes),
            // numpy has no FP8 dtype: its bytes come back as they are.
            Dtype::U8 | Dtype::F8E4M3 => typed_array::<u8>(py, &bytes),
        };
        flat.call_method1("reshape", (PyTuple::new(py, &shape)?,))
    }

    /// Waits until the work queued on `stream` is done.
    #[pyo3(signature = (stream = 0))]
    fn synchronize(&self, stream: u64) -> PyResult<()> {
        self.with(|g| g.synchronize(stream).py())
    }

    /// Number of live allocations.
    #[getter]
    fn live_allocs(&self) -> PyResult<usize> {
        self.with(|g| Ok(g.ledger().live_count()))
    }

    /// Bytes in live allocations.
    #[getter]
    fn live_bytes(&self) -> PyResult<usize> {
        self.with(|g| Ok(g.ledger().live_bytes()))
    }

    /// Every live allocation as `(ptr, nbytes, tag)`, in address order.
    fn live_report(&self) -> PyResult<Vec<(PyDevicePtr, usize, String)>> {
        self.with(|g| {
            Ok(g.ledger()
                .live_report()
                .into_iter()
                .map(|a| (PyDevicePtr(a.ptr), a.nbytes, a.tag))
                .collect())
        })
    }

    fn __repr__(&self) -> String {
        match &self.inner {
            BackendRef::Owned(a) => format!(
                "<specdraft backend {} ({} live allocations)>",
                a.name(),
                a.ledger().live_count()
            ),
            BackendRef::Leased(s) => format!("<specdraft backend {} (lent for one call)>", s.name),
        }
    }
}

#[pymethods]
impl PyCpuBackend {
    #[new]
    #[pyo3(signature = (memory_limit = None, threads = None))]
    fn new(
        memory_limit: Option<usize>,
        threads: Option<usize>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let backend = match memory_limit {
            Some(n) => CpuBackend::with_memory_limit(n),
            None => CpuBackend::new(),
        };
        let backend = match threads {
            Some(0) => return Err(request_error("threads must be at least 1")),
            Some(n) => backend.on_threads(n),
            None => backend,
        };
        Ok(PyClassInitializer::from(PyBackend {
            inner: BackendRef::Owned(Arc::new(backend)),
        })
        .add_subclass(PyCpuBackend))
    }

    /// Threads its kernels run on, the calling thread included: one per core by default.
    #[getter]
    fn threads(slf: &Bound<'_, Self>) -> PyResult<usize> {
        slf.as_super()
            .get()
            .with_concrete("CpuBackend", "a CPU", |cpu: &CpuBackend| {
                Ok(cpu.kernel_pool().threads())
            })
    }

    /// The instruction set its kernels run on, the fastest this CPU has:
    /// `"avx512-vnni"`, `"avx2-vnni"`, `"avx2"` or `"portable"` (every one gives the same
    /// bits; AMX tiles, slower than AVX-512 VNNI on a forward's calls, are not used).
    #[getter]
    fn instruction_set(slf: &Bound<'_, Self>) -> PyResult<&'static str> {
        slf.as_super()
            .get()
            .with_concrete("CpuBackend", "a CPU", |cpu: &CpuBackend| {
                Ok(cpu.kernel_pool().isa().name())
            })
    }
}
