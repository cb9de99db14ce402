//! Reading a [`ModelConfig`] from a Hugging Face `config.json`: the file (at most
//! [`MAX_CONFIG_BYTES`]), its keys by model family, and the defaults each family implies.
//!
//! Invariants: a missing key or a value of the wrong type is an error naming the key (and
//! the file, from [`ModelConfig::from_file`]); every config returned has passed
//! [`ModelConfig::validate`].

use super::config::{
    ConfigError, MlaConfig, ModelConfig, ModelFamily, MoeConfig, RopeScaling, YarnParams,
    MAX_CONFIG_BYTES,
};
use serde_json::{Map, Value};
use std::path::Path;

pub(super) struct Keys<'a> {
    map: &'a Map<String, Value>,
    model_type: &'a str,
}

impl Keys<'_> {
    fn missing(&self, key: &str) -> ConfigError {
        ConfigError::MissingKey {
            key: key.to_string(),
            model_type: self.model_type.to_string(),
        }
    }

    pub(super) fn bad(key: &str, message: impl Into<String>) -> ConfigError {
        ConfigError::BadValue {
            key: key.to_string(),
            message: message.into(),
        }
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, ConfigError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                Self::bad(key, format!("expected a non-negative integer, found {v}"))
            }),
        }
    }

    fn usize(&self, key: &str) -> Result<usize, ConfigError> {
        let n = self.opt_usize(key)?.ok_or_else(|| self.missing(key))?;
        if n == 0 {
            return Err(Self::bad(key, "must be greater than zero"));
        }
        Ok(n)
    }

    fn opt_f32(&self, key: &str) -> Result<Option<f32>, ConfigError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| Self::bad(key, format!("expected a number, found {v}"))),
        }
    }

    fn usize_list(&self, key: &str) -> Result<Vec<usize>, ConfigError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|n| n as usize)
                        .ok_or_else(|| Self::bad(key, format!("expected layer indices, found {v}")))
                })
                .collect(),
            Some(v) => Err(Self::bad(
                key,
                format!("expected a list of layer indices, found {v}"),
            )),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, ConfigError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| Self::bad(key, format!("expected true or false, found {v}"))),
        }
    }

    fn token_id(key: &str, v: &Value) -> Result<u32, ConfigError> {
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| Self::bad(key, format!("expected a u32 token id, found {v}")))
    }

    fn token_ids(&self, key: &str) -> Result<Vec<u32>, ConfigError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Number(_)) => Ok(vec![Self::token_id(key, &self.map[key])?]),
            Some(Value::Array(items)) => items.iter().map(|v| Self::token_id(key, v)).collect(),
            Some(v) => Err(Self::bad(
                key,
                format!("expected a token id or a list of them, found {v}"),
            )),
        }
    }
}

