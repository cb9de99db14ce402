//! RoPE's inverse frequencies and rotated width from a model's configuration (the base,
//! partial rotation and linear, llama3 or YaRN scaling); the rotation itself is the `rope` op.

use crate::model::{yarn_mscale, ConfigError, ModelConfig, RopeScaling};

/// RoPE inverse frequencies for `config` (`rotary_dim / 2` of them), with linear, llama3 or
/// YaRN scaling applied; other scalings are refused rather than silently ignored.
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
            "yarn" => yarn(&mut freqs, config, rs, base)?,
            other => {
                return Err(ConfigError::BadValue {
                    key: "rope_scaling".into(),
                    message: format!("rope type {other:?} is not supported (linear, llama3, yarn)"),
                })
            }
        }
    }
    Ok(freqs.into_iter().map(|f| f as f32).collect())
}

/// YaRN's frequencies, as `transformers` computes them: frequencies that turn more than
/// `beta_fast` times over the original context are kept, fewer than `beta_slow` times divided
/// by the factor, and those between blended along a linear ramp over the (truncated)
/// correction range. YaRN's cos/sin scale (`attention_factor`, or `mscale(factor, mscale) /
/// mscale(factor, mscale_all_dim)`) must be 1, as DeepSeek-V3's is: the RoPE op does not
/// scale, so any other value is refused rather than ignored.
fn yarn(
    freqs: &mut [f64],
    config: &ModelConfig,
    rs: &RopeScaling,
    base: f64,
) -> Result<(), ConfigError> {
    let y = &rs.yarn;
    let cos_sin_scale = match (y.attention_factor, y.mscale, y.mscale_all_dim) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
            yarn_mscale(rs.factor, m) / yarn_mscale(rs.factor, all)
        }
        _ => yarn_mscale(rs.factor, 1.0),
    };
    if (cos_sin_scale - 1.0).abs() > 1e-6 {
        return Err(ConfigError::BadValue {
            key: "rope_scaling".into(),
            message: format!(
                "yarn scales cos and sin by {cos_sin_scale} here (attention_factor, or mscale / mscale_all_dim), which is not supported; only a scale of 1 (DeepSeek-V3's mscale = mscale_all_dim) is"
            ),
        });
    }
    let dim = (freqs.len() * 2) as f64;
    let old = rs
        .original_max_position_embeddings
        .unwrap_or(config.max_position_embeddings) as f64;
    let correction = |rotations: f64| {
        dim * (old / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
    };
    let low = correction(f64::from(y.beta_fast.unwrap_or(32.0)))
        .floor()
        .max(0.0);
    let mut high = correction(f64::from(y.beta_slow.unwrap_or(1.0)))
        .ceil()
        .min(dim - 1.0);
    if low == high {
        high += 0.001;
    }
    let factor = f64::from(rs.factor);
    for (i, f) in freqs.iter_mut().enumerate() {
        let kept = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
        *f = *f / factor * (1.0 - kept) + *f * kept;
    }
    Ok(())
}

/// Elements of each head RoPE rotates (even): under multi-head latent attention,
/// `qk_rope_head_dim`.
pub fn rotary_dim(config: &ModelConfig) -> usize {
    if let Some(m) = &config.mla {
        return m.qk_rope_head_dim;
    }
    let d = (config.head_dim as f32 * config.partial_rotary_factor).round() as usize;
    (d / 2 * 2).clamp(2, config.head_dim)
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
            yarn: Default::default(),
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
            yarn: Default::default(),
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
        c.rope_scaling.as_mut().unwrap().kind = "dynamic".into();
        assert!(rope_inv_freq(&c)
            .unwrap_err()
            .to_string()
            .contains("dynamic"));
    }

    #[test]
    fn yarn_keeps_fast_frequencies_divides_slow_ones_and_blends_between() {
        // Eight rotated elements, base 10^4: frequencies 1, 0.1, 0.01, 0.001. Over an
        // original context of 256, beta_fast 32 and beta_slow 1 put the ramp's ends at
        // elements 0 (floor of 0.10) and 2 (ceil of 1.61): the first frequency is kept, the
        // second blended half and half, the rest divided by the factor 4.
        let mut c = ModelConfig::tiny(32);
        c.head_dim = 8;
        let yarn = |mscale: Option<f32>, all: Option<f32>| RopeScaling {
            kind: "yarn".into(),
            factor: 4.0,
            low_freq_factor: None,
            high_freq_factor: None,
            original_max_position_embeddings: Some(256),
            yarn: crate::model::YarnParams {
                beta_fast: Some(32.0),
                beta_slow: Some(1.0),
                mscale,
                mscale_all_dim: all,
                attention_factor: None,
            },
        };
        c.rope_scaling = Some(yarn(Some(0.8), Some(0.8)));
        let got = rope_inv_freq(&c).unwrap();
        let want = [1.0, 0.1 / 4.0 * 0.5 + 0.1 * 0.5, 0.01 / 4.0, 0.001 / 4.0];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= w * 1e-6, "{got:?}, expected {want:?}");
        }
        // Without mscale = mscale_all_dim, YaRN scales cos and sin, which is refused.
        c.rope_scaling = Some(yarn(None, None));
        let err = rope_inv_freq(&c).unwrap_err().to_string();
        assert!(err.contains("yarn scales cos and sin by 1.13"), "{err}");
    }
}
