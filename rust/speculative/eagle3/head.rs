//! `Eagle3Head`: construction from a checkpoint folder, alone or beside its target, and what
//! it reports about itself.
//!
//! The head is the MTP head's machinery (drafter KV pool, draft loop, deferred rows, scratch)
//! run over EAGLE-3 weights ([`MtpLayout::Eagle3`](crate::speculative::mtp::MtpLayout)); this
//! file only decides where each weight comes from. The embedding is the checkpoint's own
//! `embed_tokens.weight` when it has one, else the target's, read in place (the head then,
//! and only then, holds an `Arc` of the target so that memory outlives it); the LM head is
//! always the checkpoint's, over its draft vocabulary.
//!
//! Invariants: a loaded head's aux layer ids passed [`Eagle3Config::aux_layers`] against the
//! target's layer count; beside a target, its `vocab_size` and `target_hidden_size` are the
//! target's; everything the head allocates is freed when it is dropped, and a load that fails
//! part-way frees what it allocated.

use super::config::{Eagle3Config, Eagle3Format};
use super::load::{draft_to_target, has_embedding, layer_prefix, load_weights};
use crate::backend::GpuBackend;
use crate::model::{
    ConfigError, DeviceAllocations, Linear, ModelLevers, SafetensorsCheckpoint, TargetModel,
};
use crate::speculative::mtp::Eagle3Parts;
use crate::speculative::{MtpHead, MtpQuantization};
use std::path::Path;
use std::sync::Arc;

/// An EAGLE-3 draft head: drafts from the target's hiddens captured at several layers.
pub struct Eagle3Head {
    /// The MTP head's machinery over the EAGLE-3 weights.
    pub(crate) head: MtpHead,
    /// The layer ids as the checkpoint names them (the hidden entering layer `k`).
    aux_layer_ids: Vec<usize>,
    format: Eagle3Format,
    layer_prefix: &'static str,
}

fn in_file(path: &Path, e: ConfigError) -> ConfigError {
    match e {
        ConfigError::InFile { .. } => e,
        e => ConfigError::InFile {
            path: path.display().to_string(),
            source: Box::new(e),
        },
    }
}

fn mismatch(path: &Path, key: &str, mine: usize, theirs: usize, what: &str) -> ConfigError {
    in_file(
        path,
        ConfigError::BadValue {
            key: key.into(),
            message: format!(
                "is {mine}, but the target's {what} is {theirs}: this head was made for another model"
            ),
        },
    )
}

impl Eagle3Head {
    /// Loads the EAGLE-3 head in `dir` (a speculators or original EAGLE-3 checkpoint) onto
    /// `gpu`, to draft for a target of `target_layers` decoder layers. The checkpoint must
    /// carry its own `embed_tokens.weight`; a head without one is loaded beside its target
    /// ([`Eagle3Head::from_checkpoint_for_target`]).
    pub fn from_checkpoint(
        dir: impl AsRef<Path>,
        gpu: Arc<dyn GpuBackend>,
        target_layers: usize,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: &ModelLevers,
    ) -> crate::Result<Self> {
        let bf16 = MtpQuantization::Bf16;
        Self::from_checkpoint_quantized(
            dir,
            gpu,
            target_layers,
            bf16,
            max_seq_len,
            main_kv_blocks,
            levers,
        )
    }

    /// [`Eagle3Head::from_checkpoint`] with the head's matrices (`fc`, the decoder layer's
    /// projections and its own LM head; not the norms or an embedding) re-stored as `quant`
    /// says, by the MTP head's quantizers: a GGUF block format (`Q8_0`, say) where the
    /// backend runs block formats and a row is whole blocks, FP8 or NVFP4; `Bf16` keeps them
    /// as loaded. The loaded BF16 copies of re-stored matrices are freed.
    pub fn from_checkpoint_quantized(
        dir: impl AsRef<Path>,
        gpu: Arc<dyn GpuBackend>,
        target_layers: usize,
        quant: MtpQuantization,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: &ModelLevers,
    ) -> crate::Result<Self> {
        let sizes = (max_seq_len, main_kv_blocks);
        Self::load(dir.as_ref(), gpu, None, target_layers, quant, sizes, levers)
    }

