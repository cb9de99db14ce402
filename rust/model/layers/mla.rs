//! Multi-head latent attention (DeepSeek-V3's MLA): its extra weights, loading them, and the
//! attention half of a decoder layer that has it, on the typed kernels.
//!
//! The equations (Hugging Face's `DeepseekV3Attention`, DeepSeek's own inference code):
//! - `q = q_b(rms_norm(q_a(x)))` (or `q_proj(x)` without `q_lora_rank`), per head
//!   `[q_nope (qk_nope_head_dim) | q_rope (qk_rope_head_dim)]`;
//! - `[c_kv | k_rope] = kv_a_proj_with_mqa(x)`, `c_kv = rms_norm(c_kv, kv_a_layernorm)`;
//! - RoPE on `q_rope` and on `k_rope` only (one `k_rope` shared by every head). Both
//!   `transformers` (with its default `rope_interleave`) and DeepSeek's code rotate adjacent
//!   pairs `(2i, 2i + 1)`; `transformers` then moves the rotated elements to rotate-half
//!   order, the same permutation on queries and keys, which no dot product sees. So RoPE
//!   here is [`RopeStyle::Interleaved`] on those elements, rotate-half only where the config
//!   says `rope_interleave: false`;
//! - head `h`'s key is `[kv_b_k[h] c_kv | k_rope]` and its value `kv_b_v[h] c_kv`, where
//!   `kv_b_proj`'s rows are per head `qk_nope_head_dim` key rows then `v_head_dim` value rows;
//!   scores are scaled by `1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)` (times YaRN's
//!   `mscale(factor, mscale_all_dim)^2` where `rope_scaling` has one); the heads' outputs go
//!   through `o_proj`.
//!
//! The paged cache holds, per token, only the latent row `[c_kv | k_rope]` (normed, rotated),
//! its first half in the layer's key cache and its second in the value cache (see
//! `ModelConfig::kv_cache_row`), and attention runs in the absorbed form
//! ([`MlaAttentionArgs`]), prefill and decode alike. The cache never holds per-head keys
//! or values.
//!
//! Read from Hugging Face safetensors or from llama.cpp's `deepseek2` GGUF, whose names are
//! `attn_q_a`, `attn_q_a_norm`, `attn_q_b` (or `attn_q`), `attn_kv_a_mqa`, `attn_kv_a_norm`,
//! `attn_output`, and `attn_kv_b` whole or split into `attn_k_b` (per head `[kv_lora_rank,
//! qk_nope_head_dim]`, the key rows transposed) and `attn_v_b` (per head `[v_head_dim,
//! kv_lora_rank]`), which are put back together as `kv_b_proj`'s rows.
//!
//! Invariant: an MLA layer's [`LayerWeights`] holds `q` = `q_b_proj` (or `q_proj`), `k` =
//! `kv_a_proj_with_mqa`, `v` = `kv_b_proj` (BF16, which the attention kernel reads
//! directly; an FP8 one is dequantized at load), `o` = `o_proj`, and an [`MlaParts`] with
//! the rest; no biases, q/k norm or gate.

use super::load::{load_dense, load_linear};
use super::names::{LayerNames, NameScheme};
use super::project::{project_bf16, Projection};
use super::weights::LayerWeights;
use super::{LayerCache, LayerDepth, LayerIo, LayerShape};
use crate::backend::{
    fp8_e4m3_to_f32, CopyRowsArgs, DevicePtr, Dtype, GpuBackend, KvWriteArgs, MlaAttentionArgs,
    RmsNormArgs, RopeArgs, RopeStyle, FP8_BLOCK,
};
use crate::model::tensors::{TensorSource, TensorType};
use crate::model::{DenseWeight, DeviceAllocations, Linear, MlaConfig, ModelConfig, ModelError};
use half::bf16;

/// The weights an MLA layer has besides `q`, `k`, `v` and `o` (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct MlaParts {
    /// `[q_lora_rank, hidden]` `q_a_proj` and its `[q_lora_rank]` `q_a_layernorm`, when the
    /// query has the low-rank bottleneck.
    pub q_a: Option<(Linear, DenseWeight)>,
    /// `[kv_lora_rank]`: `kv_a_layernorm`, the RMSNorm of the latent.
    pub kv_a_norm: DenseWeight,
}

