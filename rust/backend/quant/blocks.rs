//! The one place that knows GGUF's bit layouts: every quantized block as integers and scales.
//!
//! Each format is described by its [`Spec`] (where its float scales live, how its codes are
//! offset, how long its sub-blocks are) and by [`for_each_field`], the list of bit fields
//! that hold its codes. Unpacking, packing (for the quantizers) and the interleaved repack
//! all walk that one list, so a layout is written down once.
//!
//! The value of element `e` of a block, in terms of its [`IntBlock`] (`j` = `e / sub_len`):
//! - [`Epilogue::Sym`] (Q4_0, Q5_0, Q8_0): `d * q[e]`
//! - [`Epilogue::Affine`] (Q4_1, Q5_1): `d * q[e] + d2` (`d2` is ggml's `m`)
//! - [`Epilogue::KMin`] (Q2_K, Q4_K, Q5_K): `(d * sc[j]) * q[e] - (d2 * m[j])` (`d2` = `dmin`)
//! - [`Epilogue::KSym`] (Q3_K, Q6_K): `(d * sc[j]) * q[e]`
//!
//! with f32 operations in exactly that order, which is the order of ggml's and the `gguf`
//! package's dequantizers, so [`IntBlock::dequantize`] reproduces them bit for bit.

use super::{BlockFormat, QK_K};
use half::f16;

/// How a block's integers combine with its float scales (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Epilogue {
    Sym,
    Affine,
    KMin,
    KSym,
}

/// Per-format constants of the integer view of a block.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spec {
    pub epilogue: Epilogue,
    /// Width of the unsigned code `u`; the signed integer is `q = u - offset` (Q8_0: `u as i8`).
    pub bits: u32,
    pub offset: i32,
    /// Elements per sub-block (one integer scale each); the block length for legacy formats.
    pub sub_len: usize,
    /// Byte offset of the f16 `d`, and of the second f16 scale (`m` or `dmin`) if any.
    pub d_at: usize,
    pub d2_at: Option<usize>,
    /// Where the packed sub-block scales live, and how many bytes they take.
    pub scales_at: usize,
    pub scale_bytes: usize,
}

/// The [`Spec`] of a quantized format; `None` for the float formats.
pub(crate) fn spec(format: BlockFormat) -> Option<Spec> {
    use BlockFormat as F;
    use Epilogue::*;
    let legacy = |epilogue, bits, offset, d2_at| Spec {
        epilogue,
        bits,
        offset,
        sub_len: 32,
        d_at: 0,
        d2_at,
        scales_at: 0,
        scale_bytes: 0,
    };
    let k = |epilogue, bits, offset, sub_len, d_at, d2_at, scales_at, scale_bytes| Spec {
        epilogue,
        bits,
        offset,
        sub_len,
        d_at,
        d2_at,
        scales_at,
        scale_bytes,
    };
    Some(match format {
        F::F32 | F::F16 | F::BF16 => return None,
        F::Q4_0 => legacy(Sym, 4, 8, None),
        F::Q4_1 => legacy(Affine, 4, 0, Some(2)),
        F::Q5_0 => legacy(Sym, 5, 16, None),
        F::Q5_1 => legacy(Affine, 5, 0, Some(2)),
        F::Q8_0 => legacy(Sym, 8, 0, None),
        F::Q2_K => k(KMin, 2, 0, 16, 80, Some(82), 0, 16),
        F::Q3_K => k(KSym, 3, 4, 16, 108, None, 96, 12),
        F::Q4_K => k(KMin, 4, 0, 32, 0, Some(2), 4, 12),
        F::Q5_K => k(KMin, 5, 0, 32, 0, Some(2), 4, 12),
        F::Q6_K => k(KSym, 6, 32, 16, 208, None, 192, 16),
    })
}

