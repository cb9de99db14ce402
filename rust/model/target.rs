//! `TargetModel`: a Llama-family decoder (Llama, SmolLM2, Qwen2/2.5/3, MiMo's base, the
//! GQA mixture-of-experts families GLM-4.5 and Qwen3-MoE, and DeepSeek-V3 with multi-head
//! latent attention) with a paged KV cache, serving prefill and verification for many
//! sequences in one forward. An MLA layer's cache holds one latent row a token (see
//! [`ModelConfig::kv_cache_row`]).
//!
//! Invariants:
//! - Every device buffer the model uses (weights, KV caches, scratch, outputs) is owned by
//!   one [`DeviceAllocations`]; after [`TargetModel::free`] or drop the ledger holds none of them.
//! - A [`KvSequence`] holds exactly `ceil(len / block_size)` blocks of the model's pool, and
//!   rows `0..len` of those blocks hold its keys and values.
//! - `forward` is all-or-nothing: on error no sequence changes and no block is taken.
//! - Forwards are serialised (one scratch, one set of outputs); the outputs stay valid until
//!   the next forward.
//! - A draft tree's verify forward ([`TargetModel::forward_tree`]) writes its rows to the
//!   sequence's next cache rows in node order, each at its depth's position; `compact` then
//!   moves the accepted path's rows down after the prefix (in order, never reading a row it
//!   wrote) and drops the rest, leaving the cache a plain forward of the path would.
//! - A forward that names capture layers (see [`super::capture`]) also returns the hidden
//!   after each of them for every row; one that names none reads and writes nothing more
//!   than a forward without capture, and allocates nothing for it.

use super::batch::{stage, Plan, RowTrees};
use super::capture::{check_layer_ids, Capture, CaptureBuffer};
use super::decoder_weights::{DecoderWeights, NameScheme};
use super::gguf::GgufFile;
use super::hf_checkpoint::SafetensorsCheckpoint;
use super::layers::{
    arena_slots, decoder_layer, decoder_layer_tree, rope_inv_freq, ExpertShard, LayerCache,
    LayerDepth, LayerIo, LayerScratch, LayerShape,
};
use super::quantized_source::QuantizedSource;
pub use super::sequence::{ForwardOutput, KvSequence, LogitRows};
use super::tensors::TensorSource;
use super::weights::DeviceAllocations;
use super::{ModelConfig, ModelError};
use crate::backend::quant::BlockFormat;
use crate::backend::{
    DevicePtr, Dtype, EmbeddingArgs, GpuBackend, KvCopyArgs, RmsNormArgs, RopeStyle, DEFAULT_STREAM,
};
use crate::memory::{BlockAllocator, BufferArena};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// KV rows per block.
pub const BLOCK_SIZE: usize = 16;

static NEXT_MODEL_ID: AtomicU64 = AtomicU64::new(1);

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

struct Scratch {
    staging: Vec<u32>,
    capture: CaptureBuffer,
}

/// A loaded Llama-family target model.
pub struct TargetModel {
    id: u64,
    /// The id the next [`KvSequence`] gets (what rank 0 names it by to its workers).
    next_seq: AtomicU64,
    /// This rank's routed experts, on a multi-rank load.
    expert_shard: Option<ExpertShard>,
    gpu: Arc<dyn GpuBackend>,
    config: Arc<ModelConfig>,
    weights: DecoderWeights,
    caches: Vec<LayerCache>,
    pool: BlockAllocator,
    buffers: Arc<BufferArena>,
    /// The layers' view of `buffers`.
    scratch_slots: LayerScratch,
    shape: LayerShape,
    rope_style: RopeStyle,
    inv_freq: DevicePtr,
    logits: DevicePtr,
    /// u32 `[max_rows]`: room for one token a logits row ([`ForwardOutput::picks`]).
    picks: DevicePtr,
    hiddens: DevicePtr,
    meta: DevicePtr,
    max_rows: usize,
    max_seq_len: usize,
    max_blocks_per_seq: usize,
    scratch: Mutex<Scratch>,
    // Last field: dropped after everything that points into it.
    allocs: DeviceAllocations,
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

    /// The configuration.
    pub fn config(&self) -> &Arc<ModelConfig> {
        &self.config
    }

