//! The formats the AVX2 kernels decode: [`Fmt`] gives each one's record shape, code planes
//! and offsets as constants, so that each kernel is compiled once per format with every
//! branch on the format resolved at compile time; one zero-sized type per format.
#![allow(non_camel_case_types)]

use super::super::packed::GROUP_ROWS;
use super::BlockFormat;

/// A format's shape as the kernels need it (zero-sized types below, one per format).
pub(super) trait Fmt {
    /// The format, and the bytes of one record of it (eight rows' blocks).
    const FORMAT: BlockFormat;
    const RECORD_BYTES: usize = GROUP_ROWS * Self::FORMAT.block_bytes();
    /// Products summed in i16 before `madd` (bounded by the code width: see the `avx2` module doc).
    const TERMS: usize;
    /// Width of the first code plane, and width and bit position of the second (0: none).
    const W1: u32;
    const W2: u32 = 0;
    const D2: u32 = 0;
    /// Legacy formats: Q8_0's signed codes; a min (`m`); the code offset `2^OFFSET` (0: none).
    const Q8: bool = false;
    const AFFINE: bool = false;
    const OFFSET: i32 = 0;
    /// K-quants: group-vectors per sub-block (4: 16 elements, 8: 32); mins (else the code
    /// offset is `2^SHIFT`, applied through the sub-block scales).
    const GPS: usize = 8;
    const MIN: bool = false;
    const SHIFT: i32 = 0;
}

pub struct Q4_0;
pub struct Q4_1;
pub struct Q5_0;
pub struct Q5_1;
pub struct Q8_0;
pub struct Q2_K;
pub struct Q3_K;
pub struct Q4_K;
pub struct Q5_K;
pub struct Q6_K;
impl Fmt for Q4_0 {
    const FORMAT: BlockFormat = BlockFormat::Q4_0;
    const TERMS: usize = 8;
    const W1: u32 = 4;
    const OFFSET: i32 = 3;
}
impl Fmt for Q4_1 {
    const FORMAT: BlockFormat = BlockFormat::Q4_1;
    const TERMS: usize = 8;
    const W1: u32 = 4;
    const AFFINE: bool = true;
}
impl Fmt for Q5_0 {
    const FORMAT: BlockFormat = BlockFormat::Q5_0;
    const TERMS: usize = 4;
    const W1: u32 = 4;
    const W2: u32 = 1;
    const D2: u32 = 4;
    const OFFSET: i32 = 4;
}
impl Fmt for Q5_1 {
    const FORMAT: BlockFormat = BlockFormat::Q5_1;
    const TERMS: usize = 4;
    const W1: u32 = 4;
    const W2: u32 = 1;
    const D2: u32 = 4;
    const AFFINE: bool = true;
}
impl Fmt for Q8_0 {
    const FORMAT: BlockFormat = BlockFormat::Q8_0;
    const TERMS: usize = 1;
    const W1: u32 = 8;
    const Q8: bool = true;
}
impl Fmt for Q2_K {
    const FORMAT: BlockFormat = BlockFormat::Q2_K;
    const TERMS: usize = 4;
    const W1: u32 = 2;
    const GPS: usize = 4;
    const MIN: bool = true;
}
impl Fmt for Q3_K {
    const FORMAT: BlockFormat = BlockFormat::Q3_K;
    const TERMS: usize = 4;
    const W1: u32 = 2;
    const W2: u32 = 1;
    const D2: u32 = 2;
    const GPS: usize = 4;
    const SHIFT: i32 = 2;
}
impl Fmt for Q4_K {
    const FORMAT: BlockFormat = BlockFormat::Q4_K;
    const TERMS: usize = 8;
    const W1: u32 = 4;
    const MIN: bool = true;
}
impl Fmt for Q5_K {
    const FORMAT: BlockFormat = BlockFormat::Q5_K;
    const TERMS: usize = 4;
    const W1: u32 = 4;
    const W2: u32 = 1;
    const D2: u32 = 4;
    const MIN: bool = true;
}
impl Fmt for Q6_K {
    const FORMAT: BlockFormat = BlockFormat::Q6_K;
    const TERMS: usize = 2;
    const W1: u32 = 4;
    const W2: u32 = 2;
    const D2: u32 = 4;
    const GPS: usize = 4;
    const SHIFT: i32 = 5;
}
