//! [`PackedWeight`]: a weight matrix in the layout the kernels read, no larger than the file's.
//!
//! Quantized rows are interleaved eight at a time (after llama.cpp's `repack.cpp`, in a
//! layout of our own): for each group of [`GROUP_ROWS`] output rows and each block index, one
//! *record* holds the eight rows' f16 scales side by side, their sub-block scales
//! sub-block-major ([`super::subscales`]), and their codes as bit planes. A plane of width `w` stores, in each 32-byte chunk, `8 / w`
//! slots; slot `s` of chunk `c` holds group-vector `g = s * (G / (8 / w)) + c` (`G` = block
//! length / 4), and byte `4 l + i` of group-vector `g` is element `4 g + i` of row `l`. So one
//! 32-byte load plus a shift and a mask gives four consecutive elements of eight rows: the
//! lanes of an integer dot that produces eight outputs at once, with no horizontal sums.
//! Rows past the last full group stay in the file's plain layout. Float formats are kept as
//! they are in the file.
//!
//! Invariant: `bytes().len() == format.matrix_bytes(out_features, in_features)`, and
//! decoding any block of a packed weight gives exactly the block of the file.

use super::blocks::{self, spec, IntBlock};
use super::dequant::check_lengths;
use super::format::checked_mul;
use super::{quantize, subscales, BlockFormat, QuantError};

/// Output rows interleaved per record.
pub const GROUP_ROWS: usize = 8;

/// Where things are inside one record of a format.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RecordLayout {
    /// Eight f16 `d`, then (if the format has one) eight f16 `m`/`dmin`.
    pub d2: Option<usize>,
    /// Eight rows' sub-block scales, `scale_bytes` each, sub-block-major ([`super::subscales`]).
    pub scales: usize,
    pub scale_bytes: usize,
    /// Code planes: (byte offset, width in bits, position of its bits in the code).
    pub planes: [(usize, u32, u32); 2],
    pub n_planes: usize,
    /// Group-vectors per record (block length / 4).
    pub vectors: usize,
}

impl RecordLayout {
    pub(crate) fn of(format: BlockFormat) -> Self {
        let spec = spec(format).expect("a quantized format");
        let widths: &[(u32, u32)] = match spec.bits {
            8 => &[(8, 0)],
            6 => &[(4, 0), (2, 4)],
            5 => &[(4, 0), (1, 4)],
            4 => &[(4, 0)],
            3 => &[(2, 0), (1, 2)],
            _ => &[(2, 0)],
        };
        let d2 = spec.d2_at.map(|_| 2 * GROUP_ROWS);
        let scales = 2 * GROUP_ROWS * (1 + d2.is_some() as usize);
        let mut at = scales + GROUP_ROWS * spec.scale_bytes;
        let mut planes = [(0, 0, 0); 2];
        for (p, &(w, dest)) in planes.iter_mut().zip(widths) {
            *p = (at, w, dest);
            at += format.block_len() * w as usize;
        }
        debug_assert_eq!(at, GROUP_ROWS * format.block_bytes());
        RecordLayout {
            d2,
            scales,
            scale_bytes: spec.scale_bytes,
            planes,
            n_planes: widths.len(),
            vectors: format.block_len() / 4,
        }
    }

    /// Byte and bit shift of element `e` of row `l` in plane `p`.
    #[inline(always)]
    fn position(&self, p: usize, e: usize, l: usize) -> (usize, u32) {
        let (at, w, _) = self.planes[p];
        let per_slot = self.vectors / (8 / w as usize);
        let g = e / 4;
        let byte = at + 32 * (g % per_slot) + 4 * l + e % 4;
        (byte, (g / per_slot) as u32 * w)
    }
}

/// A `[out_features, in_features]` weight matrix in the kernels' layout (see the module doc),
/// owning its bytes (`D = Vec<u8>`, made by [`PackedWeight::new`]) or borrowing bytes packed
/// earlier ([`PackedView`], made by [`PackedWeight::view`] or [`PackedView::from_packed`],
/// which is how a backend runs the kernels on a buffer it holds).
#[derive(Clone, Debug)]
pub struct PackedWeight<D = Vec<u8>> {
    format: BlockFormat,
    out_features: usize,
    in_features: usize,
    data: D,
}

/// A packed weight over borrowed bytes: what the kernels read.
pub type PackedView<'a> = PackedWeight<&'a [u8]>;