    /// Loads the EAGLE-3 head in `dir` to draft for `target`, on the target's backend: the
    /// target's layer count decides the default aux layers, and the target's embedding is
    /// read in place unless the checkpoint carries its own.
    pub fn from_checkpoint_for_target(
        dir: impl AsRef<Path>,
        target: Arc<TargetModel>,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: &ModelLevers,
    ) -> crate::Result<Self> {
        let bf16 = MtpQuantization::Bf16;
        Self::from_checkpoint_for_target_quantized(
            dir,
            target,
            bf16,
            max_seq_len,
            main_kv_blocks,
            levers,
        )
    }

    /// [`Eagle3Head::from_checkpoint_for_target`] with the head's matrices re-stored as
    /// `quant` says (see [`Eagle3Head::from_checkpoint_quantized`]).
    pub fn from_checkpoint_for_target_quantized(
        dir: impl AsRef<Path>,
        target: Arc<TargetModel>,
        quant: MtpQuantization,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: &ModelLevers,
    ) -> crate::Result<Self> {
        let (gpu, layers) = (target.gpu().clone(), target.config().num_hidden_layers);
        let sizes = (max_seq_len, main_kv_blocks);
        Self::load(
            dir.as_ref(),
            gpu,
            Some(target),
            layers,
            quant,
            sizes,
            levers,
        )
    }

    /// `sizes`: `(max_seq_len, main_kv_blocks)`, which size the drafter KV pool.
    fn load(
        dir: &Path,
        gpu: Arc<dyn GpuBackend>,
        target: Option<Arc<TargetModel>>,
        target_layers: usize,
        quant: MtpQuantization,
        (max_seq_len, main_kv_blocks): (usize, usize),
        levers: &ModelLevers,
    ) -> crate::Result<Self> {
        let path = dir.join("config.json");
        let cfg = Eagle3Config::from_file(&path)?;
        let (h, vocab) = (cfg.layer.hidden_size, cfg.layer.vocab_size);
        if let Some(t) = &target {
            let tc = t.config();
            if cfg.layer.vocab_size != tc.vocab_size {
                return Err(
                    mismatch(&path, "vocab_size", vocab, tc.vocab_size, "vocab_size").into(),
                );
            }
            if cfg.target_hidden_size != tc.hidden_size {
                let key = "target_hidden_size (or hidden_size)";
                return Err(mismatch(
                    &path,
                    key,
                    cfg.target_hidden_size,
                    tc.hidden_size,
                    "hidden_size",
                )
                .into());
            }
        }
        let aux = cfg
            .aux_layers(target_layers)
            .map_err(|e| in_file(&path, e))?;
        let src = SafetensorsCheckpoint::open_dir(dir)?;
        let prefix = layer_prefix(&src)?;
        let map = draft_to_target(&src, cfg.draft_vocab_size, vocab)?;
        let shared_embed = match (has_embedding(&src)?, &target) {
            (true, _) => None,
            (false, Some(t)) => {
                let e = t.weights().embed.clone();
                if e.dims() != (vocab, h) {
                    return Err(crate::speculative::mtp::bad(
                        "Eagle3Head::from_checkpoint",
                        format!(
                            "{} has no embed_tokens.weight, and the target's embedding is [{}, {}], not [{vocab}, {h}]",
                            dir.display(),
                            e.dims().0,
                            e.dims().1
                        ),
                    ));
                }
                Some(e)
            }
            (false, None) => return Err(missing_embedding(dir)),
        };
        let shares = shared_embed.is_some();
        let allocs = DeviceAllocations::new(gpu.clone());
        let mut loaded = load_weights(&allocs, &src, &cfg, prefix, aux.len())?;
        // The BF16 matrices as loaded: those `quant` re-stores are freed once the head holds
        // its copies.
        let mut dense = MtpHead::dense_projections(&mut loaded.weights);
        if let Linear::Dense(d) = &loaded.lm_head {
            dense.push(d.ptr);
        }
        let embed = loaded
            .embed
            .map(Linear::Dense)
            .or(shared_embed)
            .ok_or_else(|| missing_embedding(dir))?;
        let parts = Eagle3Parts {
            draft_to_target: map,
            norm_before_residual: cfg.norm_before_residual,
        };
        let mut head = MtpHead::for_eagle3(
            loaded.weights,
            embed,
            loaded.lm_head,
            parts,
            &cfg.layer,
            gpu.as_ref(),
            quant,
            max_seq_len,
            main_kv_blocks,
            levers,
        )?;
        head.adopt_into(allocs);
        head.free_restored(&dense)?;
        // Held only where the head reads the target's memory, so that memory outlives it.
        head.target = target.filter(|_| shares);
        Ok(Eagle3Head {
            head,
            aux_layer_ids: aux,
            format: cfg.format,
            layer_prefix: prefix,
        })
    }

