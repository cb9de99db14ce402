//! Loading one weight from a [`TensorSource`] with its shape checked: dense BF16 tensors,
//! RMSNorm weights (zero-centred ones stored with the 1 added), and projections in any
//! format the checkpoint holds them in.
//!
//! Invariant: what these return lives in the given [`DeviceAllocations`] and has exactly
//! the shape asked for; anything else is an error naming the tensor and the file. A GGUF
//! block-format projection stays in its format (repacked, the file's size) on a backend with
//! block kernels (the CPU backend), and is dequantized to BF16 for any other.

use crate::backend::quant::PackedWeight;
use crate::backend::{CpuBackend, GpuBackend};
use crate::model::tensors::{TensorSource, TensorType};
use crate::model::{
    DenseWeight, DeviceAllocations, Linear, ModelError, PackedLinear, QuantizedWeight,
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

/// Loads projection `base` (`{base}.weight`, `[out, in]`): dense, or NVFP4 when the
/// checkpoint stores packed codes with `{base}.weight_scale` / `weight_scale_2`.
pub fn load_linear(
    allocs: &DeviceAllocations,
    src: &dyn TensorSource,
    base: &str,
    out_f: usize,
    in_f: usize,
) -> crate::Result<Linear> {
    let wname = format!("{base}.weight");
    let w = src.require(&wname)?;
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
    if w.shape != [out_f, in_f / 2] || in_f % 16 != 0 {
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
    use crate::backend::{CpuBackend, GpuBackend};
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
}
