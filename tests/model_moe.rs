//! Mixture-of-experts targets (GLM-4.5's `glm4_moe`, Qwen3-MoE's `qwen3_moe`) against an
//! independent numpy forward written from the published equations
//! (`tests/python/moe_target_reference.py`), which also writes each tiny random BF16
//! checkpoint; plus speculative greedy decoding on them and the ledger after the drop.
//!
//! Bound: every logit within `max|logit| / 64` of the reference (both round every
//! activation to BF16; what differs is summation order, which moves a BF16 value by one
//! step, 2^-8 relative, here and there), for a prefill and for decode steps through the
//! paged KV cache. The reference's routing margins are checked first, so numerical noise
//! cannot flip an expert choice and the bound holds for what it says. It needs `python3`
//! with numpy (set `PYTHON` to choose the interpreter).

#[allow(dead_code)]
#[path = "../benches/common/default_model.rs"]
mod default_model;
mod hybrid_common;
#[allow(unused_imports)]
mod model_util;

use default_model::python;
use hybrid_common::Scripted;
use model_util::{
    check_refusal, edit_config, edit_header, greedy_fixed, rows, run_reference, temp_dir,
};
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::model::{GgufFile, Linear, LoadOptions, TargetModel, TensorSource};
use specdraft::speculative::{DraftProposer, PromptLookup};
use std::path::Path;
use std::sync::Arc;

const TOKENS: [u32; 24] = [
    1, 5, 17, 33, 4, 90, 12, 12, 7, 64, 5, 17, 33, 3, 22, 45, 8, 8, 61, 70, 9, 95, 40, 11,
];
/// Rows prefilled at once; the rest are decoded one token a forward.
const PREFILL: usize = 13;

struct Reference {
    logits: Vec<Vec<f32>>,
    min_margin: f64,
    sparse_layers: Vec<usize>,
}

/// Writes `family`'s checkpoint with `seed` into `dir` and returns the reference's logits.
fn reference(family: &str, dir: &Path, seed: u64) -> Reference {
    reference_with_gguf(family, dir, seed, None)
}

