//! The head's forward over a set of rows, on the typed kernels only.
//!
//! For each row: `e = enorm(embed(token))`, `g = hnorm(hidden)` (the target hidden, through
//! the target's final norm first under `mtp_target_postnorm`), `x = eh_proj(concat)` with
//! the embedding first (DeepSeek-V3/GLM, Qwen3-Next) or the hidden first (MiMo), then one
//! pre-norm decoder layer whose attention reads the head's own paged KV, then the final norm
//! and the LM head (f32 logits over the draft vocabulary).
//!
//! Rows are independent except through the KV cache, and every kernel computes a row from
//! that row alone, so a row's result does not depend on which other rows share the call:
//! this is what makes `propose_batch` return exactly what `propose` does.

use super::weights::MtpWeights;
use crate::backend::{DevicePtr, Dtype, GpuBackend, GpuBackendExt, RopeStyle};
use crate::model::{DenseWeight, ModelConfig, ModelLevers, QuantizedWeight};

/// Device scratch for one forward of up to `rows` rows.
pub(crate) struct Scratch {
    pub rows: usize,
    pub ids: DevicePtr,
    pub positions: DevicePtr,
    pub slots: DevicePtr,
    pub row_seq: DevicePtr,
    pub ctx_len: DevicePtr,
    pub table: DevicePtr,
    pub emb: DevicePtr,
    pub hid: DevicePtr,
    pub cat: DevicePtr,
    /// The layer's output hidden (before the final norm).
    pub x: DevicePtr,
    pub normed: DevicePtr,
    pub qfull: DevicePtr,
    pub q: DevicePtr,
    pub qgate: DevicePtr,
    pub k: DevicePtr,
    pub v: DevicePtr,
    pub attn: DevicePtr,
    pub mlp_gate: DevicePtr,
    pub mlp_up: DevicePtr,
    /// MoE: router logits f32 `[rows, experts]`, the accumulated MLP output `[rows, hidden]`,
    /// one expert's output, a scaled copy, the BF16 scalar weight, the shared-expert gate.
    pub router: DevicePtr,
    pub moe_acc: DevicePtr,
    pub moe_out: DevicePtr,
    pub moe_tmp: DevicePtr,
    pub moe_w: DevicePtr,
    pub moe_gate_logit: DevicePtr,
    /// The final norm's output.
    pub out: DevicePtr,
    pub logits: DevicePtr,
    pub probs: DevicePtr,
    pub picks: DevicePtr,
    pub mask: DevicePtr,
}

impl Scratch {
    #[allow(clippy::too_many_arguments)]
    pub fn alloc(
        alloc: &mut dyn FnMut(Dtype, usize, &str) -> crate::Result<DevicePtr>,
        rows: usize,
        hidden: usize,
        q_rows: usize,
        q_size: usize,
        kv_size: usize,
        ffn: usize,
        vocab: usize,
        max_blocks_per_seq: usize,
        num_experts: usize,
    ) -> crate::Result<Self> {
        let mut a = |dtype, len: usize, tag: &str| alloc(dtype, len.max(1), tag);
        use Dtype::*;
        Ok(Scratch {
            rows,
            ids: a(U32, rows, "mtp:ids")?,
            positions: a(U32, rows, "mtp:positions")?,
            slots: a(U32, rows, "mtp:slots")?,
            row_seq: a(U32, rows, "mtp:row_seq")?,
            ctx_len: a(U32, rows, "mtp:ctx_len")?,
            table: a(U32, rows * max_blocks_per_seq, "mtp:batch_table")?,
            emb: a(Bf16, rows * hidden, "mtp:emb")?,
            hid: a(Bf16, rows * hidden, "mtp:hid")?,
            cat: a(Bf16, rows * 2 * hidden, "mtp:cat")?,
            x: a(Bf16, rows * hidden, "mtp:x")?,
            normed: a(Bf16, rows * hidden, "mtp:normed")?,
            qfull: a(Bf16, rows * q_rows, "mtp:qfull")?,
            q: a(Bf16, rows * q_size, "mtp:q")?,
            qgate: a(Bf16, rows * q_size, "mtp:qgate")?,
            k: a(Bf16, rows * kv_size, "mtp:k")?,
            v: a(Bf16, rows * kv_size, "mtp:v")?,
            attn: a(Bf16, rows * q_size, "mtp:attn")?,
            mlp_gate: a(Bf16, rows * ffn, "mtp:mlp_gate")?,
            mlp_up: a(Bf16, rows * ffn, "mtp:mlp_up")?,
            router: a(F32, rows * num_experts, "mtp:router")?,
            moe_acc: a(
                Bf16,
                if num_experts > 0 { rows * hidden } else { 0 },
                "mtp:moe_acc",
            )?,
            moe_out: a(Bf16, hidden, "mtp:moe_out")?,
            moe_tmp: a(Bf16, hidden, "mtp:moe_tmp")?,
            moe_w: a(Bf16, 1, "mtp:moe_w")?,
            moe_gate_logit: a(Bf16, rows, "mtp:moe_gate_logit")?,
            out: a(Bf16, rows * hidden, "mtp:out")?,
            logits: a(F32, rows * vocab, "mtp:logits")?,
            probs: a(F32, rows * vocab, "mtp:probs")?,
            picks: a(U32, rows, "mtp:picks")?,
            mask: a(I32, vocab.div_ceil(32), "mtp:mask")?,
        })
    }
}

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
    pub embed: DenseWeight,
    pub target_final_norm: DenseWeight,
    /// `draft_vocab` rows.
    pub lm_head: QuantizedWeight,
    pub draft_vocab: usize,
    pub k_cache: DevicePtr,
    pub v_cache: DevicePtr,
    pub num_slots: usize,
    pub inv_freq: DevicePtr,
    pub rotary_dim: usize,
    pub max_blocks_per_seq: usize,
    pub ffn: usize,
}

