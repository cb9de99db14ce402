//! Scalar decoders of the narrow float formats inside quantized weights (FP8 E4M3 block
//! scales, E2M1 elements), the definitions the CPU kernels and the quantizers share.
//!
//! Written here because no crate the field relies on decodes them.

/// FP8 E4M3 (`float8_e4m3fn`) to f32: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa
/// bits, no infinities, and `S.1111.111` is NaN. Every value is exact in f32.
pub fn fp8_e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((byte >> 3) & 0x0f) as i32;
    let man = (byte & 0x07) as f32;
    if exp == 0x0f && byte & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// The values of the eight E2M1 magnitudes (NVFP4's element codes, bit 3 is the sign).
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// An E2M1 code (low four bits of `code`) to f32.
pub fn e2m1_to_f32(code: u8) -> f32 {
    let v = E2M1_VALUES[(code & 0x07) as usize];
    if code & 0x08 != 0 {
        -v
    } else {
        v
    }
}