    /// The backend every buffer lives on.
    pub fn gpu(&self) -> &Arc<dyn GpuBackend> {
        &self.gpu
    }

    /// Longest sequence a forward accepts.
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// Most rows one forward accepts.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// The KV block pool (free counts, block size).
    pub fn kv_pool(&self) -> &BlockAllocator {
        &self.pool
    }

    /// The shared forward scratch, for a `ForwardContext`.
    pub fn buffers(&self) -> &Arc<BufferArena> {
        &self.buffers
    }

    /// The RoPE pairing the q/k weights were stored for.
    pub fn rope_style(&self) -> RopeStyle {
        self.rope_style
    }

    /// The loaded weights.
    pub fn weights(&self) -> &DecoderWeights {
        &self.weights
    }

    /// Weight bytes one decode step reads.
    pub fn weight_bytes_per_token(&self) -> usize {
        self.weights.bytes_per_token()
    }

    /// This rank's routed experts and the ranks the model spans, on a multi-rank load;
    /// `None` on one rank.
    pub fn expert_shard(&self) -> Option<&ExpertShard> {
        self.expert_shard.as_ref()
    }

    /// An empty sequence, holding no blocks.
    pub fn new_sequence(&self) -> KvSequence {
        KvSequence {
            blocks: Vec::new(),
            len: 0,
            model_id: self.id,
            id: self.next_seq.fetch_add(1, Ordering::Relaxed),
        }
    }

    fn check_owner(&self, seq: &KvSequence, op: &'static str) -> Result<(), ModelError> {
        if seq.model_id != self.id {
            return Err(ModelError::invalid(
                op,
                "the sequence was not created by this model",
            ));
        }
        Ok(())
    }

    /// Appends `tokens[i]` to `seqs[i]` and runs the model on the new rows, with logits for
    /// every row; see the module docs for the all-or-nothing contract.
    pub fn forward(
        &self,
        seqs: &mut [&mut KvSequence],
        tokens: &[&[u32]],
    ) -> crate::Result<ForwardOutput> {
        self.forward_with(seqs, tokens, LogitRows::All)
    }

    /// [`TargetModel::forward`] with a choice of which rows get logits.
    pub fn forward_with(
        &self,
        seqs: &mut [&mut KvSequence],
        tokens: &[&[u32]],
        logit_rows: LogitRows,
    ) -> crate::Result<ForwardOutput> {
        self.forward_capturing(seqs, tokens, logit_rows, &[])
    }

    /// [`TargetModel::forward_with`] that also captures the hidden after each decoder layer
    /// in `layers` (ids below `num_hidden_layers`, distinct; see [`super::capture`]) for
    /// every row, into the output's `hidden_stack`: BF16 `[rows, layers.len() * hidden]`,
    /// the layers side by side in the order given. With no layers it is `forward_with`.
    pub fn forward_capturing(
        &self,
        seqs: &mut [&mut KvSequence],
        tokens: &[&[u32]],
        logit_rows: LogitRows,
        layers: &[usize],
    ) -> crate::Result<ForwardOutput> {
        self.forward_rows(seqs, tokens, logit_rows, layers, None)
    }

    /// [`TargetModel::forward_capturing`] with logits for every row, where sequence `i`'s
    /// rows form a draft tree when `trees[i]` is `Some(parents)`: its first row (the last
    /// verified token) is the root and row `k + 1`'s parent is row `parents[k]` (`<= k`).
    /// Each row sits at its depth's position (the root at the sequence's length) and
    /// attends to the prefix, its ancestors' rows and its own; its key and value go to the
    /// sequence's next cache row in row order, as in any forward, so [`TargetModel::compact`]
    /// must follow to keep one path. `None` is a chain (a plain forward of those rows).
    pub fn forward_tree(
        &self,
        seqs: &mut [&mut KvSequence],
        tokens: &[&[u32]],
        trees: &[Option<&[usize]>],
        layers: &[usize],
    ) -> crate::Result<ForwardOutput> {
        const OP: &str = "TargetModel::forward_tree";
        if trees.len() != tokens.len() {
            return Err(ModelError::invalid(
                OP,
                format!("{} trees for {} token lists", trees.len(), tokens.len()),
            )
            .into());
        }
        for (i, (tree, t)) in trees.iter().zip(tokens).enumerate() {
            let Some(parents) = tree else { continue };
            if parents.len() + 1 != t.len() {
                return Err(ModelError::invalid(
                    OP,
                    format!(
                        "sequence {i}: {} parents for {} rows (one per row after the first)",
                        parents.len(),
                        t.len()
                    ),
                )
                .into());
            }
            if let Some((k, &p)) = parents.iter().enumerate().find(|(k, &p)| p > *k) {
                return Err(ModelError::invalid(
                    OP,
                    format!(
                        "sequence {i}: row {}'s parent row {p} is not an earlier row",
                        k + 1
                    ),
                )
                .into());
            }
        }
        // Chains only: the plain forward, with no mask at all.
        let trees = trees.iter().any(Option::is_some).then_some(trees);
        self.forward_rows(seqs, tokens, LogitRows::All, layers, trees)
    }

