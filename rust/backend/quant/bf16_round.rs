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
