//! `CudaBackend`: device memory, copies, streams and the kernels of `cuda/` on an NVIDIA
//! GPU, through the CUDA driver API (cudarc, loaded at run time).
//!
//! Invariants:
//! - Construction never panics: the driver library is looked for before any other cudarc
//!   call (cudarc panics without it), and the whole start-up also runs under
//!   `catch_unwind`. A missing driver or device is [`BackendError::CudaUnavailable`].
//! - Every allocation is recorded in the ledger, and every copy, memset and kernel
//!   argument is checked against it before the driver sees the address.
//! - The kernels come from the fatbin that build.rs embeds; it is loaded once, when the
//!   backend is made, and every entry point is looked up then.
//! - Host-to-device and device-to-host copies return only when the host bytes are no
//!   longer needed (the stream is synchronised), so borrowed slices are never read late.

use super::launch::{Arg, DeviceRange, KernelLauncher, Shape, KERNEL_NAMES};
use crate::backend::{AllocationLedger, BackendError, DevicePtr, GpuBackend, DEFAULT_STREAM};
use crate::error::panic_message;
use cudarc::driver::{
    result, sys, CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};
use std::any::Any;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Every kernel in `cuda/*.cu`: SASS for sm_80 and sm_90, PTX for compute_80.
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/specdraft_kernels.fatbin"));

fn driver_error(op: &'static str) -> impl Fn(result::DriverError) -> BackendError {
    move |e| BackendError::Driver {
        op,
        message: e.to_string(),
    }
}

/// The kernels of `cuda/` on one NVIDIA GPU.
pub struct CudaBackend {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    functions: HashMap<&'static str, CudaFunction>,
    streams: Mutex<HashMap<u64, Arc<CudaStream>>>,
    next_stream: AtomicU64,
    ledger: AllocationLedger,
}

impl CudaBackend {
    /// Opens GPU `device` (0-based) and loads the kernels. Without a CUDA driver or without
    /// that device this returns [`BackendError::CudaUnavailable`] saying which; it never
    /// panics.
    pub fn new(device: usize) -> Result<CudaBackend, BackendError> {
        // SAFETY: only tries to open the library; no symbol of it is used.
        if !unsafe { sys::is_culib_present() } {
            return Err(BackendError::CudaUnavailable(
                "no CUDA driver (libcuda) found".to_string(),
            ));
        }
        catch_unwind(AssertUnwindSafe(|| Self::open(device))).unwrap_or_else(|panic| {
            let why = panic_message(panic.as_ref()).unwrap_or("unknown reason");
            Err(BackendError::CudaUnavailable(format!(
                "the CUDA driver failed to start: {why}"
            )))
        })
    }

    fn open(device: usize) -> Result<CudaBackend, BackendError> {
        let unavailable = |what: String| BackendError::CudaUnavailable(what);
        result::init()
            .map_err(|e| unavailable(format!("no CUDA device {device} (found 0): {e}")))?;
        let count = CudaContext::device_count()
            .map_err(|e| unavailable(format!("cannot count CUDA devices: {e}")))?;
        if device >= count.max(0) as usize {
            return Err(unavailable(format!(
                "no CUDA device {device} (found {count})"
            )));
        }
        let ctx = CudaContext::new(device)
            .map_err(|e| unavailable(format!("cannot open CUDA device {device}: {e}")))?;
        // The backend orders its own streams; cudarc's per-buffer events would only cost.
        // SAFETY: no cudarc-managed buffers exist in this context yet.
        unsafe { ctx.disable_event_tracking() };
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(FATBIN.to_vec()))
            .map_err(|e| {
                unavailable(format!(
                    "CUDA device {device} cannot load the kernels (sm_80/sm_90 SASS, compute_80 PTX): {e}"
                ))
            })?;
        let mut functions = HashMap::new();
        for name in KERNEL_NAMES {
            let f = module.load_function(name).map_err(|e| {
                unavailable(format!("kernel {name} is missing from the fatbin: {e}"))
            })?;
            functions.insert(name, f);
        }
        let mut streams = HashMap::new();
        streams.insert(DEFAULT_STREAM, ctx.default_stream());
        Ok(CudaBackend {
            ordinal: device,
            ctx,
            functions,
            streams: Mutex::new(streams),
            next_stream: AtomicU64::new(1),
            ledger: AllocationLedger::new(),
        })
    }

    /// The 0-based device ordinal this backend opened.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name as the driver reports it.
    pub fn device_name(&self) -> Result<String, BackendError> {
        self.ctx.name().map_err(driver_error("device name"))
    }

    /// `(free, total)` device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize), BackendError> {
        self.bind()?;
        self.ctx.mem_get_info().map_err(driver_error("memory info"))
    }

    fn bind(&self) -> Result<(), BackendError> {
        self.ctx
            .bind_to_thread()
            .map_err(driver_error("bind context"))
    }

    fn stream(&self, id: u64) -> Result<Arc<CudaStream>, BackendError> {
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
            .ok_or(BackendError::UnknownStream(id))
    }
}

impl KernelLauncher for CudaBackend {
    fn resolve(
        &self,
        ptr: DevicePtr,
        nbytes: usize,
        what: &str,
    ) -> Result<DeviceRange, BackendError> {
        self.ledger.check_range(ptr, nbytes, what)?;
        Ok(DeviceRange::new(ptr.0, None))
    }