impl HeadSpec {
    fn h_bytes(&self) -> usize {
        self.config.hidden_size * 2
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
        let (h, heads, kvh, hd) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let eps = cfg.rms_norm_eps;
        let w = &self.weights;
        let l = &w.layer;
        let hb = self.h_bytes();
        let u32s = |f: &dyn Fn(&Row) -> u32| rows.iter().map(f).collect::<Vec<u32>>();
        gpu.write(sc.ids, &u32s(&|x| x.token), stream)?;
        gpu.write(sc.positions, &u32s(&|x| x.position as u32), stream)?;
        gpu.write(sc.slots, &u32s(&|x| x.slot), stream)?;

        gpu.embedding(sc.emb, self.embed.ptr, sc.ids, r, h, cfg.vocab_size, stream)?;
        gpu.rms_norm(sc.emb, sc.emb, w.enorm.ptr, r, h, eps, stream)?;
        for (i, row) in rows.iter().enumerate() {
            gpu.copy_dtod(sc.hid.offset(i * hb), row.hidden, hb, stream)?;
        }
        if kind == HiddenKind::Target && self.levers.mtp_target_postnorm {
            gpu.rms_norm(
                sc.hid,
                sc.hid,
                self.target_final_norm.ptr,
                r,
                h,
                eps,
                stream,
            )?;
        }
        gpu.rms_norm(sc.hid, sc.hid, w.hnorm.ptr, r, h, eps, stream)?;
        let (first, second) = if w.layout.embedding_first() {
            (sc.emb, sc.hid)
        } else {
            (sc.hid, sc.emb)
        };
        for i in 0..r {
            gpu.copy_dtod(sc.cat.offset(2 * i * hb), first.offset(i * hb), hb, stream)?;
            gpu.copy_dtod(
                sc.cat.offset((2 * i + 1) * hb),
                second.offset(i * hb),
                hb,
                stream,
            )?;
        }
        w.eh_proj
            .forward(gpu, sc.x, Dtype::Bf16, sc.cat, None, r, stream)?;

        // Attention block.
        gpu.rms_norm(sc.normed, sc.x, l.attn_norm.ptr, r, h, eps, stream)?;
        let gated = w.layout.gated_attention();
        let q = if gated { sc.qfull } else { sc.q };
        l.q.forward(gpu, q, Dtype::Bf16, sc.normed, l.q_bias.as_ref(), r, stream)?;
        l.k.forward(
            gpu,
            sc.k,
            Dtype::Bf16,
            sc.normed,
            l.k_bias.as_ref(),
            r,
            stream,
        )?;
        l.v.forward(
            gpu,
            sc.v,
            Dtype::Bf16,
            sc.normed,
            l.v_bias.as_ref(),
            r,
            stream,
        )?;
        if gated {
            // Per head, q_proj's rows are [query (head_dim), gate (head_dim)].
            let hdb = hd * 2;
            for i in 0..r * heads {
                gpu.copy_dtod(
                    sc.q.offset(i * hdb),
                    sc.qfull.offset(2 * i * hdb),
                    hdb,
                    stream,
                )?;
                gpu.copy_dtod(
                    sc.qgate.offset(i * hdb),
                    sc.qfull.offset((2 * i + 1) * hdb),
                    hdb,
                    stream,
                )?;
            }
        }
        if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
            gpu.rms_norm(sc.q, sc.q, qn.ptr, r * heads, hd, eps, stream)?;
            gpu.rms_norm(sc.k, sc.k, kn.ptr, r * kvh, hd, eps, stream)?;
        }
        let rd = self.rotary_dim;
        gpu.rope(
            sc.q,
            sc.positions,
            self.inv_freq,
            r,
            heads,
            hd,
            rd,
            RopeStyle::Half,
            stream,
        )?;
        gpu.rope(
            sc.k,
            sc.positions,
            self.inv_freq,
            r,
            kvh,
            hd,
            rd,
            RopeStyle::Half,
            stream,
        )?;
        gpu.kv_write(
            self.k_cache,
            self.v_cache,
            sc.k,
            sc.v,
            sc.slots,
            r,
            kvh,
            hd,
            self.num_slots,
            stream,
        )?;
        if depth == Depth::KvOnly {
            return Ok(());
        }
        let mbps = self.max_blocks_per_seq;
        for (s, &(t, cap)) in tables.iter().enumerate() {
            gpu.copy_dtod(sc.table.offset(s * mbps * 4), t, cap.min(mbps) * 4, stream)?;
        }
        gpu.write(sc.row_seq, &u32s(&|x| x.seq as u32), stream)?;
        gpu.write(sc.ctx_len, &u32s(&|x| x.ctx_len as u32), stream)?;
        gpu.paged_attention(
            sc.attn,
            sc.q,
            self.k_cache,
            self.v_cache,
            sc.table,
            sc.row_seq,
            sc.ctx_len,
            r,
            heads,
            kvh,
            hd,
            super::state::DRAFTER_BLOCK_SIZE,
            mbps,
            1.0 / (hd as f32).sqrt(),
            stream,
        )?;
        if gated {
            gpu.sigmoid_mul(sc.attn, sc.qgate, sc.attn, r * heads * hd, stream)?;
        }
        l.o.forward(gpu, sc.normed, Dtype::Bf16, sc.attn, None, r, stream)?;
        gpu.add(sc.x, sc.x, sc.normed, r * h, stream)?;

