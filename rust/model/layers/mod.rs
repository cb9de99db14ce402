//! The one pre-norm decoder layer the target model and the MTP draft heads share, on the
//! typed [`Kernels`] only (so every backend runs it): RMSNorm (or an attention input the
//! caller normed, as EAGLE-3's wider one: [`decoder_layer_with_input`]), q/k/v projections (with
//! biases when the weights have them; one grouped linear over the shared input), the per-head q/k RMSNorm, RoPE, the paged KV write,
//! paged attention (with Qwen3-Next's sigmoid output gate), the output projection and
//! residual, then RMSNorm and a SwiGLU MLP (gate and up grouped) or routed experts with shared experts, and the
//! residual again. Its weights are [`LayerWeights`], its buffers a [`LayerScratch`].
//!
//! Invariant: a layer reads and writes only the buffers in its [`LayerIo`] and
//! [`LayerScratch`], and its own [`LayerCache`] slots named by `io.slots`.
//!
//! [`Kernels`]: crate::backend::Kernels

mod expert_shard;
mod load;
mod mla;
mod moe;
mod names;
mod project;
mod rope;
mod scratch;
mod weights;

pub use expert_shard::ExpertShard;
pub use load::{keeps_block_formats, load_dense, load_linear, load_norm};
pub use mla::{MlaParts, MlaScratch};
pub use moe::{MoeMlp, MoeScoring};
pub use names::{LayerNames, NameScheme, Part};
pub use project::{project_bf16, Projection};
pub use rope::{rope_inv_freq, rotary_dim};
pub use scratch::{arena_slots, layer_slots, GatedScratch, LayerScratch, MoeScratch, ScratchShape};
pub use weights::{LayerOptions, LayerWeights, Mlp, QkNorm, SwiGlu};

use super::{MlaConfig, ModelConfig, ModelError};
use crate::backend::{
    DevicePtr, Dtype, ElementwiseArgs, ElementwiseOp, GpuBackend, KvWriteArgs, PagedAttentionArgs,
    RmsNormArgs, RopeArgs, RopeStyle,
};

/// The sizes of a layer's attention.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerShape {
    /// Width of the residual stream.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Elements of each head RoPE rotates (even, at most `head_dim`).
    pub rotary_dim: usize,
    /// The RMSNorm epsilon.
    pub eps: f32,
    /// Multi-head latent attention's sizes and score scale
    /// ([`ModelConfig::mla_softmax_scale`]), for a layer whose attention is MLA (then
    /// `kv_heads` and `head_dim` are not read by the attention).
    pub mla: Option<(MlaConfig, f32)>,
}

impl LayerShape {
    /// The shape `config` describes.
    pub fn of(config: &ModelConfig) -> Self {
        LayerShape {
            hidden: config.hidden_size,
            heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            rotary_dim: rotary_dim(config),
            eps: config.rms_norm_eps,
            mla: config.mla.zip(config.mla_softmax_scale()),
        }
    }
}

/// Device pointers of the per-forward metadata one layer reads, and the residual stream.
pub struct LayerIo {
    /// Residual stream, BF16 `[rows, hidden]`, updated in place.
    pub hidden: DevicePtr,
    /// u32 `[rows]`: each row's RoPE position.
    pub positions: DevicePtr,
    /// u32 `[rows]`: the cache slot each row's key and value go to.
    pub slots: DevicePtr,
    /// u32 `[rows]`: each row's sequence (index into `block_table`).
    pub row_seq: DevicePtr,
    /// u32 `[rows]`: how many cached rows each row attends to (itself included).
    pub row_ctx_len: DevicePtr,
    /// u32 `[sequences, max_blocks_per_seq]`.
    pub block_table: DevicePtr,
    /// f32 `[rotary_dim / 2]`.
    pub inv_freq: DevicePtr,
    /// Token rows in this forward.
    pub rows: usize,
    /// Columns of `block_table`.
    pub max_blocks_per_seq: usize,
    /// Which elements RoPE pairs up.
    pub rope_style: RopeStyle,
    /// The stream every op of the layer is queued on.
    pub stream: u64,
}