impl ModelConfig {
    /// Reads a HF `config.json` file; an error about its contents names the file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let map = Self::read_json(path)?;
        Self::from_json_map(&map).map_err(|e| ConfigError::InFile {
            path: path.display().to_string(),
            source: Box::new(e),
        })
    }

    /// The JSON object in a `config.json` file, read only if it is at most
    /// [`MAX_CONFIG_BYTES`] long.
    pub fn read_json(path: &Path) -> Result<Map<String, Value>, ConfigError> {
        let shown = || path.display().to_string();
        let io = |e: std::io::Error| ConfigError::Io {
            path: shown(),
            message: e.to_string(),
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let size = file.metadata().map_err(io)?.len();
        if size > MAX_CONFIG_BYTES {
            return Err(ConfigError::TooLarge {
                path: shown(),
                size,
                limit: MAX_CONFIG_BYTES,
            });
        }
        let mut text = String::new();
        // The limit holds even if the file grows after the size was read.
        std::io::Read::read_to_string(&mut std::io::Read::take(file, MAX_CONFIG_BYTES), &mut text)
            .map_err(io)?;
        Self::parse_object(&text).map_err(|message| ConfigError::Json {
            path: shown(),
            message,
        })
    }

    fn parse_object(text: &str) -> Result<Map<String, Value>, String> {
        match serde_json::from_str(text).map_err(|e| e.to_string())? {
            Value::Object(map) => Ok(map),
            _ => Err("the top level is not an object".into()),
        }
    }

    /// Parses the text of a HF `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        let map = Self::parse_object(text).map_err(|message| ConfigError::Json {
            path: "config".into(),
            message,
        })?;
        Self::from_json_map(&map)
    }

    /// Builds a config from an already parsed JSON object.
    pub fn from_json_map(map: &Map<String, Value>) -> Result<Self, ConfigError> {
        let model_type = match map.get("model_type") {
            Some(Value::String(s)) => s.as_str(),
            Some(v) => {
                return Err(Keys::bad(
                    "model_type",
                    format!("expected a string, found {v}"),
                ))
            }
            None => {
                return Err(ConfigError::MissingKey {
                    key: "model_type".into(),
                    model_type: String::new(),
                })
            }
        };
        let family = ModelFamily::from_model_type(model_type)?;
        let k = Keys { map, model_type };
        let hidden_size = k.usize("hidden_size")?;
        let num_attention_heads = k.usize("num_attention_heads")?;
        let num_key_value_heads = k
            .opt_usize("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        let mla = match family {
            ModelFamily::DeepseekV3 => match k.opt_usize("kv_lora_rank")? {
                Some(kv_lora_rank) => Some(MlaConfig {
                    q_lora_rank: k.opt_usize("q_lora_rank")?,
                    kv_lora_rank,
                    qk_nope_head_dim: k.usize("qk_nope_head_dim")?,
                    qk_rope_head_dim: k.usize("qk_rope_head_dim")?,
                    v_head_dim: k.usize("v_head_dim")?,
                    rope_interleave: k.opt_bool("rope_interleave")?.unwrap_or(true),
                }),
                None => None,
            },
            _ => None,
        };
        // Under MLA, `transformers` sets head_dim to the rotated width, which is what RoPE's
        // frequencies are computed over.
        let head_dim = match (k.opt_usize("head_dim")?, &mla) {
            (Some(d), _) => d,
            (None, Some(m)) => m.qk_rope_head_dim,
            (None, None) => hidden_size / num_attention_heads,
        };
        let moe = match family {
            ModelFamily::DeepseekV3
            | ModelFamily::Glm4Moe
            | ModelFamily::Qwen3Moe
            | ModelFamily::Qwen3Next => {
                let experts = k
                    .opt_usize("n_routed_experts")?
                    .or(k.opt_usize("num_experts")?);
                match experts {
                    Some(num_experts) if num_experts > 0 => Some(MoeConfig {
                        num_experts,
                        experts_per_token: k.usize("num_experts_per_tok")?,
                        expert_intermediate_size: k.usize("moe_intermediate_size")?,
                        num_shared_experts: k.opt_usize("n_shared_experts")?.unwrap_or(
                            usize::from(k.opt_usize("shared_expert_intermediate_size")?.is_some()),
                        ),
                        // Qwen3-MoE's configuration class defaults to unnormalised weights.
                        norm_topk_prob: k
                            .opt_bool("norm_topk_prob")?
                            .unwrap_or(family != ModelFamily::Qwen3Moe),
                        routed_scaling_factor: k.opt_f32("routed_scaling_factor")?.unwrap_or(1.0),
                        n_group: k.opt_usize("n_group")?.unwrap_or(1),
                        topk_group: k.opt_usize("topk_group")?.unwrap_or(1),
                        first_k_dense_replace: k.opt_usize("first_k_dense_replace")?.unwrap_or(0),
                        decoder_sparse_step: k.opt_usize("decoder_sparse_step")?.unwrap_or(1),
                        mlp_only_layers: k.usize_list("mlp_only_layers")?,
                    }),
                    _ => None,
                }
            }
            _ => None,
        };
        let rope_scaling = match map.get("rope_scaling") {
            None | Some(Value::Null) => None,
            Some(Value::Object(rs)) => {
                let rk = Keys {
                    map: rs,
                    model_type,
                };
                let kind = rs
                    .get("rope_type")
                    .or_else(|| rs.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("linear")
                    .to_string();
                Some(RopeScaling {
                    kind,
                    factor: rk.opt_f32("factor")?.unwrap_or(1.0),
                    low_freq_factor: rk.opt_f32("low_freq_factor")?,
                    high_freq_factor: rk.opt_f32("high_freq_factor")?,
                    original_max_position_embeddings: rk
                        .opt_usize("original_max_position_embeddings")?,
                    yarn: YarnParams {
                        beta_fast: rk.opt_f32("beta_fast")?,
                        beta_slow: rk.opt_f32("beta_slow")?,
                        mscale: rk.opt_f32("mscale")?,
                        mscale_all_dim: rk.opt_f32("mscale_all_dim")?,
                        attention_factor: rk.opt_f32("attention_factor")?,
                    },
                })
            }
            Some(v) => {
                return Err(Keys::bad(
                    "rope_scaling",
                    format!("expected an object, found {v}"),
                ))
            }
        };
        let config = ModelConfig {
            family,
            hidden_size,
            intermediate_size: k.usize("intermediate_size")?,
            num_hidden_layers: k.usize("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: k.usize("vocab_size")?,
            rms_norm_eps: k
                .opt_f32("rms_norm_eps")?
                .unwrap_or(family.default_rms_norm_eps()),
            rope_theta: k.opt_f32("rope_theta")?.unwrap_or(10_000.0),
            rope_scaling,
            partial_rotary_factor: k
                .opt_f32("partial_rotary_factor")?
                .unwrap_or(family.default_partial_rotary_factor()),
            max_position_embeddings: k.opt_usize("max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: k.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            attention_bias: k
                .opt_bool("attention_bias")?
                .unwrap_or(matches!(family, ModelFamily::Qwen2 | ModelFamily::Mimo)),
            qk_norm: match family {
                ModelFamily::Qwen3 | ModelFamily::Qwen3Moe | ModelFamily::Qwen3Next => true,
                ModelFamily::Glm4Moe => k.opt_bool("use_qk_norm")?.unwrap_or(false),
                _ => false,
            },
            num_nextn_predict_layers: k
                .opt_usize("num_nextn_predict_layers")?
                .or(k.opt_usize("mtp_num_hidden_layers")?)
                .unwrap_or(0),
            moe,
            mla,
            eos_token_ids: k.token_ids("eos_token_id")?,
        };
        config.validate()?;
        Ok(config)
    }
}
