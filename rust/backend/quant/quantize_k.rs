//! Quantization of f32 weights into the K-quants Q4_K, Q5_K and Q6_K.
//!
//! A simple, bounded scheme (not ggml's iterative search): every sub-block scale is rounded
//! *up*, so no value is ever clamped, and each value is rounded to the nearest code.
//! Error bounds per element (`u = 2^-24`, `d`/`dmin` the stored f16 super-block scales):
//! - Q6_K (16-element sub-blocks, signed codes): step `s_j = d * sc_j` with
//!   `amax_j / 31 <= s_j < amax_j / 31 + d`, so `|x - x^| <= s_j / 2 + 4u |x|`.
//! - Q4_K / Q5_K (32-element sub-blocks, codes 0..L with L = 15 / 31, offset `o_j = dmin *
//!   m_j >= -min(0, min_j)`): step `s_j = d * sc_j` with `(max_j + o_j) / L <= s_j <
//!   (max_j + o_j) / L + d`, so `|x - x^| <= s_j / 2 + 4u (|x| + o_j + L s_j)`.
//!
//! Q2_K and Q3_K are read but not produced: at 2-3 bits a scheme this simple loses too much
//! to be worth offering.

use super::blocks::{pack_codes, spec};
use super::{BlockFormat, QK_K};
use half::f16;

/// The smallest f16 whose f32 value `v` satisfies `ok(v)`, searching up from `f16(start)`.
fn f16_at_least(start: f32, ok: impl Fn(f32) -> bool) -> f16 {
    let mut h = f16::from_f32(start);
    // A handful of steps at most: `start` is within an ulp or two of the answer.
    while !ok(h.to_f32()) {
        h = f16::from_bits(h.to_bits() + 1);
    }
    h
}

/// The integer in 0..=max that, times `scale`, first reaches `need` (0 when `need <= 0`).
fn ceil_ratio(need: f32, scale: f32, max: u8) -> u8 {
    if need <= 0.0 || scale == 0.0 {
        return 0;
    }
    ((need / scale).ceil() as u32).min(max as u32) as u8
}

/// Quantizes one 256-element super-block of Q4_K, Q5_K or Q6_K into `out`.
pub(super) fn quantize_block(format: BlockFormat, x: &[f32], out: &mut [u8]) {
    let spec = spec(format).expect("a K-quant");
    out.fill(0);
    let mut codes = [0u8; QK_K];
    if format == BlockFormat::Q6_K {
        q6_k(x, out, &mut codes);
    } else {
        q45_k(x, out, &mut codes, (1u32 << spec.bits) as u8 - 1);
    }
    pack_codes(format, &codes, out);
}

fn q6_k(x: &[f32], out: &mut [u8], codes: &mut [u8; QK_K]) {
    let need: Vec<f32> = x
        .chunks_exact(16)
        .map(|s| s.iter().fold(0f32, |m, v| m.max(v.abs())) / 31.0)
        .collect();
    let top = need.iter().fold(0f32, |m, &v| m.max(v));
    let d = f16_at_least(top / 127.0, |d| top == 0.0 || (d > 0.0 && top / d <= 127.0));
    let df = d.to_f32();
    for (j, (sub, &nj)) in x.chunks_exact(16).zip(&need).enumerate() {
        let sc = ceil_ratio(nj, df, 127);
        out[192 + j] = sc;
        let step = df * sc as f32;
        let inv = if step == 0.0 { 0.0 } else { 1.0 / step };
        for (i, v) in sub.iter().enumerate() {
            let q = (v * inv).round().clamp(-32.0, 31.0) as i32;
            codes[16 * j + i] = (q + 32) as u8;
        }
    }
    out[208..210].copy_from_slice(&d.to_le_bytes());
}

fn q45_k(x: &[f32], out: &mut [u8], codes: &mut [u8; QK_K], top_code: u8) {
    let levels = top_code as f32;
    let lows: Vec<f32> = x
        .chunks_exact(32)
        .map(|s| -s.iter().fold(0f32, |m, &v| m.min(v)))
        .collect();
    let top_low = lows.iter().fold(0f32, |m, &v| m.max(v));
    let dmin = f16_at_least(top_low / 63.0, |d| {
        top_low == 0.0 || (d > 0.0 && top_low / d <= 63.0)
    });
    let dminf = dmin.to_f32();
    let mins: Vec<u8> = lows.iter().map(|&l| ceil_ratio(l, dminf, 63)).collect();
    let offsets: Vec<f32> = mins.iter().map(|&m| dminf * m as f32).collect();
    let need: Vec<f32> = x
        .chunks_exact(32)
        .zip(&offsets)
        .map(|(s, o)| (s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) + o) / levels)
        .collect();
    let top = need.iter().fold(0f32, |m, &v| m.max(v));
    let d = f16_at_least(top / 63.0, |d| top == 0.0 || (d > 0.0 && top / d <= 63.0));
    let df = d.to_f32();
    let mut scales = [0u8; 8];
    for (j, sub) in x.chunks_exact(32).enumerate() {
        scales[j] = ceil_ratio(need[j], df, 63);
        let step = df * scales[j] as f32;
        let inv = if step == 0.0 { 0.0 } else { 1.0 / step };
        for (i, v) in sub.iter().enumerate() {
            let q = ((v + offsets[j]) * inv).round().clamp(0.0, levels);
            codes[32 * j + i] = q as u8;
        }
    }
    out[0..2].copy_from_slice(&d.to_le_bytes());
    out[2..4].copy_from_slice(&dmin.to_le_bytes());
    pack_k4_scales(&scales, &mins, &mut out[4..16]);
}

/// Packs eight 6-bit scales and mins the way [`super::blocks::k4_scale_min`] reads them.
fn pack_k4_scales(sc: &[u8; 8], m: &[u8], s: &mut [u8]) {
    for j in 0..4 {
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
    }
}
