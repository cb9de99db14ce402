//! Backends that run the kernels in `cuda/`: on a GPU through the CUDA driver
//! (`CudaBackend`, feature `cuda`), or on the CPU through the emulation of the CUDA
//! device model (`EmuBackend`, feature `cuda-emu`, for tests).
//!
//! Both share one host side (`ops`): each op's shared `validate` (the code the CPU
//! reference runs too), launch shapes and argument lists. A backend only supplies how a
//! `DevicePtr` becomes an address the kernel can dereference and how a kernel is launched,
//! so the emulated tests exercise the host code that the GPU runs too.

mod attention;
mod launch;
mod ops;

#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda-emu")]
mod emu;

#[cfg(feature = "cuda")]
pub use driver::CudaBackend;
#[cfg(feature = "cuda-emu")]
pub use emu::{EmuBackend, EmuFault};
pub use launch::{DeviceRange, KERNEL_NAMES};
