//! An EAGLE-3 checkpoint's `config.json`, in either of its two forms.
//!
//! - speculators (vLLM's `speculators` library): `speculators_model_type: "eagle3"`, the draft
//!   layer's Hugging Face config under `transformer_layer_config` (its `vocab_size` is the
//!   target's), and at the top level `draft_vocab_size`, `norm_before_residual`,
//!   `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`.
//! - the original EAGLE-3 release: one Llama-like config for the draft layer with
//!   `draft_vocab_size` (and optionally `target_hidden_size` and the layer ids) beside it.
//!
//! Invariants of a parsed [`Eagle3Config`]: the draft has one decoder layer; the draft
//! vocabulary is non-empty and no larger than the target's; the target hidden size is
//! within the crate's limits; the variants this crate does not run (`norm_before_fc`,
//! `fc_norm`, `norm_output`) are refused naming the key, never ignored. Layer ids are as
//! written (EAGLE-3's "hidden entering layer `k`"); [`Eagle3Config::aux_layers`] checks
//! them against a target.

use crate::model::{ConfigError, ModelConfig, LIMITS};
use serde_json::{Map, Value};
use std::path::Path;

/// Which of the two `config.json` forms a checkpoint has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Eagle3Format {
    /// vLLM `speculators`: `speculators_model_type: "eagle3"`.
    Speculators,
    /// The original EAGLE-3 release: a Llama-like config with `draft_vocab_size`.
    Original,
}

/// The aux hidden states a head fuses at most (real heads fuse three).
pub const MAX_AUX_LAYERS: usize = 16;

/// What an EAGLE-3 checkpoint's `config.json` says.
#[derive(Clone, Debug, PartialEq)]
pub struct Eagle3Config {
    /// Which form the file had.
    pub format: Eagle3Format,
    /// The draft decoder layer's sizes; its `vocab_size` is the target's vocabulary.
    pub layer: ModelConfig,
    /// Rows of the head's own LM head (its reduced draft vocabulary).
    pub draft_vocab_size: usize,
    /// Width of one captured target hidden (`layer.hidden_size` unless stated).
    pub target_hidden_size: usize,
    /// `eagle_aux_hidden_state_layer_ids` as written (hidden entering layer `k`), if given.
    pub aux_layer_ids: Option<Vec<usize>>,
    /// The layer's residual is `hidden_norm(fused)` rather than `fused`.
    pub norm_before_residual: bool,
}

fn bad(key: &str, message: String) -> ConfigError {
    ConfigError::BadValue {
        key: key.to_string(),
        message,
    }
}

fn opt_bool(map: &Map<String, Value>, key: &str) -> Result<bool, ConfigError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(bad(key, format!("expected true or false, found {v}"))),
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
        Some(Value::Array(items)) => {
            if items.is_empty() || items.len() > MAX_AUX_LAYERS {
                return Err(bad(
                    key,
                    format!(
                        "names {} layers; a head fuses 1 to {MAX_AUX_LAYERS}",
                        items.len()
                    ),
                ));
            }
            items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| usize::try_from(n).ok())
                        .ok_or_else(|| bad(key, format!("expected layer ids, found {v}")))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some)
        }
        Some(v) => Err(bad(key, format!("expected a list of layer ids, found {v}"))),
    }
}

