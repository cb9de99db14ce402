//! `MtpHead::from_checkpoint`: a Hugging Face checkpoint folder (`config.json` plus
//! safetensors) to a ready head, in any of the three MTP layouts.
//!
//! The embedding and the target's final norm are the main model's (`model.embed_tokens`,
//! `model.norm`); the LM head is the module's own `shared_head.head` where the layout has
//! one, else `lm_head`, else the tied embedding. A BF16 LM head is quantized to NVFP4 on
//! load (the head always drafts through an NVFP4 LM head); an NVFP4 one is taken as stored.
//! Everything is freed when the head is dropped.

use super::head::MtpHead;
use super::nvfp4::quantize_nvfp4;
use super::quantization::MtpQuantization;
use super::weights::{find_layout, load_norm, MtpLayout, MtpWeights};
use crate::backend::GpuBackend;
use crate::model::layers::load_linear;
use crate::model::tensors::{TensorSource, TensorType};
use crate::model::{
    ConfigError, DeviceAllocations, Linear, ModelConfig, ModelError, ModelLevers, QuantizedWeight,
    SafetensorsCheckpoint,
};
use std::path::Path;
use std::sync::Arc;

impl MtpHead {
    /// Loads the MTP module found in `dir` (module 0 where there are several) and builds the
    /// head. Errors name the file and tensor; when no layout matches, the error lists what
    /// was looked for and what the checkpoint holds.
    #[allow(clippy::too_many_arguments)]
    pub fn from_checkpoint(
        dir: impl AsRef<Path>,
        gpu: Arc<dyn GpuBackend>,
        quant: MtpQuantization,
        mtp_vocab_size: u32,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: &ModelLevers,
    ) -> crate::Result<Self> {
        let (config, src) = SafetensorsCheckpoint::open_with_config(dir.as_ref())?;
        let groups = moe_groups(&dir.as_ref().join("config.json"), &config)?;
        Self::from_source(
            &src,
            &config,
            groups,
            gpu,
            quant,
            mtp_vocab_size,
            max_seq_len,
            main_kv_blocks,
            levers,
        )
    }

    /// [`MtpHead::from_checkpoint`] from any tensor source and a parsed config.
    /// `moe_groups` is DeepSeek/GLM's `(n_group, topk_group)` for group-limited routing
    /// (`(1, 1)` when the model has none).
    #[allow(clippy::too_many_arguments)]
    pub fn from_source(
        src: &dyn TensorSource,
        config: &ModelConfig,
        moe_groups: (usize, usize),
        gpu: Arc<dyn GpuBackend>,
        quant: MtpQuantization,
        mtp_vocab_size: u32,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: &ModelLevers,
    ) -> crate::Result<Self> {
        let layout = find_layout(src, config)?;
        let allocs = DeviceAllocations::new(gpu.clone());
        let mut weights = MtpWeights::load(&allocs, src, config, layout, 0, None)?;
        if let Some(moe) = weights.layer.moe_mut() {
            (moe.n_group, moe.topk_group) = moe_groups;
        }
        let (h, vocab) = (config.hidden_size, config.vocab_size);
        let embed_name = "model.embed_tokens.weight";
        let embed = crate::model::layers::load_dense(&allocs, src, embed_name, &[vocab, h])?;
        let final_norm = load_norm(
            &allocs,
            src,
            "model.norm.weight",
            h,
            layout.zero_centered_norms(),
        )?;
        let lm_head = load_lm_head(&allocs, src, config, layout)?;
        let loaded = MtpHead::dense_projections(&mut weights);
        let mut head = MtpHead::new(
            weights,
            embed,
            final_norm,
            lm_head,
            None,
            config,
            gpu.as_ref(),
            quant,
            mtp_vocab_size,
            max_seq_len,
            main_kv_blocks,
            levers,
        )?;
        head.adopt_into(allocs);
        head.free_restored(&loaded)?;
        Ok(head)
    }
}

/// `(n_group, topk_group)` from a `config.json` (`(1, 1)` when absent): the routed experts
/// split into `n_group` equal groups, of which the `topk_group` best are kept. Values that do
/// not describe such a split are errors naming the file.
pub(super) fn moe_groups(path: &Path, config: &ModelConfig) -> Result<(usize, usize), ConfigError> {
    let map = ModelConfig::read_json(path)?;
    let bad = |key: &str, message: String| ConfigError::InFile {
        path: path.display().to_string(),
        source: Box::new(ConfigError::BadValue {
            key: key.to_string(),
            message,
        }),
    };
    let get = |key: &str| match map.get(key) {
        None | Some(serde_json::Value::Null) => Ok(1),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .filter(|&n| n > 0)
            .ok_or_else(|| bad(key, format!("expected a positive integer, found {v}"))),
    };
    // Only routed experts are grouped; a dense model's values are never used.
    let Some(experts) = config.moe.as_ref().map(|m| m.num_experts) else {
        return Ok((1, 1));
    };
    let (n_group, topk_group) = (get("n_group")?, get("topk_group")?);
    if experts % n_group != 0 {
        return Err(bad(
            "n_group",
            format!("is {n_group}, which does not divide the {experts} routed experts"),
        ));
    }
    if topk_group > n_group {
        return Err(bad(
            "topk_group",
            format!("is {topk_group}, more than the {n_group} groups"),
        ));
    }
    Ok((n_group, topk_group))
}

fn load_lm_head(
    allocs: &DeviceAllocations,
    src: &dyn TensorSource,
    config: &ModelConfig,
    layout: MtpLayout,
) -> crate::Result<QuantizedWeight> {
    let (h, vocab) = (config.hidden_size, config.vocab_size);
    let (module, _) = layout.prefixes(config, 0);
    let mut candidates = Vec::new();
    if layout == MtpLayout::DeepseekV3 {
        candidates.push(format!("{module}shared_head.head"));
    }
    candidates.push("lm_head".to_string());
    candidates.push("model.embed_tokens".to_string());
    for base in &candidates {
        if src.tensor(&format!("{base}.weight"))?.is_none() {
            continue;
        }
        let name = format!("{base}.weight");
        if src.require(&name)?.dtype == TensorType::U8 {
            if let Linear::Nvfp4(q) = load_linear(allocs, src, base, vocab, h)? {
                return Ok(q);
            }
        }
        let values: Vec<f32> = src
            .read_bf16(&name, &[vocab, h])?
            .into_iter()
            .map(f32::from)
            .collect();
        return quantize_nvfp4(&values, vocab, h)?.upload(allocs, &name);
    }
    Err(ModelError::MissingTensor {
        path: src.path().to_string(),
        tensor: format!(
            "an LM head (looked for {})",
            candidates
                .iter()
                .map(|c| format!("{c}.weight"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
    .into())
}
