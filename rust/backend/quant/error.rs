//! Errors of the quantized-kernel library: every one names the argument that was wrong.

use super::BlockFormat;
use thiserror::Error;

/// What was wrong with a request to the quantized kernels.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum QuantError {
    /// A row length that is not a whole number of blocks.
    #[error("{format}: {len} elements per row is not a multiple of its block length {block_len}")]
    NotBlockAligned {
        /// The weight format.
        format: BlockFormat,
        /// Elements per row.
        len: usize,
        /// Elements per block of the format.
        block_len: usize,
    },
    /// A buffer of the wrong length.
    #[error("{what}: expected {expected} {unit}, got {got}")]
    Length {
        /// The buffer or argument whose length is wrong.
        what: &'static str,
        /// The length it must have.
        expected: usize,
        /// The length it has.
        got: usize,
        /// What the lengths count (bytes, elements, rows).
        unit: &'static str,
    },
    /// Sizes whose product does not fit in `usize`.
    #[error("{what}: {a} x {b} overflows")]
    Overflow {
        /// The size being computed.
        what: &'static str,
        /// First factor.
        a: usize,
        /// Second factor.
        b: usize,
    },
    /// A GGML type id this library does not know.
    #[error("unknown or unsupported GGML type id {0}")]
    UnknownGgmlType(u32),
    /// A format name that is not one of [`BlockFormat::ALL`].
    #[error("unknown weight format {0:?} (expected one of f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k)")]
    UnknownFormatName(String),
    /// A format that this library reads but does not produce from floats.
    #[error("quantizing to {0} is not supported (supported: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k)")]
    QuantizeUnsupported(BlockFormat),
    /// A kernel-pool task panicked; the message is the panic's.
    #[error("a kernel task panicked: {0}")]
    TaskPanicked(String),
}
