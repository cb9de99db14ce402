//! The head's forward over a set of rows, on the typed kernels only.
//!
//! For each row: `e = enorm(embed(token))`, `g = hnorm(hidden)` (the target hidden, through
//! the target's final norm first under `mtp_target_postnorm`), `x = eh_proj(concat)` with
//! the embedding first (DeepSeek-V3/GLM, Qwen3-Next) or the hidden first (MiMo), then the
//! model layer's decoder layer (`decoder_layer`, the one the target runs) with the head's own
//! paged KV, then the final norm and the LM head (f32 logits over the draft vocabulary).
//!
//! EAGLE-3 ([`MtpLayout::Eagle3`]) fuses its input differently: `fused = fc(hidden)` for the
//! target's rows (the captured layers side by side, `n * target hidden` wide), the hidden
//! itself for the head's own (chain) rows; the layer attends over `[enorm(e) |
//! hnorm(fused)]` with `fused` (or `hnorm(fused)` under `norm_before_residual`) as its
//! residual, and a draft id `d` of its reduced vocabulary is the target id `d + d2t[d]`.
//!
//! Rows are independent except through the KV cache, and every kernel computes a row from
//! that row alone, so a row's result does not depend on which other rows share the call:
//! this is what makes `propose_batch` return exactly what `propose` does.

use super::scratch::Scratch;
use super::state::DRAFTER_BLOCK_SIZE;
use super::weights::{MtpLayout, MtpWeights};
use crate::backend::{
    DevicePtr, Dtype, EmbeddingArgs, GpuBackend, GpuBackendExt, RmsNormArgs, RopeStyle,
};
use crate::model::layers::{decoder_layer_with_input, LayerCache, LayerDepth, LayerIo, LayerShape};
use crate::model::{DenseWeight, Linear, ModelConfig, ModelLevers};

/// One row of a forward.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Row {
    pub token: u32,
    /// BF16 `[hidden]`: the target hidden, or the head's own output of the previous draft.
    pub hidden: DevicePtr,
    pub position: usize,
    /// Index into the forward's block tables.
    pub seq: usize,
    pub slot: u32,
    /// Rows of its sequence the row attends to (itself included).
    pub ctx_len: usize,
}

/// Whether the rows' hiddens come from the target or from the head's previous step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HiddenKind {
    Target,
    Chain,
}

/// How far a forward runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Depth {
    /// Up to the KV write (prefill and catch-up rows only need their keys and values).
    KvOnly,
    /// Through the LM head.
    Logits,
}

/// Everything one forward reads: what the head was built with, or what a [`DraftBinding`]
/// describes (the reference runner builds one from a binding alone).
///
/// [`DraftBinding`]: crate::speculative::DraftBinding
pub(crate) struct HeadSpec {
    pub config: ModelConfig,
    pub levers: ModelLevers,
    pub weights: MtpWeights,
    pub embed: Linear,
    pub target_final_norm: DenseWeight,
    /// The LM head's first `draft_vocab` rows (an NVFP4 copy, or the target's own head).
    pub lm_head: Linear,
    pub draft_vocab: usize,
    pub k_cache: DevicePtr,
    pub v_cache: DevicePtr,
    pub num_slots: usize,
    pub inv_freq: DevicePtr,
    pub rotary_dim: usize,
    pub max_blocks_per_seq: usize,
    /// What an EAGLE-3 head adds; `None` for an MTP head.
    pub eagle3: Option<Eagle3Parts>,
}

/// What an EAGLE-3 head's forward and draft loop read beyond an MTP head's.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Eagle3Parts {
    /// The target id of each draft-vocabulary row (`d + d2t[d]`), every one below
    /// `vocab_size`.
    pub draft_to_target: Vec<u32>,
    /// The residual is `hnorm(fused)` rather than `fused` (speculators'
    /// `norm_before_residual`).
    pub norm_before_residual: bool,
}

impl HeadSpec {
    fn row_bytes(&self) -> usize {
        self.config.hidden_size * Dtype::Bf16.size()
    }

    /// Elements of one target row the head is given: the hidden, or EAGLE-3's captured
    /// layers side by side (`fc`'s input width).
    pub(crate) fn target_width(&self) -> usize {
        match self.weights.layout {
            MtpLayout::Eagle3 => self.weights.eh_proj.dims().1,
            _ => self.config.hidden_size,
        }
    }

    /// Bytes of one target row (see [`HeadSpec::target_width`]).
    pub(crate) fn target_row_bytes(&self) -> usize {
        self.target_width() * Dtype::Bf16.size()
    }

    /// The target id of draft id `draft` (the same id without a reduced vocabulary).
    pub(crate) fn to_target(&self, draft: u32) -> u32 {
        match &self.eagle3 {
            Some(e) => e.draft_to_target[draft as usize],
            None => draft,
        }
    }

