//! `CpuBackend`: host memory behind the `GpuBackend` trait, and the reference for every kernel.
//!
//! Invariants:
//! - Addresses come from a private, monotonically growing range that starts well above 0 and
//!   is never reused, so a stale `DevicePtr` can never alias a newer allocation.
//! - Host views of device memory are handed out only through the ledger's range check: a
//!   kernel or copy can never read or write outside one live allocation.
//! - Every stream runs in order on the caller's thread: work is done when a call returns.
//!
//! The kernels are in `kernels` (the reference of every op), `linear` (the fast
//! matrix product, with the FP8 weight rows in `fp8`), `attention` (the fast paged
//! attention), `elementwise` (RMSNorm, the element-wise ops and RoPE) and `top_k` (a draft
//! tree's children), the scalar decoders of the weight formats in `formats`.
//!
//! Threads: the backend owns one [`KernelPool`] (one participant per core, the calling
//! thread included), made on the first op that needs it; every parallel op (linear in any
//! weight format, attention, the small ops when a call is large) runs on it and on nothing
//! else, so the kernels never compete with another pool's threads for the cores.

mod argmax;
mod attention;
mod elementwise;
mod formats;
mod fp8;
mod grouped;
mod kernels;
mod linear;
mod mla;
mod rope_angles;
mod shared_out;
mod top_k;

pub use argmax::argmax;
pub(crate) use attention::math::exp_nonpositive;
pub use formats::{e2m1_to_f32, fp8_e4m3_to_f32, E2M1_VALUES};

use crate::backend::kernels::CheckedMemory;
use crate::backend::quant::KernelPool;
use crate::backend::{AllocationLedger, BackendError, DevicePtr, GpuBackend};
use rustc_hash::FxHashMap;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::any::Any;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Alignment of every CPU allocation (a cache line; enough for any element type).
const ALIGN: usize = 64;
/// First address handed out; leaves room so that small integers are never valid pointers.
const BASE_ADDR: u64 = 0x1_0000_0000;

/// One host allocation standing in for device memory.
pub(crate) struct HostBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain bytes owned by this struct; concurrent access is governed by
// the same rules as device memory (the caller orders its streams).
unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    fn new(len: usize) -> Option<HostBuffer> {
        let layout = Layout::from_size_align(len.max(1), ALIGN).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        (!ptr.is_null()).then_some(HostBuffer { ptr, len })
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len.max(1), ALIGN)
            .expect("layout was valid at allocation");
        // SAFETY: `ptr` came from `alloc_zeroed` with this layout.
        unsafe { dealloc(self.ptr, layout) }
    }
}

/// A bounds-checked window into one CPU allocation. It keeps the allocation alive, so a
/// concurrent `free` cannot leave it dangling.
pub struct HostView {
    buffer: Arc<HostBuffer>,
    offset: usize,
    len: usize,
}

impl HostView {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Raw pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        // SAFETY: offset <= buffer.len, checked when the view was made.
        unsafe { self.buffer.ptr.add(self.offset) }
    }

    /// The bytes, read-only.
    ///
    /// # Safety
    /// No other view may write to the same bytes while the slice lives (the device-memory
    /// rule: the caller orders its work).
    pub unsafe fn bytes(&self) -> &[u8] {
        std::slice::from_raw_parts(self.as_ptr(), self.len)
    }

    /// The bytes, writable.
    ///
    /// # Safety
    /// No other view may read or write the same bytes while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.as_ptr(), self.len)
    }

    /// The view as elements of `T` (its length must be a multiple of `T`'s size and the
    /// address aligned for `T`).
    ///
    /// # Safety
    /// As [`HostView::bytes`].
    pub unsafe fn typed<T: bytemuck::Pod>(&self) -> &[T] {
        bytemuck::cast_slice(self.bytes())
    }

    /// The view as writable elements of `T`.
    ///
    /// # Safety
    /// As [`HostView::bytes_mut`].
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn typed_mut<T: bytemuck::Pod>(&self) -> &mut [T] {
        bytemuck::cast_slice_mut(self.bytes_mut())
    }
}

/// Host memory behind the `GpuBackend` trait; always built, and the reference for kernels.
pub struct CpuBackend {
    ledger: AllocationLedger,
    /// Every op looks its operands up here, so the hash is a cheap one (keys are addresses
    /// this backend chose, never attacker-controlled).
    buffers: Mutex<FxHashMap<u64, Arc<HostBuffer>>>,
    next_addr: AtomicU64,
    streams: Mutex<HashSet<u64>>,
    next_stream: AtomicU64,
    memory_limit: Option<usize>,
    faults: AllocFaults,
    pool: OnceLock<KernelPool>,
    threads: Option<usize>,
    rope: rope_angles::RopeCache,
}

