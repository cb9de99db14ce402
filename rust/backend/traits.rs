//! The `GpuBackend` trait and typed host<->device helpers built on it.
//!
//! Every method takes `&self`: one backend object is shared (as `Arc<dyn GpuBackend>`) by
//! the model, the proposers and the engine, and keeps its own state behind locks.

use super::{AllocationLedger, BackendError, DevicePtr, Dtype};
use crate::backend::kernels::Kernels;
use bytemuck::Pod;
use half::bf16;
use std::any::Any;

/// Device memory, copies, streams, and (through [`Kernels`]) the typed kernel entry points.
pub trait GpuBackend: Kernels + Send + Sync {
    /// A short name for messages (`"cpu"`, `"cuda:0"`).
    fn name(&self) -> String;
    /// The ledger of this backend's live allocations.
    fn ledger(&self) -> &AllocationLedger;
    /// Allocates `nbytes` zero-initialised bytes, recorded under `tag`.
    fn alloc(&self, nbytes: usize, tag: &str) -> Result<DevicePtr, BackendError>;
    /// Frees an allocation; a double free or unknown pointer is an error.
    fn free(&self, ptr: DevicePtr) -> Result<(), BackendError>;
    /// Copies host bytes to device memory.
    fn copy_htod(&self, dst: DevicePtr, src: &[u8], stream: u64) -> Result<(), BackendError>;
    /// Copies device memory to host bytes; the bytes are valid when this returns.
    fn copy_dtoh(&self, dst: &mut [u8], src: DevicePtr, stream: u64) -> Result<(), BackendError>;
    /// Copies `nbytes` between device buffers (the ranges may overlap).
    fn copy_dtod(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        nbytes: usize,
        stream: u64,
    ) -> Result<(), BackendError>;
    /// Sets `nbytes` bytes at `dst` to `value`.
    fn memset(
        &self,
        dst: DevicePtr,
        value: u8,
        nbytes: usize,
        stream: u64,
    ) -> Result<(), BackendError>;
    /// Creates a stream and returns its id (never 0, which always exists).
    fn create_stream(&self) -> Result<u64, BackendError>;
    /// Destroys a stream made by [`GpuBackend::create_stream`].
    fn destroy_stream(&self, stream: u64) -> Result<(), BackendError>;
    /// Waits until all work queued on `stream` is done.
    fn synchronize(&self, stream: u64) -> Result<(), BackendError>;
    /// For downcasting to the concrete backend.
    fn as_any(&self) -> &dyn Any;
}

/// Typed conveniences over [`GpuBackend`]'s byte copies; implemented for every backend.
pub trait GpuBackendExt {
    /// Allocates a buffer holding `data`.
    fn upload<T: Pod>(&self, data: &[T], tag: &str) -> Result<DevicePtr, BackendError>;
    /// Writes `data` at `dst`.
    fn write<T: Pod>(&self, dst: DevicePtr, data: &[T], stream: u64) -> Result<(), BackendError>;
    /// Reads `len` elements at `src`.
    fn download<T: Pod + Default>(
        &self,
        src: DevicePtr,
        len: usize,
    ) -> Result<Vec<T>, BackendError>;
    /// Allocates a BF16 buffer from f32 values (rounded to nearest even).
    fn upload_bf16(&self, data: &[f32], tag: &str) -> Result<DevicePtr, BackendError>;
    /// Reads `len` BF16 values at `src`, widened to f32.
    fn download_bf16(&self, src: DevicePtr, len: usize) -> Result<Vec<f32>, BackendError>;
    /// Allocates `len` zeroed elements of `dtype`.
    fn alloc_zeros(&self, dtype: Dtype, len: usize, tag: &str) -> Result<DevicePtr, BackendError>;
}

impl<B: GpuBackend + ?Sized> GpuBackendExt for B {
    fn upload<T: Pod>(&self, data: &[T], tag: &str) -> Result<DevicePtr, BackendError> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let ptr = self.alloc(bytes.len().max(1), tag)?;
        if let Err(e) = self.copy_htod(ptr, bytes, super::DEFAULT_STREAM) {
            // The buffer is ours and was just allocated; freeing it cannot fail.
            let _ = self.free(ptr);
            return Err(e);
        }
        Ok(ptr)
    }

    fn write<T: Pod>(&self, dst: DevicePtr, data: &[T], stream: u64) -> Result<(), BackendError> {
        self.copy_htod(dst, bytemuck::cast_slice(data), stream)
    }

    fn download<T: Pod + Default>(
        &self,
        src: DevicePtr,
        len: usize,
    ) -> Result<Vec<T>, BackendError> {
        let mut out = vec![T::default(); len];
        self.copy_dtoh(
            bytemuck::cast_slice_mut(&mut out),
            src,
            super::DEFAULT_STREAM,
        )?;
        Ok(out)
    }

    fn upload_bf16(&self, data: &[f32], tag: &str) -> Result<DevicePtr, BackendError> {
        let v: Vec<bf16> = data.iter().map(|&x| bf16::from_f32(x)).collect();
        self.upload(&v, tag)
    }

    fn download_bf16(&self, src: DevicePtr, len: usize) -> Result<Vec<f32>, BackendError> {
        Ok(self
            .download::<bf16>(src, len)?
            .into_iter()
            .map(f32::from)
            .collect())
    }

    fn alloc_zeros(&self, dtype: Dtype, len: usize, tag: &str) -> Result<DevicePtr, BackendError> {
        self.alloc((dtype.size() * len).max(1), tag)
    }
}