/// [`reference`], also writing the same weights to the GGUF file `gguf.0`, its stacked
/// experts in the format `gguf.1` (`f32` or `q8_0`).
fn reference_with_gguf(
    family: &str,
    dir: &Path,
    seed: u64,
    gguf: Option<(&Path, &str)>,
) -> Reference {
    let extra: Vec<&str> = gguf
        .map(|(g, experts)| vec![g.to_str().unwrap(), experts])
        .unwrap_or_default();
    let script = "moe_target_reference.py";
    let v = run_reference(&python(), script, family, dir, seed, &TOKENS, &extra);
    Reference {
        logits: rows(&v["logits"]),
        min_margin: v["min_margin"].as_f64().unwrap(),
        sparse_layers: v["sparse_layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect(),
    }
}

fn opts() -> LoadOptions {
    LoadOptions {
        max_rows: 32,
        max_seq_len: Some(64),
        kv_blocks: Some(16),
    }
}

/// Logits of every token: a prefill of `PREFILL` rows, then one decode step a token.
fn prefill_then_decode(model: &TargetModel) -> Vec<Vec<f32>> {
    let v = model.config().vocab_size;
    let mut seq = model.new_sequence();
    let mut rows = Vec::new();
    let mut run = |toks: &[u32], rows: &mut Vec<Vec<f32>>| {
        let out = model.forward(&mut [&mut seq], &[toks]).unwrap();
        let all: Vec<f32> = model.gpu().download(out.logits, out.rows * v).unwrap();
        rows.extend(all.chunks(v).map(<[f32]>::to_vec));
    };
    run(&TOKENS[..PREFILL], &mut rows);
    for t in &TOKENS[PREFILL..] {
        run(std::slice::from_ref(t), &mut rows);
    }
    model.free_sequence(&mut seq).unwrap();
    rows
}

/// A decode step reads every dense weight, the router and top_k experts of a routed layer
/// (BF16: two bytes a weight), not the other experts.
fn check_weight_bytes(model: &TargetModel, family: &str, sparse: &[usize]) {
    let (h, q, kv, ffn, e_ffn, experts) = (64, 64, 32, 96, 32, 8);
    let glm = family == "glm4_moe";
    let top_k = if glm { 2 } else { 3 };
    let attention = 2 * h * q + 2 * h * kv + 2 * h + if glm { q + 2 * kv } else { 2 * 16 };
    let routed_layer = experts * h + top_k * 3 * h * e_ffn + if glm { 3 * h * e_ffn } else { 0 };
    let want_bytes = 2
        * (sparse.len() * routed_layer
            + (3 - sparse.len()) * 3 * h * ffn
            + 3 * attention
            + h
            + 96 * h);
    assert_eq!(
        model.weight_bytes_per_token(),
        want_bytes,
        "weight bytes a token"
    );
}

/// Checks `family` (`glm4_moe` or `qwen3_moe`, with `+fp8` for FP8 projections) against the
/// reference.
fn check_family(family: &str, seed: u64, margin: f64, sparse: &[usize]) {
    let dir = temp_dir(&format!("moe_{}", family.replace('+', "_")));
    let want = reference(family, &dir, seed);
    assert!(
        want.min_margin > margin,
        "the fixture routes a row within {} of a tie; choose another seed",
        want.min_margin
    );
    assert_eq!(want.sparse_layers, sparse);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = TargetModel::load(&dir, gpu.clone(), opts()).unwrap();
    let layers = &model.weights().layers;
    let routed: Vec<usize> = (0..layers.len())
        .filter(|&i| layers[i].moe().is_some())
        .collect();
    assert_eq!(routed, sparse, "the layers that route");
    if family.ends_with("+fp8") {
        let fp8 = |l: &Linear| l.format_name() == "fp8";
        for i in sparse {
            let moe = layers[*i].moe().unwrap();
            assert!(moe
                .experts
                .iter()
                .all(|x| fp8(&x.gate) && fp8(&x.up) && fp8(&x.down)));
            assert!(layers[*i].projections().iter().all(|(_, l)| fp8(l)));
        }
    } else {
        check_weight_bytes(&model, family, sparse);
    }
    let got = prefill_then_decode(&model);
    assert_eq!(got.len(), TOKENS.len());
    let scale = want
        .logits
        .iter()
        .flatten()
        .fold(0f32, |m, x| m.max(x.abs()));
    let mut worst = 0f32;
    for (pos, (g, w)) in got.iter().zip(&want.logits).enumerate() {
        let d = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(d);
        assert!(
            d <= scale / 64.0,
            "{family}: position {pos} ({}) differs from the reference by {d} (bound {})",
            if pos < PREFILL { "prefill" } else { "decode" },
            scale / 64.0
        );
    }
    println!("{family}: worst logit difference {worst} of max |logit| {scale}");
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0, "the ledger after the drop");
}

#[test]
fn glm4_moe_target_matches_the_numpy_reference() {
    // Layer 0 is dense (first_k_dense_replace = 1).
    check_family("glm4_moe", 12, 0.005, &[1, 2]);
}

#[test]
fn fp8_moe_targets_match_the_numpy_reference_of_their_dequantized_weights() {
    // Qwen3's FP8 checkpoints keep weight_scale_inv per 128 x 128 block, as written here.
    check_family("qwen3_moe+fp8", 56, 0.02, &[0, 2]);
    check_family("glm4_moe+fp8", 12, 0.005, &[1, 2]);
}

#[test]
fn qwen3_moe_target_matches_the_numpy_reference() {
    // Layer 1 is dense (mlp_only_layers = [1]).
    check_family("qwen3_moe", 56, 0.02, &[0, 2]);
}

