//! A DFlash checkpoint's `config.json` (z-lab's layout): a Qwen3 config whose
//! `num_hidden_layers` counts the draft's own layers, plus `block_size`, `num_target_layers`
//! and `dflash_config: {target_layer_ids, mask_token_id}`.
//!
//! Invariants of a parsed [`DFlashConfig`]: the block holds at least two rows (the last
//! accepted token and one mask) and at most [`MAX_BLOCK_SIZE`]; the mask token lies inside
//! the vocabulary; a sliding-window draft is refused naming the key, never ignored. Layer ids
//! are checked against a target by [`DFlashConfig::target_layers`]: each below the target's
//! layer count, none twice, between 1 and [`MAX_TARGET_LAYERS`] of them.

use crate::model::{ConfigError, ModelConfig};
use serde_json::{Map, Value};
use std::path::Path;

/// The largest block a head drafts (z-lab ships 8 and 16; the scratch is sized from it).
pub const MAX_BLOCK_SIZE: usize = 64;
/// The most target layers a head fuses.
pub const MAX_TARGET_LAYERS: usize = 16;

/// What a DFlash checkpoint's `config.json` says.
#[derive(Clone, Debug, PartialEq)]
pub struct DFlashConfig {
    /// The draft layers' sizes: `num_hidden_layers` of them, over the target's vocabulary.
    pub layer: ModelConfig,
    /// γ: rows of one block forward (the last accepted token, then γ - 1 masks).
    pub block_size: usize,
    /// `dflash_config.target_layer_ids` as written, if given.
    pub target_layer_ids: Option<Vec<usize>>,
    /// `num_target_layers`, if given: the layer count of the target the head was made for.
    pub num_target_layers: Option<usize>,
    /// The token every block row but the first holds.
    pub mask_token_id: u32,
}

fn bad(key: &str, message: String) -> ConfigError {
    ConfigError::BadValue {
        key: key.to_string(),
        message,
    }
}

fn opt_usize(map: &Map<String, Value>, key: &str) -> Result<Option<usize>, ConfigError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| bad(key, format!("expected a non-negative integer, found {v}"))),
    }
}

fn opt_ids(map: &Map<String, Value>, key: &str) -> Result<Option<Vec<usize>>, ConfigError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| bad(key, format!("expected layer ids, found {v}")))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(v) => Err(bad(key, format!("expected a list of layer ids, found {v}"))),
    }
}

/// z-lab's default taps for `draft_layers` draft layers over a target of `target_layers`:
/// one layer in the middle, or `draft_layers` ids spread evenly over `[1, L - 3]`.
pub fn default_target_layer_ids(target_layers: usize, draft_layers: usize) -> Vec<usize> {
    if draft_layers <= 1 {
        return vec![target_layers / 2];
    }
    let (start, end) = (1.0f64, target_layers as f64 - 3.0);
    let span = end - start;
    (0..draft_layers)
        .map(|i| {
            let x = start + i as f64 * span / (draft_layers - 1) as f64;
            // Python's round() rounds halves to even.
            let r = x.round_ties_even();
            r.max(0.0) as usize
        })
        .collect()
}

