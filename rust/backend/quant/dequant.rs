//! Dequantization of plain GGUF rows to f32 (the CPU reference) and to BF16 (what a GPU
//! backend uploads when it has no kernel for a block format).
//!
//! Invariant: the f32 values equal ggml's and the `gguf` package's dequantizers bit for bit
//! (the operation order is fixed in [`super::blocks`]); the BF16 values are those f32 values
//! rounded to nearest, ties to even.

use super::blocks::IntBlock;
use super::{BlockFormat, QuantError};
use half::{bf16, f16};

/// Checks that `bytes` holds exactly the blocks of `elements` values; returns the block count.
pub(crate) fn check_lengths(
    format: BlockFormat,
    bytes: usize,
    elements: usize,
) -> Result<usize, QuantError> {
    let blocks = format.blocks_per_row(elements)?;
    let want = format.row_bytes(elements)?;
    if bytes != want {
        return Err(QuantError::Length {
            what: "quantized data",
            expected: want,
            got: bytes,
            unit: "bytes",
        });
    }
    Ok(blocks)
}

/// Dequantizes whole blocks: `bytes` holds `out.len() / block_len` blocks of `format`.
pub fn dequantize(format: BlockFormat, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    check_lengths(format, bytes.len(), out.len())?;
    match format {
        BlockFormat::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        BlockFormat::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        BlockFormat::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        _ => {
            let n = format.block_len();
            for (o, b) in out
                .chunks_exact_mut(n)
                .zip(bytes.chunks_exact(format.block_bytes()))
            {
                IntBlock::from_plain(format, b).dequantize(format, o);
            }
        }
    }
    Ok(())
}

/// Dequantizes whole blocks to BF16 (each f32 value of [`dequantize`] rounded to nearest even).
pub fn dequantize_bf16(
    format: BlockFormat,
    bytes: &[u8],
    out: &mut [bf16],
) -> Result<(), QuantError> {
    if format == BlockFormat::BF16 {
        check_lengths(format, bytes.len(), out.len())?;
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
            *o = bf16::from_le_bytes([b[0], b[1]]);
        }
        return Ok(());
    }
    // A block at a time through f32, so the scratch stays small whatever the tensor.
    check_lengths(format, bytes.len(), out.len())?;
    let n = format.block_len();
    let mut wide = [0f32; 256];
    for (o, b) in out
        .chunks_exact_mut(n)
        .zip(bytes.chunks_exact(format.block_bytes()))
    {
        dequantize(format, b, &mut wide[..n])?;
        for (d, s) in o.iter_mut().zip(&wide[..n]) {
            *d = bf16::from_f32(*s);
        }
    }
    Ok(())
}
