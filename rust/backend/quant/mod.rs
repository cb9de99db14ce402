//! Quantized CPU kernels: GGUF block formats kept as they are in the file, and a linear op
//! that reads them with integer dot products.
//!
//! Works on plain host slices, so it can sit behind any backend interface:
//! - [`BlockFormat`]: the formats (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K)
//!   with checked size arithmetic.
//! - [`dequantize`] / [`dequantize_bf16`]: file blocks to f32 (bit-identical to ggml's and the
//!   `gguf` package's dequantizers) or BF16 (for a GPU upload).
//! - [`quantize`]: f32 to Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (ggml's reference quantizers, byte for
//!   byte), Q4_K, Q5_K, Q6_K (a simple scheme with stated bounds) and the float formats.
//! - [`PackedWeight`]: one weight matrix, repacked at load into eight-row interleaved records
//!   (no larger than the file's bytes).
//! - [`linear`] on a [`KernelPool`]: `out[r, o] = sum_i W[o, i] x[r, i] (+ bias[o])`.
//!
//! # How the linear works (after llama.cpp's CPU backend, written independently)
//! Each input row is quantized once per call to 8-bit blocks (Q8 blocks of 32 for the legacy
//! formats, Q8K blocks of 256 with 16- and 32-element sums for the K-quants), then every
//! weight block meets it in an integer dot: AVX2 `maddubs` + `madd` on eight output rows at
//! once from the interleaved records, with both block scales applied in f32. Rows are taken
//! four at a time against each decoded weight record, so a call with k rows reads each weight
//! byte from memory once; long calls stream all their rows past each decoded record (from
//! L1), which makes a prefill a tiled matrix product rather than row-by-row dots. Float
//! weights use float dots (F16C widening for F16). AVX-VNNI's `vpdpbusd` is not used: this
//! path's sums never saturate `maddubs`, so it would give the same integers, but no machine
//! here has VNNI to test it on.
//!
//! # Invariants
//! - Every output element is one fixed sequence of operations on its own input row and
//!   weight row ([`dot_portable`] and [`float_dot`] define it): integer sums are exact, the
//!   f32 operations (fused multiply-adds where the definition says so, IEEE-rounded once)
//!   always run in the same order. So a row's output is bit-identical
//!   whatever the batch it is computed in, the thread split, and the instruction set
//!   (AVX2 or portable): greedy speculative decoding emits what plain decoding emits.
//! - Bad arguments (lengths, block alignment, overflowing sizes) are [`QuantError`]s, never
//!   panics; a panicking pool task becomes an error too.
//!
//! # Threads
//! [`KernelPool`] has one participant per core (the caller included): persistent workers
//! that spin briefly between calls, then sleep. See [`pool`] and the measured figures in
//! `benches/quant_linear.rs`'s output.

mod activation;
#[cfg(target_arch = "x86_64")]
mod avx2;
mod blocks;
mod dequant;
mod dot_portable;
mod error;
mod float_dot;
mod format;
mod linear;
mod packed;
pub mod pool;
mod quantize;
mod quantize_k;
mod subscales;

pub use activation::InputElem;
pub use dequant::{dequantize, dequantize_bf16};
pub use error::QuantError;
pub use format::{BlockFormat, QK, QK_K};
pub use linear::linear;
pub use packed::{PackedWeight, GROUP_ROWS};
pub use pool::{Isa, KernelPool};
pub use quantize::{quantize, quantize_to_vec};