    /// The aux layer ids as the checkpoint (or vLLM's default) names them: the hidden
    /// entering layer `k`.
    pub fn aux_layer_ids(&self) -> &[usize] {
        &self.aux_layer_ids
    }

    /// The target layers whose outputs the head fuses, in specdraft's convention (the
    /// output of layer `i`): `k - 1` for each aux id `k`.
    pub fn capture_layer_ids(&self) -> Vec<usize> {
        self.aux_layer_ids.iter().map(|k| k - 1).collect()
    }

    /// `"speculators"` or `"eagle3"` (the original release), from `config.json`.
    pub fn format(&self) -> &'static str {
        match self.format {
            Eagle3Format::Speculators => "speculators",
            Eagle3Format::Original => "eagle3",
        }
    }

    /// The decoder layer's tensor prefix in the checkpoint (`"layers.0."` or `"midlayer."`).
    pub fn layer_prefix(&self) -> &'static str {
        self.layer_prefix
    }

    /// Rows of the head's own LM head (its draft vocabulary).
    pub fn draft_vocab_size(&self) -> usize {
        self.head.draft_vocab_size()
    }

    /// The target id of each draft id (`d + d2t[d]`).
    pub fn draft_to_target(&self) -> &[u32] {
        self.head
            .spec
            .eagle3
            .as_ref()
            .map_or(&[], |e| &e.draft_to_target)
    }

    /// Whether the head reads its target's embedding in place.
    pub fn shares_target(&self) -> bool {
        self.head.shares_target()
    }

    /// Turns tree growth on or off (off by default): on, `grows_trees()` is true and an
    /// engine under the `"tree"` draft shape asks the head for an EAGLE-2 tree per
    /// sequence (see the MTP head's `set_grow_trees`).
    pub fn set_grow_trees(&self, on: bool) {
        self.head.set_grow_trees(on);
    }

    /// Blocks in the drafter KV pool, and how many are free.
    pub fn kv_blocks(&self) -> (usize, usize) {
        self.head.kv_blocks()
    }

    /// Bytes of weights one draft step reads.
    pub fn bytes_per_draft(&self) -> usize {
        self.head.bytes_per_draft()
    }

    /// Row `row` of the f32 logits (over the draft vocabulary) of the head's latest forward.
    pub fn last_logits(&self, gpu: &dyn GpuBackend, row: usize) -> crate::Result<Vec<f32>> {
        self.head.last_logits(gpu, row)
    }

    /// The storage of the head's projections as a draft step reads them (`"bf16"`, `"q8_0"`,
    /// ...; `fc`'s, which the layer's projections share unless a row is not whole blocks).
    pub fn projection_format(&self) -> &'static str {
        self.head.projection_format()
    }

    /// The storage of the head's own LM head (`"bf16"`, `"q8_0"`, ...).
    pub fn lm_head_format(&self) -> &'static str {
        self.head.lm_head_format()
    }

    /// The draft layer's configuration (its `vocab_size` is the target's).
    pub fn config(&self) -> &crate::model::ModelConfig {
        self.head.config()
    }
}

/// The error of a head with no embedding of its own loaded without its target.
fn missing_embedding(dir: &Path) -> crate::Error {
    crate::model::ModelError::MissingTensor {
        path: dir.display().to_string(),
        tensor: "embed_tokens.weight (a head without its own embedding is loaded beside its target: target=)".into(),
    }
    .into()
}
