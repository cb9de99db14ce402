//! A backend for the engine tests that must see what the engine asks of the device: the
//! CPU backend behind a wrapper that counts chosen kernel calls and the bytes downloaded.

use specdraft::backend::{
    AllocationLedger, ArgmaxArgs, BackendError, CopyRowsArgs, CpuBackend, DevicePtr,
    ElementwiseArgs, EmbeddingArgs, GpuBackend, GroupedLinearArgs, Kernels, KvCopyArgs,
    KvWriteArgs, LinearArgs, MlaAttentionArgs, PagedAttentionArgs, PickArgs, RmsNormArgs, RopeArgs,
    SoftmaxArgs, TopKArgs,
};
use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The CPU backend, counting the calls and bytes the engine tests ask about.
pub struct Counting {
    pub inner: CpuBackend,
    /// `copy_rows` calls (the capture kernel).
    pub copy_rows: AtomicUsize,
    /// `argmax` calls.
    pub argmax: AtomicUsize,
    /// Bytes downloaded (`copy_dtoh`).
    pub dtoh_bytes: AtomicUsize,
}

impl Counting {
    pub fn new() -> Self {
        Counting {
            inner: CpuBackend::new(),
            copy_rows: AtomicUsize::new(0),
            argmax: AtomicUsize::new(0),
            dtoh_bytes: AtomicUsize::new(0),
        }
    }

    pub fn reset(&self) {
        for c in [&self.copy_rows, &self.argmax, &self.dtoh_bytes] {
            c.store(0, Ordering::Relaxed);
        }
    }
}

impl Kernels for Counting {
    fn embedding(&self, a: EmbeddingArgs) -> std::result::Result<(), BackendError> {
        self.inner.embedding(a)
    }
    fn rms_norm(&self, a: RmsNormArgs) -> std::result::Result<(), BackendError> {
        self.inner.rms_norm(a)
    }
    fn elementwise(&self, a: ElementwiseArgs) -> std::result::Result<(), BackendError> {
        self.inner.elementwise(a)
    }
    fn linear(&self, a: LinearArgs) -> std::result::Result<(), BackendError> {
        self.inner.linear(a)
    }
    fn grouped_linear(&self, a: GroupedLinearArgs) -> std::result::Result<(), BackendError> {
        self.inner.grouped_linear(a)
    }
    fn rope(&self, a: RopeArgs) -> std::result::Result<(), BackendError> {
        self.inner.rope(a)
    }
    fn kv_write(&self, a: KvWriteArgs) -> std::result::Result<(), BackendError> {
        self.inner.kv_write(a)
    }
    fn paged_attention(&self, a: PagedAttentionArgs) -> std::result::Result<(), BackendError> {
        self.inner.paged_attention(a)
    }
    fn argmax(&self, a: ArgmaxArgs) -> std::result::Result<(), BackendError> {
        self.argmax.fetch_add(1, Ordering::Relaxed);
        self.inner.argmax(a)
    }
    fn softmax(&self, a: SoftmaxArgs) -> std::result::Result<(), BackendError> {
        self.inner.softmax(a)
    }
    fn pick(&self, a: PickArgs) -> std::result::Result<(), BackendError> {
        self.inner.pick(a)
    }
    fn top_k(&self, a: TopKArgs) -> std::result::Result<(), BackendError> {
        self.inner.top_k(a)
    }
    fn copy_rows(&self, a: CopyRowsArgs) -> std::result::Result<(), BackendError> {
        self.copy_rows.fetch_add(1, Ordering::Relaxed);
        self.inner.copy_rows(a)
    }
    fn kv_copy(&self, a: KvCopyArgs) -> std::result::Result<(), BackendError> {
        self.inner.kv_copy(a)
    }
    fn mla_attention(&self, a: MlaAttentionArgs) -> std::result::Result<(), BackendError> {
        self.inner.mla_attention(a)
    }
}

impl GpuBackend for Counting {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn ledger(&self) -> &AllocationLedger {
        self.inner.ledger()
    }
    fn alloc(&self, nbytes: usize, tag: &str) -> std::result::Result<DevicePtr, BackendError> {
        self.inner.alloc(nbytes, tag)
    }
    fn free(&self, ptr: DevicePtr) -> std::result::Result<(), BackendError> {
        self.inner.free(ptr)
    }
    fn copy_htod(
        &self,
        dst: DevicePtr,
        src: &[u8],
        s: u64,
    ) -> std::result::Result<(), BackendError> {
        self.inner.copy_htod(dst, src, s)
    }
    fn copy_dtoh(
        &self,
        dst: &mut [u8],
        src: DevicePtr,
        s: u64,
    ) -> std::result::Result<(), BackendError> {
        self.dtoh_bytes.fetch_add(dst.len(), Ordering::Relaxed);
        self.inner.copy_dtoh(dst, src, s)
    }
    fn copy_dtod(
        &self,
        d: DevicePtr,
        src: DevicePtr,
        n: usize,
        s: u64,
    ) -> std::result::Result<(), BackendError> {
        self.inner.copy_dtod(d, src, n, s)
    }
    fn memset(
        &self,
        d: DevicePtr,
        v: u8,
        n: usize,
        s: u64,
    ) -> std::result::Result<(), BackendError> {
        self.inner.memset(d, v, n, s)
    }
    fn create_stream(&self) -> std::result::Result<u64, BackendError> {
        self.inner.create_stream()
    }
    fn destroy_stream(&self, stream: u64) -> std::result::Result<(), BackendError> {
        self.inner.destroy_stream(stream)
    }
    fn synchronize(&self, stream: u64) -> std::result::Result<(), BackendError> {
        self.inner.synchronize(stream)
    }
    fn as_any(&self) -> &dyn Any {
        self.inner.as_any()
    }
}
