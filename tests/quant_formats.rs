//! Block formats against an independent implementation (the `gguf` package's numpy codecs,
//! run through `tests/python/gguf_blocks.py`): dequantization of every format equals it bit
//! for bit on random blocks, and the legacy quantizers produce its bytes. Quantize-dequantize
//! round trips stay within each format's stated bound. Needs Python with numpy and gguf (CI
//! installs them before `cargo test`).

mod quant_common;

use half::{bf16, f16};
use quant_common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::quant::{
    dequantize, dequantize_bf16, quantize, quantize_to_vec, BlockFormat, PackedWeight, QuantError,
};
use std::path::PathBuf;
use std::process::Command;

/// A fresh folder for one test's request files.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specdraft-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the gguf reference over every request file in `dir`.
fn run_reference(dir: &PathBuf) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/gguf_blocks.py");
    let out = Command::new(python())
        .arg(script)
        .arg(dir)
        .output()
        .expect("running the Python reference (set $PYTHON to an interpreter with gguf)");
    assert!(
        out.status.success(),
        "gguf reference failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn read_u32s(path: PathBuf) -> Vec<u32> {
    let b = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn dequantize_matches_gguf_exactly() {
    let dir = scratch_dir("dequant");
    let mut rng = SmallRng::seed_from_u64(20);
    let mut inputs = Vec::new();
    for format in BlockFormat::ALL {
        // Every finite f16 scale: signs, zeros, subnormals, the largest values.
        let n = if format.is_quantized() { 96 } else { 512 };
        let bytes = random_blocks(&mut rng, format, n, &mut any_finite_f16);
        std::fs::write(dir.join(format!("{format}.blocks")), &bytes).unwrap();
        inputs.push((format, bytes));
    }
    run_reference(&dir);
    for (format, bytes) in inputs {
        let n = bytes.len() / format.block_bytes() * format.block_len();
        let mut got = vec![0f32; n];
        dequantize(format, &bytes, &mut got).unwrap();
        let want = read_u32s(dir.join(format!("{format}.f32")));
        assert_eq!(want.len(), n, "{format}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                *w,
                "{format} element {i}: {g} vs {}",
                f32::from_bits(*w)
            );
        }
        let mut got16 = vec![bf16::ZERO; n];
        dequantize_bf16(format, &bytes, &mut got16).unwrap();
        let raw = std::fs::read(dir.join(format!("{format}.bf16"))).unwrap();
        for (i, (g, w)) in got16.iter().zip(raw.chunks_exact(2)).enumerate() {
            assert_eq!(
                g.to_bits(),
                u16::from_le_bytes([w[0], w[1]]),
                "{format} bf16 {i}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Values with the shapes weights have: mixed signs, outliers, one-signed blocks, zero blocks.
fn test_values(rng: &mut SmallRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let block = i / 256;
            let v: f32 = rng.random_range(-1.0..1.0);
            match block % 5 {
                0 => v * 0.05,
                1 => v.abs() * 0.02 + 0.01,
                2 => -(v.abs() * 3.0),
                3 if i % 97 == 0 => v * 8.0,
                3 => v * 0.1,
                _ => 0.0,
            }
        })
        .collect()
}

#[test]
fn legacy_quantizers_match_gguf_bytes() {
    let dir = scratch_dir("quant");
    let mut rng = SmallRng::seed_from_u64(21);
    let formats = [
        BlockFormat::Q8_0,
        BlockFormat::Q4_0,
        BlockFormat::Q4_1,
        BlockFormat::Q5_0,
        BlockFormat::Q5_1,
        BlockFormat::F16,
        BlockFormat::BF16,
    ];
    let values = test_values(&mut rng, 1280);
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    for f in formats {
        std::fs::write(dir.join(format!("{f}.values")), &raw).unwrap();
    }
    run_reference(&dir);
    for f in formats {
        let want = std::fs::read(dir.join(format!("{f}.quant"))).unwrap();
        assert_eq!(quantize_to_vec(f, &values).unwrap(), want, "{f}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

const U: f64 = 1.0 / (1u64 << 24) as f64;

/// The f16 at `block[at..]` as f64.
fn f16_at(block: &[u8], at: usize) -> f64 {
    f16::from_le_bytes([block[at], block[at + 1]]).to_f64()
}

/// The per-element bound the quantizer's documentation states, for element `i` of `x`.
fn stated_bound(format: BlockFormat, x: &[f32], block: &[u8], i: usize) -> f64 {
    let amax = x.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
    let max = x.iter().fold(f64::MIN, |m, &v| m.max(v as f64));
    let min = x.iter().fold(f64::MAX, |m, &v| m.min(v as f64));
    let v = (x[i] as f64).abs();
    match format {
        BlockFormat::Q8_0 => {
            let d = (amax as f32 / 127.0) as f64;
            d / 2.0 + 127.0 * (f16_at(block, 0) - d).abs() + 2.0 * U * v
        }
        BlockFormat::Q4_0 | BlockFormat::Q5_0 => {
            let half = if format == BlockFormat::Q4_0 {
                8.0
            } else {
                16.0
            };
            let d = amax / half;
            d + half * (f16_at(block, 0).abs() - d).abs() + 2.0 * U * v
        }
        BlockFormat::Q4_1 | BlockFormat::Q5_1 => {
            let levels = if format == BlockFormat::Q4_1 {
                15.0
            } else {
                31.0
            };
            let d = (max - min) / levels;
            d / 2.0
                + levels * (f16_at(block, 0) - d).abs()
                + (f16_at(block, 2) - min).abs()
                + 4.0 * U * (v + min.abs() + max.abs())
        }
        BlockFormat::Q4_K | BlockFormat::Q5_K => {
            let levels = if format == BlockFormat::Q4_K {
                15.0
            } else {
                31.0
            };
            let sub = &x[i / 32 * 32..][..32];
            let hi = sub.iter().fold(f64::MIN, |m, &v| m.max(v as f64));
            let lo = sub.iter().fold(0f64, |m, &v| m.min(v as f64));
            let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
            let step = (hi - lo + dmin) / levels + d;
            step / 2.0 + 4.0 * U * (v + dmin * 63.0 + levels * step)
        }
        BlockFormat::Q6_K => {
            let sub = &x[i / 16 * 16..][..16];
            let amax_j = sub.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
            amax_j / 62.0 + f16_at(block, 208) / 2.0 + 4.0 * U * v
        }
        BlockFormat::F16 => 2f64.powi(-11) * v + 2f64.powi(-25),
        BlockFormat::BF16 => 2f64.powi(-8) * v,
        BlockFormat::F32 => 0.0,
        BlockFormat::Q2_K | BlockFormat::Q3_K => unreachable!(),
    }
}

#[test]
fn quantize_round_trips_within_stated_bounds() {
    let mut rng = SmallRng::seed_from_u64(22);
    for format in BlockFormat::ALL {
        if matches!(format, BlockFormat::Q2_K | BlockFormat::Q3_K) {
            assert_eq!(
                quantize_to_vec(format, &[0.0; 256]),
                Err(QuantError::QuantizeUnsupported(format))
            );
            continue;
        }
        let values = test_values(&mut rng, 2560);
        let bytes = quantize_to_vec(format, &values).unwrap();
        let mut back = vec![0f32; values.len()];
        dequantize(format, &bytes, &mut back).unwrap();
        let n = format.block_len();
        let mut worst = 0f64;
        for (b, (x, y)) in values.chunks(n).zip(back.chunks(n)).enumerate() {
            let block = &bytes[b * format.block_bytes()..][..format.block_bytes()];
            for i in 0..n {
                let err = (x[i] as f64 - y[i] as f64).abs();
                let bound = stated_bound(format, x, block, i);
                assert!(
                    err <= bound,
                    "{format} block {b} element {i}: {} -> {} (bound {bound})",
                    x[i],
                    y[i]
                );
                worst = worst.max(err / bound.max(f64::MIN_POSITIVE));
            }
        }
        // The bounds are not vacuous: some element comes within a factor 4 of its bound.
        if format != BlockFormat::F32 {
            assert!(
                worst > 0.25,
                "{format}: worst error only {worst} of its bound"
            );
        }
    }
}

#[test]
fn bad_sizes_are_errors() {
    let f = BlockFormat::Q4_1;
    let mut out = vec![0f32; 64];
    assert_eq!(
        dequantize(f, &[0u8; 39], &mut out),
        Err(QuantError::Length {
            what: "quantized data",
            expected: 40,
            got: 39,
            unit: "bytes"
        })
    );
    assert!(matches!(
        dequantize(f, &[0u8; 40], &mut out[..48]),
        Err(QuantError::NotBlockAligned {
            len: 48,
            block_len: 32,
            ..
        })
    ));
    assert!(matches!(
        quantize(BlockFormat::Q6_K, &[0.0; 300], &mut [0u8; 210]),
        Err(QuantError::NotBlockAligned { .. })
    ));
    assert!(matches!(
        PackedWeight::new(BlockFormat::Q4_K, 8, 576, &[0u8; 8 * 144 * 2]),
        Err(QuantError::NotBlockAligned {
            len: 576,
            block_len: 256,
            ..
        })
    ));
    assert!(matches!(
        PackedWeight::new(f, 8, 64, &[0u8; 8 * 40 - 1]),
        Err(QuantError::Length { .. })
    ));
    assert!(matches!(
        PackedWeight::new(f, usize::MAX / 4, 64, &[]),
        Err(QuantError::Overflow { .. })
    ));
    let w = PackedWeight::new(f, 8, 64, &[0u8; 8 * 40]).unwrap();
    assert!(matches!(
        w.dequantize_row(8, &mut out),
        Err(QuantError::Length { .. })
    ));
    assert!(matches!(
        w.dequantize_row(0, &mut out[..63]),
        Err(QuantError::Length { .. })
    ));
}

#[test]
fn packed_rows_dequantize_like_the_file() {
    let mut rng = SmallRng::seed_from_u64(23);
    for format in BlockFormat::ALL {
        let (rows, cols) = (13, 2 * format.block_len().max(16));
        let bytes = random_blocks(
            &mut rng,
            format,
            rows * cols / format.block_len(),
            &mut any_finite_f16,
        );
        let mut want = vec![0f32; rows * cols];
        dequantize(format, &bytes, &mut want).unwrap();
        let w = PackedWeight::new(format, rows, cols, &bytes).unwrap();
        assert_eq!(w.bytes().len(), bytes.len(), "{format}: packed size");
        let mut row = vec![0f32; cols];
        for o in 0..rows {
            w.dequantize_row(o, &mut row).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&row),
                bits(&want[o * cols..(o + 1) * cols]),
                "{format} row {o}"
            );
        }
    }
}