    fn launch(
        &self,
        kernel: &'static str,
        shape: Shape,
        args: &[Arg],
        stream: u64,
    ) -> Result<(), BackendError> {
        let stream = self.stream(stream)?;
        let func = self
            .functions
            .get(kernel)
            .ok_or_else(|| BackendError::Driver {
                op: kernel,
                message: "no such kernel in the fatbin".to_string(),
            })?;
        self.bind()?;
        let mut builder = stream.launch_builder(func);
        for arg in args {
            match arg {
                Arg::Ptr(p) => builder.arg(p),
                Arg::I32(i) => builder.arg(i),
                Arg::F32(f) => builder.arg(f),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: shape.grid,
            block_dim: shape.block,
            shared_mem_bytes: 0,
        };
        // SAFETY: the argument list matches the kernel's C signature (the emulated tests
        // check every launch's type codes) and every pointer was checked against the
        // ledger for the range the kernel touches.
        unsafe { builder.launch(cfg) }.map_err(driver_error(kernel))?;
        Ok(())
    }
}

impl GpuBackend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn ledger(&self) -> &AllocationLedger {
        &self.ledger
    }

    fn alloc(&self, nbytes: usize, tag: &str) -> Result<DevicePtr, BackendError> {
        if nbytes == 0 {
            return Err(BackendError::ZeroSizedAlloc {
                tag: tag.to_string(),
            });
        }
        self.bind()?;
        // SAFETY: a plain allocation in the bound context.
        let ptr = unsafe { result::malloc_sync(nbytes) }.map_err(|e| {
            if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                BackendError::OutOfMemory {
                    requested: nbytes,
                    tag: tag.to_string(),
                    live_bytes: self.ledger.live_bytes(),
                    live_count: self.ledger.live_count(),
                }
            } else {
                driver_error("alloc")(e)
            }
        })?;
        // SAFETY: `ptr` is the start of `nbytes` just allocated.
        if let Err(e) = unsafe { result::memset_d8_sync(ptr, 0, nbytes) } {
            // SAFETY: freeing what was just allocated and never handed out.
            let _ = unsafe { result::free_sync(ptr) };
            return Err(driver_error("alloc (zeroing)")(e));
        }
        self.ledger.record_alloc(DevicePtr(ptr), nbytes, tag);
        Ok(DevicePtr(ptr))
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), BackendError> {
        self.ledger.check_free(ptr)?;
        self.bind()?;
        // SAFETY: the ledger says `ptr` is a live allocation of this backend.
        unsafe { result::free_sync(ptr.0) }.map_err(driver_error("free"))?;
        self.ledger.record_free(ptr)?;
        Ok(())
    }

    fn copy_htod(&self, dst: DevicePtr, src: &[u8], stream: u64) -> Result<(), BackendError> {
        let s = self.stream(stream)?;
        self.ledger.check_range(dst, src.len(), "copy to device")?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: checked range; the stream is synchronised before `src` is released.
        unsafe { result::memcpy_htod_async(dst.0, src, s.cu_stream()) }
            .map_err(driver_error("copy to device"))?;
        s.synchronize().map_err(driver_error("copy to device"))
    }

    fn copy_dtoh(&self, dst: &mut [u8], src: DevicePtr, stream: u64) -> Result<(), BackendError> {
        let s = self.stream(stream)?;
        self.ledger.check_range(src, dst.len(), "copy to host")?;
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: checked range; the stream is synchronised before `dst` is released.
        unsafe { result::memcpy_dtoh_async(dst, src.0, s.cu_stream()) }
            .map_err(driver_error("copy to host"))?;
        s.synchronize().map_err(driver_error("copy to host"))
    }

    fn copy_dtod(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        nbytes: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        let s = self.stream(stream)?;
        self.ledger
            .check_range(src, nbytes, "device-to-device copy (source)")?;
        self.ledger
            .check_range(dst, nbytes, "device-to-device copy (destination)")?;
        if nbytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both ranges checked; cuMemcpy handles overlapping device ranges.
        unsafe { result::memcpy_dtod_async(dst.0, src.0, nbytes, s.cu_stream()) }
            .map_err(driver_error("device-to-device copy"))
    }

    fn memset(
        &self,
        dst: DevicePtr,
        value: u8,
        nbytes: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        let s = self.stream(stream)?;
        self.ledger.check_range(dst, nbytes, "memset")?;
        if nbytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: checked range.
        unsafe { result::memset_d8_async(dst.0, value, nbytes, s.cu_stream()) }
            .map_err(driver_error("memset"))
    }

    fn create_stream(&self) -> Result<u64, BackendError> {
        let stream = self
            .ctx
            .new_stream()
            .map_err(driver_error("create stream"))?;
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, stream);
        Ok(id)
    }

    fn destroy_stream(&self, stream: u64) -> Result<(), BackendError> {
        if stream == DEFAULT_STREAM {
            return Err(BackendError::UnknownStream(stream));
        }
        let removed = self
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&stream);
        match removed {
            // Dropping the last handle destroys the stream once its work is done.
            Some(s) => s.synchronize().map_err(driver_error("destroy stream")),
            None => Err(BackendError::UnknownStream(stream)),
        }
    }

    fn synchronize(&self, stream: u64) -> Result<(), BackendError> {
        self.stream(stream)?
            .synchronize()
            .map_err(driver_error("synchronize"))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
