//! The DFlash head's two forwards, on the typed kernels and the model layer's decoder layer.
//!
//! Context rows (`append_context`): for captured rows `c` (the target layers' hiddens side
//! by side, computed at positions `q`), `x = hidden_norm(fc(c))`; every draft layer writes
//! `k = k_norm(k_proj(x))` (RoPE at `q`) and `v = v_proj(x)` into its cache. The same `x`
//! feeds every layer and no `input_layernorm` touches it: it is the decoder layer run to its
//! KV write with `x` as the attention's (already normed) input.
//!
//! The block (`blocks_forward`): `[last token, mask × (γ - 1)]` at positions `p .. p + γ - 1`,
//! embedded with the target's embedding, through every draft layer (whole, its q/k/v from
//! the block rows), each block row attending to every context row and every block row: its
//! context length is `context rows + γ`, which makes the block non-causal. Then `norm` and
//! the target's LM head (its first `draft_vocab` rows) over rows `1 ..`; row `j` predicts the
//! token at `p + j`. The block's keys and values land in the slots after the context rows,
//! which the next context rows overwrite: they never count as rows. `blocks_forward` runs
//! the blocks of several sequences as one forward, each block's rows reading its own
//! sequence's block table and context.
//!
//! Invariant: a forward touches only the head's scratch, its caches' slots named by the
//! state's rows, and the state's reserved blocks.

use super::head::DFlashHead;
use super::state::{DFlashState, DFLASH_BLOCK_ROWS};
use crate::backend::{ArgmaxArgs, DevicePtr, Dtype, EmbeddingArgs, GpuBackend, GpuBackendExt};
use crate::backend::{PickArgs, RmsNormArgs, RopeStyle, SoftmaxArgs};
use crate::memory::{ArenaSlot, BufferArena, SlotSpec};
use crate::model::layers::{
    decoder_layer, decoder_layer_with_input, layer_slots, LayerCache, LayerDepth, LayerIo,
    LayerScratch, ScratchShape,
};
use crate::model::{DenseWeight, ModelConfig};
use crate::speculative::error::bad;

/// One sequence's block in [`DFlashHead::blocks_forward`]: its state (context rows and
/// block table) and the token and position it drafts from.
pub(crate) struct BlockSeq<'s> {
    pub state: &'s DFlashState,
    pub last_token: u32,
    pub position: usize,
}

/// The head's forward scratch: the decoder layer's buffers and its own around them.
pub(crate) struct Scratch {
    pub rows: usize,
    pub layer: LayerScratch,
    pub token_ids: DevicePtr,
    pub positions: DevicePtr,
    pub slots: DevicePtr,
    pub row_seq: DevicePtr,
    pub row_ctx_len: DevicePtr,
    /// u32 `[rows, max_blocks_per_seq]`: block `s`'s sequence's block table at row `s`.
    pub block_tables: DevicePtr,
    /// BF16 `[rows, hidden]`: the fused, normed context rows.
    pub ctx: DevicePtr,
    /// BF16 `[rows, hidden]`: the block's residual stream.
    pub residual: DevicePtr,
    /// BF16 `[rows, hidden]`: `norm` of the block rows that draft.
    pub final_normed: DevicePtr,
    /// f32 `[rows, draft_vocab]`: the logits of the latest blocks' drafting rows, block
    /// after block.
    pub logits: DevicePtr,
    /// f32 `[rows, draft_vocab]`: their softmax, where confidences were asked for.
    pub probs: DevicePtr,
    /// f32 `[rows]`: each drafting row's probability of its pick.
    pub picked_probs: DevicePtr,
    pub picks: DevicePtr,
    /// i32 `[rows, ceil(draft_vocab / 32)]`: the grammar mask, one copy per drafting row.
    pub grammar_mask: DevicePtr,
}

