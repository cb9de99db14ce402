//! `MtpHead`: construction and the device memory it owns.
//!
//! The head owns (and frees in [`MtpHead::release`], or on drop when it was loaded by
//! [`MtpHead::from_checkpoint`]) its drafter KV caches, its forward scratch, the RoPE table,
//! the deferred-token slot and any projection it re-quantized. The weights given to
//! [`MtpHead::new`] stay the caller's.

use super::bad;
use super::forward::{Eagle3Parts, HeadSpec};
use super::head_memory::{requantize, Owned};
use super::quantization::MtpQuantization;
use super::scratch::Scratch;
use super::state::{DrafterKv, DRAFTER_BLOCK_SIZE};
use super::weight_checks::{check_weights, first_rows};
use super::weights::{MtpLayout, MtpWeights};
use crate::backend::{DevicePtr, Dtype, GpuBackend, GpuBackendExt};
use crate::memory::BlockAllocator;
use crate::model::layers::rope_inv_freq;
use crate::model::{
    DenseWeight, DeviceAllocations, Linear, ModelConfig, ModelLevers, QuantizedWeight, TargetModel,
};
use crate::speculative::DraftRunner;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// Sequences one batched propose (and one forward) takes at most.
pub const MTP_MAX_BATCH: usize = 32;
/// Rows one prefill or catch-up forward takes at most (longer inputs are chunked).
pub const MTP_CHUNK_ROWS: usize = 32;
/// Drafter rows a state can hold beyond its token budget (drafts run past the budget).
pub(crate) const DRAFT_SLACK_ROWS: usize = 64;

static NEXT_HEAD_ID: AtomicU64 = AtomicU64::new(1);

/// The MTP draft head.
pub struct MtpHead {
    pub(crate) id: u64,
    /// What every forward reads (weights, caches, sizes, levers).
    pub(crate) spec: HeadSpec,
    pub(crate) kv: DrafterKv,
    pub(crate) scratch: Mutex<Scratch>,
    pub(crate) deferred: DevicePtr,
    pub(crate) max_seq_len: usize,
    /// Device memory `new` allocated, freed by `release`.
    pub(crate) device: Mutex<Vec<DevicePtr>>,
    /// Weights loaded by `from_checkpoint` (and the memory above, once adopted): freed on drop.
    pub(crate) owned: Option<DeviceAllocations>,
    /// The target whose embedding, final norm and LM head the head reads in place, when it
    /// was loaded beside one ([`MtpHead::from_checkpoint_for_target`]): held so that memory
    /// outlives the head.
    pub(crate) target: Option<Arc<TargetModel>>,
    pub(crate) runner: RwLock<Option<Arc<dyn DraftRunner>>>,
    /// Whether a propose of no drafts defers its row's KV write to the sequence's next
    /// drafting propose (on by default; off writes it at once).
    pub(crate) defer_rows: std::sync::atomic::AtomicBool,
    /// Whether `grows_trees()` answers true, so an engine asks for trees (off by default:
    /// on a CPU a tree's extra nodes, each a verify row and a head step, did not pay).
    pub(crate) grow_trees: std::sync::atomic::AtomicBool,
}

fn invalid(message: String) -> crate::Error {
    bad("MtpHead::new", message)
}