/// Calls `field(e, byte, shift, width, dest)` for every bit field holding a code: bits
/// `shift..shift + width` of block byte `byte` are bits `dest..dest + width` of element
/// `e`'s unsigned code. Together the fields cover every code bit exactly once.
#[inline(always)]
pub(crate) fn for_each_field(
    format: BlockFormat,
    mut field: impl FnMut(usize, usize, u32, u32, u32),
) {
    use BlockFormat as F;
    // Legacy 4-bit codes: byte l holds element l (low nibble) and element l + 16 (high).
    let nibbles32 = |qs: usize, field: &mut dyn FnMut(usize, usize, u32, u32, u32)| {
        for l in 0..16 {
            field(l, qs + l, 0, 4, 0);
            field(l + 16, qs + l, 4, 4, 0);
        }
    };
    // K-quant 4-bit codes: 64-element chunks, byte l of a chunk holds elements l and l + 32.
    let nibbles256 = |qs: usize, field: &mut dyn FnMut(usize, usize, u32, u32, u32)| {
        for c in 0..4 {
            for h in 0..2 {
                for l in 0..32 {
                    field(64 * c + 32 * h + l, qs + 32 * c + l, 4 * h as u32, 4, 0);
                }
            }
        }
    };
    // K-quant 2-bit codes: 128-element halves, byte l of a half holds elements l + 32 j.
    let crumbs256 = |qs: usize, dest: u32, field: &mut dyn FnMut(usize, usize, u32, u32, u32)| {
        for n in 0..2 {
            for j in 0..4 {
                for l in 0..32 {
                    field(128 * n + 32 * j + l, qs + 32 * n + l, 2 * j as u32, 2, dest);
                }
            }
        }
    };
    // One high bit per element: bit i of byte l is element 32 i + l (K) or bit e of a u32.
    let high_bits256 =
        |qh: usize, dest: u32, field: &mut dyn FnMut(usize, usize, u32, u32, u32)| {
            for e in 0..QK_K {
                field(e, qh + e % 32, (e / 32) as u32, 1, dest);
            }
        };
    let f = &mut field;
    match format {
        F::F32 | F::F16 | F::BF16 => {}
        F::Q4_0 => nibbles32(2, f),
        F::Q4_1 => nibbles32(4, f),
        F::Q5_0 | F::Q5_1 => {
            let qh = if format == F::Q5_0 { 2 } else { 4 };
            nibbles32(qh + 4, f);
            for e in 0..32 {
                f(e, qh + e / 8, (e % 8) as u32, 1, 4);
            }
        }
        F::Q8_0 => {
            for e in 0..32 {
                f(e, 2 + e, 0, 8, 0);
            }
        }
        F::Q2_K => crumbs256(16, 0, f),
        F::Q3_K => {
            crumbs256(32, 0, f);
            high_bits256(0, 2, f);
        }
        F::Q4_K => nibbles256(16, f),
        F::Q5_K => {
            nibbles256(48, f);
            high_bits256(16, 4, f);
        }
        F::Q6_K => {
            for n in 0..2 {
                for h in 0..2 {
                    for l in 0..64 {
                        f(128 * n + 64 * h + l, 64 * n + l, 4 * h as u32, 4, 0);
                    }
                }
                for s in 0..4 {
                    for l in 0..32 {
                        f(128 * n + 32 * s + l, 128 + 32 * n + l, 2 * s as u32, 2, 4);
                    }
                }
            }
        }
    }
}

/// The unsigned codes of a plain ggml block (`u[e]`, `e < block_len`).
pub(crate) fn unpack_codes(format: BlockFormat, block: &[u8], u: &mut [u8]) {
    u[..format.block_len()].fill(0);
    for_each_field(format, |e, byte, shift, width, dest| {
        u[e] |= ((block[byte] >> shift) & ((1u16 << width) - 1) as u8) << dest;
    });
}

/// Writes codes `u` into the code bytes of a plain ggml block (other bytes are left alone).
pub(crate) fn pack_codes(format: BlockFormat, u: &[u8], block: &mut [u8]) {
    for_each_field(format, |_, byte, _, _, _| block[byte] = 0);
    for_each_field(format, |e, byte, shift, width, dest| {
        block[byte] |= ((u[e] >> dest) & ((1u16 << width) - 1) as u8) << shift;
    });
}

/// Q4_K / Q5_K: the 6-bit scale and min of sub-block `j` from the 12 packed bytes.
#[inline(always)]
pub(crate) fn k4_scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q3_K: the signed scale of sub-block `j` (6 bits stored with an offset of 32).
#[inline(always)]
pub(crate) fn k3_scale(s: &[u8], j: usize) -> i8 {
    let low = (s[j % 8] >> (4 * (j / 8))) & 0x0f;
    let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    (low | (high << 4)) as i8 - 32
}

/// The integer scales `sc` and mins `m` of each sub-block from a format's packed scale bytes.
pub(crate) fn sub_scales(format: BlockFormat, s: &[u8], sc: &mut [i8; 16], m: &mut [u8; 16]) {
    use BlockFormat as F;
    match format {
        F::Q2_K => {
            for j in 0..16 {
                sc[j] = (s[j] & 0x0f) as i8;
                m[j] = s[j] >> 4;
            }
        }
        F::Q3_K => (0..16).for_each(|j| sc[j] = k3_scale(s, j)),
        F::Q4_K | F::Q5_K => {
            for j in 0..8 {
                let (a, b) = k4_scale_min(s, j);
                sc[j] = a as i8;
                m[j] = b;
            }
        }
        F::Q6_K => (0..16).for_each(|j| sc[j] = s[j] as i8),
        _ => sc[0] = 1,
    }
}

