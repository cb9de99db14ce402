//! `DFlashHead`: loading a DFlash checkpoint beside its target, and the device memory the
//! head owns.
//!
//! The head reads the target's embedding and LM head in place (a DFlash checkpoint holds
//! neither) and holds an `Arc` of the target so that memory outlives it. It owns its weights,
//! one K and one V cache per draft layer (every layer's rows at the same slots, so one block
//! table serves all), the RoPE table and its forward scratch, all in one
//! [`DeviceAllocations`] freed when the head is dropped (a load that fails part-way frees
//! what it had allocated the same way).
//!
//! Invariants: a loaded head's `hidden_size` and `vocab_size` are the target's, its layer ids
//! passed [`DFlashConfig::target_layers`] against the target, its mask token lies in the
//! vocabulary, and its draft vocabulary (the LM head rows drafts are chosen from) is a
//! prefix of the target's LM head that the head reads in place.

use super::config::DFlashConfig;
use super::forward::Scratch;
use super::load::{load_weights, DFlashWeights};
use super::state::DFLASH_BLOCK_ROWS;
use super::storage::store_in;
use crate::backend::quant::{BlockFormat, GROUP_ROWS};
use crate::backend::{DevicePtr, GpuBackend, GpuBackendExt};
use crate::memory::BlockAllocator;
use crate::model::layers::{rope_inv_freq, LayerShape};
use crate::model::{
    ConfigError, DenseWeight, DeviceAllocations, Fp8Weight, Linear, ModelConfig, PackedLinear,
    QuantizedWeight, SafetensorsCheckpoint, TargetModel,
};
use crate::speculative::ProposerError;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Sequences whose context the drafter KV pool is sized for (as the MTP head's).
const POOL_SEQUENCES: usize = 32;
/// Context rows one forward of the context takes at most (longer prefills are chunked).
pub(crate) const CONTEXT_CHUNK_ROWS: usize = 32;

/// Sequences whose blocks one forward runs at most (`propose_batch_max`): a batch of four
/// reads the draft layers and the LM head once where four proposes read them four times,
/// and its scratch stays `4 γ` rows.
pub const DFLASH_MAX_BATCH: usize = 4;

static NEXT_HEAD_ID: AtomicU64 = AtomicU64::new(1);

/// A DFlash (block diffusion) draft head: drafts a whole block of γ - 1 tokens in one
/// forward from the target's hiddens captured at several layers.
pub struct DFlashHead {
    pub(crate) id: u64,
    /// The draft layers' configuration (its vocabulary is the target's).
    pub(crate) config: ModelConfig,
    pub(crate) layer_shape: LayerShape,
    pub(crate) weights: DFlashWeights,
    /// The target's embedding, read in place.
    pub(crate) embed: Linear,
    /// The target's LM head's first `draft_vocab` rows, read in place.
    pub(crate) lm_head: Linear,
    pub(crate) draft_vocab: usize,
    pub(crate) block_size: usize,
    pub(crate) mask_token_id: u32,
    target_layer_ids: Vec<usize>,
    pub(crate) pool: BlockAllocator,
    /// BF16 `[layers, num_slots, kv_heads, head_dim]` each.
    pub(crate) k_cache: DevicePtr,
    pub(crate) v_cache: DevicePtr,
    pub(crate) num_slots: usize,
    pub(crate) inv_freq: DevicePtr,
    pub(crate) scratch: Mutex<Scratch>,
    /// Whether proposes of 0 drafts defer their context rows (see `deferred`).
    pub(crate) defer_rows: AtomicBool,
    max_seq_len: usize,
    max_blocks_per_seq: usize,
    /// Everything above that lives on the device and is the head's; freed on drop.
    _allocs: DeviceAllocations,
    /// The target whose embedding and LM head the head reads.
    _target: Arc<TargetModel>,
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

fn invalid(message: String) -> crate::Error {
    ProposerError::InvalidArgument {
        method: "DFlashHead::from_checkpoint",
        message,
    }
    .into()
}

/// The first `n` rows of the LM head, read in place (every storage keeps rows contiguous
/// and in order; a repacked block format keeps them in groups of [`GROUP_ROWS`], so only a
/// whole number of groups is a matrix of its own).
fn first_rows(lin: &Linear, n: usize) -> crate::Result<Linear> {
    if let Linear::Packed(q) = lin {
        if q.format.is_quantized() && !n.is_multiple_of(GROUP_ROWS) && n != q.out_features {
            return Err(invalid(format!(
                "draft_vocab={n}: the target's {} LM head is read in place, which takes a multiple of {GROUP_ROWS} rows",
                q.format
            )));
        }
    }
    Ok(match lin {
        Linear::Dense(w) => Linear::Dense(DenseWeight {
            ptr: w.ptr,
            shape: vec![n, w.shape[1]],
        }),
        Linear::Nvfp4(q) => Linear::Nvfp4(QuantizedWeight {
            out_features: n,
            ..q.clone()
        }),
        Linear::Fp8(q) => Linear::Fp8(Fp8Weight {
            out_features: n,
            ..q.clone()
        }),
        Linear::Packed(q) => Linear::Packed(PackedLinear {
            out_features: n,
            ..q.clone()
        }),
    })
}

impl DFlashHead {
    /// Loads the DFlash head in `dir` (z-lab's layout: `config.json` and safetensors of
    /// `fc`, `hidden_norm`, `layers.*`, `norm`) to draft for `target`, on the target's
    /// backend, reading the target's embedding and LM head in place.
    ///
    /// `draft_vocab`: score only the LM head's first `n` rows (all of them when `None`).
    /// `quant`: re-store the head's projections in that GGUF block format (on the CPU
    /// backend; as loaded when `None`). `max_seq_len` and `main_kv_blocks` size the drafter
    /// KV pool: enough for 32 sequences of `max_seq_len` rows, capped near the target's pool
    /// of `main_kv_blocks` blocks.
    pub fn from_checkpoint_for_target(
        dir: impl AsRef<Path>,
        target: Arc<TargetModel>,
        draft_vocab: Option<usize>,
        quant: Option<BlockFormat>,
        max_seq_len: usize,
        main_kv_blocks: usize,
    ) -> crate::Result<Self> {
        let dir = dir.as_ref();
        let path = dir.join("config.json");
        let cfg = DFlashConfig::from_file(&path)?;
        let tc = target.config();
        let (h, vocab) = (cfg.layer.hidden_size, cfg.layer.vocab_size);
        for (key, mine, theirs) in [
            ("hidden_size", h, tc.hidden_size),
            ("vocab_size", vocab, tc.vocab_size),
        ] {
            if mine != theirs {
                let e = ConfigError::BadValue {
                    key: key.into(),
                    message: format!(
                        "is {mine}, but the target's is {theirs}: this head was made for another model"
                    ),
                };
                return Err(in_file(&path, e).into());
            }
        }
        let taps = cfg
            .target_layers(tc.num_hidden_layers)
            .map_err(|e| in_file(&path, e))?;
        if max_seq_len == 0 || main_kv_blocks == 0 {
            return Err(invalid(format!(
                "max_seq_len ({max_seq_len}) and main_kv_blocks ({main_kv_blocks}) must be positive"
            )));
        }
        let shared = target.weights();
        let embed = shared.embed.clone();
        let lm_full = shared.lm_head.clone().unwrap_or_else(|| embed.clone());
        if embed.dims() != (vocab, h) || lm_full.dims() != (vocab, h) {
            return Err(invalid(format!(
                "the target's embedding is {:?} and its LM head {:?}, not [{vocab}, {h}]",
                embed.dims(),
                lm_full.dims()
            )));
        }
        let draft_vocab = draft_vocab.unwrap_or(vocab);
        if draft_vocab == 0 || draft_vocab > vocab {
            return Err(invalid(format!(
                "draft_vocab={draft_vocab}: it must be in 1..={vocab} (the target's vocabulary)"
            )));
        }
        let lm_head = first_rows(&lm_full, draft_vocab)?;

        let gpu = target.gpu().clone();
        let allocs = DeviceAllocations::new(gpu.clone());
        let src = SafetensorsCheckpoint::open_dir(dir)?;
        let mut weights = load_weights(&allocs, &src, &cfg, taps.len())?;
        if let Some(format) = quant {
            store_in(&allocs, &mut weights, format)?;
        }
        let config = cfg.layer.clone();
        let freqs = rope_inv_freq(&config)?;
        let inv_freq = allocs.upload(&freqs, "dflash:rope_inv_freq")?;
        let layer_shape = LayerShape {
            rotary_dim: freqs.len() * 2,
            ..LayerShape::of(&config)
        };
        let g = cfg.block_size;
        let max_blocks_per_seq = (max_seq_len + g).div_ceil(DFLASH_BLOCK_ROWS);
        // The context holds at most one row per target token; each sequence's block adds a
        // few rows more.
        let block_blocks = g.div_ceil(DFLASH_BLOCK_ROWS) + 1;
        let num_blocks = (max_blocks_per_seq * POOL_SEQUENCES)
            .min(main_kv_blocks.saturating_add(block_blocks * POOL_SEQUENCES));
        let num_slots = num_blocks * DFLASH_BLOCK_ROWS;
        let layers = config.num_hidden_layers;
        let cache_bytes = layers
            .checked_mul(num_slots)
            .and_then(|n| n.checked_mul(config.kv_size() * 2))
            .ok_or_else(|| {
                invalid(format!(
                    "a drafter KV pool of {num_blocks} blocks overflows"
                ))
            })?;
        let k_cache = allocs.alloc(cache_bytes, "dflash:k_cache")?;
        let v_cache = allocs.alloc(cache_bytes, "dflash:v_cache")?;
        let mlp_width = weights
            .layers
            .iter()
            .map(|l| l.mlp.max_width())
            .max()
            .unwrap_or(0);
        let rows = (g * DFLASH_MAX_BATCH).max(CONTEXT_CHUNK_ROWS);
        let (scratch, slots) = Scratch::alloc(
            gpu.as_ref(),
            &config,
            mlp_width,
            draft_vocab,
            rows,
            max_blocks_per_seq,
        )?;
        for s in &slots {
            allocs.adopt(s.ptr);
        }
        Ok(DFlashHead {
            id: NEXT_HEAD_ID.fetch_add(1, Ordering::Relaxed),
            config,
            layer_shape,
            weights,
            embed,
            lm_head,
            draft_vocab,
            block_size: g,
            mask_token_id: cfg.mask_token_id,
            target_layer_ids: taps,
            pool: BlockAllocator::new(num_blocks, DFLASH_BLOCK_ROWS)?,
            k_cache,
            v_cache,
            num_slots,
            inv_freq,
            scratch: Mutex::new(scratch),
            defer_rows: AtomicBool::new(true),
            max_seq_len,
            max_blocks_per_seq,
            _allocs: allocs,
            _target: target,
        })
    }

    /// The target layers whose outputs the head fuses (specdraft's convention, the output
    /// of layer `i`, which is z-lab's `hidden_states[i + 1]`).
    pub fn capture_layer_ids(&self) -> &[usize] {
        &self.target_layer_ids
    }

    /// γ: rows of one block forward; a propose drafts at most γ - 1 tokens.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The token the block's rows after the first hold.
    pub fn mask_token_id(&self) -> u32 {
        self.mask_token_id
    }

    /// Rows of the target's LM head drafts are chosen from.
    pub fn draft_vocab_size(&self) -> usize {
        self.draft_vocab
    }

    /// The storage of the head's projections (`"bf16"`, `"q8_0"`, ...; its first layer's
    /// `q_proj`'s, which every projection shares unless a row is not whole blocks).
    pub fn projection_format(&self) -> &'static str {
        self.weights
            .layers
            .first()
            .map_or("bf16", |l| l.q.format_name())
    }

    /// Draft layers.
    pub fn num_layers(&self) -> usize {
        self.weights.layers.len()
    }

    /// Blocks in the drafter KV pool, and how many are free.
    pub fn kv_blocks(&self) -> (usize, usize) {
        (self.pool.num_blocks(), self.pool.num_free())
    }

    /// Bytes of weights one block forward reads: the draft layers, `norm`, γ embedding rows
    /// and the LM head rows drafts are chosen from (`fc` is read by context rows only).
    pub fn bytes_per_block(&self) -> usize {
        let row = self.embed.nbytes() / self.config.vocab_size.max(1);
        self.weights.nbytes() + self.block_size * row + self.lm_head.nbytes()
    }

    /// Row `row` of the f32 logits (over the draft vocabulary) of the latest block (the
    /// first sequence's, after a batch): the logits that picked draft `row` (block row
    /// `row + 1`). Rows past the latest propose's drafts hold an earlier block's. For tests
    /// and debugging; not synchronised with concurrent proposes.
    pub fn last_logits(&self, gpu: &dyn GpuBackend, row: usize) -> crate::Result<Vec<f32>> {
        if row + 1 >= self.block_size {
            return Err(ProposerError::InvalidArgument {
                method: "DFlashHead::last_logits",
                message: format!(
                    "row {row}: a block of {} rows drafts at most {}",
                    self.block_size,
                    self.block_size - 1
                ),
            }
            .into());
        }
        let sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let v = self.draft_vocab;
        Ok(gpu.download::<f32>(sc.logits.offset(row * v * 4), v)?)
    }

    /// The draft layers' configuration (its `vocab_size` is the target's).
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Entries of a block table in a forward (the most blocks any state holds).
    pub(crate) fn max_blocks_per_seq(&self) -> usize {
        self.max_blocks_per_seq
    }

    /// Blocks a state with a budget of `budget_tokens` may hold: its context and one block.
    pub(crate) fn capacity_blocks(&self, budget_tokens: usize) -> usize {
        budget_tokens
            .min(self.max_seq_len)
            .saturating_add(self.block_size)
            .div_ceil(DFLASH_BLOCK_ROWS)
            .min(self.max_blocks_per_seq)
    }

    /// Bytes of one captured row (`taps * hidden` BF16).
    pub(crate) fn stack_row_bytes(&self) -> usize {
        self.target_layer_ids.len() * self.config.hidden_size * 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_of_a_repacked_lm_head_is_whole_groups_only() {
        let packed = Linear::Packed(PackedLinear {
            blocks: DevicePtr(4096),
            format: crate::backend::quant::BlockFormat::Q8_0,
            out_features: 100,
            in_features: 64,
        });
        assert_eq!(first_rows(&packed, 16).unwrap().dims(), (16, 64));
        assert_eq!(first_rows(&packed, 100).unwrap().dims(), (100, 64));
        let err = first_rows(&packed, 17).unwrap_err().to_string();
        assert!(
            err.contains("draft_vocab=17") && err.contains("multiple of 8"),
            "{err}"
        );
        let dense = Linear::Dense(DenseWeight {
            ptr: DevicePtr(64),
            shape: vec![100, 64],
        });
        assert_eq!(first_rows(&dense, 17).unwrap().dims(), (17, 64));
    }
}
