//! The Llama-family decoder's layers on the typed [`Kernels`] only (so every backend runs
//! them): RoPE frequencies from the config, and one pre-norm decoder layer's forward.
//!
//! Invariant: a layer reads and writes only the buffers in its [`LayerIo`] and its own
//! [`LayerCache`] slots named by `io.slots`.
//!
//! [`Kernels`]: crate::backend::Kernels

use super::decoder_weights::LayerWeights;
// The loaders that build layer weights, re-exported where the layers are.
pub use super::decoder_weights::{load_dense, load_linear};
use super::{ConfigError, ModelConfig};
use crate::backend::{DevicePtr, Dtype, GpuBackend, RopeStyle};

/// RoPE inverse frequencies for `config` (`rotary_dim / 2` of them), with linear or llama3
/// scaling applied; other scalings are refused rather than silently ignored.
pub fn rope_inv_freq(config: &ModelConfig) -> Result<Vec<f32>, ConfigError> {
    let rotary_dim = rotary_dim(config);
    let base = config.rope_theta as f64;
    let mut freqs: Vec<f64> = (0..rotary_dim / 2)
        .map(|i| 1.0 / base.powf(2.0 * i as f64 / rotary_dim as f64))
        .collect();
    if let Some(rs) = &config.rope_scaling {
        let factor = rs.factor as f64;
        match rs.kind.as_str() {
            "default" | "none" => {}
            "linear" => freqs.iter_mut().for_each(|f| *f /= factor),
            "llama3" => {
                let low = rs.low_freq_factor.unwrap_or(1.0) as f64;
                let high = rs.high_freq_factor.unwrap_or(4.0) as f64;
                let old = rs.original_max_position_embeddings.unwrap_or(8192) as f64;
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                for f in freqs.iter_mut() {
                    let wavelen = 2.0 * std::f64::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old / wavelen - low) / (high - low);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
            other => {
                return Err(ConfigError::BadValue {
                    key: "rope_scaling".into(),
                    message: format!("rope type {other:?} is not supported (linear, llama3)"),
                })
            }
        }
    }
    Ok(freqs.into_iter().map(|f| f as f32).collect())
}

/// Elements of each head RoPE rotates (even).
pub fn rotary_dim(config: &ModelConfig) -> usize {
    let d = (config.head_dim as f32 * config.partial_rotary_factor).round() as usize;
    (d / 2 * 2).clamp(2, config.head_dim)
}

/// Device pointers of the per-forward metadata and scratch one layer reads and writes.
pub struct LayerIo {
    /// Residual stream, BF16 `[rows, hidden]`, updated in place.
    pub hidden: DevicePtr,
    pub normed: DevicePtr,
    pub q: DevicePtr,
    pub k: DevicePtr,
    pub v: DevicePtr,
    pub attn_out: DevicePtr,
    pub gate: DevicePtr,
    pub up: DevicePtr,
    pub positions: DevicePtr,
    pub slots: DevicePtr,
    pub row_seq: DevicePtr,
    pub row_ctx_len: DevicePtr,
    pub block_table: DevicePtr,
    pub inv_freq: DevicePtr,
    pub rows: usize,
    pub max_blocks_per_seq: usize,
    pub rope_style: RopeStyle,
    pub stream: u64,
}

/// The paged KV cache of one layer.
pub struct LayerCache {
    pub k: DevicePtr,
    pub v: DevicePtr,
    pub num_slots: usize,
    pub block_size: usize,
}

/// One pre-norm decoder layer: attention then SwiGLU MLP, each added to the residual.
pub fn decoder_layer(
    gpu: &dyn GpuBackend,
    config: &ModelConfig,
    w: &LayerWeights,
    cache: &LayerCache,
    io: &LayerIo,
) -> crate::Result<()> {
    let (rows, s) = (io.rows, io.stream);
    let (h, heads, kvh, hd) = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    );
    let eps = config.rms_norm_eps;
    gpu.rms_norm(io.normed, io.hidden, w.attn_norm.ptr, rows, h, eps, s)?;
    w.q.forward(
        gpu,
        io.q,
        Dtype::Bf16,
        io.normed,
        w.q_bias.as_ref(),
        rows,
        s,
    )?;
    w.k.forward(
        gpu,
        io.k,
        Dtype::Bf16,
        io.normed,
        w.k_bias.as_ref(),
        rows,
        s,
    )?;
    w.v.forward(
        gpu,
        io.v,
        Dtype::Bf16,
        io.normed,
        w.v_bias.as_ref(),
        rows,
        s,
    )?;
    if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
        gpu.rms_norm(io.q, io.q, qn.ptr, rows * heads, hd, eps, s)?;
        gpu.rms_norm(io.k, io.k, kn.ptr, rows * kvh, hd, eps, s)?;
    }
    let rd = rotary_dim(config);
    gpu.rope(
        io.q,
        io.positions,
        io.inv_freq,
        rows,
        heads,
        hd,
        rd,
        io.rope_style,
        s,
    )?;
    gpu.rope(
        io.k,
        io.positions,
        io.inv_freq,
        rows,
        kvh,
        hd,
        rd,
        io.rope_style,
        s,
    )?;
    gpu.kv_write(
        cache.k,
        cache.v,
        io.k,
        io.v,
        io.slots,
        rows,
        kvh,
        hd,
        cache.num_slots,
        s,
    )?;
    gpu.paged_attention(
        io.attn_out,
        io.q,
        cache.k,
        cache.v,
        io.block_table,
        io.row_seq,
        io.row_ctx_len,
        rows,
        heads,
        kvh,
        hd,
        cache.block_size,
        io.max_blocks_per_seq,
        1.0 / (hd as f32).sqrt(),
        s,
    )?;
    w.o.forward(gpu, io.normed, Dtype::Bf16, io.attn_out, None, rows, s)?;
    gpu.add(io.hidden, io.hidden, io.normed, rows * h, s)?;
    gpu.rms_norm(io.normed, io.hidden, w.ffn_norm.ptr, rows, h, eps, s)?;
    w.gate
        .forward(gpu, io.gate, Dtype::Bf16, io.normed, None, rows, s)?;
    w.up.forward(gpu, io.up, Dtype::Bf16, io.normed, None, rows, s)?;
    let ffn = config.intermediate_size;
    gpu.silu_mul(io.gate, io.gate, io.up, rows * ffn, s)?;
    w.down
        .forward(gpu, io.normed, Dtype::Bf16, io.gate, None, rows, s)?;
    gpu.add(io.hidden, io.hidden, io.normed, rows * h, s)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RopeScaling;

    #[test]
    fn rope_frequencies_follow_theta_and_scaling() {
        let mut c = ModelConfig::tiny(32);
        let plain = rope_inv_freq(&c).unwrap();
        assert_eq!(plain.len(), 8);
        assert_eq!(plain[0], 1.0);
        assert!((plain[1] - 10_000f32.powf(-2.0 / 16.0)).abs() < 1e-7);
        c.rope_scaling = Some(RopeScaling {
            kind: "linear".into(),
            factor: 4.0,
            low_freq_factor: None,
            high_freq_factor: None,
            original_max_position_embeddings: None,
        });
        let lin = rope_inv_freq(&c).unwrap();
        assert!(lin
            .iter()
            .zip(&plain)
            .all(|(a, b)| (a * 4.0 - b).abs() < 1e-7));
        c.rope_theta = 500_000.0;
        c.rope_scaling = Some(RopeScaling {
            kind: "llama3".into(),
            factor: 8.0,
            low_freq_factor: Some(1.0),
            high_freq_factor: Some(4.0),
            original_max_position_embeddings: Some(8192),
        });
        let base = {
            let mut b = c.clone();
            b.rope_scaling = None;
            rope_inv_freq(&b).unwrap()
        };
        let l3 = rope_inv_freq(&c).unwrap();
        // Short wavelengths (< 8192 / 4) are kept, long ones (> 8192) divided by the factor.
        for (f, b) in l3.iter().zip(&base) {
            let wavelen = 2.0 * std::f32::consts::PI / b;
            if wavelen < 2048.0 {
                assert_eq!(f, b);
            } else if wavelen > 8192.0 {
                assert!((f * 8.0 - b).abs() <= b * 1e-6);
            } else {
                assert!(*f < *b && *f > b / 8.0);
            }
        }
        c.rope_scaling.as_mut().unwrap().kind = "yarn".into();
        assert!(rope_inv_freq(&c).unwrap_err().to_string().contains("yarn"));
    }
}
