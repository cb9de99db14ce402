//! The Llama-family decoder's weights: tensor names per checkpoint format (Hugging Face,
//! GGUF), and loading every tensor the config implies with its shape checked.
//!
//! Invariants: a loaded [`DecoderWeights`] has every tensor the config implies, with the
//! shape it implies (`[out, in]` projections); every device buffer it points to is owned
//! by the [`DeviceAllocations`] it was loaded into.

use super::tensors::{TensorSource, TensorType};
use super::weights::{DenseWeight, DeviceAllocations, Linear, QuantizedWeight};
use super::{ModelConfig, ModelError};

/// How a checkpoint names its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameScheme {
    /// Hugging Face (`model.layers.{i}.self_attn.q_proj.weight`).
    HuggingFace,
    /// llama.cpp's GGUF (`blk.{i}.attn_q.weight`).
    Gguf,
}

/// The parts of a decoder layer, named in [`NameScheme::name`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    AttnNorm,
    Q,
    K,
    V,
    O,
    QNorm,
    KNorm,
    FfnNorm,
    Gate,
    Up,
    Down,
}

impl NameScheme {
    /// The name of layer `layer`'s `part` (without `.weight` / `.bias`).
    pub fn name(self, layer: usize, part: Part) -> String {
        let (hf, gg) = match part {
            Part::AttnNorm => ("input_layernorm", "attn_norm"),
            Part::Q => ("self_attn.q_proj", "attn_q"),
            Part::K => ("self_attn.k_proj", "attn_k"),
            Part::V => ("self_attn.v_proj", "attn_v"),
            Part::O => ("self_attn.o_proj", "attn_output"),
            Part::QNorm => ("self_attn.q_norm", "attn_q_norm"),
            Part::KNorm => ("self_attn.k_norm", "attn_k_norm"),
            Part::FfnNorm => ("post_attention_layernorm", "ffn_norm"),
            Part::Gate => ("mlp.gate_proj", "ffn_gate"),
            Part::Up => ("mlp.up_proj", "ffn_up"),
            Part::Down => ("mlp.down_proj", "ffn_down"),
        };
        match self {
            NameScheme::HuggingFace => format!("model.layers.{layer}.{hf}"),
            NameScheme::Gguf => format!("blk.{layer}.{gg}"),
        }
    }

    /// `(embedding, final norm, lm head)` tensor names.
    pub fn globals(self) -> (&'static str, &'static str, &'static str) {
        match self {
            NameScheme::HuggingFace => (
                "model.embed_tokens.weight",
                "model.norm.weight",
                "lm_head.weight",
            ),
            NameScheme::Gguf => ("token_embd.weight", "output_norm.weight", "output.weight"),
        }
    }
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

/// One decoder layer's weights.
pub struct LayerWeights {
    pub attn_norm: DenseWeight,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_bias: Option<DenseWeight>,
    pub k_bias: Option<DenseWeight>,
    pub v_bias: Option<DenseWeight>,
    pub q_norm: Option<DenseWeight>,
    pub k_norm: Option<DenseWeight>,
    pub ffn_norm: DenseWeight,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

/// Every weight of a decoder-only Llama-family model.
pub struct DecoderWeights {
    pub embed: DenseWeight,
    pub layers: Vec<LayerWeights>,
    pub final_norm: DenseWeight,
    /// `None` when tied to the embedding.
    pub lm_head: Option<Linear>,
}

impl DecoderWeights {
    /// Loads and checks every tensor `config` implies.
    pub fn load(
        allocs: &DeviceAllocations,
        src: &dyn TensorSource,
        config: &ModelConfig,
        scheme: NameScheme,
    ) -> crate::Result<Self> {
        let (h, qs, kvs, ffn) = (
            config.hidden_size,
            config.q_size(),
            config.kv_size(),
            config.intermediate_size,
        );
        let (embed_name, norm_name, head_name) = scheme.globals();
        let embed = load_dense(allocs, src, embed_name, &[config.vocab_size, h])?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let n = |p: Part| scheme.name(i, p);
            let lin = |p: Part, o: usize, inp: usize| load_linear(allocs, src, &n(p), o, inp);
            let vecw = |p: Part, suffix: &str, len: usize| {
                load_dense(allocs, src, &format!("{}.{suffix}", n(p)), &[len])
            };
            let bias = |p: Part, len: usize| -> crate::Result<Option<DenseWeight>> {
                if config.attention_bias {
                    vecw(p, "bias", len).map(Some)
                } else {
                    Ok(None)
                }
            };
            let norm = |p: Part| -> crate::Result<Option<DenseWeight>> {
                if config.qk_norm {
                    vecw(p, "weight", config.head_dim).map(Some)
                } else {
                    Ok(None)
                }
            };
            layers.push(LayerWeights {
                attn_norm: vecw(Part::AttnNorm, "weight", h)?,
                q: lin(Part::Q, qs, h)?,
                k: lin(Part::K, kvs, h)?,
                v: lin(Part::V, kvs, h)?,
                o: lin(Part::O, h, qs)?,
                q_bias: bias(Part::Q, qs)?,
                k_bias: bias(Part::K, kvs)?,
                v_bias: bias(Part::V, kvs)?,
                q_norm: norm(Part::QNorm)?,
                k_norm: norm(Part::KNorm)?,
                ffn_norm: vecw(Part::FfnNorm, "weight", h)?,
                gate: lin(Part::Gate, ffn, h)?,
                up: lin(Part::Up, ffn, h)?,
                down: lin(Part::Down, h, ffn)?,
            });
        }
        let final_norm = load_dense(allocs, src, norm_name, &[h])?;
        let has_head = src.tensor(head_name)?.is_some();
        let lm_head =
            if has_head && !(config.tie_word_embeddings && scheme == NameScheme::HuggingFace) {
                let base = head_name.trim_end_matches(".weight");
                Some(load_linear(allocs, src, base, config.vocab_size, h)?)
            } else if config.tie_word_embeddings || scheme == NameScheme::Gguf {
                None
            } else {
                return Err(ModelError::MissingTensor {
                    path: src.path().to_string(),
                    tensor: head_name.to_string(),
                }
                .into());
            };
        Ok(DecoderWeights {
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }

    /// Bytes of weights one decode step reads (every layer, the final norm and the head;
    /// the embedding only for the rows looked up, so it is not counted unless tied).
    pub fn bytes_per_token(&self) -> usize {
        let dense = |w: &DenseWeight| w.nbytes();
        let mut total = dense(&self.final_norm);
        for l in &self.layers {
            total += dense(&l.attn_norm) + dense(&l.ffn_norm);
            for lin in [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down] {
                total += lin.nbytes();
            }
        }
        total
            + self
                .lm_head
                .as_ref()
                .map_or(self.embed.nbytes(), Linear::nbytes)
    }
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