/// The MLA scratch buffers, per row.
#[derive(Clone, Copy, Debug)]
pub struct MlaScratch {
    /// BF16 `[rows, q_lora_rank]`: `q_a_proj`'s output, then normed.
    pub q_a: DevicePtr,
    /// BF16 `[rows, heads, qk_nope + qk_rope]`: the queries.
    pub q: DevicePtr,
    /// BF16 `[rows, heads, qk_rope]`: the queries' RoPE parts, rotated apart.
    pub q_rope: DevicePtr,
    /// BF16 `[rows, kv_lora_rank + qk_rope]`: `kv_a_proj_with_mqa`'s output, then the latent.
    pub kv: DevicePtr,
    /// BF16 `[rows, kv_lora_rank]`: `c_kv`, normed apart.
    pub c_kv: DevicePtr,
    /// BF16 `[rows, qk_rope]`: `k_rope`, rotated apart.
    pub k_rope: DevicePtr,
    /// BF16 `[rows, latent / 2]`: the latent rows' first halves.
    pub lo: DevicePtr,
    /// BF16 `[rows, latent / 2]`: the latent rows' second halves.
    pub hi: DevicePtr,
    /// BF16 `[rows, heads, v_head_dim]`: attention's output before `o_proj`.
    pub out: DevicePtr,
}

/// Loads an MLA layer's attention weights: `(q, k, v, o, parts)` as the module's invariant
/// names them, every shape checked against `config` and `m`.
pub(super) fn load(
    allocs: &DeviceAllocations,
    src: &dyn TensorSource,
    config: &ModelConfig,
    m: &MlaConfig,
    names: &LayerNames,
) -> crate::Result<(Linear, Linear, Linear, Linear, MlaParts)> {
    let (h, heads) = (config.hidden_size, config.num_attention_heads);
    let (rank, nope, rope, vd) = (
        m.kv_lora_rank,
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
    );
    let attn = |part: &str| match names.scheme {
        NameScheme::HuggingFace => names.hf(&format!("self_attn.{part}")),
        NameScheme::Gguf => format!("{}{}", names.prefix, gguf_name(part)),
    };
    let lin = |part: &str, o, i| load_linear(allocs, src, &attn(part), o, i);
    let norm = |part: &str, len| load_dense(allocs, src, &format!("{}.weight", attn(part)), &[len]);
    let (q_a, q) = match m.q_lora_rank {
        Some(r) => {
            let q_a = (lin("q_a_proj", r, h)?, norm("q_a_layernorm", r)?);
            (Some(q_a), lin("q_b_proj", heads * (nope + rope), r)?)
        }
        None => (None, lin("q_proj", heads * (nope + rope), h)?),
    };
    let k = lin("kv_a_proj_with_mqa", rank + rope, h)?;
    // The attention kernel reads kv_b's rows per head, so it is kept in BF16 whatever the
    // checkpoint stores it in.
    let kv_b_name = format!("{}.weight", attn("kv_b_proj"));
    let kv_b_shape = [heads * (nope + vd), rank];
    let split = format!("{}attn_k_b.weight", names.prefix);
    let kv_b = match names.scheme == NameScheme::Gguf && src.tensor(&split)?.is_some() {
        true => join_split_kv_b(src, &names.prefix, m, heads)?,
        false => read_bf16_dequantized(src, &attn("kv_b_proj"), &kv_b_shape)?,
    };
    let v = Linear::Dense(DenseWeight::upload(allocs, &kv_b_name, &kv_b_shape, &kv_b)?);
    let o = lin("o_proj", h, heads * vd)?;
    let parts = MlaParts {
        q_a,
        kv_a_norm: norm("kv_a_layernorm", rank)?,
    };
    Ok((q, k, v, o, parts))
}

/// llama.cpp's `deepseek2` name of a Hugging Face MLA part.
fn gguf_name(hf: &str) -> &str {
    match hf {
        "q_a_proj" => "attn_q_a",
        "q_a_layernorm" => "attn_q_a_norm",
        "q_b_proj" => "attn_q_b",
        "q_proj" => "attn_q",
        "kv_a_proj_with_mqa" => "attn_kv_a_mqa",
        "kv_a_layernorm" => "attn_kv_a_norm",
        "kv_b_proj" => "attn_kv_b",
        "o_proj" => "attn_output",
        other => other,
    }
}

