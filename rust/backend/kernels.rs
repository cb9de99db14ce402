//! The typed kernel entry points every backend implements.
//!
//! Each op is one method with named, typed arguments. The CPU backend implements them in
//! Rust (the reference); the CUDA backend launches the kernels in `cuda/`.

/// The typed kernel entry points; every backend implements each op.
pub trait Kernels {}