fn engine_prompts() -> Vec<Vec<u32>> {
    vec![
        TOKENS[..10].to_vec(),
        vec![11, 12, 13, 11, 12, 13, 11, 12],
        vec![3, 22, 45, 8, 8, 61],
    ]
}

/// Greedy outputs of the engine prompts with `p` drafting the whole budget of 4 every step.
fn generate(
    model: &Arc<TargetModel>,
    p: Option<Arc<dyn DraftProposer>>,
) -> (Vec<Vec<u32>>, u64, u64) {
    greedy_fixed(model, p, 4, usize::MAX, &engine_prompts())
}

#[test]
fn speculative_greedy_equals_plain_greedy_on_moe_targets() {
    for (family, seed) in [("glm4_moe", 12), ("qwen3_moe", 56)] {
        let dir = temp_dir(&format!("moe_engine_{family}"));
        reference(family, &dir, seed);
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let model = Arc::new(TargetModel::load(&dir, gpu.clone(), opts()).unwrap());
        let (plain, _, _) = generate(&model, None);
        let lookup: Arc<dyn DraftProposer> = Arc::new(PromptLookup::default());
        assert_eq!(
            generate(&model, Some(lookup)).0,
            plain,
            "{family}: prompt lookup"
        );
        let runs = engine_prompts()
            .into_iter()
            .zip(&plain)
            .map(|(p, out)| [p, out.clone()].concat())
            .collect();
        // Every draft it is asked for, from the plain output: all accepted when
        // verification agrees with plain decoding, several verify rows a sequence.
        let replay: Arc<dyn DraftProposer> = Arc::new(Scripted {
            fulls: runs,
            plan: |_| Some((usize::MAX, usize::MAX)),
            vocab: model.config().vocab_size as u32,
        });
        let (spec, drafted, accepted) = generate(&model, Some(replay));
        assert_eq!(spec, plain, "{family}: drafts of the plain output");
        // Verification took several rows a sequence and accepted them all.
        assert!(
            drafted >= 24 && accepted == drafted,
            "{family}: {accepted} of {drafted}"
        );
        drop(model);
        assert_eq!(
            gpu.ledger().live_count(),
            0,
            "{family}: the ledger after the drop"
        );
    }
}

/// A broken checkpoint: its family, what is broken, the edit that breaks it, and what the
/// refusal must name.
type Case<T> = (
    &'static str,
    &'static str,
    Box<dyn Fn(&mut T)>,
    &'static [&'static str],
);