/// The paged KV cache of one layer.
pub struct LayerCache {
    /// BF16 `[num_slots, kv_heads, head_dim]`: the key cache.
    pub k: DevicePtr,
    /// BF16 `[num_slots, kv_heads, head_dim]`: the value cache.
    pub v: DevicePtr,
    /// Slots in each cache (blocks times `block_size`).
    pub num_slots: usize,
    /// Cache rows per KV block.
    pub block_size: usize,
}

/// How far a layer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerDepth {
    /// Up to the KV write: rows that only need their keys and values (an MTP head's
    /// prefill and catch-up); `row_seq`, `row_ctx_len` and `block_table` are not read.
    KvOnly,
    /// The whole layer.
    Full,
}

/// Runs one decoder layer over `io.rows` rows.
pub fn decoder_layer(
    gpu: &dyn GpuBackend,
    shape: &LayerShape,
    w: &LayerWeights,
    cache: &LayerCache,
    io: &LayerIo,
    sc: &LayerScratch,
    depth: LayerDepth,
) -> crate::Result<()> {
    decoder_layer_with_input(gpu, shape, w, cache, io, sc, depth, None)
}

/// [`decoder_layer`] whose rows form draft trees: the attention's tree mask `row_parent`
/// (u32 `[rows]`, see [`PagedAttentionArgs::row_parent`]) narrows each row with a parent to
/// the prefix and its ancestors' rows. `io.positions` must give each row its depth's
/// position, which the caller stages.
pub fn decoder_layer_tree(
    gpu: &dyn GpuBackend,
    shape: &LayerShape,
    w: &LayerWeights,
    cache: &LayerCache,
    io: &LayerIo,
    sc: &LayerScratch,
    row_parent: DevicePtr,
) -> crate::Result<()> {
    layer(
        gpu,
        shape,
        w,
        cache,
        io,
        sc,
        LayerDepth::Full,
        None,
        Some(row_parent),
    )
}

/// [`decoder_layer`] whose attention reads `attn_input` (BF16 `[rows, in]`, already normed
/// by the caller, `in` the q/k/v projections' input width) instead of
/// `input_layernorm(io.hidden)`; `io.hidden` is still the residual stream the attention and
/// the MLP add to. EAGLE-3's layer attends over `[input_layernorm(embed) | hidden_norm(h)]`
/// (twice the hidden width) this way. `None` is [`decoder_layer`].
#[allow(clippy::too_many_arguments)]
pub fn decoder_layer_with_input(
    gpu: &dyn GpuBackend,
    shape: &LayerShape,
    w: &LayerWeights,
    cache: &LayerCache,
    io: &LayerIo,
    sc: &LayerScratch,
    depth: LayerDepth,
    attn_input: Option<DevicePtr>,
) -> crate::Result<()> {
    layer(gpu, shape, w, cache, io, sc, depth, attn_input, None)
}

/// The norm and element-wise ops of one layer's forward, on its stream with its epsilon.
struct LayerOps<'a> {
    gpu: &'a dyn GpuBackend,
    eps: f32,
    stream: u64,
}

impl LayerOps<'_> {
    fn rms_norm(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        weight: DevicePtr,
        rows: usize,
        dim: usize,
    ) -> Result<(), crate::backend::BackendError> {
        self.gpu.rms_norm(RmsNormArgs {
            out,
            x,
            weight,
            rows,
            dim,
            eps: self.eps,
            stream: self.stream,
        })
    }

    fn elementwise(
        &self,
        op: ElementwiseOp,
        out: DevicePtr,
        a: DevicePtr,
        b: DevicePtr,
        n: usize,
    ) -> Result<(), crate::backend::BackendError> {
        self.gpu.elementwise(ElementwiseArgs {
            op,
            out,
            a,
            b,
            n,
            stream: self.stream,
        })
    }
}

