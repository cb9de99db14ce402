//! `ModelConfig` reads the keys of each supported family and names what is missing or wrong.

use specdraft::model::{ConfigError, ModelConfig, ModelFamily};

const SMOLLM2: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":576,
 "intermediate_size":1536,"num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,
 "vocab_size":49152,"rms_norm_eps":1e-05,"rope_theta":100000,"tie_word_embeddings":true,
 "max_position_embeddings":8192,"eos_token_id":2,"rope_scaling":null}"#;

const QWEN2: &str = r#"{"model_type":"qwen2","hidden_size":896,"intermediate_size":4864,"num_hidden_layers":24,
 "num_attention_heads":14,"num_key_value_heads":2,"vocab_size":151936,"rms_norm_eps":1e-06,
 "rope_theta":1000000.0,"tie_word_embeddings":true,"eos_token_id":151643}"#;

const QWEN3: &str = r#"{"model_type":"qwen3","hidden_size":1024,"intermediate_size":3072,"num_hidden_layers":28,
 "num_attention_heads":16,"num_key_value_heads":8,"head_dim":128,"vocab_size":151936,"rms_norm_eps":1e-06,
 "rope_theta":1000000,"tie_word_embeddings":true,"attention_bias":false}"#;

const MIMO: &str = r#"{"model_type":"mimo","hidden_size":4096,"intermediate_size":11008,"num_hidden_layers":36,
 "num_attention_heads":32,"num_key_value_heads":8,"vocab_size":151680,"rms_norm_eps":1e-05,
 "rope_theta":640000,"num_nextn_predict_layers":1,"tie_word_embeddings":false}"#;

const DEEPSEEK_V3: &str = r#"{"model_type":"deepseek_v3","hidden_size":7168,"intermediate_size":18432,
 "num_hidden_layers":61,"num_attention_heads":128,"num_key_value_heads":128,"vocab_size":129280,
 "rms_norm_eps":1e-06,"rope_theta":10000,"num_nextn_predict_layers":1,"n_routed_experts":256,
 "num_experts_per_tok":8,"moe_intermediate_size":2048,"n_shared_experts":1,"norm_topk_prob":true,
 "routed_scaling_factor":2.5,"eos_token_id":1,
 "rope_scaling":{"type":"yarn","factor":40,"original_max_position_embeddings":4096}}"#;

const GLM4_MOE: &str = r#"{"model_type":"glm4_moe","hidden_size":4096,"intermediate_size":10944,
 "num_hidden_layers":46,"num_attention_heads":96,"num_key_value_heads":8,"head_dim":128,"vocab_size":151552,
 "rms_norm_eps":1e-05,"rope_theta":1000000,"num_nextn_predict_layers":1,"n_routed_experts":128,
 "num_experts_per_tok":8,"moe_intermediate_size":1408,"n_shared_experts":1,"attention_bias":true,
 "partial_rotary_factor":0.5,"eos_token_id":[151329,151336,151338]}"#;

#[test]
fn reads_every_family() {
    let c = ModelConfig::from_json_str(SMOLLM2).unwrap();
    assert_eq!(
        (c.family, c.hidden_size, c.head_dim, c.num_key_value_heads),
        (ModelFamily::Llama, 576, 64, 3)
    );
    assert!(c.tie_word_embeddings && !c.attention_bias && !c.qk_norm);
    assert_eq!(
        (c.rope_theta, c.rms_norm_eps, c.eos_token_ids.clone()),
        (100000.0, 1e-5, vec![2])
    );
    assert_eq!(c.num_nextn_predict_layers, 0);

    let c = ModelConfig::from_json_str(QWEN2).unwrap();
    assert!(c.attention_bias, "qwen2 q/k/v carry biases");
    assert_eq!(c.head_dim, 64);

    let c = ModelConfig::from_json_str(QWEN3).unwrap();
    assert!(c.qk_norm && !c.attention_bias);
    assert_eq!((c.head_dim, c.q_size(), c.kv_size()), (128, 2048, 1024));

    let c = ModelConfig::from_json_str(MIMO).unwrap();
    assert_eq!(
        (c.family, c.num_nextn_predict_layers),
        (ModelFamily::Mimo, 1)
    );
    assert!(c.attention_bias && !c.tie_word_embeddings);

    let c = ModelConfig::from_json_str(DEEPSEEK_V3).unwrap();
    let moe = c.moe.clone().unwrap();
    assert_eq!(
        (
            moe.num_experts,
            moe.experts_per_token,
            moe.expert_intermediate_size
        ),
        (256, 8, 2048)
    );
    assert_eq!(
        (moe.num_shared_experts, moe.routed_scaling_factor),
        (1, 2.5)
    );
    let rs = c.rope_scaling.clone().unwrap();
    assert_eq!(
        (
            rs.kind.as_str(),
            rs.factor,
            rs.original_max_position_embeddings
        ),
        ("yarn", 40.0, Some(4096))
    );

    let c = ModelConfig::from_json_str(GLM4_MOE).unwrap();
    assert_eq!(
        (
            c.family,
            c.num_nextn_predict_layers,
            c.partial_rotary_factor
        ),
        (ModelFamily::Glm4Moe, 1, 0.5)
    );
    assert_eq!(c.eos_token_ids, vec![151329, 151336, 151338]);
}

