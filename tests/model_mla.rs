//! DeepSeek-V3 targets (multi-head latent attention, a dense first layer, sigmoid
//! group-routed experts with a shared expert) against an independent numpy forward written
//! from the published equations (`tests/python/mla_target_reference.py`, Hugging Face's
//! non-absorbed attention), which also writes each tiny random BF16 checkpoint; the latent
//! cache against what DeepSeek's absorbed inference caches; draft trees and their
//! compaction on the latent cache; speculative greedy decoding; the same weights as llama.cpp's
//! `deepseek2` GGUF (`attn_kv_b` whole or split into `attn_k_b` / `attn_v_b`) giving the
//! safetensors logits bit for bit, or within 1/32 of the largest with Q8_0 experts; and the
//! ledger after the drop.
//!
//! Bounds: every logit within `max|logit| / 64` of the reference (both round every stored
//! activation to BF16; what differs is summation order, which moves a BF16 value by one step,
//! 2^-8 relative, here and there), for a prefill and for decode steps through
//! the paged cache; every cached latent element of the first layer within 2^-7 of its
//! magnitude plus 2^-7 (a BF16 step or two, from the projection's summation order), of later
//! layers (whose inputs carry the differences above) within 1/16 of the layer's largest
//! latent element. The reference's routing margins
//! are checked first, so numerical noise cannot flip an expert choice. It needs `python3`
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
use specdraft::model::{KvSequence, LoadOptions, ModelConfig, TargetModel};
use specdraft::speculative::{DraftProposer, PromptLookup};
use std::path::Path;
use std::sync::Arc;

const TOKENS: [u32; 24] = [
    1, 5, 17, 33, 4, 90, 12, 12, 7, 64, 5, 17, 33, 3, 22, 45, 8, 8, 61, 70, 9, 95, 40, 11,
];
/// Rows prefilled at once; the rest are decoded one token a forward.
const PREFILL: usize = 13;
/// The fixture's sizes (`mla_target_reference.py`).
const KV_LORA: usize = 32;
const ROPE: usize = 8;

struct Reference {
    logits: Vec<Vec<f32>>,
    min_margin: f64,
    sparse_layers: Vec<usize>,
    /// `[layer][position][kv_lora + rope]`.
    latents: Vec<Vec<Vec<f32>>>,
}

/// Writes `variant`'s checkpoint with `seed` into `dir` and returns the reference.
fn reference(variant: &str, dir: &Path, seed: u64) -> Reference {
    reference_with_gguf(variant, dir, seed, &[])
}