impl Scratch {
    /// Allocates the scratch for forwards of up to `rows` rows; the returned slots are the
    /// caller's to free (on failure nothing stays allocated).
    pub fn alloc(
        gpu: &dyn GpuBackend,
        config: &ModelConfig,
        mlp_width: usize,
        draft_vocab: usize,
        rows: usize,
        max_blocks_per_seq: usize,
    ) -> crate::Result<(Scratch, Vec<ArenaSlot>)> {
        let h = config.hidden_size;
        let mut slots = layer_slots(&ScratchShape {
            hidden: h,
            q_size: config.q_size(),
            kv_size: config.kv_size(),
            mlp_width,
            gated_attention: false,
            experts: 0,
            mla: None,
        });
        let slot = |name, dtype, row_elems| SlotSpec {
            name,
            dtype,
            row_elems,
        };
        use Dtype::*;
        slots.extend([
            slot("token_ids", U32, 1),
            slot("positions", U32, 1),
            slot("slots", U32, 1),
            slot("row_seq", U32, 1),
            slot("row_ctx_len", U32, 1),
            slot("block_tables", U32, max_blocks_per_seq),
            slot("ctx", Bf16, h),
            slot("residual", Bf16, h),
            slot("final_normed", Bf16, h),
            slot("logits", F32, draft_vocab),
            slot("probs", F32, draft_vocab),
            slot("picks", U32, 1),
            slot("picked_probs", F32, 1),
            slot("grammar_mask", I32, draft_vocab.div_ceil(32)),
        ]);
        let mut arena = BufferArena::new(gpu, "dflash", &slots, rows)?;
        let at = |name: &str| -> crate::Result<DevicePtr> { Ok(arena.slot(name)?.ptr) };
        let made = (|| {
            Ok::<_, crate::Error>(Scratch {
                rows,
                layer: LayerScratch::from_arena(&arena)?,
                token_ids: at("token_ids")?,
                positions: at("positions")?,
                slots: at("slots")?,
                row_seq: at("row_seq")?,
                row_ctx_len: at("row_ctx_len")?,
                block_tables: at("block_tables")?,
                ctx: at("ctx")?,
                residual: at("residual")?,
                final_normed: at("final_normed")?,
                logits: at("logits")?,
                probs: at("probs")?,
                picks: at("picks")?,
                picked_probs: at("picked_probs")?,
                grammar_mask: at("grammar_mask")?,
            })
        })();
        match made {
            Ok(sc) => Ok((sc, arena.slots().to_vec())),
            Err(e) => {
                arena.free(gpu)?;
                Err(e)
            }
        }
    }
}

impl DFlashHead {
    fn rms_norm(
        &self,
        gpu: &dyn GpuBackend,
        out: DevicePtr,
        x: DevicePtr,
        weight: &DenseWeight,
        rows: usize,
        stream: u64,
    ) -> crate::Result<()> {
        let cfg = &self.config;
        Ok(gpu.rms_norm(RmsNormArgs {
            out,
            x,
            weight: weight.ptr,
            rows,
            dim: cfg.hidden_size,
            eps: cfg.rms_norm_eps,
            stream,
        })?)
    }

    /// Layer `layer`'s cache.
    fn cache(&self, layer: usize) -> LayerCache {
        let bytes = self.num_slots * self.config.kv_size() * Dtype::Bf16.size();
        LayerCache {
            k: self.k_cache.offset(layer * bytes),
            v: self.v_cache.offset(layer * bytes),
            num_slots: self.num_slots,
            block_size: DFLASH_BLOCK_ROWS,
        }
    }

    /// The per-row metadata of a forward of `rows` rows (at most `sc.rows`), reading the
    /// scratch's block tables (context rows write by slot and read no table).
    fn io(&self, sc: &Scratch, rows: usize, stream: u64) -> LayerIo {
        LayerIo {
            hidden: sc.residual,
            positions: sc.positions,
            slots: sc.slots,
            row_seq: sc.row_seq,
            row_ctx_len: sc.row_ctx_len,
            block_table: sc.block_tables,
            inv_freq: self.inv_freq,
            rows,
            max_blocks_per_seq: self.max_blocks_per_seq(),
            rope_style: RopeStyle::Half,
            stream,
        }
    }