impl<'a> PackedView<'a> {
    /// Borrows `bytes` that already hold a packed `[out_features, in_features]` matrix of
    /// `format` (the [`PackedWeight::bytes`] of one). Only the length can be checked: bytes
    /// that were not packed for this shape give wrong numbers, never undefined behaviour.
    pub fn from_packed(
        format: BlockFormat,
        out_features: usize,
        in_features: usize,
        bytes: &'a [u8],
    ) -> Result<Self, QuantError> {
        format.row_bytes(in_features)?;
        check_lengths(
            format,
            bytes.len(),
            checked_mul("weight", out_features, in_features)?,
        )?;
        Ok(PackedWeight {
            format,
            out_features,
            in_features,
            data: bytes,
        })
    }
}

impl PackedWeight {
    /// Packs a matrix given in the file's layout (`bytes`: rows of `format` blocks).
    pub fn new(
        format: BlockFormat,
        out_features: usize,
        in_features: usize,
        bytes: &[u8],
    ) -> Result<Self, QuantError> {
        let row = format.row_bytes(in_features)?;
        check_lengths(
            format,
            bytes.len(),
            checked_mul("weight", out_features, in_features)?,
        )?;
        let mut data = bytes.to_vec();
        if format.is_quantized() {
            let layout = RecordLayout::of(format);
            let blocks = in_features / format.block_len();
            let bb = format.block_bytes();
            let record = GROUP_ROWS * bb;
            for g in 0..out_features / GROUP_ROWS {
                for b in 0..blocks {
                    let rec = &mut data[(g * blocks + b) * record..][..record];
                    let plain = |l: usize| &bytes[(g * GROUP_ROWS + l) * row + b * bb..][..bb];
                    pack_record(format, &layout, rec, plain);
                }
            }
        }
        Ok(PackedWeight {
            format,
            out_features,
            in_features,
            data,
        })
    }

    /// Quantizes f32 weights `[out_features, in_features]` to `format` and packs them.
    pub fn from_f32(
        format: BlockFormat,
        out_features: usize,
        in_features: usize,
        values: &[f32],
    ) -> Result<Self, QuantError> {
        let expected = checked_mul("weight", out_features, in_features)?;
        if values.len() != expected {
            return Err(QuantError::Length {
                what: "weight values",
                expected,
                got: values.len(),
                unit: "elements",
            });
        }
        let bytes = quantize::quantize_to_vec(format, values)?;
        Self::new(format, out_features, in_features, &bytes)
    }
}

impl<D: AsRef<[u8]>> PackedWeight<D> {
    /// The same matrix over borrowed bytes.
    pub fn view(&self) -> PackedView<'_> {
        PackedWeight {
            format: self.format,
            out_features: self.out_features,
            in_features: self.in_features,
            data: self.data.as_ref(),
        }
    }

    /// The format the weight's blocks are stored in.
    pub fn format(&self) -> BlockFormat {
        self.format
    }

    /// Rows of the weight (outputs of the linear layer).
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Elements per row (inputs of the linear layer).
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// The packed bytes (exactly as many as the file's).
    pub fn bytes(&self) -> &[u8] {
        self.data.as_ref()
    }

    /// Row `o` as f32, bit-identical to dequantizing that row of the file.
    pub fn dequantize_row(&self, o: usize, out: &mut [f32]) -> Result<(), QuantError> {
        if o >= self.out_features {
            return Err(QuantError::Length {
                what: "row index",
                expected: self.out_features,
                got: o,
                unit: "rows (index past the end)",
            });
        }
        if out.len() != self.in_features {
            return Err(QuantError::Length {
                what: "dequantized row",
                expected: self.in_features,
                got: out.len(),
                unit: "elements",
            });
        }
        if !self.format.is_quantized() {
            let row = self.format.row_bytes(self.in_features)?;
            return super::dequantize(self.format, &self.bytes()[o * row..][..row], out);
        }
        let n = self.format.block_len();
        for (b, chunk) in out.chunks_exact_mut(n).enumerate() {
            self.int_block(o, b).dequantize(self.format, chunk);
        }
        Ok(())
    }

    /// Blocks per row.
    pub(crate) fn blocks(&self) -> usize {
        self.in_features / self.format.block_len()
    }

    /// Full groups of [`GROUP_ROWS`] interleaved rows (0 for float formats).
    pub(crate) fn groups(&self) -> usize {
        if self.format.is_quantized() {
            self.out_features / GROUP_ROWS
        } else {
            0
        }
    }

    /// The record of group `g`, block `b`.
    #[inline(always)]
    pub(crate) fn record(&self, g: usize, b: usize) -> &[u8] {
        let record = GROUP_ROWS * self.format.block_bytes();
        &self.group_records(g)[b * record..][..record]
    }

    /// All records of group `g`, block after block.
    #[inline(always)]
    pub(crate) fn group_records(&self, g: usize) -> &[u8] {
        let bytes = GROUP_ROWS * self.format.row_bytes(self.in_features).unwrap_or(0);
        &self.bytes()[g * bytes..][..bytes]
    }

    /// Block `b` of row `o` as integers, from a record or from the plain tail.
    pub(crate) fn int_block(&self, o: usize, b: usize) -> IntBlock {
        let g = o / GROUP_ROWS;
        if g < self.groups() {
            let layout = RecordLayout::of(self.format);
            return unpack_record_row(self.format, &layout, self.record(g, b), o % GROUP_ROWS);
        }
        let bb = self.format.block_bytes();
        let row = bb * self.blocks();
        IntBlock::from_plain(self.format, &self.bytes()[o * row + b * bb..][..bb])
    }
}