/// [`reference`], with the writer's GGUF arguments (`[path, kv_b form, experts format]`,
/// a prefix of them) after the tokens.
fn reference_with_gguf(variant: &str, dir: &Path, seed: u64, gguf: &[&str]) -> Reference {
    let script = "mla_target_reference.py";
    let v = run_reference(&python(), script, variant, dir, seed, &TOKENS, gguf);
    Reference {
        logits: rows(&v["logits"]),
        min_margin: v["min_margin"].as_f64().unwrap(),
        sparse_layers: v["sparse_layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect(),
        latents: v["latents"].as_array().unwrap().iter().map(rows).collect(),
    }
}

fn opts() -> LoadOptions {
    LoadOptions {
        max_rows: 32,
        max_seq_len: Some(64),
        kv_blocks: Some(16),
    }
}

fn logits_of(model: &TargetModel, out: &specdraft::model::ForwardOutput) -> Vec<Vec<f32>> {
    let v = model.config().vocab_size;
    let all: Vec<f32> = model.gpu().download(out.logits, out.rows * v).unwrap();
    all.chunks(v).map(<[f32]>::to_vec).collect()
}

/// Logits of every token: a prefill of `PREFILL` rows, then one decode step a token; and
/// the sequence, still holding its cache.
fn prefill_then_decode(model: &TargetModel) -> (Vec<Vec<f32>>, KvSequence) {
    let mut seq = model.new_sequence();
    let mut rows = Vec::new();
    let out = model
        .forward(&mut [&mut seq], &[&TOKENS[..PREFILL]])
        .unwrap();
    rows.extend(logits_of(model, &out));
    for t in &TOKENS[PREFILL..] {
        let out = model
            .forward(&mut [&mut seq], &[std::slice::from_ref(t)])
            .unwrap();
        rows.extend(logits_of(model, &out));
    }
    (rows, seq)
}

fn bf16_bits_to_f32(bits: &[u16]) -> Vec<f32> {
    bits.iter()
        .map(|&b| f32::from_bits(u32::from(b) << 16))
        .collect()
}

/// Checks `variant` (`q_lora`, `plain_q`, `yarn` or `fp8`) against the reference.
fn check_variant(variant: &str, seed: u64) {
    let dir = temp_dir(&format!("mla_{variant}"));
    let want = reference(variant, &dir, seed);
    assert!(
        want.min_margin > 0.005,
        "the fixture routes a row within {} of a tie; choose another seed",
        want.min_margin
    );
    assert_eq!(want.sparse_layers, [1, 2]);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = TargetModel::load(&dir, gpu.clone(), opts()).unwrap();
    let layers = &model.weights().layers;
    assert!(layers.iter().all(|l| l.mla.is_some()), "every layer is MLA");
    if variant == "fp8" {
        for l in layers {
            let formats: Vec<(&str, &str)> = l
                .projections()
                .iter()
                .map(|(n, p)| (*n, p.format_name()))
                .collect();
            let want = |n: &str| {
                if n == "self_attn.kv_b_proj" {
                    "bf16"
                } else {
                    "fp8"
                }
            };
            assert!(
                formats.iter().all(|(n, f)| *f == want(n)),
                "projection formats {formats:?}"
            );
        }
    }
    let routed: Vec<usize> = (0..layers.len())
        .filter(|&i| layers[i].moe().is_some())
        .collect();
    assert_eq!(routed, [1, 2], "the layers that route");
    let (got, mut seq) = prefill_then_decode(&model);
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
            "{variant}: position {pos} ({}) differs from the reference by {d} (bound {})",
            if pos < PREFILL { "prefill" } else { "decode" },
            scale / 64.0
        );
    }
    println!("{variant}: worst logit difference {worst} of max |logit| {scale}");
    // The cache holds one latent row a token, [kv_a_layernorm(c_kv) | rope(k_pe)], split in
    // two halves across the layer's two caches.
    for (layer, want_rows) in want.latents.iter().enumerate() {
        let (lo, hi) = model.read_kv(&seq, layer).unwrap();
        let half = (KV_LORA + ROPE) / 2;
        assert_eq!(
            (lo.len(), hi.len()),
            (TOKENS.len() * half, TOKENS.len() * half)
        );
        let (lo, hi) = (bf16_bits_to_f32(&lo), bf16_bits_to_f32(&hi));
        // Layer 0 reads the embedding itself, so its latents differ by rounding alone; a
        // later layer's input carries the logits' differences, which its norm scales up.
        let max = want_rows.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
        let bound = |w: f32| match layer {
            0 => w.abs() / 128.0 + 1.0 / 128.0,
            _ => max / 16.0,
        };
        for (pos, w) in want_rows.iter().enumerate() {
            let row: Vec<f32> = [&lo[pos * half..][..half], &hi[pos * half..][..half]].concat();
            for (e, (g, w)) in row.iter().zip(w).enumerate() {
                let part = if e < KV_LORA { "c_kv" } else { "k_rope" };
                assert!(
                    (g - w).abs() <= bound(*w),
                    "{variant}: layer {layer} position {pos} latent element {e} ({part}) is {g}, the reference {w}"
                );
            }
        }
    }
    model.free_sequence(&mut seq).unwrap();
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0, "the ledger after the drop");
}