/// Injected allocation failures, for tests of what a full device does to a caller: the
/// attempt numbered `first`, then every `every`-th after it (0: only `first`), fails.
struct AllocFaults {
    attempts: AtomicU64,
    first: AtomicU64,
    every: AtomicU64,
    injected: AtomicU64,
}

impl AllocFaults {
    /// Counts an attempt; true when it is to fail.
    fn hit(&self) -> bool {
        let k = self.attempts.fetch_add(1, Ordering::Relaxed);
        let first = self.first.load(Ordering::Relaxed);
        let every = self.every.load(Ordering::Relaxed);
        let fail = k >= first && (k == first || (every > 0 && (k - first).is_multiple_of(every)));
        if fail {
            self.injected.fetch_add(1, Ordering::Relaxed);
        }
        fail
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// A CPU backend limited only by host memory.
    pub fn new() -> Self {
        CpuBackend {
            ledger: AllocationLedger::new(),
            buffers: Mutex::new(FxHashMap::default()),
            next_addr: AtomicU64::new(BASE_ADDR),
            streams: Mutex::new(HashSet::new()),
            next_stream: AtomicU64::new(1),
            memory_limit: None,
            faults: AllocFaults {
                attempts: AtomicU64::new(0),
                first: AtomicU64::new(u64::MAX),
                every: AtomicU64::new(0),
                injected: AtomicU64::new(0),
            },
            pool: OnceLock::new(),
            threads: None,
            rope: rope_angles::RopeCache::default(),
        }
    }

    /// A CPU backend whose kernels run on `threads` threads (the caller's included) rather
    /// than one per core.
    pub fn with_threads(threads: usize) -> Self {
        CpuBackend {
            threads: Some(threads.max(1)),
            ..Self::new()
        }
    }

    /// A CPU backend for one of `processes` processes sharing this machine's cores (ranks
    /// launched together on one host): its kernels run on cores / `processes` threads, at
    /// least 1, so the processes together run one kernel thread a core. One pool per core
    /// in every process would put several threads on each core, and the ranks' collectives
    /// would wait on whichever rank the scheduler left behind.
    pub fn sharing_cores(processes: usize) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_threads(cores / processes.max(1))
    }

    /// The same backend with its kernels on `threads` threads (the caller's included).
    pub fn on_threads(self, threads: usize) -> Self {
        CpuBackend {
            threads: Some(threads.max(1)),
            ..self
        }
    }

    /// A CPU backend whose kernels run on `pool` (for instance one limited to the portable
    /// instruction set, to compare it with the default).
    pub fn with_kernel_pool(pool: KernelPool) -> Self {
        let backend = Self::new();
        let _ = backend.pool.set(pool);
        backend
    }

    /// The pool every parallel kernel of this backend runs on.
    pub fn kernel_pool(&self) -> &KernelPool {
        self.pool.get_or_init(|| match self.threads {
            Some(n) => KernelPool::new(n),
            None => KernelPool::per_core(),
        })
    }

    /// Makes allocation attempt `first` (counted from this backend's creation, see
    /// [`CpuBackend::alloc_attempts`]) fail as an out-of-memory device would, then every
    /// `every`-th attempt after it (0: only that one). For fault-injection tests.
    pub fn inject_alloc_failures(&self, first: u64, every: u64) {
        self.faults.every.store(every, Ordering::Relaxed);
        self.faults.first.store(first, Ordering::Relaxed);
    }

    /// Stops injecting allocation failures.
    pub fn clear_alloc_failures(&self) {
        self.faults.first.store(u64::MAX, Ordering::Relaxed);
    }

    /// Allocation attempts so far, failed ones included.
    pub fn alloc_attempts(&self) -> u64 {
        self.faults.attempts.load(Ordering::Relaxed)
    }

    /// Allocation failures injected so far.
    pub fn injected_alloc_failures(&self) -> u64 {
        self.faults.injected.load(Ordering::Relaxed)
    }

    /// A CPU backend that refuses to hold more than `bytes` live bytes, as a device would.
    pub fn with_memory_limit(bytes: usize) -> Self {
        CpuBackend {
            memory_limit: Some(bytes),
            ..Self::new()
        }
    }