/// Writes one record from the plain blocks `plain(l)` of its eight rows.
fn pack_record<'a>(
    format: BlockFormat,
    layout: &RecordLayout,
    rec: &mut [u8],
    plain: impl Fn(usize) -> &'a [u8],
) {
    let spec = spec(format).expect("quantized");
    rec.fill(0);
    let mut u = [0u8; 256];
    for l in 0..GROUP_ROWS {
        let block = plain(l);
        rec[2 * l..2 * l + 2].copy_from_slice(&block[spec.d_at..spec.d_at + 2]);
        if let (Some(at), Some(d2)) = (spec.d2_at, layout.d2) {
            rec[d2 + 2 * l..d2 + 2 * l + 2].copy_from_slice(&block[at..at + 2]);
        }
        let (mut sc, mut m) = ([0i8; 16], [0u8; 16]);
        blocks::sub_scales(
            format,
            &block[spec.scales_at..][..layout.scale_bytes],
            &mut sc,
            &mut m,
        );
        subscales::put(
            format,
            &mut rec[layout.scales..][..GROUP_ROWS * layout.scale_bytes],
            l,
            &sc,
            &m,
        );
        blocks::unpack_codes(format, block, &mut u);
        for p in 0..layout.n_planes {
            let (_, w, dest) = layout.planes[p];
            for (e, &code) in u[..format.block_len()].iter().enumerate() {
                let (byte, shift) = layout.position(p, e, l);
                rec[byte] |= ((code >> dest) & ((1u16 << w) - 1) as u8) << shift;
            }
        }
    }
}

/// Row `l` of a record as integers (the inverse of [`pack_record`]).
fn unpack_record_row(format: BlockFormat, layout: &RecordLayout, rec: &[u8], l: usize) -> IntBlock {
    let mut u = [0u8; 256];
    for p in 0..layout.n_planes {
        let (_, w, dest) = layout.planes[p];
        for (e, code) in u[..format.block_len()].iter_mut().enumerate() {
            let (byte, shift) = layout.position(p, e, l);
            *code |= ((rec[byte] >> shift) & ((1u16 << w) - 1) as u8) << dest;
        }
    }
    let d2 = layout.d2.map_or(0.0, |at| blocks::f16_at(rec, at + 2 * l));
    let (mut sc, mut m) = ([0i8; 16], [0u8; 16]);
    subscales::get(
        format,
        &rec[layout.scales..][..GROUP_ROWS * layout.scale_bytes],
        l,
        &mut sc,
        &mut m,
    );
    IntBlock::assemble(format, (blocks::f16_at(rec, 2 * l), d2), sc, m, &u)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn packing_keeps_size_and_every_block() {
        let mut rng = SmallRng::seed_from_u64(11);
        for format in BlockFormat::ALL.into_iter().filter(|f| f.is_quantized()) {
            let (rows, cols) = (19, 2 * format.block_len());
            let mut bytes: Vec<u8> = (0..format.matrix_bytes(rows, cols).unwrap())
                .map(|_| rng.random())
                .collect();
            // Finite f16 scales, so decoded blocks compare equal (NaN != NaN).
            let spec = spec(format).unwrap();
            for block in bytes.chunks_exact_mut(format.block_bytes()) {
                for at in [Some(spec.d_at), spec.d2_at].into_iter().flatten() {
                    block[at + 1] &= 0x3f;
                }
            }
            let w = PackedWeight::new(format, rows, cols, &bytes).unwrap();
            assert_eq!(w.bytes().len(), bytes.len(), "{format}");
            assert_ne!(w.bytes(), &bytes[..], "{format}: nothing was interleaved");
            let row = format.row_bytes(cols).unwrap();
            let bb = format.block_bytes();
            for o in 0..rows {
                for b in 0..2 {
                    let plain = IntBlock::from_plain(format, &bytes[o * row + b * bb..][..bb]);
                    assert_eq!(w.int_block(o, b), plain, "{format} row {o} block {b}");
                }
            }
        }
    }
}