    /// Words of a grammar mask the head needs: its draft vocabulary's, or the whole target
    /// vocabulary's when draft ids map to other target ids.
    pub(crate) fn mask_words(&self) -> usize {
        match &self.eagle3 {
            Some(_) => self.config.vocab_size.div_ceil(32),
            None => self.draft_vocab.div_ceil(32),
        }
    }

    /// `mask` (over target ids) as a mask over draft ids: draft id `d` is allowed when its
    /// target id is. `mask` holds at least [`HeadSpec::mask_words`] words.
    pub(crate) fn draft_mask(&self, mask: &[i32]) -> Vec<i32> {
        let Some(e) = &self.eagle3 else {
            return mask[..self.draft_vocab.div_ceil(32)].to_vec();
        };
        let mut out = vec![0i32; self.draft_vocab.div_ceil(32)];
        for (d, &t) in e.draft_to_target.iter().enumerate() {
            let t = t as usize;
            if (mask[t / 32] >> (t % 32)) & 1 == 1 {
                out[d / 32] |= 1 << (d % 32);
            }
        }
        out
    }

    /// The decoder layer's sizes (its rotation width is the head's RoPE table's).
    pub(crate) fn layer_shape(&self) -> LayerShape {
        LayerShape {
            rotary_dim: self.rotary_dim,
            ..LayerShape::of(&self.config)
        }
    }

