//! specdraft: the drafting half of speculative decoding.
//!
//! The crate is layered; each layer talks only to the one below it:
//!
//! 1. [`backend`]: the `GpuBackend` trait, `DevicePtr`, the allocation ledger, the CPU
//!    reference backend (and the CUDA backend with feature `cuda`).
//! 2. [`memory`]: the paged KV `BlockAllocator` and the shared forward scratch `BufferArena`.
//! 3. [`model`]: `ModelConfig`, `ModelLevers`, `ForwardContext`.
//! 4. [`speculative`]: the `DraftProposer` protocol, its proposers and the conformance checker.
//! 5. [`engine`]: the speculative decoding loop, verification, grammar masks and metrics.
//!
//! Python bindings live behind feature `python`; a Rust engine builder needs neither pyo3
//! nor a GPU toolkit to use this crate.

pub mod backend;
pub mod engine;
pub mod error;
pub mod memory;
pub mod model;
pub mod speculative;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};