#[test]
fn deepseek_v3_target_matches_the_numpy_reference() {
    check_variant("q_lora", 6);
}

#[test]
fn deepseek_v3_without_a_query_bottleneck_matches_the_numpy_reference() {
    check_variant("plain_q", 8);
}

#[test]
fn fp8_deepseek_v3_matches_the_numpy_reference_of_its_dequantized_weights() {
    // DeepSeek-V3 ships its projections as E4M3 with weight_scale_inv per 128 x 128 block;
    // kv_b_proj, which the latent attention reads per head, is dequantized at load.
    check_variant("fp8", 24);
}

#[test]
fn deepseek_v3_with_yarn_rope_scaling_matches_the_numpy_reference() {
    // DeepSeek-V3's own checkpoints scale RoPE with YaRN (mscale = mscale_all_dim).
    check_variant("yarn", 2);
}

/// A draft tree's rows see only their own branch, and compacting the accepted path leaves
/// the latent cache a chain forward of that path would: the tree's rows and the next
/// forward after compaction give the chain's logits, bit for bit.
#[test]
fn draft_trees_and_compaction_on_the_latent_cache_match_chains() {
    let dir = temp_dir("mla_tree");
    reference("q_lora", &dir, 6);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = TargetModel::load(&dir, gpu.clone(), opts()).unwrap();
    let prefix = &TOKENS[..9];
    let prefilled = || {
        let mut s = model.new_sequence();
        model.forward(&mut [&mut s], &[prefix]).unwrap();
        s
    };
    let chain = |path: &[u32]| -> Vec<Vec<f32>> {
        let mut s = prefilled();
        let out = model.forward(&mut [&mut s], &[path]).unwrap();
        let rows = logits_of(&model, &out);
        model.free_sequence(&mut s).unwrap();
        rows
    };
    // Root 40 (the last verified token); 50 and 60 its children, 70 a child of 50.
    let (tree, parents) = ([40u32, 50, 60, 70], [0usize, 0, 1]);
    let mut seq = prefilled();
    let out = model
        .forward_tree(&mut [&mut seq], &[&tree], &[Some(&parents)], &[])
        .unwrap();
    let rows = logits_of(&model, &out);
    let ab_d = chain(&[40, 50, 70]);
    let a_c = chain(&[40, 60]);
    assert_eq!(rows[0], ab_d[0], "the root");
    assert_eq!(rows[1], ab_d[1], "node 50");
    assert_eq!(rows[2], a_c[1], "node 60 sees the root, not its sibling 50");
    assert_eq!(rows[3], ab_d[2], "node 70 sees 50, not 60");
    // Keep the path 40, 50, 70 (cache rows 9, 10, 12), then decode one more token.
    let n = prefix.len();
    model.compact(&mut seq, n, &[n, n + 1, n + 3]).unwrap();
    assert_eq!(seq.len(), n + 3);
    let out = model.forward(&mut [&mut seq], &[&[80]]).unwrap();
    let after = logits_of(&model, &out);
    let want = chain(&[40, 50, 70, 80]);
    assert_eq!(after[0], want[3], "the forward after compaction");
    model.free_sequence(&mut seq).unwrap();
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0, "the ledger after the drop");
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
fn speculative_greedy_equals_plain_greedy_on_deepseek_v3() {
    let dir = temp_dir("mla_engine");
    reference("q_lora", &dir, 6);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = Arc::new(TargetModel::load(&dir, gpu.clone(), opts()).unwrap());
    let (plain, _, _) = generate(&model, None);
    let lookup: Arc<dyn DraftProposer> = Arc::new(PromptLookup::default());
    assert_eq!(generate(&model, Some(lookup)).0, plain, "prompt lookup");
    let runs = engine_prompts()
        .into_iter()
        .zip(&plain)
        .map(|(p, out)| [p, out.clone()].concat())
        .collect();
    // Every draft it is asked for, from the plain output: all accepted when verification
    // agrees with plain decoding, several verify rows a sequence.
    let replay: Arc<dyn DraftProposer> = Arc::new(Scripted {
        fulls: runs,
        plan: |_| Some((usize::MAX, usize::MAX)),
        vocab: model.config().vocab_size as u32,
    });
    let (spec, drafted, accepted) = generate(&model, Some(replay));
    assert_eq!(spec, plain, "drafts of the plain output");
    assert!(
        drafted >= 24 && accepted == drafted,
        "{accepted} of {drafted}"
    );
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0, "the ledger after the drop");
}