impl DFlashConfig {
    /// Reads `path`; an error about its contents names the file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let map = ModelConfig::read_json(path)?;
        Self::from_json_map(&map).map_err(|e| ConfigError::InFile {
            path: path.display().to_string(),
            source: Box::new(e),
        })
    }

    /// Parses an already read `config.json` object.
    pub fn from_json_map(map: &Map<String, Value>) -> Result<Self, ConfigError> {
        let layer = ModelConfig::from_json_map(map)?;
        if let Some(Value::Bool(true)) = map.get("use_sliding_window") {
            return Err(bad(
                "use_sliding_window",
                "is true; this head runs every draft layer over the whole context".into(),
            ));
        }
        let key = "block_size";
        let block_size = opt_usize(map, key)?.ok_or_else(|| ConfigError::MissingKey {
            key: key.into(),
            model_type: "dflash".into(),
        })?;
        if !(2..=MAX_BLOCK_SIZE).contains(&block_size) {
            return Err(bad(
                key,
                format!(
                    "is {block_size}; a block holds 2 to {MAX_BLOCK_SIZE} rows (the last token and at least one mask)"
                ),
            ));
        }
        let dflash = match map.get("dflash_config") {
            Some(Value::Object(d)) => d,
            Some(v) => {
                return Err(bad(
                    "dflash_config",
                    format!("expected an object, found {v}"),
                ))
            }
            None => {
                return Err(ConfigError::MissingKey {
                    key: "dflash_config".into(),
                    model_type: "dflash".into(),
                })
            }
        };
        let key = "dflash_config.mask_token_id";
        let mask = opt_usize(dflash, "mask_token_id")
            .map_err(|_| {
                bad(
                    key,
                    format!("expected a token id, found {}", dflash["mask_token_id"]),
                )
            })?
            .ok_or_else(|| ConfigError::MissingKey {
                key: key.into(),
                model_type: "dflash".into(),
            })?;
        if mask >= layer.vocab_size {
            return Err(bad(
                key,
                format!(
                    "is {mask}, outside the vocabulary of {} (vocab_size)",
                    layer.vocab_size
                ),
            ));
        }
        let target_layer_ids = opt_ids(dflash, "target_layer_ids").map_err(|e| match e {
            ConfigError::BadValue { message, .. } => bad("dflash_config.target_layer_ids", message),
            e => e,
        })?;
        Ok(DFlashConfig {
            layer,
            block_size,
            target_layer_ids,
            num_target_layers: opt_usize(map, "num_target_layers")?,
            mask_token_id: mask as u32,
        })
    }

    /// The target layers whose outputs the head fuses, for a target of `target_layers`
    /// decoder layers: the stated ids, or z-lab's default for the draft's layer count. A
    /// stated `num_target_layers` must be the target's.
    pub fn target_layers(&self, target_layers: usize) -> Result<Vec<usize>, ConfigError> {
        if let Some(n) = self.num_target_layers.filter(|&n| n != target_layers) {
            return Err(bad(
                "num_target_layers",
                format!(
                    "is {n}, but the target has {target_layers} layers: this head was made for another model"
                ),
            ));
        }
        let key = "dflash_config.target_layer_ids";
        let ids = match &self.target_layer_ids {
            Some(ids) => ids.clone(),
            None => default_target_layer_ids(target_layers, self.layer.num_hidden_layers),
        };
        if ids.is_empty() || ids.len() > MAX_TARGET_LAYERS {
            return Err(bad(
                key,
                format!(
                    "names {} layers; a head fuses 1 to {MAX_TARGET_LAYERS}",
                    ids.len()
                ),
            ));
        }
        for (i, &id) in ids.iter().enumerate() {
            if id >= target_layers {
                return Err(bad(
                    key,
                    format!(
                        "names layer {id}, but the target has {target_layers} layers (ids are 0 ..= {})",
                        target_layers.saturating_sub(1)
                    ),
                ));
            }
            if ids[..i].contains(&id) {
                return Err(bad(key, format!("names layer {id} twice")));
            }
        }
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str, dflash: &str) -> Result<DFlashConfig, ConfigError> {
        let text = format!(
            r#"{{"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
                "head_dim": 16, "vocab_size": 100, "block_size": 8,
                "dflash_config": {{{dflash}}} {extra}}}"#
        );
        let map = serde_json::from_str::<Value>(&text).unwrap();
        DFlashConfig::from_json_map(map.as_object().unwrap())
    }

    #[test]
    fn the_default_taps_are_z_labs() {
        // build_target_layer_ids in z-lab's dflash/model.py, values computed by hand:
        // Qwen3-8B (36 layers, 5 draft layers) taps 1, 9, 17, 25, 33.
        assert_eq!(default_target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(default_target_layer_ids(36, 1), vec![18]);
        // 30 layers, 2 draft layers: 1 and 27; 31 layers, 3: 1, 14 (14.5, a half, to even), 28.
        assert_eq!(default_target_layer_ids(30, 2), vec![1, 27]);
        assert_eq!(default_target_layer_ids(31, 3), vec![1, 14, 28]);
        let c = config("", r#""mask_token_id": 99"#).unwrap();
        assert_eq!(c.target_layers(30).unwrap(), vec![1, 27]);
        assert_eq!((c.block_size, c.mask_token_id), (8, 99));
    }

    #[test]
    fn bad_values_are_named() {
        let err = config("", r#""mask_token_id": 100"#)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("mask_token_id") && err.contains("is 100, outside the vocabulary of 100"),
            "{err}"
        );
        let err = config("", r#""target_layer_ids": [1, 3]"#)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("missing required key \"dflash_config.mask_token_id\""),
            "{err}"
        );
        let c = config("", r#""mask_token_id": 5, "target_layer_ids": [1, 7, 1]"#).unwrap();
        let err = c.target_layers(8).unwrap_err().to_string();
        assert!(err.contains("names layer 1 twice"), "{err}");
        let err = c.target_layers(7).unwrap_err().to_string();
        assert!(
            err.contains("names layer 7, but the target has 7 layers"),
            "{err}"
        );
        let c = config(r#", "num_target_layers": 12"#, r#""mask_token_id": 5"#).unwrap();
        let err = c.target_layers(8).unwrap_err().to_string();
        assert!(err.contains("is 12, but the target has 8 layers"), "{err}");
        let err = config(r#", "use_sliding_window": true"#, r#""mask_token_id": 5"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("use_sliding_window"), "{err}");
    }
}