        // MLP block.
        gpu.rms_norm(sc.normed, sc.x, l.ffn_norm.ptr, r, h, eps, stream)?;
        l.gate
            .forward(gpu, sc.mlp_gate, Dtype::Bf16, sc.normed, None, r, stream)?;
        l.up.forward(gpu, sc.mlp_up, Dtype::Bf16, sc.normed, None, r, stream)?;
        gpu.silu_mul(sc.mlp_gate, sc.mlp_gate, sc.mlp_up, r * self.ffn, stream)?;
        match &l.moe {
            None => {
                l.down
                    .forward(gpu, sc.normed, Dtype::Bf16, sc.mlp_gate, None, r, stream)?;
                gpu.add(sc.x, sc.x, sc.normed, r * h, stream)?;
            }
            Some(moe) => {
                // The layer's gate/up/down are the shared expert; the routed experts read
                // the same normed input, so it must survive until they ran.
                l.down
                    .forward(gpu, sc.moe_acc, Dtype::Bf16, sc.mlp_gate, None, r, stream)?;
                moe.forward(gpu, sc, r, h, stream)?;
                gpu.add(sc.x, sc.x, sc.moe_acc, r * h, stream)?;
            }
        }

        gpu.rms_norm(sc.out, sc.x, w.final_norm.ptr, r, h, eps, stream)?;
        let lm = &self.lm_head;
        gpu.linear_nvfp4(
            sc.logits,
            Dtype::F32,
            sc.out,
            lm.weight,
            lm.weight_scale,
            lm.weight_scale_2,
            r,
            h,
            self.draft_vocab,
            stream,
        )?;
        Ok(())
    }

    /// The hidden the next draft step feeds back for row `i` of the last forward.
    pub(crate) fn chain_hidden(&self, sc: &Scratch, i: usize) -> DevicePtr {
        let base = if self.levers.mtp_chain_postnorm {
            sc.out
        } else {
            sc.x
        };
        base.offset(i * self.h_bytes())
    }
}