/// The layer itself, with an optional tree mask for its attention.
#[allow(clippy::too_many_arguments)]
fn layer(
    gpu: &dyn GpuBackend,
    shape: &LayerShape,
    w: &LayerWeights,
    cache: &LayerCache,
    io: &LayerIo,
    sc: &LayerScratch,
    depth: LayerDepth,
    attn_input: Option<DevicePtr>,
    row_parent: Option<DevicePtr>,
) -> crate::Result<()> {
    let (rows, stream) = (io.rows, io.stream);
    let LayerShape { hidden, eps, .. } = *shape;
    let ops = LayerOps { gpu, eps, stream };
    let bf16 = Dtype::Bf16;

    // Attention.
    let attn_in = match attn_input {
        Some(x) => x,
        None => {
            ops.rms_norm(sc.normed, io.hidden, w.attn_norm.ptr, rows, hidden)?;
            sc.normed
        }
    };
    let go_on = match (&w.mla, shape.mla, sc.mla) {
        (None, _, _) => gqa_attention(gpu, shape, w, cache, io, sc, attn_in, depth, row_parent)?,
        (Some(parts), Some((m, scale)), Some(ms)) => mla::attention(
            gpu,
            shape,
            (&m, scale),
            w,
            parts,
            cache,
            io,
            &ms,
            attn_in,
            sc.normed,
            depth,
            row_parent,
        )?,
        (Some(_), _, _) => {
            return Err(ModelError::invalid(
                "decoder_layer",
                "an MLA layer needs the MLA sizes in its shape and the mla_* scratch slots",
            )
            .into())
        }
    };
    if !go_on {
        return Ok(());
    }
    ops.elementwise(
        ElementwiseOp::Add,
        io.hidden,
        io.hidden,
        sc.normed,
        rows * hidden,
    )?;

    // MLP: the dense SwiGLU, or the shared experts and then the routed ones.
    ops.rms_norm(sc.normed, io.hidden, w.ffn_norm.ptr, rows, hidden)?;
    if let Some(mlp) = w.mlp.always_run() {
        let gate_up = [(&mlp.gate, sc.gate), (&mlp.up, sc.up)].map(|(weight, out)| Projection {
            weight,
            bias: None,
            out,
        });
        project_bf16(gpu, sc.normed, rows, stream, &gate_up)?;
        let n = rows * mlp.width();
        ops.elementwise(ElementwiseOp::SiluMul, sc.gate, sc.gate, sc.up, n)?;
    }
    match (&w.mlp, &sc.moe) {
        (Mlp::Dense(m), _) => {
            m.down
                .forward(gpu, sc.normed, bf16, sc.gate, None, rows, stream)?;
            ops.elementwise(
                ElementwiseOp::Add,
                io.hidden,
                io.hidden,
                sc.normed,
                rows * hidden,
            )?;
        }
        (Mlp::Experts(moe), Some(ms)) => {
            // The routed experts read the same normed input, so the shared experts' output
            // goes to the accumulator rather than over it.
            match &moe.shared {
                Some(shared) => shared
                    .down
                    .forward(gpu, ms.acc, bf16, sc.gate, None, rows, stream)?,
                None => gpu.memset(ms.acc, 0, rows * hidden * 2, stream)?,
            }
            moe.forward(gpu, sc, ms, rows, hidden, stream)?;
            ops.elementwise(
                ElementwiseOp::Add,
                io.hidden,
                io.hidden,
                ms.acc,
                rows * hidden,
            )?;
        }
        (Mlp::Experts(_), None) => {
            return Err(ModelError::invalid(
                "decoder_layer",
                "routed experts need the moe_* scratch slots",
            )
            .into())
        }
    }
    Ok(())
}

