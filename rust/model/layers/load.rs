//! Loading one weight from a [`TensorSource`] with its shape checked: dense BF16 tensors,
//! RMSNorm weights (zero-centred ones stored with the 1 added), and projections in any
//! format the checkpoint holds them in.
//!
//! Invariant: what these return lives in the given [`DeviceAllocations`] and has exactly
//! the shape asked for; anything else is an error naming the tensor and the file. A GGUF
//! block-format projection stays in its format (repacked, the file's size) on a backend with
//! block kernels (the CPU backend), and is dequantized to BF16 for any other.

use crate::backend::quant::PackedWeight;
use crate::backend::{CpuBackend, GpuBackend, FP8_BLOCK};
use crate::model::tensors::{TensorSource, TensorType};
use crate::model::{
    DenseWeight, DeviceAllocations, Fp8Weight, Linear, ModelError, PackedLinear, QuantizedWeight,
};
use half::bf16;

/// Whether `gpu` runs `linear` on GGUF block formats itself (only the CPU backend does; a
/// GPU backend is given BF16).
pub fn keeps_block_formats(gpu: &dyn GpuBackend) -> bool {
    gpu.as_any().is::<CpuBackend>()
}

/// Loads a dense BF16 tensor of shape `expected`.
pub fn load_dense(
    allocs: &DeviceAllocations,
    src: &dyn TensorSource,
    name: &str,
    expected: &[usize],
) -> crate::Result<DenseWeight> {
    let data = src.read_bf16(name, expected)?;
    Ok(DenseWeight::upload(allocs, name, expected, &data)?)
}

/// Loads projection `base` (`{base}.weight`, `[out, in]`): dense, NVFP4 when the
/// checkpoint stores packed codes with `{base}.weight_scale` / `weight_scale_2`, or FP8 when
/// it stores E4M3 elements with f32 `{base}.weight_scale_inv` per 128 x 128 block
/// (DeepSeek-V3's FP8 layout), kept as they are.
pub fn load_linear(
    allocs: &DeviceAllocations,
    src: &dyn TensorSource,
    base: &str,
    out_f: usize,
    in_f: usize,
) -> crate::Result<Linear> {
    let wname = format!("{base}.weight");
    let w = src.require(&wname)?;
    if w.dtype == TensorType::F8E4M3 {
        return load_fp8(allocs, src, base, out_f, in_f);
    }
    if let (Some(format), true) = (w.dtype.block_format(), keeps_block_formats(&**allocs.gpu())) {
        if w.shape != [out_f, in_f] {
            return Err(ModelError::ShapeMismatch {
                path: src.path().to_string(),
                tensor: wname,
                expected: vec![out_f, in_f],
                found: w.shape.clone(),
            }
            .into());
        }
        let packed =
            PackedWeight::new(format, out_f, in_f, w.data).map_err(|e| ModelError::Format {
                path: src.path().to_string(),
                format: "GGUF",
                message: format!("tensor {wname:?}: {e}"),
            })?;
        return Ok(Linear::Packed(PackedLinear {
            blocks: allocs.upload(packed.bytes(), &wname)?,
            format,
            out_features: out_f,
            in_features: in_f,
        }));
    }
    if w.dtype != TensorType::U8 {
        return Ok(Linear::Dense(load_dense(
            allocs,
            src,
            &wname,
            &[out_f, in_f],
        )?));
    }
    let shape_err =
        |tensor: &str, expected: Vec<usize>, found: Vec<usize>| ModelError::ShapeMismatch {
            path: src.path().to_string(),
            tensor: tensor.to_string(),
            expected,
            found,
        };
    if w.shape != [out_f, in_f / 2] || !in_f.is_multiple_of(16) {
        return Err(shape_err(&wname, vec![out_f, in_f / 2], w.shape.clone()).into());
    }
    let sname = format!("{base}.weight_scale");
    let s = src.require(&sname)?;
    if s.shape != [out_f, in_f / 16] || s.dtype != TensorType::F8E4M3 {
        return Err(shape_err(&sname, vec![out_f, in_f / 16], s.shape.clone()).into());
    }
    let scalar = |name: String| -> crate::Result<Option<f32>> {
        match src.tensor(&name)? {
            None => Ok(None),
            Some(t) if t.numel() == 1 => Ok(Some(t.to_bf16(&name, src.path())?[0].to_f32())),
            Some(t) => Err(shape_err(&name, vec![1], t.shape.clone()).into()),
        }
    };
    // The global scale is kept in f32 exactly: read its bytes rather than through BF16.
    let g2name = format!("{base}.weight_scale_2");
    let g2 = src.require(&g2name)?;
    let weight_scale_2 = match (&g2.dtype, g2.data.len()) {
        (TensorType::F32, 4) => {
            f32::from_le_bytes([g2.data[0], g2.data[1], g2.data[2], g2.data[3]])
        }
        _ => return Err(shape_err(&g2name, vec![1], g2.shape.clone()).into()),
    };
    Ok(Linear::Nvfp4(QuantizedWeight {
        weight: allocs.upload(w.data, &wname)?,
        weight_scale: allocs.upload(s.data, &sname)?,
        weight_scale_2,
        input_scale: scalar(format!("{base}.input_scale"))?,
        out_features: out_f,
        in_features: in_f,
    }))
}

