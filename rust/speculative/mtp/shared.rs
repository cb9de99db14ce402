//! `MtpHead::from_checkpoint_for_target`: a head folder that holds only the head's own
//! weights, run beside a loaded target whose embedding, final norm and LM head it reads in
//! place.
//!
//! A trained head (`specdraft train-mtp`) stores its ~4M parameters and not the target's
//! ~28M-parameter embedding and LM head; loading it beside the target takes those from the
//! target's own device buffers, whatever storage the target keeps them in, so nothing is
//! copied or quantized.
//!
//! Invariants: the head allocates nothing the size of the embedding or the LM head (its
//! device memory is its own weights, drafter KV, scratch and RoPE table); it holds an `Arc`
//! of the target, so the shared buffers outlive it (the target can only be freed through
//! `&mut`, which no one holds while the head lives); its `config.json` has the target's
//! `hidden_size` and `vocab_size`, or loading fails naming the file, the key and both values.

use super::checkpoint::moe_groups;
use super::head::MtpHead;
use super::quantization::MtpQuantization;
use super::weights::{find_layout, MtpWeights};
use crate::model::{
    ConfigError, DeviceAllocations, ModelConfig, ModelLevers, SafetensorsCheckpoint, TargetModel,
};
use std::path::Path;
use std::sync::Arc;

impl MtpHead {
    /// Loads the head in `dir` (`config.json` plus safetensors of the MTP module alone) to
    /// draft for `target`, on the target's backend.
    ///
    /// The embedding, the target's final norm and the LM head are the target's buffers
    /// (the LM head is the tied embedding when the target has no separate one). Drafts come
    /// from the LM head's first `mtp_vocab_size` rows; 0 takes `mtp_vocab_size` from the
    /// head's `config.json`, or every row when it names none. Everything the head allocates
    /// is freed on drop. On one rank of a multi-rank target (loaded with an expert shard)
    /// the head holds this rank's share of its routed experts too, and `needs_comm` is true.
    pub fn from_checkpoint_for_target(
        dir: impl AsRef<Path>,
        target: Arc<TargetModel>,
        quant: MtpQuantization,
        mtp_vocab_size: u32,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: &ModelLevers,
    ) -> crate::Result<Self> {
        let dir = dir.as_ref();
        let config_path = dir.join("config.json");
        let (config, src) = SafetensorsCheckpoint::open_with_config(dir)?;
        check_matches_target(&config_path, &config, target.config())?;
        let draft_rows = match mtp_vocab_size {
            0 => stated_draft_vocab(&config_path)?,
            n => n,
        };
        let gpu = target.gpu().clone();
        let allocs = DeviceAllocations::new(gpu.clone());
        let layout = find_layout(&src, &config)?;
        // On one rank of several the head's routed experts are split as the target's are.
        let shard = target.expert_shard();
        let mut weights = MtpWeights::load(&allocs, &src, &config, layout, 0, shard)?;
        if let Some(moe) = weights.layer.moe_mut() {
            (moe.n_group, moe.topk_group) = moe_groups(&config_path, &config)?;
        }
        let shared = target.weights();
        let loaded = MtpHead::dense_projections(&mut weights);
        let lm_head = shared
            .lm_head
            .clone()
            .unwrap_or_else(|| shared.embed.clone());
        let mut head = MtpHead::with_lm_head(
            weights,
            shared.embed.clone(),
            shared.final_norm.clone(),
            lm_head,
            &config,
            gpu.as_ref(),
            quant,
            draft_rows,
            max_seq_len,
            main_kv_blocks,
            levers,
        )?;
        head.adopt_into(allocs);
        head.free_restored(&loaded)?;
        head.target = Some(target);
        Ok(head)
    }

    /// Whether the head reads a target's embedding and LM head in place.
    pub fn shares_target(&self) -> bool {
        self.target.is_some()
    }
}

/// Refuses a head whose hidden size or vocabulary is not the target's.
fn check_matches_target(
    path: &Path,
    head: &ModelConfig,
    target: &ModelConfig,
) -> Result<(), ConfigError> {
    let pairs = [
        ("hidden_size", head.hidden_size, target.hidden_size),
        ("vocab_size", head.vocab_size, target.vocab_size),
    ];
    for (key, mine, theirs) in pairs {
        if mine != theirs {
            return Err(ConfigError::InFile {
                path: path.display().to_string(),
                source: Box::new(ConfigError::BadValue {
                    key: key.into(),
                    message: format!(
                        "is {mine}, but the target's is {theirs}: this head was made for another model"
                    ),
                }),
            });
        }
    }
    Ok(())
}

/// The `mtp_vocab_size` a head's `config.json` states (0, every row, when absent).
fn stated_draft_vocab(path: &Path) -> Result<u32, ConfigError> {
    let map = ModelConfig::read_json(path)?;
    match map.get("mtp_vocab_size") {
        None | Some(serde_json::Value::Null) => Ok(0),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| ConfigError::InFile {
                path: path.display().to_string(),
                source: Box::new(ConfigError::BadValue {
                    key: "mtp_vocab_size".into(),
                    message: format!("expected a non-negative integer, found {v}"),
                }),
            }),
    }
}