/// A quantized block as integers and scales (see the module doc for its value).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct IntBlock {
    /// Signed integer of each element (`u - offset`; Q8_0: the stored byte as `i8`).
    pub q: [i8; QK_K],
    /// Integer scale and min of each sub-block (legacy formats: `sc[0] = 1`).
    pub sc: [i8; 16],
    pub m: [u8; 16],
    pub d: f32,
    /// `m` (Affine), `dmin` (KMin), else 0.
    pub d2: f32,
}

/// The f16 at `bytes[at..at + 2]` as f32 (exact).
#[inline(always)]
pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

impl IntBlock {
    /// Assembles a block from its scales, sub-block scales and mins, and unsigned codes.
    pub(crate) fn assemble(
        format: BlockFormat,
        (d, d2): (f32, f32),
        sc: [i8; 16],
        m: [u8; 16],
        u: &[u8],
    ) -> Self {
        let spec = spec(format).expect("a quantized format");
        let mut q = [0i8; QK_K];
        for (q, &u) in q.iter_mut().zip(&u[..format.block_len()]) {
            *q = if format == BlockFormat::Q8_0 {
                u as i8
            } else {
                (u as i32 - spec.offset) as i8
            };
        }
        IntBlock { q, sc, m, d, d2 }
    }

    /// Decodes one plain ggml block (`block.len() == format.block_bytes()`).
    pub(crate) fn from_plain(format: BlockFormat, block: &[u8]) -> Self {
        let spec = spec(format).expect("a quantized format");
        let mut u = [0u8; QK_K];
        unpack_codes(format, block, &mut u);
        let d2 = spec.d2_at.map_or(0.0, |at| f16_at(block, at));
        let (mut sc, mut m) = ([0i8; 16], [0u8; 16]);
        sub_scales(
            format,
            &block[spec.scales_at..spec.scales_at + spec.scale_bytes],
            &mut sc,
            &mut m,
        );
        Self::assemble(format, (f16_at(block, spec.d_at), d2), sc, m, &u)
    }

    /// The block's values, in the f32 operation order of ggml's dequantizers.
    pub(crate) fn dequantize(&self, format: BlockFormat, out: &mut [f32]) {
        let spec = spec(format).expect("a quantized format");
        let n = format.block_len();
        for (e, o) in out[..n].iter_mut().enumerate() {
            let q = self.q[e] as f32;
            let j = e / spec.sub_len;
            *o = match spec.epilogue {
                Epilogue::Sym => self.d * q,
                Epilogue::Affine => self.d * q + self.d2,
                Epilogue::KMin => (self.d * self.sc[j] as f32) * q - self.d2 * self.m[j] as f32,
                Epilogue::KSym => (self.d * self.sc[j] as f32) * q,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn fields_cover_every_code_bit_once() {
        for format in BlockFormat::ALL.into_iter().filter(|f| f.is_quantized()) {
            let spec = spec(format).unwrap();
            let mut bits = vec![0u32; format.block_len()];
            let mut byte_bits = vec![0u8; format.block_bytes()];
            for_each_field(format, |e, byte, shift, width, dest| {
                let mask = ((1u32 << width) - 1) << dest;
                assert_eq!(bits[e] & mask, 0, "{format}: element {e} bit set twice");
                bits[e] |= mask;
                let bmask = (((1u16 << width) - 1) << shift) as u8;
                assert_eq!(
                    byte_bits[byte] & bmask,
                    0,
                    "{format}: byte {byte} bit used twice"
                );
                byte_bits[byte] |= bmask;
            });
            assert!(bits.iter().all(|&b| b == (1 << spec.bits) - 1), "{format}");
            // Code bytes never overlap the scales.
            let scalar = [Some(spec.d_at), spec.d2_at]
                .into_iter()
                .flatten()
                .flat_map(|at| at..at + 2)
                .chain(spec.scales_at..spec.scales_at + spec.scale_bytes);
            for b in scalar {
                assert_eq!(byte_bits[b], 0, "{format}: code bits in scale byte {b}");
            }
        }
    }

    #[test]
    fn pack_inverts_unpack() {
        let mut rng = SmallRng::seed_from_u64(1);
        for format in BlockFormat::ALL.into_iter().filter(|f| f.is_quantized()) {
            let spec = spec(format).unwrap();
            let codes: Vec<u8> = (0..format.block_len())
                .map(|_| rng.random_range(0..=((1u16 << spec.bits) - 1)) as u8)
                .collect();
            let mut block = vec![0xa5u8; format.block_bytes()];
            pack_codes(format, &codes, &mut block);
            let mut back = vec![0u8; format.block_len()];
            unpack_codes(format, &block, &mut back);
            assert_eq!(back, codes, "{format}");
        }
    }
}
