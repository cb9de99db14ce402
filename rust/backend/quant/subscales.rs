//! The sub-block scales of a K-quant record, stored sub-block-major for the kernels.
//!
//! A file block packs its row's integer sub-block scales (and mins) row by row; a record of
//! eight rows stores them instead as `[sub-block][row]`, in the same number of bytes, so that
//! the eight rows' scales of one sub-block are eight adjacent bytes (one load widens them to
//! the eight lanes of a register). Per format, with `t = 8 j + l` for sub-block `j` of row
//! `l`:
//! - Q2_K (16 sub-blocks, 4-bit scale and min): byte `t` = `sc | m << 4` (as in the file).
//! - Q6_K (16 sub-blocks, i8 scale): byte `t` = `sc`.
//! - Q4_K / Q5_K (8 sub-blocks, 6-bit scale and min): byte `t` = `(sc & 15) | (m & 15) << 4`;
//!   byte `64 + 8 (j % 4) + l`, bits `4 (j / 4)..`: `sc >> 4 | (m >> 4) << 2`.
//! - Q3_K (16 sub-blocks, 6-bit scale stored with +32): byte `8 (j % 8) + l`, bits
//!   `4 (j / 8)..`: the low 4 bits; byte `64 + 8 (j % 4) + l`, bits `2 (j / 4)..`: the high 2.

use super::blocks::sub_scales;
use super::BlockFormat;

/// Writes row `l`'s scales `sc` and mins `m` into a record's scale bytes `out`.
pub(crate) fn put(format: BlockFormat, out: &mut [u8], l: usize, sc: &[i8; 16], m: &[u8; 16]) {
    use BlockFormat as F;
    match format {
        F::Q2_K => (0..16).for_each(|j| out[8 * j + l] = sc[j] as u8 | (m[j] << 4)),
        F::Q6_K => (0..16).for_each(|j| out[8 * j + l] = sc[j] as u8),
        F::Q4_K | F::Q5_K => {
            for j in 0..8 {
                let (s, n) = (sc[j] as u8, m[j]);
                out[8 * j + l] = (s & 15) | ((n & 15) << 4);
                out[64 + 8 * (j % 4) + l] |= ((s >> 4) | ((n >> 4) << 2)) << (4 * (j / 4));
            }
        }
        F::Q3_K => {
            for j in 0..16 {
                let s = (sc[j] as i32 + 32) as u8;
                out[8 * (j % 8) + l] |= (s & 15) << (4 * (j / 8));
                out[64 + 8 * (j % 4) + l] |= (s >> 4) << (2 * (j / 4));
            }
        }
        _ => {}
    }
}

/// Row `l`'s scales and mins from a record's scale bytes (the inverse of [`put`]).
pub(crate) fn get(format: BlockFormat, rec: &[u8], l: usize, sc: &mut [i8; 16], m: &mut [u8; 16]) {
    use BlockFormat as F;
    match format {
        F::Q2_K => {
            for j in 0..16 {
                sc[j] = (rec[8 * j + l] & 15) as i8;
                m[j] = rec[8 * j + l] >> 4;
            }
        }
        F::Q6_K => (0..16).for_each(|j| sc[j] = rec[8 * j + l] as i8),
        F::Q4_K | F::Q5_K => {
            for j in 0..8 {
                let (lo, hi) = (rec[8 * j + l], rec[64 + 8 * (j % 4) + l] >> (4 * (j / 4)));
                sc[j] = ((lo & 15) | ((hi & 3) << 4)) as i8;
                m[j] = (lo >> 4) | (((hi >> 2) & 3) << 4);
            }
        }
        F::Q3_K => {
            for j in 0..16 {
                let lo = (rec[8 * (j % 8) + l] >> (4 * (j / 8))) & 15;
                let hi = (rec[64 + 8 * (j % 4) + l] >> (2 * (j / 4))) & 3;
                sc[j] = (lo | (hi << 4)) as i8 - 32;
            }
        }
        _ => sub_scales(format, &[], sc, m),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::quant::blocks::spec;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn get_inverts_put_for_every_scale_value() {
        let mut rng = SmallRng::seed_from_u64(3);
        for format in [
            BlockFormat::Q2_K,
            BlockFormat::Q3_K,
            BlockFormat::Q4_K,
            BlockFormat::Q5_K,
            BlockFormat::Q6_K,
        ] {
            let bytes = spec(format).unwrap().scale_bytes;
            for _ in 0..50 {
                // Scales as the file encodes them: decode random file bytes.
                let rows: Vec<([i8; 16], [u8; 16])> = (0..8)
                    .map(|_| {
                        let raw: Vec<u8> = (0..bytes).map(|_| rng.random()).collect();
                        let (mut sc, mut m) = ([0i8; 16], [0u8; 16]);
                        sub_scales(format, &raw, &mut sc, &mut m);
                        (sc, m)
                    })
                    .collect();
                let mut rec = vec![0u8; 8 * bytes];
                for (l, (sc, m)) in rows.iter().enumerate() {
                    put(format, &mut rec, l, sc, m);
                }
                for (l, want) in rows.iter().enumerate() {
                    let mut got = ([0i8; 16], [0u8; 16]);
                    get(format, &rec, l, &mut got.0, &mut got.1);
                    assert_eq!(&got, want, "{format} row {l}");
                }
            }
        }
    }
}
