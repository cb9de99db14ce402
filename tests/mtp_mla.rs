//! DeepSeek-V3's own MTP layer (`model.layers.{num_hidden_layers}.*`: `enorm`, `hnorm`,
//! `eh_proj`, a decoder layer with multi-head latent attention and routed plus shared
//! experts, `shared_head`) run by `MtpHead` beside its DeepSeek-V3 target, against an
//! independent numpy forward written from the published equations
//! (`tests/python/mla_target_reference.py mtp`, which also writes the tiny random BF16
//! checkpoint, target and MTP layer in one folder as DeepSeek-V3 ships them).
//!
//! What it proves: the head's logits at every position, over drafter rows written by a
//! prefill and then one propose a token, match the reference's from the same target hiddens;
//! the head's drafter cache holds the MTP layer's latent rows (`kv_lora_rank +
//! qk_rope_head_dim` a token, split across its two caches as the target's are); greedy
//! speculative decoding with the head emits what plain decoding does; a latent-attention
//! layer under a config without the MLA sizes is refused naming MLA. Nothing is left in the
//! ledger.
//!
//! Bounds: every logit within `max|logit| / 256` of the reference, one BF16 step at the
//! logits' scale (both round every stored activation to BF16, so what differs is summation
//! order, which can move a BF16 value by one step; measured on the CPU backend: 5e-7 of a
//! largest logit of 5.5); every cached latent element within 2^-7 of its magnitude plus 2^-7. The reference's routing
//! margins are checked first, so numerical noise cannot flip an expert choice. It needs
//! `python3` with numpy (set `PYTHON` to choose the interpreter).

#[allow(dead_code)]
#[path = "../benches/common/default_model.rs"]
mod default_model;
#[allow(unused_imports)]
mod model_util;

use default_model::python;
use model_util::{greedy_fixed, rows, run_reference, temp_dir};
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::model::{ForwardContext, LoadOptions, ModelLevers, TargetModel};
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization};
use std::path::Path;
use std::sync::Arc;

const TOKENS: [u32; 20] = [
    1, 5, 17, 33, 4, 90, 12, 12, 7, 64, 5, 17, 33, 3, 22, 45, 8, 8, 61, 70,
];
/// Tokens the head's drafter rows are prefilled from; the rest come one propose a token.
const PREFILL: usize = 9;
/// The fixture's sizes (`mla_target_reference.py`).
const HIDDEN: usize = 64;
const KV_LORA: usize = 32;
const ROPE: usize = 8;

struct Reference {
    /// `[position][hidden]`: the target's hidden before its final norm.
    hiddens: Vec<Vec<f32>>,
    /// `[position - 1][vocab]`: the MTP layer's logits at positions 1 .. n - 1.
    mtp_logits: Vec<Vec<f32>>,
    /// `[position - 1][kv_lora + rope]`: the MTP layer's cached latent rows.
    mtp_latents: Vec<Vec<f32>>,
    min_margin: f64,
}

/// Writes the checkpoint (target and MTP layer) with `seed` into `dir`; the reference.
fn reference(dir: &Path, seed: u64) -> Reference {
    let v = run_reference(
        &python(),
        "mla_target_reference.py",
        "mtp",
        dir,
        seed,
        &TOKENS,
        &[],
    );
    Reference {
        hiddens: rows(&v["hiddens"]),
        mtp_logits: rows(&v["mtp_logits"]),
        mtp_latents: rows(&v["mtp_latents"]),
        min_margin: v["min_margin"].as_f64().unwrap(),
    }
}

fn opts() -> LoadOptions {
    LoadOptions {
        max_rows: 32,
        max_seq_len: Some(64),
        kv_blocks: Some(16),
    }
}