#[test]
fn deepseek2_gguf_and_safetensors_of_the_same_weights_give_the_same_logits() {
    for (variant, form) in [
        ("q_lora", "split"),
        ("q_lora", "kv_b"),
        ("plain_q", "split"),
        ("yarn", "split"),
    ] {
        let what = format!("{variant}, {form}");
        let dir = temp_dir(&format!("mla_gguf_{variant}_{form}"));
        let gguf = dir.join("model.gguf");
        reference_with_gguf(variant, &dir, 6, &[gguf.to_str().unwrap(), form]);
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let from_st = TargetModel::load(&dir, gpu.clone(), opts()).unwrap();
        let from_gguf = TargetModel::load(&gguf, gpu.clone(), opts()).unwrap();
        let (a, b) = (from_st.config(), from_gguf.config());
        assert_eq!(b.mla, a.mla, "{what}: the MLA sizes from GGUF metadata");
        assert_eq!(b.moe, a.moe, "{what}: the MoE config from GGUF metadata");
        assert_eq!(
            (
                b.family,
                b.num_hidden_layers,
                b.head_dim,
                b.num_key_value_heads
            ),
            (
                a.family,
                a.num_hidden_layers,
                a.head_dim,
                a.num_key_value_heads
            ),
            "{what}"
        );
        assert_eq!(b.mla_softmax_scale(), a.mla_softmax_scale(), "{what}");
        // YaRN: GGUF stores `0.1 * mscale_all_dim` as an f32 multiplier, so the value read
        // back may sit one f32 step from the config's.
        let yarn = |c: &ModelConfig| {
            c.rope_scaling.as_ref().map(|r| {
                (
                    r.kind.clone(),
                    r.factor,
                    r.yarn.mscale_all_dim.unwrap_or(0.0),
                )
            })
        };
        match (yarn(b), yarn(a)) {
            (Some((kb, fb, mb)), Some((ka, fa, ma))) => {
                assert_eq!((kb, fb), (ka, fa), "{what}: YaRN from GGUF metadata");
                assert!(
                    (mb - ma).abs() <= 1e-6,
                    "{what}: mscale_all_dim {mb} against {ma}"
                );
            }
            (b, a) => assert_eq!(b, a, "{what}: rope scaling from GGUF metadata"),
        }
        // F32 tensors holding BF16 values load to the same BF16 weights (kv_b_proj put back
        // together from attn_k_b and attn_v_b): the same logits, bit for bit.
        assert_eq!(
            prefill_then_decode(&from_gguf).0,
            prefill_then_decode(&from_st).0,
            "{what}: GGUF and safetensors logits"
        );
        drop((from_st, from_gguf));
        assert_eq!(
            gpu.ledger().live_count(),
            0,
            "{what}: the ledger after the drop"
        );
    }
}