#[test]
fn broken_moe_checkpoints_are_refused_by_name() {
    type Tensors = serde_json::Map<String, serde_json::Value>;
    type Config = serde_json::Value;
    let rename = |name: &'static str| {
        move |h: &mut Tensors| {
            let t = h.remove(name).expect(name);
            h.insert(format!("unused.{name}"), t);
        }
    };
    let reshape = |name: &'static str, shape: serde_json::Value| {
        move |h: &mut Tensors| h[name]["shape"] = shape.clone()
    };
    let tensor_cases: Vec<Case<Tensors>> = vec![
        (
            "glm4_moe",
            "missing expert",
            Box::new(rename("model.layers.2.mlp.experts.5.up_proj.weight")),
            &["model.layers.2.mlp.experts.5.up_proj.weight", "missing"],
        ),
        (
            "qwen3_moe",
            "expert of the wrong shape",
            Box::new(reshape(
                "model.layers.0.mlp.experts.3.gate_proj.weight",
                serde_json::json!([64, 32]),
            )),
            &[
                "model.layers.0.mlp.experts.3.gate_proj.weight",
                "[64, 32]",
                "[32, 64]",
            ],
        ),
        (
            "glm4_moe",
            "missing shared expert",
            Box::new(rename("model.layers.1.mlp.shared_experts.gate_proj.weight")),
            &[
                "model.layers.1.mlp.shared_experts.gate_proj.weight",
                "missing",
            ],
        ),
        (
            "qwen3_moe",
            "router for another expert count",
            Box::new(reshape(
                "model.layers.2.mlp.gate.weight",
                serde_json::json!([4, 128]),
            )),
            &["model.layers.2.mlp.gate.weight", "[8, 64]"],
        ),
        (
            "glm4_moe",
            "missing router",
            Box::new(rename("model.layers.1.mlp.gate.weight")),
            &["model.layers.1.mlp.gate.weight", "missing"],
        ),
    ];
    let mut failures = Vec::new();
    for (i, (family, what, edit, needles)) in tensor_cases.iter().enumerate() {
        let dir = temp_dir(&format!("moe_broken_tensor_{i}"));
        reference(family, &dir, 3);
        edit_header(&dir, |h| edit(h));
        failures.extend(check_refusal(&dir, what, needles, opts()).err());
    }
    let config_cases: Vec<Case<Config>> = vec![
        (
            "glm4_moe",
            "top_k above the experts",
            Box::new(|c| c["num_experts_per_tok"] = serde_json::json!(9)),
            &["num_experts_per_tok", "is 9", "1..=8"],
        ),
        (
            "glm4_moe",
            "n_group not dividing the experts",
            Box::new(|c| c["n_group"] = serde_json::json!(3)),
            &[
                "config.json",
                "n_group",
                "is 3",
                "does not divide the 8 routed experts",
            ],
        ),
        (
            "glm4_moe",
            "topk_group above n_group",
            Box::new(|c| c["topk_group"] = serde_json::json!(5)),
            &["topk_group", "is 5", "1..=4"],
        ),
        (
            "glm4_moe",
            "kept groups too small for top_k",
            Box::new(|c| {
                c["topk_group"] = serde_json::json!(1);
                c["num_experts_per_tok"] = serde_json::json!(3);
            }),
            &["topk_group", "fewer than num_experts_per_tok 3"],
        ),
        (
            "qwen3_moe",
            "decoder_sparse_step of zero",
            Box::new(|c| c["decoder_sparse_step"] = serde_json::json!(0)),
            &["decoder_sparse_step", "greater than zero"],
        ),
        (
            "qwen3_moe",
            "mlp_only_layers not a list",
            Box::new(|c| c["mlp_only_layers"] = serde_json::json!("1")),
            &["mlp_only_layers", "list of layer indices"],
        ),
        (
            "qwen3_moe",
            "a layer made sparse without experts",
            Box::new(|c| c["mlp_only_layers"] = serde_json::json!([])),
            &["model.layers.1.mlp.gate.weight", "missing"],
        ),
        (
            "glm4_moe",
            "DeepSeek-V3 (MLA attention)",
            Box::new(|c| c["model_type"] = serde_json::json!("deepseek_v3")),
            &["deepseek_v3", "multi-head latent attention (MLA)"],
        ),
        (
            "qwen3_moe",
            "Qwen3-Next (linear attention)",
            Box::new(|c| c["model_type"] = serde_json::json!("qwen3_next")),
            &["qwen3_next", "linear-attention (Gated DeltaNet)"],
        ),
    ];
    for (i, (family, what, edit, needles)) in config_cases.iter().enumerate() {
        let dir = temp_dir(&format!("moe_broken_config_{i}"));
        reference(family, &dir, 3);
        edit_config(&dir, |c| edit(c));
        failures.extend(check_refusal(&dir, what, needles, opts()).err());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn gguf_and_safetensors_of_the_same_weights_give_the_same_logits() {
    for (family, seed) in [("glm4_moe", 12), ("qwen3_moe", 56)] {
        let dir = temp_dir(&format!("moe_gguf_{family}"));
        let gguf = temp_dir(&format!("moe_gguf_file_{family}")).join("model.gguf");
        reference_with_gguf(family, &dir, seed, Some((&gguf, "f32")));
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let from_st = TargetModel::load(&dir, gpu.clone(), opts()).unwrap();
        let from_gguf = TargetModel::load(&gguf, gpu.clone(), opts()).unwrap();
        let (a, b) = (from_st.config(), from_gguf.config());
        assert_eq!(a.moe, b.moe, "{family}: the MoE config from GGUF metadata");
        assert_eq!(
            (
                a.family,
                a.num_hidden_layers,
                a.partial_rotary_factor,
                a.qk_norm,
                a.attention_bias
            ),
            (
                b.family,
                b.num_hidden_layers,
                b.partial_rotary_factor,
                b.qk_norm,
                b.attention_bias
            ),
            "{family}"
        );
        // F32 tensors holding BF16 values load to the same BF16 weights: the same logits,
        // bit for bit.
        assert_eq!(
            prefill_then_decode(&from_gguf),
            prefill_then_decode(&from_st),
            "{family}: GGUF and safetensors logits"
        );
        drop((from_st, from_gguf));
        assert_eq!(
            gpu.ledger().live_count(),
            0,
            "{family}: the ledger after the drop"
        );
    }
}

#[test]
fn a_block_format_gguf_serves_each_expert_as_its_own_blocks() {
    for (family, seed, sparse) in [("glm4_moe", 12, [1, 2]), ("qwen3_moe", 56, [0, 2])] {
        let dir = temp_dir(&format!("moe_q8_{family}"));
        let gguf = temp_dir(&format!("moe_q8_file_{family}")).join("model.gguf");
        reference_with_gguf(family, &dir, seed, Some((&gguf, "q8_0")));
        let file = GgufFile::open(&gguf).unwrap();
        for layer in sparse {
            for proj in ["gate", "up", "down"] {
                let name = format!("blk.{layer}.ffn_{proj}_exps.3.weight");
                let got = file.require(&name).unwrap();
                // Expert 3 quantized on its own by the writer.
                let want = file.require(&format!("check.{name}")).unwrap();
                assert_eq!(got.dtype, want.dtype, "{name}");
                assert_eq!(got.shape, want.shape, "{name}");
                assert!(
                    got.data == want.data,
                    "{name}: the slice is not expert 3's blocks"
                );
                let past = format!("blk.{layer}.ffn_{proj}_exps.8.weight");
                assert!(file.tensor(&past).unwrap().is_none(), "{past} exists");
            }
        }
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let model = TargetModel::load(&gguf, gpu.clone(), opts()).unwrap();
        let moe = model.weights().layers[2].moe().unwrap();
        assert!(moe.experts.iter().all(|x| x.up.format_name() == "q8_0"));
        assert_eq!(prefill_then_decode(&model).len(), TOKENS.len());
        drop(model);
        assert_eq!(
            gpu.ledger().live_count(),
            0,
            "{family}: the ledger after the drop"
        );
    }
}

#[test]
fn broken_moe_gguf_files_are_refused_by_name() {
    let cases: [(&str, &str, &[&str]); 3] = [
        (
            "flat_experts",
            "stacked experts of the wrong rank",
            &[
                "blk.1.ffn_up_exps.weight",
                "[experts, rows, cols]",
                "[256, 64]",
            ],
        ),
        (
            "softmax_gating",
            "softmax gating in a glm4moe file",
            &["glm4moe.expert_gating_func", "is 1", "sigmoid"],
        ),
        (
            "no_expert_count",
            "no expert count",
            &["glm4moe.expert_count", "missing"],
        ),
    ];
    let mut failures = Vec::new();
    for (variant, what, needles) in cases {
        let dir = temp_dir(&format!("moe_broken_gguf_{variant}"));
        let gguf = dir.join("model.gguf");
        reference_with_gguf("glm4_moe", &dir.join("hf"), 3, Some((&gguf, variant)));
        failures.extend(check_refusal(&gguf, what, needles, opts()).err());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