/// `kv_b_proj` (`[heads * (nope + v_head_dim), kv_lora_rank]`, per head its key rows then
/// its value rows) from a GGUF's `attn_k_b` (`[heads, kv_lora_rank, nope]`: each head's key
/// rows transposed) and `attn_v_b` (`[heads, v_head_dim, kv_lora_rank]`).
fn join_split_kv_b(
    src: &dyn TensorSource,
    prefix: &str,
    m: &MlaConfig,
    heads: usize,
) -> crate::Result<Vec<bf16>> {
    let (rank, nope, vd) = (m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim);
    let k_b = src.read_bf16(&format!("{prefix}attn_k_b.weight"), &[heads, rank, nope])?;
    let v_b = src.read_bf16(&format!("{prefix}attn_v_b.weight"), &[heads, vd, rank])?;
    let mut kv_b = Vec::with_capacity(heads * (nope + vd) * rank);
    for h in 0..heads {
        let k = &k_b[h * rank * nope..(h + 1) * rank * nope];
        for i in 0..nope {
            kv_b.extend((0..rank).map(|c| k[c * nope + i]));
        }
        kv_b.extend_from_slice(&v_b[h * vd * rank..(h + 1) * vd * rank]);
    }
    Ok(kv_b)
}

/// `{base}.weight` of `shape` as BF16: converted as [`TensorSource::read_bf16`] does, or,
/// for FP8 E4M3 with DeepSeek-V3's f32 `{base}.weight_scale_inv` per 128 x 128 block, each
/// code times its block's scale.
fn read_bf16_dequantized(
    src: &dyn TensorSource,
    base: &str,
    shape: &[usize; 2],
) -> crate::Result<Vec<bf16>> {
    let name = format!("{base}.weight");
    let w = src.require(&name)?;
    if w.dtype != TensorType::F8E4M3 {
        return Ok(src.read_bf16(&name, shape)?);
    }
    let [rows, cols] = *shape;
    let scale_name = format!("{base}.weight_scale_inv");
    let s = src.require(&scale_name)?;
    let grid = [rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)];
    let checks = [
        (&name, &w, TensorType::F8E4M3, shape.to_vec()),
        (&scale_name, &s, TensorType::F32, grid.to_vec()),
    ];
    for (n, t, dtype, want) in checks {
        if t.shape != want || t.dtype != dtype || dtype.nbytes(t.numel()) != Some(t.data.len()) {
            return Err(ModelError::ShapeMismatch {
                path: src.path().to_string(),
                tensor: format!("{n} ({}, expected {})", t.dtype.name(), dtype.name()),
                expected: want,
                found: t.shape.clone(),
            }
            .into());
        }
    }
    let scale = |i: usize, j: usize| {
        let at = 4 * ((i / FP8_BLOCK) * grid[1] + j / FP8_BLOCK);
        f32::from_le_bytes([s.data[at], s.data[at + 1], s.data[at + 2], s.data[at + 3]])
    };
    Ok((0..rows * cols)
        .map(|k| {
            let (i, j) = (k / cols, k % cols);
            bf16::from_f32(fp8_e4m3_to_f32(w.data[k]) * scale(i, j))
        })
        .collect())
}