    /// Keeps one path of a draft tree's verify forward: cache rows `rows` (increasing, each
    /// at or after its destination, below the sequence's length) move, in order, to the
    /// rows from `start` on, and the sequence is trimmed to `start + rows.len()`. The keys
    /// and values move unchanged; a node's position was its depth's, which is the row it
    /// lands on.
    pub fn compact(&self, seq: &mut KvSequence, start: usize, rows: &[usize]) -> crate::Result<()> {
        const OP: &str = "TargetModel::compact";
        self.check_owner(seq, OP)?;
        let end = start + rows.len();
        let fault = rows.iter().enumerate().find_map(|(k, &r)| {
            if r < start + k {
                Some(format!("row {r} would move up, to row {}", start + k))
            } else if k > 0 && r <= rows[k - 1] {
                Some(format!("rows {} and {r} are not increasing", rows[k - 1]))
            } else if r >= seq.len {
                Some(format!("row {r} is past the sequence's {} rows", seq.len))
            } else {
                None
            }
        });
        if let Some(message) = fault {
            return Err(ModelError::invalid(OP, message).into());
        }
        let slot =
            |j: usize| seq.blocks[j / BLOCK_SIZE] * BLOCK_SIZE as u32 + (j % BLOCK_SIZE) as u32;
        let (src, dst): (Vec<u32>, Vec<u32>) = rows
            .iter()
            .enumerate()
            .filter(|&(k, &r)| r != start + k)
            .map(|(k, &r)| (slot(r), slot(start + k)))
            .unzip();
        if !src.is_empty() {
            // The forward's metadata buffer is free between forwards, which the lock serialises.
            let _scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            let n = src.len();
            let words: Vec<u32> = src.into_iter().chain(dst).collect();
            self.gpu
                .copy_htod(self.meta, bytemuck::cast_slice(&words), DEFAULT_STREAM)?;
            let (kv_heads, head_dim) = self.config.kv_cache_row();
            for cache in &self.caches {
                self.gpu.kv_copy(KvCopyArgs {
                    k_cache: cache.k,
                    v_cache: cache.v,
                    src: self.meta,
                    dst: self.meta.offset(n * 4),
                    copies: n,
                    kv_heads,
                    head_dim,
                    num_slots: cache.num_slots,
                    stream: DEFAULT_STREAM,
                })?;
            }
        }
        self.trim(seq, end)
    }

    /// The keys and values `seq` holds at decoder layer `layer`: BF16 bits `[len, kv_heads *
    /// head_dim]` each, cache row `j` at row `j` (read through the block table), for tests
    /// and debugging. Under MLA, the two halves of each token's latent row `[c_kv | k_rope]`
    /// (see [`ModelConfig::kv_cache_row`]).
    pub fn read_kv(&self, seq: &KvSequence, layer: usize) -> crate::Result<(Vec<u16>, Vec<u16>)> {
        const OP: &str = "TargetModel::read_kv";
        self.check_owner(seq, OP)?;
        let Some(cache) = self.caches.get(layer) else {
            return Err(
                ModelError::invalid(OP, format!("layer {layer} of {}", self.caches.len())).into(),
            );
        };
        let width = self.config.kv_cache_width();
        let row_bytes = width * Dtype::Bf16.size();
        let mut out = (
            Vec::with_capacity(seq.len * width),
            Vec::with_capacity(seq.len * width),
        );
        for j in 0..seq.len {
            let slot = seq.blocks[j / BLOCK_SIZE] as usize * BLOCK_SIZE + j % BLOCK_SIZE;
            for (ptr, dst) in [(cache.k, &mut out.0), (cache.v, &mut out.1)] {
                let mut row = vec![0u8; row_bytes];
                self.gpu
                    .copy_dtoh(&mut row, ptr.offset(slot * row_bytes), DEFAULT_STREAM)?;
                dst.extend(row.chunks(2).map(|b| u16::from_le_bytes([b[0], b[1]])));
            }
        }
        Ok(out)
    }