    /// Runs `rows` (at most `sc.rows`). `tables[s]` is sequence `s`'s device block table.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_rows(
        &self,
        gpu: &dyn GpuBackend,
        sc: &Scratch,
        rows: &[Row],
        tables: &[(DevicePtr, usize)],
        kind: HiddenKind,
        depth: Depth,
        stream: u64,
    ) -> crate::Result<()> {
        let r = rows.len();
        if r == 0 {
            return Ok(());
        }
        let cfg = &self.config;
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let w = &self.weights;
        let rms_norm = |out, x, weight: &DenseWeight| {
            gpu.rms_norm(RmsNormArgs {
                out,
                x,
                weight: weight.ptr,
                rows: r,
                dim: h,
                eps,
                stream,
            })
        };
        let u32s = |f: &dyn Fn(&Row) -> u32| rows.iter().map(f).collect::<Vec<u32>>();
        gpu.write(sc.token_ids, &u32s(&|x| x.token), stream)?;
        gpu.write(sc.positions, &u32s(&|x| x.position as u32), stream)?;
        gpu.write(sc.slots, &u32s(&|x| x.slot), stream)?;

        gpu.embedding(EmbeddingArgs {
            out: sc.embedding,
            table: self.embed.descriptor(),
            ids: sc.token_ids,
            rows: r,
            hidden: h,
            vocab: cfg.vocab_size,
            stream,
        })?;
        rms_norm(sc.embedding, sc.embedding, &w.enorm)?;
        let attn_input = match w.layout {
            MtpLayout::Eagle3 => Some(self.eagle3_input(gpu, sc, rows, kind, stream)?),
            _ => {
                self.mtp_input(gpu, sc, rows, kind, stream)?;
                None
            }
        };

        let mbps = self.max_blocks_per_seq;
        let layer_depth = match depth {
            Depth::KvOnly => LayerDepth::KvOnly,
            Depth::Logits => {
                for (s, &(t, cap)) in tables.iter().enumerate() {
                    let to = sc.block_tables.offset(s * mbps * 4);
                    gpu.copy_dtod(to, t, cap.min(mbps) * 4, stream)?;
                }
                gpu.write(sc.row_seq, &u32s(&|x| x.seq as u32), stream)?;
                gpu.write(sc.row_ctx_len, &u32s(&|x| x.ctx_len as u32), stream)?;
                LayerDepth::Full
            }
        };
        let io = LayerIo {
            hidden: sc.residual,
            positions: sc.positions,
            slots: sc.slots,
            row_seq: sc.row_seq,
            row_ctx_len: sc.row_ctx_len,
            block_table: sc.block_tables,
            inv_freq: self.inv_freq,
            rows: r,
            max_blocks_per_seq: mbps,
            rope_style: RopeStyle::Half,
            stream,
        };
        let cache = LayerCache {
            k: self.k_cache,
            v: self.v_cache,
            num_slots: self.num_slots,
            block_size: DRAFTER_BLOCK_SIZE,
        };
        let shape = self.layer_shape();
        decoder_layer_with_input(
            gpu,
            &shape,
            &w.layer,
            &cache,
            &io,
            &sc.layer,
            layer_depth,
            attn_input,
        )?;
        if depth == Depth::KvOnly {
            return Ok(());
        }

        rms_norm(sc.final_normed, sc.residual, &w.final_norm)?;
        self.lm_head
            .forward(gpu, sc.logits, Dtype::F32, sc.final_normed, None, r, stream)?;
        Ok(())
    }

    /// MTP's input: `sc.residual = eh_proj(concat)` of the normed embedding (already in
    /// `sc.embedding`) and the normed hidden, in the layout's order.
    fn mtp_input(
        &self,
        gpu: &dyn GpuBackend,
        sc: &Scratch,
        rows: &[Row],
        kind: HiddenKind,
        stream: u64,
    ) -> crate::Result<()> {
        let (w, r, row_bytes) = (&self.weights, rows.len(), self.row_bytes());
        let rms_norm = |out, x, weight: &DenseWeight| self.rms_norm(gpu, out, x, weight, r, stream);
        for (i, row) in rows.iter().enumerate() {
            let to = sc.target_hidden.offset(i * row_bytes);
            gpu.copy_dtod(to, row.hidden, row_bytes, stream)?;
        }
        if kind == HiddenKind::Target && self.levers.mtp_target_postnorm {
            rms_norm(sc.target_hidden, sc.target_hidden, &self.target_final_norm)?;
        }
        rms_norm(sc.target_hidden, sc.target_hidden, &w.hnorm)?;
        let (first, second) = if w.layout.embedding_first() {
            (sc.embedding, sc.target_hidden)
        } else {
            (sc.target_hidden, sc.embedding)
        };
        self.concat(gpu, sc, first, second, r, stream)?;
        w.eh_proj
            .forward(gpu, sc.residual, Dtype::Bf16, sc.concat, None, r, stream)?;
        Ok(())
    }

    /// EAGLE-3's input: the residual `sc.residual = fused` (`fc` of a target row, or a
    /// chain row as it is; `hnorm(fused)` under `norm_before_residual`), and the attention
    /// input `[enorm(e) | hnorm(fused)]` in `sc.concat`, which it returns.
    fn eagle3_input(
        &self,
        gpu: &dyn GpuBackend,
        sc: &Scratch,
        rows: &[Row],
        kind: HiddenKind,
        stream: u64,
    ) -> crate::Result<DevicePtr> {
        let (w, r, row_bytes) = (&self.weights, rows.len(), self.row_bytes());
        let in_bytes = match kind {
            HiddenKind::Target => self.target_row_bytes(),
            HiddenKind::Chain => row_bytes,
        };
        // Rows are copied in before anything is written: a chain row's hidden is the
        // previous step's `sc.residual`, which this forward overwrites.
        for (i, row) in rows.iter().enumerate() {
            let to = sc.target_hidden.offset(i * in_bytes);
            gpu.copy_dtod(to, row.hidden, in_bytes, stream)?;
        }
        match kind {
            HiddenKind::Target => w.eh_proj.forward(
                gpu,
                sc.residual,
                Dtype::Bf16,
                sc.target_hidden,
                None,
                r,
                stream,
            )?,
            HiddenKind::Chain => {
                gpu.copy_dtod(sc.residual, sc.target_hidden, r * row_bytes, stream)?
            }
        }
        self.rms_norm(gpu, sc.target_hidden, sc.residual, &w.hnorm, r, stream)?;
        if self.eagle3.as_ref().is_some_and(|e| e.norm_before_residual) {
            gpu.copy_dtod(sc.residual, sc.target_hidden, r * row_bytes, stream)?;
        }
        self.concat(gpu, sc, sc.embedding, sc.target_hidden, r, stream)?;
        Ok(sc.concat)
    }

    /// `sc.concat` row `i` = `[first row i | second row i]` (each `hidden` wide).
    fn concat(
        &self,
        gpu: &dyn GpuBackend,
        sc: &Scratch,
        first: DevicePtr,
        second: DevicePtr,
        r: usize,
        stream: u64,
    ) -> crate::Result<()> {
        let row_bytes = self.row_bytes();
        for i in 0..r {
            let to = sc.concat.offset(2 * i * row_bytes);
            gpu.copy_dtod(to, first.offset(i * row_bytes), row_bytes, stream)?;
            let to = sc.concat.offset((2 * i + 1) * row_bytes);
            gpu.copy_dtod(to, second.offset(i * row_bytes), row_bytes, stream)?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn rms_norm(
        &self,
        gpu: &dyn GpuBackend,
        out: DevicePtr,
        x: DevicePtr,
        weight: &DenseWeight,
        rows: usize,
        stream: u64,
    ) -> crate::Result<()> {
        Ok(gpu.rms_norm(RmsNormArgs {
            out,
            x,
            weight: weight.ptr,
            rows,
            dim: self.config.hidden_size,
            eps: self.config.rms_norm_eps,
            stream,
        })?)
    }

    /// The hidden the next draft step feeds back for row `i` of the last forward.
    pub(crate) fn chain_hidden(&self, sc: &Scratch, i: usize) -> DevicePtr {
        let base = if self.levers.mtp_chain_postnorm {
            sc.final_normed
        } else {
            sc.residual
        };
        base.offset(i * self.row_bytes())
    }
}
