//! The backend layer: device memory, copies, streams and typed kernel entry points.
//!
//! Invariants every caller can rely on:
//! - A [`DevicePtr`] is a plain address (`Copy`, no `Drop`): whoever allocated it frees it.
//! - Every backend records its allocations in an [`AllocationLedger`]; a double free, a free
//!   of an unknown pointer, or a copy that leaves one live allocation is an error, never a crash.
//! - Streams are `u64` ids; stream `0` always exists. On the CPU every stream runs in order,
//!   so work is complete when the call returns.
//! - Every kernel op takes one argument struct whose one `validate` every backend runs
//!   first ([`kernels`]): the CPU reference (`cpu/`) and the CUDA launchers (`cuda/`)
//!   accept and refuse the same arguments.

mod const_count;
mod cpu;
#[cfg(any(feature = "cuda", feature = "cuda-emu"))]
pub mod cuda;
mod device_ptr;
mod dtype;
mod error;
pub mod kernels;
mod ledger;
mod observed;
pub mod quant;
mod simd_builds;
mod traits;

pub(crate) use cpu::exp_nonpositive;
pub use cpu::{argmax, e2m1_to_f32, fp8_e4m3_to_f32, CpuBackend, HostView, E2M1_VALUES};
#[cfg(feature = "cuda")]
pub use cuda::CudaBackend;
#[cfg(feature = "cuda-emu")]
pub use cuda::{EmuBackend, EmuFault};
pub use device_ptr::DevicePtr;
pub use dtype::Dtype;
pub use error::BackendError;
pub use kernels::{
    ArgmaxArgs, CheckedMemory, CopyRowsArgs, ElementwiseArgs, ElementwiseOp, EmbeddingArgs,
    GroupedLinearArgs, Kernels, KvCopyArgs, KvWriteArgs, LinearArgs, LinearPart, LinearWeight,
    MlaAttentionArgs, PagedAttentionArgs, PickArgs, RmsNormArgs, RopeArgs, RopeStyle, SoftmaxArgs,
    TopKArgs, FP8_BLOCK, MAX_LINEAR_PARTS, NVFP4_BLOCK, TOP_K_MAX,
};
pub use ledger::{AllocationLedger, LiveAllocation};
pub use observed::{Call, Observed, Observer};
pub use traits::{GpuBackend, GpuBackendExt};

/// The default stream every backend provides.
pub const DEFAULT_STREAM: u64 = 0;

/// The best backend this build and machine offer: the first CUDA device when the crate is
/// built with feature `cuda` and a driver and device work, else the CPU backend.
pub fn default_backend() -> std::sync::Arc<dyn GpuBackend> {
    #[cfg(feature = "cuda")]
    if let Ok(gpu) = CudaBackend::new(0) {
        return std::sync::Arc::new(gpu);
    }
    std::sync::Arc::new(CpuBackend::new())
}