/// Loads an FP8 projection: `{base}.weight` E4M3 `[out, in]` and f32
/// `{base}.weight_scale_inv` `[ceil(out / 128), ceil(in / 128)]`.
fn load_fp8(
    allocs: &DeviceAllocations,
    src: &dyn TensorSource,
    base: &str,
    out_f: usize,
    in_f: usize,
) -> crate::Result<Linear> {
    let (wname, sname) = (format!("{base}.weight"), format!("{base}.weight_scale_inv"));
    let w = src.require(&wname)?;
    let s = src.require(&sname)?;
    let grid = vec![out_f.div_ceil(FP8_BLOCK), in_f.div_ceil(FP8_BLOCK)];
    let checks = [
        (&wname, &w, TensorType::F8E4M3, vec![out_f, in_f]),
        (&sname, &s, TensorType::F32, grid),
    ];
    for (name, t, dtype, shape) in checks {
        if t.shape != shape {
            return Err(ModelError::ShapeMismatch {
                path: src.path().to_string(),
                tensor: name.clone(),
                expected: shape,
                found: t.shape.clone(),
            }
            .into());
        }
        if t.dtype != dtype || dtype.nbytes(t.numel()) != Some(t.data.len()) {
            return Err(ModelError::Format {
                path: src.path().to_string(),
                format: "FP8 projection",
                message: format!(
                    "{name} is {} in {} bytes, expected {} of shape {shape:?}",
                    t.dtype.name(),
                    t.data.len(),
                    dtype.name()
                ),
            }
            .into());
        }
    }
    let scales: Vec<f32> = s
        .data
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok(Linear::Fp8(Fp8Weight {
        weight: allocs.upload(w.data, &wname)?,
        block_scales: allocs.upload(&scales, &sname)?,
        out_features: out_f,
        in_features: in_f,
    }))
}