    /// A bounds-checked view of `nbytes` at `ptr`; `what` names the caller in errors.
    pub fn view(
        &self,
        ptr: DevicePtr,
        nbytes: usize,
        what: &str,
    ) -> Result<HostView, BackendError> {
        let (base, offset) = self.ledger.check_range(ptr, nbytes, what)?;
        let buffer = self
            .buffers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&base.0)
            .cloned()
            .ok_or(BackendError::UnknownPointer { ptr: base })?;
        Ok(HostView {
            buffer,
            offset,
            len: nbytes,
        })
    }

    fn check_stream(&self, stream: u64) -> Result<(), BackendError> {
        if stream == crate::backend::DEFAULT_STREAM
            || self
                .streams
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&stream)
        {
            Ok(())
        } else {
            Err(BackendError::UnknownStream(stream))
        }
    }
}

impl CheckedMemory for CpuBackend {
    type Range = HostView;

    fn checked_range(
        &self,
        ptr: DevicePtr,
        nbytes: usize,
        what: &str,
    ) -> Result<HostView, BackendError> {
        self.view(ptr, nbytes, what)
    }

    fn read_u32(
        &self,
        range: &HostView,
        _ptr: DevicePtr,
        n: usize,
        _stream: u64,
    ) -> Result<Vec<u32>, BackendError> {
        // SAFETY: a checked range, read before the op writes anything; the copy goes through
        // bytes, so the address needs no alignment.
        let bytes = unsafe { range.bytes() };
        match bytes.get(..n.saturating_mul(4)) {
            Some(b) => Ok(b
                .chunks_exact(4)
                .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
                .collect()),
            None => Err(BackendError::InvalidArgument {
                op: "read_u32",
                message: format!("{n} values do not fit a range of {} bytes", bytes.len()),
            }),
        }
    }
}

impl GpuBackend for CpuBackend {
    fn name(&self) -> String {
        "cpu".to_string()
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
        let oom = || BackendError::OutOfMemory {
            requested: nbytes,
            tag: tag.to_string(),
            live_bytes: self.ledger.live_bytes(),
            live_count: self.ledger.live_count(),
        };
        if self.faults.hit() {
            return Err(oom());
        }
        if let Some(limit) = self.memory_limit {
            if self.ledger.live_bytes().saturating_add(nbytes) > limit {
                return Err(oom());
            }
        }
        let buffer = HostBuffer::new(nbytes).ok_or_else(oom)?;
        let stride = (nbytes as u64).div_ceil(ALIGN as u64) * ALIGN as u64 + ALIGN as u64;
        let addr = self.next_addr.fetch_add(stride, Ordering::Relaxed);
        self.buffers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(addr, Arc::new(buffer));
        self.ledger.record_alloc(DevicePtr(addr), nbytes, tag);
        Ok(DevicePtr(addr))
    }

    fn free(&self, ptr: DevicePtr) -> Result<(), BackendError> {
        self.ledger.record_free(ptr)?;
        self.buffers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&ptr.0);
        Ok(())
    }

    fn copy_htod(&self, dst: DevicePtr, src: &[u8], stream: u64) -> Result<(), BackendError> {
        self.check_stream(stream)?;
        let view = self.view(dst, src.len(), "copy to device")?;
        // SAFETY: the view is exactly src.len() bytes inside a live allocation.
        unsafe { view.bytes_mut().copy_from_slice(src) };
        Ok(())
    }

    fn copy_dtoh(&self, dst: &mut [u8], src: DevicePtr, stream: u64) -> Result<(), BackendError> {
        self.check_stream(stream)?;
        let view = self.view(src, dst.len(), "copy to host")?;
        // SAFETY: as above.
        dst.copy_from_slice(unsafe { view.bytes() });
        Ok(())
    }

    fn copy_dtod(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        nbytes: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        self.check_stream(stream)?;
        let from = self.view(src, nbytes, "device-to-device copy (source)")?;
        let to = self.view(dst, nbytes, "device-to-device copy (destination)")?;
        // SAFETY: both ranges were checked; `copy` allows overlap.
        unsafe { std::ptr::copy(from.as_ptr(), to.as_ptr(), nbytes) };
        Ok(())
    }

    fn memset(
        &self,
        dst: DevicePtr,
        value: u8,
        nbytes: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        self.check_stream(stream)?;
        let view = self.view(dst, nbytes, "memset")?;
        // SAFETY: checked range.
        unsafe { view.bytes_mut().fill(value) };
        Ok(())
    }

    fn create_stream(&self) -> Result<u64, BackendError> {
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id);
        Ok(id)
    }

    fn destroy_stream(&self, stream: u64) -> Result<(), BackendError> {
        if self
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&stream)
        {
            Ok(())
        } else {
            Err(BackendError::UnknownStream(stream))
        }
    }

    fn synchronize(&self, stream: u64) -> Result<(), BackendError> {
        self.check_stream(stream)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