/// The attention half of a grouped-query layer: from `attn_in` to `o_proj`'s output in
/// `sc.normed`, writing the rows' keys and values to `cache` on the way. `Ok(false)` when
/// `depth` stops after the cache write.
#[allow(clippy::too_many_arguments)]
fn gqa_attention(
    gpu: &dyn GpuBackend,
    shape: &LayerShape,
    w: &LayerWeights,
    cache: &LayerCache,
    io: &LayerIo,
    sc: &LayerScratch,
    attn_in: DevicePtr,
    depth: LayerDepth,
    row_parent: Option<DevicePtr>,
) -> crate::Result<bool> {
    let (rows, stream) = (io.rows, io.stream);
    let LayerShape {
        heads,
        kv_heads,
        head_dim,
        rotary_dim,
        eps,
        ..
    } = *shape;
    let ops = LayerOps { gpu, eps, stream };
    let bf16 = Dtype::Bf16;
    let gated = match (w.gated_attention, sc.gated) {
        (false, _) => None,
        (true, Some(g)) => Some(g),
        (true, None) => {
            return Err(ModelError::invalid(
                "decoder_layer",
                "gated attention needs the q_full and q_gate scratch slots",
            )
            .into())
        }
    };
    let q_out = gated.map_or(sc.q, |g| g.q_full);
    let qkv = [
        (&w.q, w.q_bias.as_ref(), q_out),
        (&w.k, w.k_bias.as_ref(), sc.k),
        (&w.v, w.v_bias.as_ref(), sc.v),
    ]
    .map(|(weight, bias, out)| Projection { weight, bias, out });
    project_bf16(gpu, attn_in, rows, stream, &qkv)?;
    if let Some(g) = gated {
        // Per head, q_proj's rows are [query (head_dim), gate (head_dim)].
        let head_bytes = head_dim * bf16.size();
        for i in 0..rows * heads {
            let from = g.q_full.offset(2 * i * head_bytes);
            gpu.copy_dtod(sc.q.offset(i * head_bytes), from, head_bytes, stream)?;
            let from = g.q_full.offset((2 * i + 1) * head_bytes);
            gpu.copy_dtod(g.q_gate.offset(i * head_bytes), from, head_bytes, stream)?;
        }
    }
    if let Some(n) = &w.qk_norm {
        ops.rms_norm(sc.q, sc.q, n.q.ptr, rows * heads, head_dim)?;
        ops.rms_norm(sc.k, sc.k, n.k.ptr, rows * kv_heads, head_dim)?;
    }
    for (x, heads) in [(sc.q, heads), (sc.k, kv_heads)] {
        gpu.rope(RopeArgs {
            x,
            positions: io.positions,
            inv_freq: io.inv_freq,
            rows,
            heads,
            head_dim,
            rotary_dim,
            style: io.rope_style,
            stream,
        })?;
    }
    gpu.kv_write(KvWriteArgs {
        k_cache: cache.k,
        v_cache: cache.v,
        k: sc.k,
        v: sc.v,
        slots: io.slots,
        rows,
        kv_heads,
        head_dim,
        num_slots: cache.num_slots,
        stream,
    })?;
    if depth == LayerDepth::KvOnly {
        return Ok(false);
    }
    gpu.paged_attention(PagedAttentionArgs {
        out: sc.attn_out,
        q: sc.q,
        k_cache: cache.k,
        v_cache: cache.v,
        block_table: io.block_table,
        row_seq: io.row_seq,
        row_ctx_len: io.row_ctx_len,
        row_parent,
        rows,
        heads,
        kv_heads,
        head_dim,
        block_size: cache.block_size,
        max_blocks_per_seq: io.max_blocks_per_seq,
        scale: 1.0 / (head_dim as f32).sqrt(),
        stream,
    })?;
    if let Some(g) = gated {
        let n = rows * heads * head_dim;
        ops.elementwise(
            ElementwiseOp::SigmoidMul,
            sc.attn_out,
            g.q_gate,
            sc.attn_out,
            n,
        )?;
    }
    w.o.forward(gpu, sc.normed, bf16, sc.attn_out, None, rows, stream)?;
    Ok(true)
}