    fn forward_rows(
        &self,
        seqs: &mut [&mut KvSequence],
        tokens: &[&[u32]],
        logit_rows: LogitRows,
        layers: &[usize],
        trees: RowTrees<'_>,
    ) -> crate::Result<ForwardOutput> {
        const OP: &str = "TargetModel::forward";
        if self.allocs.is_empty() {
            return Err(ModelError::invalid(OP, "the model has been freed").into());
        }
        check_layer_ids(layers, self.config.num_hidden_layers)
            .map_err(|m| ModelError::invalid(OP, format!("capture layers: {m}")))?;
        if seqs.len() != tokens.len() || seqs.is_empty() {
            return Err(ModelError::invalid(
                OP,
                format!(
                    "{} sequences but {} token lists (need the same, at least one)",
                    seqs.len(),
                    tokens.len()
                ),
            )
            .into());
        }
        let rows: usize = tokens.iter().map(|t| t.len()).sum();
        if rows == 0 || rows > self.max_rows {
            return Err(ModelError::invalid(
                OP,
                format!(
                    "{rows} rows; a forward takes 1..={} rows (split it)",
                    self.max_rows
                ),
            )
            .into());
        }
        let vocab = self.config.vocab_size;
        let mut need = Vec::with_capacity(seqs.len());
        for (i, (s, t)) in seqs.iter().zip(tokens).enumerate() {
            self.check_owner(s, OP)?;
            if let Some(&bad) = t.iter().find(|&&x| x as usize >= vocab) {
                return Err(ModelError::invalid(
                    OP,
                    format!("sequence {i}: token id {bad} is outside the vocabulary of {vocab}"),
                )
                .into());
            }
            if t.is_empty() && logit_rows == LogitRows::LastPerSequence {
                return Err(ModelError::invalid(
                    OP,
                    format!("sequence {i} has no tokens, so it has no last row to give logits for"),
                )
                .into());
            }
            let new_len = s.len + t.len();
            if new_len > self.max_seq_len {
                return Err(ModelError::invalid(
                    OP,
                    format!(
                        "sequence {i} would reach {new_len} tokens, more than max_seq_len {}",
                        self.max_seq_len
                    ),
                )
                .into());
            }
            need.push(new_len.div_ceil(BLOCK_SIZE) - s.blocks.len());
        }
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let capture = match layers {
            [] => None,
            ids => Some(Capture {
                buffer: scratch.capture.with_room(
                    &self.allocs,
                    ids.len(),
                    self.max_rows,
                    self.config.hidden_size,
                )?,
                ids,
            }),
        };
        let fresh = self.pool.alloc(need.iter().sum())?;
        let plan = stage(&mut scratch.staging, seqs, tokens, &need, &fresh, trees);
        match self.run(&scratch.staging, plan, rows, logit_rows, capture) {
            Ok(out) => {
                let mut taken = 0;
                for ((s, t), n) in seqs.iter_mut().zip(tokens).zip(&need) {
                    s.blocks.extend_from_slice(&fresh[taken..taken + n]);
                    taken += n;
                    s.len += t.len();
                }
                Ok(out)
            }
            Err(e) => {
                self.pool.free(&fresh)?;
                Err(e)
            }
        }
    }