impl Eagle3Config {
    /// Reads `path`; an error about its contents names the file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let map = ModelConfig::read_json(path)?;
        Self::from_json_map(&map).map_err(|e| ConfigError::InFile {
            path: path.display().to_string(),
            source: Box::new(e),
        })
    }

    /// Parses an already read `config.json` object of either form.
    pub fn from_json_map(map: &Map<String, Value>) -> Result<Self, ConfigError> {
        let (format, layer_map, extra) = match map.get("speculators_model_type") {
            None | Some(Value::Null) => (Eagle3Format::Original, map, None),
            Some(Value::String(s)) if s == "eagle3" => match map.get("transformer_layer_config") {
                Some(Value::Object(layer)) => (Eagle3Format::Speculators, layer, Some(map)),
                Some(v) => {
                    return Err(bad(
                        "transformer_layer_config",
                        format!("expected an object, found {v}"),
                    ))
                }
                None => {
                    return Err(ConfigError::MissingKey {
                        key: "transformer_layer_config".into(),
                        model_type: "eagle3".into(),
                    })
                }
            },
            Some(v) => {
                return Err(bad(
                    "speculators_model_type",
                    format!("is {v}; this loader reads \"eagle3\" checkpoints"),
                ))
            }
        };
        let layer = ModelConfig::from_json_map(layer_map)?;
        // The original form keeps the EAGLE keys beside the layer's (some under
        // `eagle_config`); speculators keeps them at the top level.
        let top = extra.unwrap_or(map);
        let nested = match top.get("eagle_config") {
            Some(Value::Object(e)) => Some(e),
            _ => None,
        };
        for key in ["norm_before_fc", "fc_norm", "norm_output"] {
            if opt_bool(top, key)? {
                return Err(bad(
                    key,
                    "is true; this head runs the EAGLE-3 layer without that variant".into(),
                ));
            }
        }
        if layer.num_hidden_layers != 1 {
            return Err(bad(
                "num_hidden_layers",
                format!(
                    "is {}; an EAGLE-3 head here has exactly one decoder layer",
                    layer.num_hidden_layers
                ),
            ));
        }
        let vocab = layer.vocab_size;
        let draft_vocab_size = opt_usize(top, "draft_vocab_size")?.unwrap_or(vocab);
        if draft_vocab_size == 0 || draft_vocab_size > vocab {
            return Err(bad(
                "draft_vocab_size",
                format!(
                    "is {draft_vocab_size}; it must be in 1..={vocab} (the target's vocab_size)"
                ),
            ));
        }
        let target_hidden_size = opt_usize(top, "target_hidden_size")?.unwrap_or(layer.hidden_size);
        let limit = LIMITS[0].1;
        if target_hidden_size == 0 || target_hidden_size > limit {
            return Err(bad(
                "target_hidden_size",
                format!("is {target_hidden_size}; it must be in 1..={limit}"),
            ));
        }
        let key = "eagle_aux_hidden_state_layer_ids";
        let aux_layer_ids = match opt_ids(top, key)? {
            Some(ids) => Some(ids),
            None => nested.map(|e| opt_ids(e, key)).transpose()?.flatten(),
        };
        Ok(Eagle3Config {
            format,
            layer,
            draft_vocab_size,
            target_hidden_size,
            aux_layer_ids,
            norm_before_residual: opt_bool(top, "norm_before_residual")?,
        })
    }

    /// The aux layer ids for a target of `target_layers` layers: the configured ones, or
    /// vLLM's default `(2, L / 2, L - 3)`. Each id `k` names the hidden entering layer `k`
    /// (the output of layer `k - 1`), so `k` must be in `1..L` (0 is the embedding, which
    /// the target does not capture) and the ids distinct.
    pub fn aux_layers(&self, target_layers: usize) -> Result<Vec<usize>, ConfigError> {
        let key = "eagle_aux_hidden_state_layer_ids";
        let ids = match &self.aux_layer_ids {
            Some(ids) => ids.clone(),
            None => {
                let l = target_layers;
                let ids = vec![2, l / 2, l.saturating_sub(3)];
                let distinct = ids[0] < ids[1] && ids[1] < ids[2];
                if !distinct {
                    return Err(bad(
                        key,
                        format!(
                            "is absent, and the default (2, L / 2, L - 3) is {ids:?} for a target of {l} layers, not three distinct layers; state the ids"
                        ),
                    ));
                }
                ids
            }
        };
        for (i, &k) in ids.iter().enumerate() {
            if k == 0 {
                return Err(bad(
                    key,
                    "names layer 0, the hidden entering the first layer (the embedding), which the target does not capture; ids are 1 ..= num_hidden_layers - 1".into(),
                ));
            }
            if k >= target_layers {
                return Err(bad(
                    key,
                    format!(
                        "names layer {k}, but the target has {target_layers} layers (ids are 1 ..= {})",
                        target_layers.saturating_sub(1)
                    ),
                ));
            }
            if ids[..i].contains(&k) {
                return Err(bad(key, format!("names layer {k} twice")));
            }
        }
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Result<Eagle3Config, ConfigError> {
        let text = format!(
            r#"{{"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 100 {extra}}}"#
        );
        let map = serde_json::from_str::<Value>(&text).unwrap();
        Eagle3Config::from_json_map(map.as_object().unwrap())
    }

    #[test]
    fn the_default_layers_are_vllms_and_too_few_target_layers_are_refused() {
        let c = config("").unwrap();
        assert_eq!(c.format, Eagle3Format::Original);
        assert_eq!(
            c.draft_vocab_size, 100,
            "without draft_vocab_size, the target's"
        );
        assert_eq!(c.aux_layers(7).unwrap(), vec![2, 3, 4]);
        assert_eq!(c.aux_layers(32).unwrap(), vec![2, 16, 29]);
        // Six layers give (2, 3, 3): one layer twice.
        let err = c.aux_layers(6).unwrap_err().to_string();
        assert!(err.contains("[2, 3, 3] for a target of 6 layers"), "{err}");
    }

    #[test]
    fn stated_layers_are_checked_against_the_target() {
        let c =
            config(r#", "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 5]}"#).unwrap();
        let err = c.aux_layers(8).unwrap_err().to_string();
        assert!(err.contains("names layer 5 twice"), "{err}");
        let c = config(r#", "eagle_aux_hidden_state_layer_ids": [1, 5, 7]"#).unwrap();
        assert_eq!(c.aux_layers(8).unwrap(), vec![1, 5, 7]);
    }

    #[test]
    fn a_draft_vocabulary_larger_than_the_targets_is_refused() {
        let err = config(r#", "draft_vocab_size": 101"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("is 101; it must be in 1..=100"), "{err}");
    }
}
