//! f32 to BF16 rounding written so that loops of it vectorise: the linear op's BF16 outputs
//! and the CPU backend's element-wise ops both round through it.
//!
//! Invariant: [`round_bf16`] gives the same bits as `half::bf16::from_f32` (round to nearest
//! even; a NaN stays a NaN, made quiet) for every f32.

use half::bf16;

/// f32 to BF16, rounding to nearest even (a NaN stays a NaN, made quiet): the same bits as
/// `half::bf16::from_f32`, but branch-free so that loops of it vectorise.
#[inline(always)]
pub(crate) fn round_bf16(v: f32) -> bf16 {
    let x = v.to_bits();
    let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
    let quiet = ((x >> 16) | 0x40) as u16;
    bf16::from_bits(if x & 0x7fff_ffff > 0x7f80_0000 {
        quiet
    } else {
        rounded
    })
}

/// `dst[i] = round_bf16(src[i])` over the shorter of the two.
#[inline(always)]
pub(crate) fn narrow(src: &[f32], dst: &mut [bf16]) {
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = round_bf16(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn round_bf16_matches_half_on_every_kind_of_value() {
        let mut patterns = vec![
            0u32,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x7fc0_0000,
            0x7f80_0001,
            0xffff_ffff,
            0x0000_8000,
            0x0001_8000,
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_8001,
            0x3f80_7fff,
        ];
        // Every low half-word (the rounded-off bits, ties included) under assorted high halves.
        for high in [
            0x0000u32, 0x0001, 0x3f80, 0x3f81, 0x7f7f, 0x7f80, 0x7fc0, 0xbf80, 0xff7f,
        ] {
            patterns.extend((0..=0xffffu32).map(|low| high << 16 | low));
        }
        let mut rng = SmallRng::seed_from_u64(7);
        patterns.extend((0..1 << 20).map(|_| rng.random::<u32>()));
        for p in patterns {
            let v = f32::from_bits(p);
            assert_eq!(
                round_bf16(v).to_bits(),
                bf16::from_f32(v).to_bits(),
                "bits {p:#010x}"
            );
        }
    }
}