/// The attention half of an MLA layer: from `attn_in` (the normed input) to `o_proj`'s
/// output in `normed`, writing the rows' latents to `cache` on the way. `Ok(false)` when
/// `depth` stops after the cache write.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention(
    gpu: &dyn GpuBackend,
    shape: &LayerShape,
    (m, scale): (&MlaConfig, f32),
    w: &LayerWeights,
    parts: &MlaParts,
    cache: &LayerCache,
    io: &LayerIo,
    ms: &MlaScratch,
    attn_in: DevicePtr,
    normed: DevicePtr,
    depth: LayerDepth,
    row_parent: Option<DevicePtr>,
) -> crate::Result<bool> {
    let (rows, stream, heads, eps) = (io.rows, io.stream, shape.heads, shape.eps);
    let (rank, nope, rope, vd) = (
        m.kv_lora_rank,
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
    );
    let (qk, latent) = (m.qk_head_dim(), m.latent_width());
    let half = latent / 2;
    let bf16 = Dtype::Bf16;
    let el = bf16.size();
    let rms_norm = |x: DevicePtr, weight: &DenseWeight, dim: usize| {
        gpu.rms_norm(RmsNormArgs {
            out: x,
            x,
            weight: weight.ptr,
            rows,
            dim,
            eps,
            stream,
        })
    };
    let copy =
        |dst: DevicePtr, src: DevicePtr, n: usize, width: usize, col, dst_stride, src_stride| {
            gpu.copy_rows(CopyRowsArgs {
                dst,
                src,
                rows: n,
                width,
                col,
                dst_stride,
                src_stride,
                stream,
            })
        };
    let style = if m.rope_interleave {
        RopeStyle::Interleaved
    } else {
        RopeStyle::Half
    };
    let rope_op = |x: DevicePtr, heads: usize| {
        gpu.rope(RopeArgs {
            x,
            positions: io.positions,
            inv_freq: io.inv_freq,
            rows,
            heads,
            head_dim: rope,
            rotary_dim: rope,
            style,
            stream,
        })
    };

    // Queries, their RoPE parts rotated in a buffer of their own.
    let q_in = match &parts.q_a {
        Some((q_a, q_a_norm)) => {
            let r = q_a.dims().0;
            q_a.forward(gpu, ms.q_a, bf16, attn_in, None, rows, stream)?;
            rms_norm(ms.q_a, q_a_norm, r)?;
            ms.q_a
        }
        None => attn_in,
    };
    // The latent projection reads the layer's input, the query's second one its bottleneck.
    match parts.q_a {
        Some(_) => {
            w.q.forward(gpu, ms.q, bf16, q_in, None, rows, stream)?;
            w.k.forward(gpu, ms.kv, bf16, attn_in, None, rows, stream)?;
        }
        None => {
            let both = [(&w.q, ms.q), (&w.k, ms.kv)].map(|(weight, out)| Projection {
                weight,
                bias: None,
                out,
            });
            project_bf16(gpu, attn_in, rows, stream, &both)?;
        }
    }
    let qr = rows * heads;
    copy(ms.q_rope, ms.q.offset(nope * el), qr, rope, 0, rope, qk)?;
    rope_op(ms.q_rope, heads)?;
    copy(ms.q, ms.q_rope, qr, rope, nope, qk, rope)?;

    // The latent: c_kv normed, k_rope rotated, then cached as two halves.
    copy(ms.c_kv, ms.kv, rows, rank, 0, rank, latent)?;
    rms_norm(ms.c_kv, &parts.kv_a_norm, rank)?;
    copy(ms.kv, ms.c_kv, rows, rank, 0, latent, rank)?;
    copy(
        ms.k_rope,
        ms.kv.offset(rank * el),
        rows,
        rope,
        0,
        rope,
        latent,
    )?;
    rope_op(ms.k_rope, 1)?;
    copy(ms.kv, ms.k_rope, rows, rope, rank, latent, rope)?;
    copy(ms.lo, ms.kv, rows, half, 0, half, latent)?;
    copy(ms.hi, ms.kv.offset(half * el), rows, half, 0, half, latent)?;
    gpu.kv_write(KvWriteArgs {
        k_cache: cache.k,
        v_cache: cache.v,
        k: ms.lo,
        v: ms.hi,
        slots: io.slots,
        rows,
        kv_heads: 1,
        head_dim: half,
        num_slots: cache.num_slots,
        stream,
    })?;
    if depth == LayerDepth::KvOnly {
        return Ok(false);
    }
    let Linear::Dense(kv_b) = &w.v else {
        return Err(ModelError::invalid(
            "decoder_layer",
            "an MLA layer's kv_b_proj must be BF16 (the attention kernel reads it directly)",
        )
        .into());
    };
    gpu.mla_attention(MlaAttentionArgs {
        out: ms.out,
        q: ms.q,
        kv_b: kv_b.ptr,
        lo_cache: cache.k,
        hi_cache: cache.v,
        block_table: io.block_table,
        row_seq: io.row_seq,
        row_ctx_len: io.row_ctx_len,
        row_parent,
        rows,
        heads,
        kv_lora_rank: rank,
        nope_dim: nope,
        rope_dim: rope,
        v_dim: vd,
        block_size: cache.block_size,
        max_blocks_per_seq: io.max_blocks_per_seq,
        scale,
        stream,
    })?;
    w.o.forward(gpu, normed, bf16, ms.out, None, rows, stream)?;
    Ok(true)
}
