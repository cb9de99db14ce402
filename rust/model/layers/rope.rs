//! RoPE's inverse frequencies and rotated width from a model's configuration (the base,
//! partial rotation and linear or llama3 scaling); the rotation itself is the `rope` op.

use crate::model::{ConfigError, ModelConfig};

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