    /// Writes context rows at positions `first ..` from `stack` (BF16 `[n, taps * hidden]`,
    /// row `i` computed at `first + i`), after the state's rows, in chunks of the scratch's
    /// rows. The state must have room reserved for them.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn append_context(
        &self,
        gpu: &dyn GpuBackend,
        sc: &Scratch,
        st: &mut DFlashState,
        stack: DevicePtr,
        first: usize,
        n: usize,
        stream: u64,
    ) -> crate::Result<()> {
        let row_bytes = self.stack_row_bytes();
        let shape = self.layer_shape;
        let mut done = 0;
        while done < n {
            let r = (n - done).min(sc.rows);
            let base = st.rows();
            let pos: Vec<u32> = (0..r).map(|i| (first + done + i) as u32).collect();
            let slots: Vec<u32> = (0..r).map(|i| st.slot(base + i)).collect();
            gpu.write(sc.positions, &pos, stream)?;
            gpu.write(sc.slots, &slots, stream)?;
            let x = stack.offset(done * row_bytes);
            self.weights
                .fc
                .forward(gpu, sc.ctx, Dtype::Bf16, x, None, r, stream)?;
            self.rms_norm(gpu, sc.ctx, sc.ctx, &self.weights.hidden_norm, r, stream)?;
            let io = self.io(sc, r, stream);
            for (l, w) in self.weights.layers.iter().enumerate() {
                decoder_layer_with_input(
                    gpu,
                    &shape,
                    w,
                    &self.cache(l),
                    &io,
                    &sc.layer,
                    LayerDepth::KvOnly,
                    Some(sc.ctx),
                )?;
            }
            st.push_rows(first + done, r);
            done += r;
        }
        Ok(())
    }

    /// Runs one block for each of `blocks` in one forward (at most `sc.rows / γ` of them),
    /// each after its state's context rows, and returns each sequence's drafts: up to
    /// `num_drafts` (at most γ - 1), the greedy pick of its rows `1 ..`, with the draft
    /// probability of each pick where `want_conf` (else empty lists). With `mask` (over the
    /// target's vocabulary, at least `ceil(draft_vocab / 32)` words) only allowed ids are
    /// picked, and a sequence's drafts end before the first row that allows none. Every
    /// state must have room reserved for its block's rows.
    ///
    /// A row's result depends only on its own sequence's rows and context (the kernels
    /// compute each row alike whatever the batch), so a sequence drafts the same alone as in
    /// a batch.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn blocks_forward(
        &self,
        gpu: &dyn GpuBackend,
        sc: &Scratch,
        blocks: &[BlockSeq<'_>],
        num_drafts: usize,
        mask: Option<&[i32]>,
        want_conf: bool,
        stream: u64,
    ) -> crate::Result<Vec<(Vec<u32>, Vec<f32>)>> {
        let (g, n) = (self.block_size, blocks.len());
        let nd = num_drafts.min(g - 1);
        if nd == 0 || n == 0 {
            return Ok(vec![(Vec::new(), Vec::new()); n]);
        }
        if n * g > sc.rows {
            let message = format!("{n} blocks of {g} rows; one forward takes {} rows", sc.rows);
            return Err(bad("propose_batch", message));
        }
        let (h, mbps) = (self.config.hidden_size, self.max_blocks_per_seq());
        let (mut tokens, mut pos, mut slots, mut row_seq, mut ctx_len) =
            (vec![], vec![], vec![], vec![], vec![]);
        for (s, b) in blocks.iter().enumerate() {
            let c = b.state.rows();
            tokens.push(b.last_token);
            tokens.extend(std::iter::repeat_n(self.mask_token_id, g - 1));
            pos.extend((0..g).map(|i| (b.position + i) as u32));
            slots.extend((0..g).map(|i| b.state.slot(c + i)));
            row_seq.extend(std::iter::repeat_n(s as u32, g));
            // Every block row sees the whole context and the whole block: non-causal.
            ctx_len.extend(std::iter::repeat_n((c + g) as u32, g));
            let table_bytes = b.state.capacity_blocks().min(mbps) * 4;
            gpu.copy_dtod(
                sc.block_tables.offset(s * mbps * 4),
                b.state.table(),
                table_bytes,
                stream,
            )?;
        }
        let rows = n * g;
        gpu.write(sc.token_ids, &tokens, stream)?;
        gpu.write(sc.positions, &pos, stream)?;
        gpu.write(sc.slots, &slots, stream)?;
        gpu.write(sc.row_seq, &row_seq, stream)?;
        gpu.write(sc.row_ctx_len, &ctx_len, stream)?;
        gpu.embedding(EmbeddingArgs {
            out: sc.residual,
            table: self.embed.descriptor(),
            ids: sc.token_ids,
            rows,
            hidden: h,
            vocab: self.config.vocab_size,
            stream,
        })?;
        let io = self.io(sc, rows, stream);
        for (l, w) in self.weights.layers.iter().enumerate() {
            decoder_layer(
                gpu,
                &self.layer_shape,
                w,
                &self.cache(l),
                &io,
                &sc.layer,
                LayerDepth::Full,
            )?;
        }
        // Each block's drafting rows (`1 ..= nd`), normed side by side for one LM head pass.
        let row_bytes = h * Dtype::Bf16.size();
        for s in 0..n {
            self.rms_norm(
                gpu,
                sc.final_normed.offset(s * nd * row_bytes),
                sc.residual.offset((s * g + 1) * row_bytes),
                &self.weights.norm,
                nd,
                stream,
            )?;
        }
        let picked = n * nd;
        self.lm_head.forward(
            gpu,
            sc.logits,
            Dtype::F32,
            sc.final_normed,
            None,
            picked,
            stream,
        )?;
        let vd = self.draft_vocab;
        if let Some(m) = mask {
            let words = vd.div_ceil(32);
            let rows: Vec<i32> = (0..picked)
                .flat_map(|_| m[..words].iter().copied())
                .collect();
            gpu.write(sc.grammar_mask, &rows, stream)?;
        }
        gpu.argmax(ArgmaxArgs {
            out: sc.picks,
            logits: sc.logits,
            bitmask: mask.map(|_| sc.grammar_mask),
            rows: picked,
            vocab: vd,
            stream,
        })?;
        let picks: Vec<u32> = gpu.download(sc.picks, picked)?;
        let mut picked_probs = Vec::new();
        if want_conf {
            // Each row's probability of its pick, gathered on the device: one download.
            gpu.softmax(SoftmaxArgs {
                out: sc.probs,
                logits: sc.logits,
                rows: picked,
                vocab: vd,
                temperature: 1.0,
                stream,
            })?;
            gpu.pick(PickArgs {
                out: sc.picked_probs,
                values: sc.probs,
                index: sc.picks,
                rows: picked,
                width: vd,
                stream,
            })?;
            picked_probs = gpu.download::<f32>(sc.picked_probs, picked)?;
        }
        let mut out = Vec::with_capacity(n);
        for row_picks in picks.chunks(nd) {
            // A row that allows no token ends the drafts (u32::MAX from the argmax).
            let drafts: Vec<u32> = row_picks
                .iter()
                .copied()
                .take_while(|&t| t != u32::MAX)
                .collect();
            let first = out.len() * nd;
            let conf = picked_probs
                .get(first..first + drafts.len())
                .map_or_else(Vec::new, <[f32]>::to_vec);
            out.push((drafts, conf));
        }
        Ok(out)
    }
}
