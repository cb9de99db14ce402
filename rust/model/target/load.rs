//! Loading a [`TargetModel`]: a HF directory or a GGUF file (each weight in its stored
//! format, or a float checkpoint quantized as it loads), or any [`TensorSource`], with the
//! sizes [`LoadOptions`] chooses.
//!
//! Invariants: a load either returns a model whose every buffer (weights, KV caches, the
//! arena, outputs) is owned by its [`DeviceAllocations`], or fails having freed everything
//! it allocated.

use super::{Scratch, TargetModel, BLOCK_SIZE, NEXT_MODEL_ID};
use crate::backend::quant::BlockFormat;
use crate::backend::{Dtype, GpuBackend, RopeStyle};
use crate::memory::{BlockAllocator, BufferArena};
use crate::model::capture::CaptureBuffer;
use crate::model::decoder_weights::{DecoderWeights, NameScheme};
use crate::model::gguf::GgufFile;
use crate::model::hf_checkpoint::SafetensorsCheckpoint;
use crate::model::layers::{
    arena_slots, rope_inv_freq, ExpertShard, LayerCache, LayerScratch, LayerShape,
};
use crate::model::quantized_source::QuantizedSource;
use crate::model::tensors::TensorSource;
use crate::model::weights::DeviceAllocations;
use crate::model::{ModelConfig, ModelError};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Sizes chosen at load time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Most token rows one forward may carry (all sequences together).
    pub max_rows: usize,
    /// Longest sequence; `None`: the model's context, at most 4096.
    pub max_seq_len: Option<usize>,
    /// KV blocks in the pool; `None`: enough for two sequences of `max_seq_len`.
    pub kv_blocks: Option<usize>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            max_rows: 512,
            max_seq_len: None,
            kv_blocks: None,
        }
    }
}

impl TargetModel {
    /// Loads a checkpoint: a HF directory (`config.json` + `*.safetensors`) or a `.gguf` file,
    /// each weight in the format the file holds it in.
    pub fn load(
        path: impl AsRef<Path>,
        gpu: Arc<dyn GpuBackend>,
        opts: LoadOptions,
    ) -> crate::Result<Self> {
        Self::load_with_weights(path, gpu, opts, None)
    }

    /// [`TargetModel::load`], with a HF checkpoint's float matrices quantized to `weights` at
    /// load (see [`QuantizedSource`] for which); `None` keeps what the file has. A GGUF file
    /// keeps its own formats, so asking it for another is an error.
    pub fn load_with_weights(
        path: impl AsRef<Path>,
        gpu: Arc<dyn GpuBackend>,
        opts: LoadOptions,
        weights: Option<BlockFormat>,
    ) -> crate::Result<Self> {
        Self::load_sharded(path, gpu, opts, weights, None)
    }