#[test]
fn a_deepseek2_gguf_with_q8_0_experts_stays_within_its_bound_of_the_bf16_logits() {
    let dir = temp_dir("mla_gguf_q8_0");
    let gguf = dir.join("model.gguf");
    reference_with_gguf(
        "q_lora",
        &dir,
        6,
        &[gguf.to_str().unwrap(), "split", "q8_0"],
    );
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let from_st = TargetModel::load(&dir, gpu.clone(), opts()).unwrap();
    let from_gguf = TargetModel::load(&gguf, gpu.clone(), opts()).unwrap();
    let moe = from_gguf.weights().layers[2].moe().unwrap();
    assert!(moe.experts.iter().all(|x| x.down.format_name() == "q8_0"));
    let (want, got) = (
        prefill_then_decode(&from_st).0,
        prefill_then_decode(&from_gguf).0,
    );
    let scale = want.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    let mut worst = 0f32;
    for (pos, (g, w)) in got.iter().zip(&want).enumerate() {
        let d = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(d);
        // Q8_0 rounds each weight to 1/254 of its block's largest magnitude (and the
        // activations the experts read to BF16 as before): measured, the logits move by
        // 0.074 of a largest 6.16; the bound is 1/32 of the largest.
        assert!(
            d <= scale / 32.0,
            "position {pos}: Q8_0 experts move the logits by {d} (bound {})",
            scale / 32.0
        );
    }
    println!("Q8_0 experts: worst logit difference {worst} of max |logit| {scale}");
    drop((from_st, from_gguf));
    assert_eq!(gpu.ledger().live_count(), 0, "the ledger after the drop");
}

type Edit<T> = Box<dyn Fn(&mut T)>;

#[test]
fn broken_deepseek_v3_checkpoints_are_refused_by_name() {
    type Tensors = serde_json::Map<String, serde_json::Value>;
    let rename = |name: &'static str| -> Edit<Tensors> {
        Box::new(move |h: &mut Tensors| {
            let t = h.remove(name).expect(name);
            h.insert(format!("unused.{name}"), t);
        })
    };
    let tensor_cases: Vec<(&str, Edit<Tensors>, &[&str])> = vec![
        (
            "kv_b_proj for another head split",
            Box::new(|h: &mut Tensors| {
                h["model.layers.1.self_attn.kv_b_proj.weight"]["shape"] =
                    serde_json::json!([32, 112])
            }),
            &[
                "model.layers.1.self_attn.kv_b_proj.weight",
                "[112, 32]",
                "[32, 112]",
            ],
        ),
        (
            "missing kv_a_layernorm",
            rename("model.layers.2.self_attn.kv_a_layernorm.weight"),
            &["model.layers.2.self_attn.kv_a_layernorm.weight", "missing"],
        ),
        (
            "missing q_b_proj",
            rename("model.layers.0.self_attn.q_b_proj.weight"),
            &["model.layers.0.self_attn.q_b_proj.weight", "missing"],
        ),
    ];
    let mut failures = Vec::new();
    for (i, (what, edit, needles)) in tensor_cases.iter().enumerate() {
        let dir = temp_dir(&format!("mla_broken_tensor_{i}"));
        reference("q_lora", &dir, 3);
        edit_header(&dir, |h| edit(h));
        failures.extend(check_refusal(&dir, what, needles, opts()).err());
    }
    let config_cases: Vec<(&str, Edit<serde_json::Value>, &[&str])> = vec![
        (
            "no latent attention sizes",
            Box::new(|c| {
                c.as_object_mut().unwrap().remove("kv_lora_rank");
            }),
            &[
                "deepseek_v3",
                "multi-head latent attention (MLA)",
                "kv_lora_rank",
            ],
        ),
        (
            "YaRN scaling cos and sin (no mscale keys)",
            Box::new(|c| {
                c["rope_scaling"] = serde_json::json!({"type": "yarn", "factor": 40.0,
                    "original_max_position_embeddings": 4096})
            }),
            &["rope_scaling", "yarn scales cos and sin by 1.36"],
        ),
    ];
    for (i, (what, edit, needles)) in config_cases.iter().enumerate() {
        let dir = temp_dir(&format!("mla_broken_config_{i}"));
        reference("q_lora", &dir, 3);
        edit_config(&dir, |c| edit(c));
        failures.extend(check_refusal(&dir, what, needles, opts()).err());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
