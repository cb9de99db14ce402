//! specdraft: the drafting half of speculative decoding.
//!
//! The crate is layered. A layer uses the layers below it (any of them, not only the next
//! one) and never one above, so each can be built and tested without the ones on top:
//!
//! 1. [`backend`]: the `GpuBackend` trait, `DevicePtr`, the allocation ledger, the typed
//!    kernel ops with their shared argument checks, the CPU reference backend (and the CUDA
//!    backend with feature `cuda`).
//!    [`distributed`] (uses nothing else): the `Communicator` between the ranks of a
//!    multi-rank serve (all-reduce, broadcast, barrier, rank 0's commands to its workers).
//! 2. [`memory`] (uses `backend`): the paged KV `BlockAllocator` and `BufferArena`, scratch
//!    sized from a slot list it is given; it knows devices, not models.
//! 3. [`model`] (uses `memory`, `backend`): `ModelConfig`, `ModelLevers`, `ForwardContext`,
//!    weights and their loaders, the one decoder layer, and `TargetModel`.
//! 4. [`speculative`] (uses `model`, `memory`, `backend`): the `DraftProposer` protocol,
//!    its proposers (the MTP head runs the model layer's decoder layer) and the conformance
//!    checker.
//! 5. [`engine`] (uses all of the above): the speculative decoding loop, verification,
//!    grammar masks and metrics.
//!
//! The Python bindings (feature `python`) sit on top of every layer; a Rust engine builder
//! needs neither pyo3 nor a GPU toolkit to use this crate.

#![warn(missing_docs)]

pub mod backend;
pub mod distributed;
pub mod engine;
pub mod error;
pub mod memory;
pub mod model;
pub mod speculative;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};