impl MtpHead {
    /// Builds the head from its weights, sharing the target's embedding, final norm and an
    /// NVFP4 LM head.
    ///
    /// `lm_head_nvfp4_t`: an optional trimmed copy of the LM head holding only its first `n`
    /// rows (`n` the `u32`), used for drafting instead of `lm_head_nvfp4` when given.
    /// Otherwise drafts come from the first `mtp_vocab_size` rows of `lm_head_nvfp4` (all of
    /// them when 0). The drafter KV pool holds `16`-row blocks: enough for
    /// [`MTP_MAX_BATCH`] sequences of `max_seq_len` rows, capped at `main_kv_blocks` (the
    /// drafter holds at most one row per target token, so it never needs more blocks than
    /// the target's pool of 16-row blocks).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        weights: MtpWeights,
        embed_tokens: DenseWeight,
        target_final_norm: DenseWeight,
        lm_head_nvfp4: QuantizedWeight,
        lm_head_nvfp4_t: Option<(QuantizedWeight, u32)>,
        config: &ModelConfig,
        gpu: &dyn GpuBackend,
        quant: MtpQuantization,
        mtp_vocab_size: u32,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: &ModelLevers,
    ) -> crate::Result<Self> {
        Self::build_or_free(
            gpu,
            weights,
            Linear::Dense(embed_tokens),
            target_final_norm,
            Linear::Nvfp4(lm_head_nvfp4),
            lm_head_nvfp4_t.map(|(t, n)| (Linear::Nvfp4(t), n)),
            config,
            quant,
            mtp_vocab_size,
            max_seq_len,
            main_kv_blocks,
            levers,
            None,
        )
    }

    /// [`MtpHead::new`] with an LM head of any storage (the target's own, shared), and
    /// drafts from its first `mtp_vocab_size` rows (all when 0).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn with_lm_head(
        weights: MtpWeights,
        embed_tokens: Linear,
        target_final_norm: DenseWeight,
        lm_head: Linear,
        config: &ModelConfig,
        gpu: &dyn GpuBackend,
        quant: MtpQuantization,
        mtp_vocab_size: u32,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: &ModelLevers,
    ) -> crate::Result<Self> {
        Self::build_or_free(
            gpu,
            weights,
            embed_tokens,
            target_final_norm,
            lm_head,
            None,
            config,
            quant,
            mtp_vocab_size,
            max_seq_len,
            main_kv_blocks,
            levers,
            None,
        )
    }

    /// The machinery of an EAGLE-3 head ([`Eagle3Head`](crate::speculative::Eagle3Head)):
    /// `weights` of layout [`MtpLayout::Eagle3`], its own LM head over the draft vocabulary
    /// (every row), and what the EAGLE-3 forward adds. The MTP levers do not apply: the
    /// target rows are fed as captured, the chain feeds the pre-norm hidden, and accepted
    /// drafts keep their draft-time rows. `quant` re-stores the projections (`fc` among them)
    /// and, since the head owns it, the LM head as [`MtpHead::new`] re-stores projections.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn for_eagle3(
        weights: MtpWeights,
        embed_tokens: Linear,
        lm_head: Linear,
        eagle3: Eagle3Parts,
        config: &ModelConfig,
        gpu: &dyn GpuBackend,
        quant: MtpQuantization,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: &ModelLevers,
    ) -> crate::Result<Self> {
        let levers = ModelLevers {
            mtp_kv_exact: false,
            mtp_target_postnorm: false,
            mtp_chain_postnorm: false,
            ..*levers
        };
        // The target's final norm is never read with `mtp_target_postnorm` off; the head's
        // own stands in for it.
        let final_norm = weights.final_norm.clone();
        Self::build_or_free(
            gpu,
            weights,
            embed_tokens,
            final_norm,
            lm_head,
            None,
            config,
            quant,
            0,
            max_seq_len,
            main_kv_blocks,
            &levers,
            Some(eagle3),
        )
    }

    /// [`MtpHead::build`] on fresh allocations, every one of them freed if it fails.
    #[allow(clippy::too_many_arguments)]
    fn build_or_free(
        gpu: &dyn GpuBackend,
        weights: MtpWeights,
        embed: Linear,
        target_final_norm: DenseWeight,
        lm_head: Linear,
        lm_head_t: Option<(Linear, u32)>,
        config: &ModelConfig,
        quant: MtpQuantization,
        mtp_vocab_size: u32,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: &ModelLevers,
        eagle3: Option<Eagle3Parts>,
    ) -> crate::Result<Self> {
        let mut owned = Owned {
            gpu,
            ptrs: Vec::new(),
        };
        let result = Self::build(
            &mut owned,
            weights,
            embed,
            target_final_norm,
            lm_head,
            lm_head_t,
            config,
            quant,
            mtp_vocab_size,
            max_seq_len,
            main_kv_blocks,
            levers,
            eagle3,
        );
        if result.is_err() {
            owned.free_all();
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        owned: &mut Owned<'_>,
        mut weights: MtpWeights,
        embed: Linear,
        target_final_norm: DenseWeight,
        lm_head: Linear,
        lm_head_t: Option<(Linear, u32)>,
        config: &ModelConfig,
        quant: MtpQuantization,
        mtp_vocab_size: u32,
        max_seq_len: usize,
        main_kv_blocks: usize,
        levers: &ModelLevers,
        eagle3: Option<Eagle3Parts>,
    ) -> crate::Result<Self> {
        config.validate()?;
        let (h, vocab) = (config.hidden_size, config.vocab_size);
        if (weights.layout == MtpLayout::Eagle3) != eagle3.is_some() {
            return Err(invalid(
                "EAGLE-3 weights are drafted by Eagle3Head, and only those".into(),
            ));
        }
        check_weights(&weights, &embed, &target_final_norm, config)?;
        let (lm_rows, lm_cols) = lm_head.dims();
        if lm_cols != h || lm_rows > vocab || lm_rows == 0 {
            return Err(invalid(format!(
                "lm_head is [{lm_rows}, {lm_cols}]; expected [rows <= vocab_size {vocab}, hidden_size {h}]"
            )));
        }
        let (head, draft_vocab) = match lm_head_t {
            Some((t, n)) => {
                let (rows, cols) = t.dims();
                if cols != h || rows != n as usize || n == 0 {
                    return Err(invalid(format!(
                        "lm_head_nvfp4_t is [{rows}, {cols}] with {n} rows declared; expected [{n}, {h}]"
                    )));
                }
                (t, n as usize)
            }
            None if mtp_vocab_size == 0 => (lm_head.clone(), lm_rows),
            None if mtp_vocab_size as usize <= lm_rows => {
                (lm_head.clone(), mtp_vocab_size as usize)
            }
            None => {
                return Err(invalid(format!(
                    "mtp_vocab_size {mtp_vocab_size} exceeds the LM head's {lm_rows} rows"
                )))
            }
        };
        if draft_vocab > vocab {
            return Err(invalid(format!(
                "the draft vocabulary ({draft_vocab}) exceeds vocab_size {vocab}"
            )));
        }
        if let Some(e) = &eagle3 {
            if e.draft_to_target.len() != draft_vocab {
                return Err(invalid(format!(
                    "{} draft-to-target ids for a draft vocabulary of {draft_vocab}",
                    e.draft_to_target.len()
                )));
            }
            if let Some((d, t)) = e
                .draft_to_target
                .iter()
                .enumerate()
                .find(|(_, &t)| t as usize >= vocab)
            {
                return Err(invalid(format!(
                    "draft id {d} maps to target id {t}, outside vocab_size {vocab}"
                )));
            }
        }
        let mut head = first_rows(&head, draft_vocab)?;
        if eagle3.is_some() {
            // An EAGLE-3 head's LM head is its own, and its largest matrix: a draft step
            // reads it whole, so it is stored as the projections are.
            requantize(owned, &mut head, quant)?;
        }
        if max_seq_len == 0 || main_kv_blocks == 0 {
            return Err(invalid(format!(
                "max_seq_len ({max_seq_len}) and main_kv_blocks ({main_kv_blocks}) must be positive"
            )));
        }
        for lin in weights.projections_mut() {
            requantize(owned, lin, quant)?;
        }
        let max_blocks_per_seq = (max_seq_len + DRAFT_SLACK_ROWS).div_ceil(DRAFTER_BLOCK_SIZE);
        let num_blocks = (max_blocks_per_seq * MTP_MAX_BATCH).min(main_kv_blocks);
        // A row holds what a target layer's cache row does: its keys and values, or under
        // MLA half the token's latent in each cache.
        let cache_len = num_blocks * DRAFTER_BLOCK_SIZE * config.kv_cache_width();
        let kv = DrafterKv {
            allocator: BlockAllocator::new(num_blocks, DRAFTER_BLOCK_SIZE)?,
            k: owned.alloc(Dtype::Bf16, cache_len, "mtp:k_cache")?,
            v: owned.alloc(Dtype::Bf16, cache_len, "mtp:v_cache")?,
            num_blocks,
        };
        let freqs = rope_inv_freq(config)?;
        let inv_freq = owned.upload(&freqs, "mtp:rope_inv_freq")?;
        let deferred = owned.alloc(Dtype::U32, 1, "mtp:deferred_token")?;
        let num_slots = kv.num_slots();
        let spec = HeadSpec {
            config: config.clone(),
            levers: *levers,
            weights,
            embed,
            target_final_norm,
            lm_head: head,
            draft_vocab,
            k_cache: kv.k,
            v_cache: kv.v,
            num_slots,
            inv_freq,
            rotary_dim: freqs.len() * 2,
            max_blocks_per_seq,
            eagle3,
        };
        let rows = MTP_MAX_BATCH.max(MTP_CHUNK_ROWS);
        let (scratch, slots) = Scratch::alloc(owned.gpu, &spec, rows)?;
        owned.ptrs.extend(slots.iter().map(|s| s.ptr));
        Ok(MtpHead {
            id: NEXT_HEAD_ID.fetch_add(1, Ordering::Relaxed),
            spec,
            kv,
            scratch: Mutex::new(scratch),
            deferred,
            max_seq_len,
            device: Mutex::new(std::mem::take(&mut owned.ptrs)),
            owned: None,
            target: None,
            runner: RwLock::new(None),
            defer_rows: std::sync::atomic::AtomicBool::new(true),
            grow_trees: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Frees the device memory `new` allocated (caches, scratch, re-quantized weights).
    /// Call it once every state is freed; later calls free nothing. A head loaded by
    /// [`MtpHead::from_checkpoint`] also frees it on drop.
    pub fn release(&self, gpu: &dyn GpuBackend) -> crate::Result<()> {
        let ptrs = std::mem::take(&mut *self.device.lock().unwrap_or_else(|e| e.into_inner()));
        let mut first = None;
        for p in ptrs.into_iter().rev() {
            if let Err(e) = gpu.free(p) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), |e| Err(e.into()))
    }

    /// The BF16 projections a forward reads (routed experts included), to tell which of
    /// them [`MtpHead::new`] re-stored in another format.
    pub(crate) fn dense_projections(weights: &mut MtpWeights) -> Vec<DevicePtr> {
        let dense = |l: &mut Linear| match l {
            Linear::Dense(d) => Some(d.ptr),
            _ => None,
        };
        weights
            .projections_mut()
            .into_iter()
            .filter_map(dense)
            .collect()
    }

    /// Frees the BF16 projections in `loaded` (owned by the allocations the head adopted)
    /// that the head no longer reads because `new` re-stored them as FP8 or NVFP4, so a
    /// quantized head holds only its quantized copies. `loaded` may name the head's own LM
    /// head too (an EAGLE-3 head's), freed likewise once re-stored.
    pub(crate) fn free_restored(&mut self, loaded: &[DevicePtr]) -> crate::Result<()> {
        let mut kept = Self::dense_projections(&mut self.spec.weights);
        if let Linear::Dense(d) = &self.spec.lm_head {
            kept.push(d.ptr);
        }
        let Some(allocs) = &self.owned else {
            return Ok(());
        };
        for p in loaded.iter().filter(|p| !kept.contains(p)) {
            allocs.free(*p)?;
        }
        Ok(())
    }

    /// Hands the head's own device memory to `allocs`, which frees it with the weights.
    pub(crate) fn adopt_into(&mut self, allocs: DeviceAllocations) {
        for p in std::mem::take(&mut *self.device.lock().unwrap_or_else(|e| e.into_inner())) {
            allocs.adopt(p);
        }
        self.owned = Some(allocs);
    }

    /// The head's weights.
    pub fn weights(&self) -> &MtpWeights {
        &self.spec.weights
    }

    /// Rows of the LM head drafts are chosen from.
    pub fn draft_vocab_size(&self) -> usize {
        self.spec.draft_vocab
    }

    /// The storage of the head's own projections as a draft step reads them (`"bf16"`,
    /// `"q8_0"`, ...; `eh_proj`'s, which every projection shares unless a row width does not
    /// divide into the blocks asked for).
    pub fn projection_format(&self) -> &'static str {
        self.spec.weights.eh_proj.format_name()
    }

    /// The storage of the LM head drafts are chosen with (`"nvfp4"`, or the shared target's
    /// own format, `"q8_0"` say).
    pub fn lm_head_format(&self) -> &'static str {
        self.spec.lm_head.format_name()
    }

    /// Blocks in the drafter KV pool, and how many are free.
    pub fn kv_blocks(&self) -> (usize, usize) {
        (self.kv.num_blocks, self.kv.allocator.num_free())
    }

    /// Bytes of weights one draft step reads: the projections and norms, one embedding
    /// row, and the LM head rows drafts are chosen from.
    pub fn bytes_per_draft(&self) -> usize {
        self.spec.weights.nbytes() + self.spec.config.hidden_size * 2 + self.spec.lm_head.nbytes()
    }

    /// Row `row` of the f32 logits of the head's latest own forward (over the draft
    /// vocabulary): the logits that picked the last draft of the latest `propose`. For
    /// tests and debugging; not synchronised with concurrent proposes.
    pub fn last_logits(&self, gpu: &dyn GpuBackend, row: usize) -> crate::Result<Vec<f32>> {
        let sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if row >= sc.rows {
            return Err(invalid(format!(
                "row {row} is past the {} scratch rows",
                sc.rows
            )));
        }
        let v = self.spec.draft_vocab;
        Ok(gpu.download::<f32>(sc.logits.offset(row * v * 4), v)?)
    }

    /// The configuration the head was built for.
    pub fn config(&self) -> &ModelConfig {
        &self.spec.config
    }
}
