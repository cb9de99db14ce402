//! Random GGUF blocks for the quantized-kernel tests, built from ggml's block struct layouts
//! (written down here independently of the library's own tables).

#![allow(dead_code)]

#[path = "../../benches/common/default_model.rs"]
mod default_model;

use half::f16;
use rand::rngs::SmallRng;
use rand::Rng;
use specdraft::backend::quant::{BlockFormat, Isa};

/// Byte offsets of a block's f16 scale fields (`d`, then `m` or `dmin` where the format has one).
pub fn f16_fields(format: BlockFormat) -> &'static [usize] {
    use BlockFormat as F;
    match format {
        F::Q4_0 | F::Q5_0 | F::Q8_0 => &[0],
        F::Q4_1 | F::Q5_1 | F::Q4_K | F::Q5_K => &[0, 2],
        F::Q2_K => &[80, 82],
        F::Q3_K => &[108],
        F::Q6_K => &[208],
        F::F32 | F::F16 | F::BF16 => &[],
    }
}

/// Bounds on a block's value parts: `|scale part of w| <= |d| * c1`, `|offset part| <= |d2| * c2`
/// (largest integer sub-scale times largest code magnitude, and largest min).
pub fn part_bounds(format: BlockFormat) -> (f64, f64) {
    use BlockFormat as F;
    match format {
        F::Q4_0 => (8.0, 0.0),
        F::Q4_1 => (15.0, 1.0),
        F::Q5_0 => (16.0, 0.0),
        F::Q5_1 => (31.0, 1.0),
        F::Q8_0 => (128.0, 0.0),
        F::Q2_K => (15.0 * 3.0, 15.0),
        F::Q3_K => (32.0 * 4.0, 0.0),
        F::Q4_K => (63.0 * 15.0, 63.0),
        F::Q5_K => (63.0 * 31.0, 63.0),
        F::Q6_K => (128.0 * 32.0, 0.0),
        F::F32 | F::F16 | F::BF16 => (1.0, 0.0),
    }
}

/// A random finite f16 (any sign, subnormals and zeros included).
pub fn any_finite_f16(rng: &mut SmallRng) -> f16 {
    loop {
        let h = f16::from_bits(rng.random());
        if h.is_finite() {
            return h;
        }
    }
}

/// `n` random blocks: random code bytes, f16 scales from `scale(rng)`.
pub fn random_blocks(
    rng: &mut SmallRng,
    format: BlockFormat,
    n: usize,
    scale: &mut dyn FnMut(&mut SmallRng) -> f16,
) -> Vec<u8> {
    let bb = format.block_bytes();
    let mut out = vec![0u8; n * bb];
    for block in out.chunks_exact_mut(bb) {
        rng.fill(block);
        match format {
            BlockFormat::F32 => {
                let v: f32 = rng.random_range(-4.0..4.0);
                block.copy_from_slice(&v.to_le_bytes());
            }
            BlockFormat::F16 | BlockFormat::BF16 => {
                let v: f32 = rng.random_range(-4.0..4.0);
                let bits = if format == BlockFormat::F16 {
                    f16::from_f32(v).to_bits()
                } else {
                    half::bf16::from_f32(v).to_bits()
                };
                block.copy_from_slice(&bits.to_le_bytes());
            }
            _ => {
                for &at in f16_fields(format) {
                    block[at..at + 2].copy_from_slice(&scale(rng).to_le_bytes());
                }
            }
        }
    }
    out
}

/// A scale of magnitude in `[lo, hi)` with a random sign.
pub fn scale_in(lo: f32, hi: f32) -> impl FnMut(&mut SmallRng) -> f16 {
    move |rng| {
        let m: f32 = rng.random_range(lo..hi);
        f16::from_f32(if rng.random() { m } else { -m })
    }
}

/// The quantized formats.
pub fn quantized() -> impl Iterator<Item = BlockFormat> {
    BlockFormat::ALL.into_iter().filter(|f| f.is_quantized())
}

/// The interpreter with numpy and gguf.
#[allow(unused_imports)]
pub use default_model::python;

/// The SIMD instruction sets this CPU runs (AVX2, AVX-VNNI, AVX-512 VNNI where it has them),
/// each forced in turn: the best one alone would leave the others untested.
pub fn simd_isas() -> Vec<Isa> {
    let isas = Isa::available_simd();
    if !isas.contains(&Isa::Avx512Vnni) {
        eprintln!("this CPU runs {isas:?} only: the kernels of the others are not compared");
    }
    isas
}