    /// [`TargetModel::load_with_weights`] holding only `expert_shard`'s routed experts of
    /// each MoE layer (see [`ExpertShard`]); `None` holds them all.
    pub fn load_sharded(
        path: impl AsRef<Path>,
        gpu: Arc<dyn GpuBackend>,
        opts: LoadOptions,
        weights: Option<BlockFormat>,
        expert_shard: Option<ExpertShard>,
    ) -> crate::Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            let (config, src) = SafetensorsCheckpoint::open_with_config(path)?;
            let quantized = weights
                .map(|format| QuantizedSource::new(&src, format))
                .transpose()?;
            let src: &dyn TensorSource = match &quantized {
                Some(q) => q,
                None => &src,
            };
            Self::from_source_sharded(
                gpu,
                config,
                src,
                NameScheme::HuggingFace,
                RopeStyle::Half,
                opts,
                expert_shard,
            )
        } else if path.is_file() {
            if let Some(format) = weights {
                return Err(ModelError::invalid(
                    "load_model",
                    format!(
                        "weights={format} quantizes a safetensors checkpoint at load; {} is a GGUF file, whose weights keep the formats they are stored in",
                        path.display()
                    ),
                )
                .into());
            }
            let src = GgufFile::open(path)?;
            let config = src.model_config()?;
            // llama.cpp's converter permutes llama q/k rows for adjacent-pair RoPE; the
            // Qwen converters do not.
            let style = match src.architecture() {
                Some("llama") => RopeStyle::Interleaved,
                _ => RopeStyle::Half,
            };
            Self::from_source_sharded(
                gpu,
                config,
                &src,
                NameScheme::Gguf,
                style,
                opts,
                expert_shard,
            )
        } else {
            Err(ModelError::Io {
                path: path.display().to_string(),
                message: "no such file or directory".into(),
            }
            .into())
        }
    }

    /// Builds the model from any tensor source. On error everything allocated is freed.
    pub fn from_source(
        gpu: Arc<dyn GpuBackend>,
        config: ModelConfig,
        src: &dyn TensorSource,
        scheme: NameScheme,
        rope_style: RopeStyle,
        opts: LoadOptions,
    ) -> crate::Result<Self> {
        Self::from_source_sharded(gpu, config, src, scheme, rope_style, opts, None)
    }

    /// [`TargetModel::from_source`] holding only `expert_shard`'s routed experts of each MoE
    /// layer (every rank of the shard's communicator loads its own; see [`ExpertShard`]).
    pub fn from_source_sharded(
        gpu: Arc<dyn GpuBackend>,
        config: ModelConfig,
        src: &dyn TensorSource,
        scheme: NameScheme,
        rope_style: RopeStyle,
        opts: LoadOptions,
        expert_shard: Option<ExpertShard>,
    ) -> crate::Result<Self> {
        config.validate()?;
        let max_seq_len = opts
            .max_seq_len
            .unwrap_or(config.max_position_embeddings.min(4096));
        if opts.max_rows == 0 || max_seq_len == 0 {
            return Err(ModelError::invalid(
                "TargetModel",
                "max_rows and max_seq_len must be positive",
            )
            .into());
        }
        let max_blocks_per_seq = max_seq_len.div_ceil(BLOCK_SIZE);
        let kv_blocks = opts.kv_blocks.unwrap_or(2 * max_blocks_per_seq);
        let inv = rope_inv_freq(&config)?;
        let allocs = DeviceAllocations::new(gpu.clone());
        let weights = DecoderWeights::load(&allocs, src, &config, scheme, expert_shard.as_ref())?;
        let arena = BufferArena::new(gpu.as_ref(), "arena", &arena_slots(&config), opts.max_rows)?;
        // The model frees the arena's buffers with everything else, so that dropping the
        // model leaves nothing live even while a ForwardContext still holds the Arc.
        for s in arena.slots() {
            allocs.adopt(s.ptr);
        }
        let scratch_slots = LayerScratch::from_arena(&arena)?;
        let num_slots = kv_blocks * BLOCK_SIZE;
        // Under MLA a row of the two caches is half of a token's latent (`kv_cache_row`).
        let cache_bytes = num_slots * config.kv_cache_width() * Dtype::Bf16.size();
        let mut caches = Vec::with_capacity(config.num_hidden_layers);
        for l in 0..config.num_hidden_layers {
            caches.push(LayerCache {
                k: allocs.alloc(cache_bytes, &format!("kv_cache.{l}.k"))?,
                v: allocs.alloc(cache_bytes, &format!("kv_cache.{l}.v"))?,
                num_slots,
                block_size: BLOCK_SIZE,
            });
        }
        // Six per-row lists (the sixth, row parents, only for draft trees) and the table.
        let meta_len = 6 * opts.max_rows + opts.max_rows * max_blocks_per_seq;
        Ok(TargetModel {
            id: NEXT_MODEL_ID.fetch_add(1, Ordering::Relaxed),
            next_seq: AtomicU64::new(1),
            expert_shard,
            inv_freq: allocs.upload(&inv, "rope_inv_freq")?,
            logits: allocs.alloc(opts.max_rows * config.vocab_size * 4, "target_logits")?,
            picks: allocs.alloc(opts.max_rows * 4, "target_picks")?,
            hiddens: allocs.alloc(opts.max_rows * config.hidden_size * 2, "target_hiddens")?,
            meta: allocs.alloc(meta_len * 4, "target_forward_meta")?,
            pool: BlockAllocator::new(kv_blocks, BLOCK_SIZE)?,
            scratch_slots,
            shape: LayerShape::of(&config),
            gpu,
            config: Arc::new(config),
            weights,
            caches,
            buffers: Arc::new(arena),
            rope_style,
            max_rows: opts.max_rows,
            max_seq_len,
            max_blocks_per_seq,
            scratch: Mutex::new(Scratch {
                staging: Vec::with_capacity(meta_len),
                capture: CaptureBuffer::empty(),
            }),
            allocs,
        })
    }
}