    fn run(
        &self,
        staging: &[u32],
        plan: Plan,
        rows: usize,
        logit_rows: LogitRows,
        capture: Option<Capture<'_>>,
    ) -> crate::Result<ForwardOutput> {
        let gpu = self.gpu.as_ref();
        let mbps = plan.max_blocks_per_seq;
        let row_offsets = plan.row_offsets;
        let num_seqs = row_offsets.len() - 1;
        let row_parent = plan.row_parent_at.map(|at| self.meta.offset(at * 4));
        if num_seqs * mbps > self.max_rows * self.max_blocks_per_seq {
            return Err(ModelError::invalid(
                "TargetModel::forward",
                "too many sequences for the block-table buffer",
            )
            .into());
        }
        let s = DEFAULT_STREAM;
        gpu.copy_htod(self.meta, bytemuck::cast_slice(staging), s)?;
        let at = |k: usize| self.meta.offset(k * rows * 4);
        let io = LayerIo {
            hidden: self.hiddens,
            positions: at(1),
            slots: at(2),
            row_seq: at(3),
            row_ctx_len: at(4),
            block_table: at(5),
            inv_freq: self.inv_freq,
            rows,
            max_blocks_per_seq: mbps,
            rope_style: self.rope_style,
            stream: s,
        };
        let sc = &self.scratch_slots;
        let c = &*self.config;
        let w = &self.weights;
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        gpu.embedding(EmbeddingArgs {
            out: io.hidden,
            table: w.embed.descriptor(),
            ids: at(0),
            rows,
            hidden: h,
            vocab: c.vocab_size,
            stream: s,
        })?;
        for (l, (lw, cache)) in w.layers.iter().zip(&self.caches).enumerate() {
            match row_parent {
                Some(p) => decoder_layer_tree(gpu, &self.shape, lw, cache, &io, sc, p)?,
                None => decoder_layer(gpu, &self.shape, lw, cache, &io, sc, LayerDepth::Full)?,
            }
            if let Some(c) = &capture {
                c.after_layer(gpu, l, io.hidden, rows, h, s)?;
            }
        }
        let final_norm = |x: DevicePtr, rows: usize| {
            gpu.rms_norm(RmsNormArgs {
                out: sc.normed,
                x,
                weight: w.final_norm.ptr,
                rows,
                dim: h,
                eps,
                stream: s,
            })
        };
        let head_rows = match logit_rows {
            LogitRows::All => {
                final_norm(io.hidden, rows)?;
                rows
            }
            LogitRows::LastPerSequence => {
                // Gather each sequence's last hidden row into `normed` (row i <= its source
                // row, so no copy overwrites a row still to be read), then norm in place.
                let row_bytes = h * Dtype::Bf16.size();
                for (i, end) in row_offsets.iter().skip(1).enumerate() {
                    let src = io.hidden.offset((end - 1) * row_bytes);
                    gpu.copy_dtod(sc.normed.offset(i * row_bytes), src, row_bytes, s)?;
                }
                final_norm(sc.normed, num_seqs)?;
                num_seqs
            }
        };
        w.head()
            .forward(gpu, self.logits, Dtype::F32, sc.normed, None, head_rows, s)?;
        Ok(ForwardOutput {
            rows,
            row_offsets,
            logits: self.logits,
            logits_rows: head_rows,
            picks: self.picks,
            hiddens: self.hiddens,
            hidden_stack: capture.map(|c| c.buffer),
        })
    }

    /// Drops rows `new_len..` of `seq` (rejected drafts), returning emptied blocks.
    pub fn trim(&self, seq: &mut KvSequence, new_len: usize) -> crate::Result<()> {
        self.check_owner(seq, "TargetModel::trim")?;
        if new_len > seq.len {
            return Err(ModelError::invalid(
                "TargetModel::trim",
                format!("cannot trim a sequence of {} rows to {new_len}", seq.len),
            )
            .into());
        }
        let keep = new_len.div_ceil(BLOCK_SIZE);
        self.pool.free(&seq.blocks[keep..])?;
        seq.blocks.truncate(keep);
        seq.len = new_len;
        Ok(())
    }

    /// Returns every block of `seq`; it becomes empty (and reusable).
    pub fn free_sequence(&self, seq: &mut KvSequence) -> crate::Result<()> {
        self.trim(seq, 0)
    }

    /// Frees every device buffer now (weights, caches, scratch, outputs); dropping the model
    /// does the same. Later forwards are errors.
    pub fn free(&mut self) -> crate::Result<()> {
        Ok(self.allocs.free_all()?)
    }
}