/// The MTP layer in the target's own folder, beside the target.
fn head_beside(dir: &Path, model: &Arc<TargetModel>) -> specdraft::Result<MtpHead> {
    MtpHead::from_checkpoint_for_target(
        dir,
        model.clone(),
        MtpQuantization::Bf16,
        0,
        64,
        16,
        &ModelLevers::default(),
    )
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

#[test]
fn deepseek_v3_mtp_layer_logits_and_latent_cache_match_the_numpy_reference() {
    let dir = temp_dir("mtp_mla_reference");
    let want = reference(&dir, 6);
    assert!(
        want.min_margin > 0.005,
        "the fixture routes a row within {} of a tie; choose another seed",
        want.min_margin
    );
    assert_eq!(want.mtp_logits.len(), TOKENS.len() - 1);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = Arc::new(TargetModel::load(&dir, gpu.clone(), opts()).unwrap());
    let head = head_beside(&dir, &model).expect("load DeepSeek-V3's MTP layer");
    let layer = &head.weights().layer;
    assert!(
        layer.mla.is_some() && layer.moe().is_some(),
        "the head's layer has latent attention and routed experts"
    );
    // The reference's hiddens are BF16 values: uploaded as they are.
    let flat: Vec<f32> = want.hiddens.iter().flatten().copied().collect();
    assert_eq!(flat.len(), TOKENS.len() * HIDDEN);
    let hiddens = gpu.upload_bf16(&flat, "test:hiddens").unwrap();
    let hidden_at = |p: usize| hiddens.offset(p * HIDDEN * 2);
    let levers = ModelLevers::default();
    let ctx = ForwardContext::new(
        gpu.clone(),
        model.buffers().clone(),
        model.config().clone(),
        levers,
    );
    let mut state = head.alloc_state_for(gpu.as_ref(), 64).unwrap();
    let written = head
        .prefill_drafter(&TOKENS[..PREFILL], hiddens, &mut *state, &ctx, 0)
        .unwrap();
    assert_eq!(written, PREFILL - 1, "rows for positions 1 .. PREFILL - 1");
    let scale = want
        .mtp_logits
        .iter()
        .flatten()
        .fold(0f32, |m, x| m.max(x.abs()));
    let bound = scale / 256.0;
    let mut worst = 0f32;
    for (p, &token) in TOKENS.iter().enumerate().skip(PREFILL) {
        // The row at p from the token at p and the target hidden at p - 1; its draft is
        // rejected, so the next propose comes at p + 1 with the token there.
        head.propose(
            token,
            hidden_at(p - 1),
            p,
            1,
            &mut *state,
            &ctx,
            0,
            None,
            None,
            None,
        )
        .unwrap();
        let got = head.last_logits(gpu.as_ref(), 0).unwrap();
        let d = max_abs_diff(&got, &want.mtp_logits[p - 1]);
        worst = worst.max(d);
        assert!(
            d <= bound,
            "position {p}: the head's logits differ from the reference by {d} (bound {bound})"
        );
        head.after_verify(0, &mut *state, 0).unwrap();
    }
    println!("worst MTP logit difference {worst} of max |logit| {scale}");
    // Drafter row j holds position j + 1's latent: its first half in the key cache, its
    // second in the value cache.
    for row in 0..TOKENS.len() - 1 {
        let bits = head.drafter_kv_row(gpu.as_ref(), &mut *state, row).unwrap();
        assert_eq!(bits.len(), KV_LORA + ROPE, "one latent row a token");
        let got: Vec<f32> = bits
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect();
        for (i, (g, w)) in got.iter().zip(&want.mtp_latents[row]).enumerate() {
            let tol = w.abs() / 128.0 + 1.0 / 128.0;
            assert!(
                (g - w).abs() <= tol,
                "drafter row {row}, latent element {i}: {g} against {w}"
            );
        }
    }
    head.free_state(gpu.as_ref(), &mut *state).unwrap();
    assert_eq!(
        head.kv_blocks().0,
        head.kv_blocks().1,
        "blocks left in the pool"
    );
    drop(head);
    drop(model);
    gpu.free(hiddens).unwrap();
    assert_eq!(gpu.ledger().live_count(), 0, "the ledger after the drop");
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        TOKENS[..10].to_vec(),
        vec![11, 12, 13, 11, 12, 13, 11, 12],
        vec![3, 22, 45, 8, 8, 61],
    ]
}

/// Greedy outputs of [`prompts`] and the drafts made, 3 a step, two sequences at a time.
fn generate(model: &Arc<TargetModel>, p: Option<Arc<dyn DraftProposer>>) -> (Vec<Vec<u32>>, u64) {
    let (tokens, drafted, _) = greedy_fixed(model, p, 3, 2, &prompts());
    (tokens, drafted)
}

#[test]
fn greedy_decoding_with_the_deepseek_v3_mtp_head_emits_what_plain_decoding_does() {
    let dir = temp_dir("mtp_mla_engine");
    reference(&dir, 6);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = Arc::new(TargetModel::load(&dir, gpu.clone(), opts()).unwrap());
    let (plain, _) = generate(&model, None);
    let head: Arc<dyn DraftProposer> = Arc::new(head_beside(&dir, &model).unwrap());
    let (spec, drafted) = generate(&model, Some(head));
    assert!(drafted > 0, "the head drafted nothing");
    assert_eq!(spec, plain, "greedy with the MTP head against plain greedy");
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0, "the ledger after the drop");
}

#[test]
fn a_latent_attention_layer_without_the_mla_sizes_is_refused_naming_mla() {
    let dir = temp_dir("mtp_mla_no_sizes");
    reference(&dir, 6);
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let map = config.as_object_mut().unwrap();
    for key in ["kv_lora_rank", "q_lora_rank"] {
        map.remove(key);
    }
    // A head_dim that makes the config valid without MLA.
    map.insert("head_dim".into(), serde_json::json!(16));
    std::fs::write(&path, config.to_string()).unwrap();
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let err = MtpHead::from_checkpoint(
        &dir,
        gpu.clone(),
        MtpQuantization::Bf16,
        0,
        64,
        16,
        &ModelLevers::default(),
    )
    .err()
    .expect("an MLA layer loaded without its sizes")
    .to_string();
    assert!(
        err.contains("model.layers.3.self_attn.kv_a_proj_with_mqa.weight")
            && err.contains("multi-head latent attention (MLA)")
            && err.contains("kv_lora_rank"),
        "{err}"
    );
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "nothing left after the refusal"
    );
}
