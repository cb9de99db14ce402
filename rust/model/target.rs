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
//! - A forward that names capture layers (see the `capture` module) also returns the hidden
//!   after each of them for every row; one that names none reads and writes nothing more
//!   than a forward without capture, and allocates nothing for it.

use super::batch::{stage, Plan, RowTrees};
use super::capture::{check_layer_ids, Capture, CaptureBuffer};
use super::decoder_weights::DecoderWeights;
use super::layers::{
    decoder_layer, decoder_layer_tree, ExpertShard, LayerCache, LayerDepth, LayerIo, LayerScratch,
    LayerShape,
};
pub use super::sequence::{ForwardOutput, KvSequence, LogitRows};
use super::weights::DeviceAllocations;
use super::{ModelConfig, ModelError};
use crate::backend::{
    DevicePtr, Dtype, EmbeddingArgs, GpuBackend, RmsNormArgs, RopeStyle, DEFAULT_STREAM,
};
use crate::memory::{BlockAllocator, BufferArena};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

mod kv;
mod load;

pub use load::LoadOptions;

/// KV rows per block.
pub const BLOCK_SIZE: usize = 16;

static NEXT_MODEL_ID: AtomicU64 = AtomicU64::new(1);

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
    /// in `layers` (ids below `num_hidden_layers`, distinct; see the `capture` module) for
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

    /// Frees every device buffer now (weights, caches, scratch, outputs); dropping the model
    /// does the same. Later forwards are errors.
    pub fn free(&mut self) -> crate::Result<()> {
        Ok(self.allocs.free_all()?)
    }
}