#[test]
fn keys_left_out_take_the_familys_transformers_default() {
    // Each family's config with the rotary fraction and the norm epsilon left out.
    let strip = |json: &str| -> String {
        let mut v: serde_json::Value = serde_json::from_str(json).unwrap();
        let o = v.as_object_mut().unwrap();
        o.remove("partial_rotary_factor");
        o.remove("rms_norm_eps");
        v.to_string()
    };
    let qwen3_next = QWEN3.replace(r#""model_type":"qwen3""#, r#""model_type":"qwen3_next""#);
    for (json, rotary, eps) in [
        (GLM4_MOE, 0.5, 1e-5),
        (qwen3_next.as_str(), 0.25, 1e-6),
        (DEEPSEEK_V3, 1.0, 1e-6),
        (SMOLLM2, 1.0, 1e-6),
        (QWEN3, 1.0, 1e-6),
    ] {
        let c = ModelConfig::from_json_str(&strip(json)).unwrap();
        assert_eq!(
            (c.partial_rotary_factor, c.rms_norm_eps),
            (rotary, eps),
            "{:?}",
            c.family
        );
    }
}

#[test]
fn missing_and_bad_keys_are_named() {
    let without = SMOLLM2.replace(r#""num_hidden_layers":30,"#, "");
    match ModelConfig::from_json_str(&without) {
        Err(ConfigError::MissingKey { key, model_type }) => assert_eq!(
            (key.as_str(), model_type.as_str()),
            ("num_hidden_layers", "llama")
        ),
        other => panic!("expected a missing key error, got {other:?}"),
    }
    let err = ModelConfig::from_json_str(
        &SMOLLM2.replace(r#""model_type":"llama""#, r#""model_type":"gpt2""#),
    )
    .unwrap_err();
    assert_eq!(err, ConfigError::UnknownModelType("gpt2".into()));
    assert!(err.to_string().contains("known: llama"));
    let err = ModelConfig::from_json_str(
        &SMOLLM2.replace(r#""hidden_size":576"#, r#""hidden_size":"wide""#),
    )
    .unwrap_err();
    assert!(
        matches!(&err, ConfigError::BadValue { key, .. } if key == "hidden_size"),
        "{err}"
    );
    let err = ModelConfig::from_json_str(
        &SMOLLM2.replace(r#""num_key_value_heads":3"#, r#""num_key_value_heads":4"#),
    )
    .unwrap_err();
    assert!(err.to_string().contains("does not divide"), "{err}");
    let err =
        ModelConfig::from_json_str(&SMOLLM2.replace(r#""vocab_size":49152"#, r#""vocab_size":0"#))
            .unwrap_err();
    assert!(err.to_string().contains("vocab_size"), "{err}");
    assert!(matches!(
        ModelConfig::from_json_str("[1,2]"),
        Err(ConfigError::Json { .. })
    ));
    assert!(matches!(
        ModelConfig::from_json_str("{"),
        Err(ConfigError::Json { .. })
    ));
    let err = ModelConfig::from_file("/nonexistent/config.json").unwrap_err();
    assert!(matches!(err, ConfigError::Io { .. }));
}

#[test]
fn deepseek_v3_reads_its_latent_attention_sizes() {
    // DeepSeek-V3's published attention sizes, on the config above.
    let mla_keys = r#""q_lora_rank":1536,"kv_lora_rank":512,"qk_nope_head_dim":128,
 "qk_rope_head_dim":64,"v_head_dim":128,"#;
    let json = DEEPSEEK_V3.replacen('{', &format!("{{{mla_keys}"), 1);
    let c = ModelConfig::from_json_str(&json).unwrap();
    let m = c.mla.unwrap();
    assert_eq!(
        (
            m.q_lora_rank,
            m.kv_lora_rank,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim
        ),
        (Some(1536), 512, 128, 64, 128)
    );
    assert!(m.rope_interleave, "transformers' default rope_interleave");
    // RoPE's frequencies cover the rotated width, as transformers' head_dim does.
    assert_eq!(c.head_dim, 64, "head_dim under MLA");
    assert_eq!((m.latent_width(), m.qk_head_dim()), (576, 192));
    assert_eq!(m.softmax_scale(), 1.0 / 192f32.sqrt());
    // One latent row a token: half in each of the layer's two caches.
    assert_eq!(
        (c.kv_cache_row(), c.kv_cache_width()),
        ((1, 288), 288),
        "an MLA cache row"
    );
    // Without the bottleneck, and with rotate-half RoPE asked for.
    let plain = json
        .replace(r#""q_lora_rank":1536"#, r#""q_lora_rank":null"#)
        .replacen('{', r#"{"rope_interleave":false,"#, 1);
    let m = ModelConfig::from_json_str(&plain).unwrap().mla.unwrap();
    assert_eq!((m.q_lora_rank, m.rope_interleave), (None, false));
    // A GQA config's caches are its KV heads.
    let c = ModelConfig::from_json_str(QWEN3).unwrap();
    assert_eq!((c.kv_cache_row(), c.kv_cache_width()), ((8, 128), 1024));
    // Impossible sizes are named.
    for (edit, needles) in [
        (
            (r#""v_head_dim":128"#, r#""v_head_dim":0"#),
            ["v_head_dim", "greater than zero"],
        ),
        (
            (r#""kv_lora_rank":512"#, r#""kv_lora_rank":511"#),
            ["kv_lora_rank", "511 is odd"],
        ),
        (
            (r#""qk_rope_head_dim":64"#, r#""qk_rope_head_dim":63"#),
            ["qk_rope_head_dim", "63 is odd"],
        ),
        (
            (r#""q_lora_rank":1536"#, r#""q_lora_rank":0"#),
            ["q_lora_rank", "is 0, not in 1..=65536"],
        ),
        (
            (r#""qk_nope_head_dim":128,"#, ""),
            ["qk_nope_head_dim", "missing"],
        ),
    ] {
        let err = ModelConfig::from_json_str(&json.replace(edit.0, edit.1))
            .unwrap_err()
            .to_string();
        for n in needles {
            assert!(err.contains(n), "{err:?} does not name {n:?}");
        }
    }
}