/// Loads an RMSNorm weight of `len`; a zero-centred one (stored as `w` for a scale of
/// `1 + w`, as Qwen3-Next does) is stored with the 1 added, so every norm is a plain one.
pub fn load_norm(
    allocs: &DeviceAllocations,
    src: &dyn TensorSource,
    name: &str,
    len: usize,
    zero_centered: bool,
) -> crate::Result<DenseWeight> {
    if !zero_centered {
        return load_dense(allocs, src, name, &[len]);
    }
    let w: Vec<bf16> = src
        .read_bf16(name, &[len])?
        .into_iter()
        .map(|x| bf16::from_f32(1.0 + x.to_f32()))
        .collect();
    Ok(DenseWeight::upload(allocs, name, &[len], &w)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{CpuBackend, GpuBackend, GpuBackendExt};
    use crate::model::tensors::RawTensor;
    use std::collections::HashMap;
    use std::sync::Arc;

    struct MemSource(HashMap<String, (TensorType, Vec<usize>, Vec<u8>)>);

    impl TensorSource for MemSource {
        fn path(&self) -> &str {
            "memory"
        }
        fn names(&self) -> Vec<String> {
            self.0.keys().cloned().collect()
        }
        fn tensor(&self, name: &str) -> Result<Option<RawTensor<'_>>, ModelError> {
            Ok(self.0.get(name).map(|(t, s, d)| RawTensor {
                dtype: t.clone(),
                shape: s.clone(),
                data: d,
            }))
        }
    }

    #[test]
    fn nvfp4_projections_load_with_their_scales_and_bad_ones_are_named() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let allocs = DeviceAllocations::new(gpu.clone());
        let mut m = HashMap::new();
        m.insert(
            "p.weight".to_string(),
            (TensorType::U8, vec![4, 16], vec![0x21u8; 64]),
        );
        m.insert(
            "p.weight_scale".to_string(),
            (TensorType::F8E4M3, vec![4, 2], vec![0x38u8; 8]),
        );
        m.insert(
            "p.weight_scale_2".to_string(),
            (TensorType::F32, vec![], 0.25f32.to_le_bytes().to_vec()),
        );
        let src = MemSource(m);
        match load_linear(&allocs, &src, "p", 4, 32).unwrap() {
            Linear::Nvfp4(q) => {
                assert_eq!(
                    (q.out_features, q.in_features, q.weight_scale_2),
                    (4, 32, 0.25)
                );
                assert_eq!(q.input_scale, None);
            }
            other => panic!("expected NVFP4, got {other:?}"),
        }
        let err = load_linear(&allocs, &src, "p", 4, 64).unwrap_err();
        assert!(err.to_string().contains("\"p.weight\""), "{err}");
        let mut src = src;
        src.0.remove("p.weight_scale");
        let err = load_linear(&allocs, &src, "p", 4, 32).unwrap_err();
        assert!(err.to_string().contains("p.weight_scale"), "{err}");
        drop(allocs);
        assert_eq!(gpu.ledger().live_count(), 0);
    }

    #[test]
    fn fp8_projections_keep_their_bytes_and_block_scales() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let allocs = DeviceAllocations::new(gpu.clone());
        let (out_f, in_f) = (130, 4);
        let codes: Vec<u8> = (0..out_f * in_f).map(|i| (i % 251) as u8).collect();
        let scales: Vec<u8> = [0.5f32, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut m = HashMap::new();
        m.insert(
            "p.weight".to_string(),
            (TensorType::F8E4M3, vec![out_f, in_f], codes.clone()),
        );
        m.insert(
            "p.weight_scale_inv".to_string(),
            (TensorType::F32, vec![2, 1], scales),
        );
        let mut src = MemSource(m);
        match load_linear(&allocs, &src, "p", out_f, in_f).unwrap() {
            Linear::Fp8(f) => {
                assert_eq!((f.out_features, f.in_features), (out_f, in_f));
                assert_eq!(gpu.download::<u8>(f.weight, out_f * in_f).unwrap(), codes);
                let s = gpu.download::<f32>(f.block_scales, 2).unwrap();
                assert_eq!(s, vec![0.5, 3.0]);
            }
            other => panic!("expected FP8, got {other:?}"),
        }
        // One block row of scales for 130 rows is one too few.
        src.0.get_mut("p.weight_scale_inv").unwrap().1 = vec![1, 2];
        let err = load_linear(&allocs, &src, "p", out_f, in_f).unwrap_err();
        assert!(err.to_string().contains("p.weight_scale_inv"), "{err}");
        src.0.remove("p.weight_scale_inv");
        let err = load_linear(&allocs, &src, "p", out_f, in_f).unwrap_err();
        assert!(err.to_string().contains("p.weight_scale_inv"), "{err}");
        drop(allocs);
        assert_eq!(gpu.ledger().live_count(), 0);
    }
}
