//! `Eagle3Head` with its matrices re-stored at load (`quant`), beside a tiny seeded target
//! (four Llama layers, hidden 64, CPU backend): Q8_0 stores `fc`, the layer's projections and
//! the head's own LM head in blocks and frees their loaded BF16 copies, so a draft step reads
//! about 34/64 of the bytes; its logits for the same propose stay within 3% of the BF16
//! head's largest logit (Q8_0 rounds each weight to 1/254 of its block's largest); greedy
//! output through the engine is unchanged; nothing leaks.

mod drafter_fixtures;
#[allow(unused_imports)] // the helpers re-export a GGUF writer this test does not use
mod model_util;

use model_util::{temp_dir, write_hf, Tiny};
use specdraft::backend::quant::BlockFormat;
use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::engine::{DraftPolicyKind, GenerateRequest, SpecEngine};
use specdraft::model::{ForwardContext, LoadOptions, LogitRows, ModelLevers, TargetModel};
use specdraft::speculative::{DraftProposer, Eagle3Head, MtpQuantization};
use std::path::Path;
use std::sync::Arc;

const Q8_0: MtpQuantization = MtpQuantization::Block(BlockFormat::Q8_0);
/// The draft vocabulary's target ids (any distinct ids of the target's 96).
const DRAFT_VOCAB: [u32; 32] = [
    3, 5, 7, 9, 11, 14, 17, 20, 23, 26, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 72, 75, 78, 81,
    84, 86, 88, 90, 92, 94, 95,
];

fn tiny() -> Tiny {
    Tiny {
        layers: 4,
        ..Tiny::default()
    }
}

fn target(gpu: &Arc<dyn GpuBackend>, tag: &str) -> Arc<TargetModel> {
    let t = tiny();
    let dir = temp_dir(&format!("eagle3_quant_target_{tag}"));
    write_hf(&dir, &t, &t.tensors(11));
    let opts = LoadOptions {
        max_rows: 64,
        max_seq_len: Some(128),
        kv_blocks: Some(64),
    };
    Arc::new(TargetModel::load(&dir, gpu.clone(), opts).unwrap())
}

fn load(dir: &Path, model: &Arc<TargetModel>, quant: MtpQuantization) -> Eagle3Head {
    let levers = ModelLevers::default();
    Eagle3Head::from_checkpoint_for_target_quantized(dir, model.clone(), quant, 128, 64, &levers)
        .unwrap()
}

/// The logits of a propose of one draft after `tokens` (over the draft vocabulary), from the
/// rows the target captures for them.
fn first_logits(head: &Eagle3Head, model: &TargetModel, tokens: &[u32]) -> Vec<f32> {
    let gpu = model.gpu().clone();
    let layers = head.target_layer_ids();
    let width = layers.len() * model.config().hidden_size * 2;
    let mut seq = model.new_sequence();
    let out = model
        .forward_capturing(
            &mut [&mut seq],
            &[tokens],
            LogitRows::LastPerSequence,
            &layers,
        )
        .unwrap();
    let stack = gpu.alloc(tokens.len() * width, "test stack").unwrap();
    gpu.copy_dtod(stack, out.hidden_stack.unwrap(), tokens.len() * width, 0)
        .unwrap();
    model.free_sequence(&mut seq).unwrap();
    let mut ctx = ForwardContext::new(
        gpu.clone(),
        model.buffers().clone(),
        model.config().clone(),
        ModelLevers::default(),
    );
    ctx.target_hidden_stack = Some(stack);
    let p = tokens.len() - 1;
    let mut st = head.alloc_state_for(gpu.as_ref(), 128).unwrap();
    head.prefill_drafter(&tokens[..p], stack, &mut *st, &ctx, 0)
        .unwrap();
    // The last token is paired with the row computed before it.
    let row = stack.offset((p - 1) * width);
    let drafts = head
        .propose(
            tokens[p],
            row,
            p,
            1,
            &mut *st,
            &ctx,
            0,
            None,
            None,
            Some(row),
        )
        .unwrap();
    assert_eq!(drafts.len(), 1);
    let logits = head.last_logits(gpu.as_ref(), 0).unwrap();
    head.free_state(gpu.as_ref(), &mut *st).unwrap();
    gpu.free(stack).unwrap();
    logits
}

#[test]
fn q8_0_stores_the_heads_matrices_in_blocks_and_keeps_its_logits() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = target(&gpu, "logits");
    let dir = drafter_fixtures::write_eagle3("quant", &tiny(), &[1, 2, 3], &DRAFT_VOCAB);
    let base = gpu.ledger().live_bytes();
    let bf16 = load(&dir, &model, MtpQuantization::Bf16);
    let bf16_bytes = gpu.ledger().live_bytes() - base;
    let q8 = load(&dir, &model, Q8_0);
    let q8_bytes = gpu.ledger().live_bytes() - base - bf16_bytes;
    assert_eq!(
        (bf16.projection_format(), bf16.lm_head_format()),
        ("bf16", "bf16")
    );
    assert_eq!(
        (q8.projection_format(), q8.lm_head_format()),
        ("q8_0", "q8_0")
    );
    // 34 bytes a block of 32 against 64, plus the BF16 norms.
    let ratio = q8.bytes_per_draft() as f64 / bf16.bytes_per_draft() as f64;
    assert!((0.50..0.60).contains(&ratio), "bytes per draft {ratio}");
    // The loaded BF16 copies are freed: the Q8_0 head holds less than the BF16 one, by about
    // what its matrices shrink.
    let saved = bf16.bytes_per_draft() - q8.bytes_per_draft();
    assert!(
        q8_bytes + saved * 9 / 10 <= bf16_bytes,
        "Q8_0 head {q8_bytes} bytes, BF16 head {bf16_bytes}, matrices {saved} smaller"
    );
    let tokens: Vec<u32> = (0..13).map(|k| (k * 7 + k * k) % 90 + 3).collect();
    let a = first_logits(&bf16, &model, &tokens);
    let b = first_logits(&q8, &model, &tokens);
    assert_eq!(a.len(), DRAFT_VOCAB.len());
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    let err = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        err <= 0.03 * scale,
        "first draft step's logits: max error {err} against a scale of {scale}"
    );
    assert!(
        err > 0.0,
        "the Q8_0 head computed the BF16 head's logits exactly"
    );
    drop((bf16, q8));
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

#[test]
fn greedy_output_with_a_q8_0_head_is_plain_output() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = target(&gpu, "engine");
    let dir = drafter_fixtures::write_eagle3("quant_engine", &tiny(), &[1, 2, 3], &DRAFT_VOCAB);
    let prompts: Vec<Vec<u32>> = [9u32, 23, 3]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..n)
                .map(|k| (i as u32 * 11 + k * 5 + k * k) % 90 + 3)
                .collect()
        })
        .collect();
    let requests = || {
        prompts
            .iter()
            .map(|p| GenerateRequest::new(p.clone(), 20).ignore_eos())
            .collect::<Vec<_>>()
    };
    let plain = SpecEngine::new(model.clone(), None, 0).unwrap();
    let want: Vec<Vec<u32>> = plain
        .generate(requests())
        .results
        .into_iter()
        .map(|r| r.tokens)
        .collect();
    drop(plain);
    let head: Arc<dyn DraftProposer> = Arc::new(load(&dir, &model, Q8_0));
    let engine = SpecEngine::new(model.clone(), Some(head), 3)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed);
    let out = engine.generate(requests());
    for (i, r) in out.results.iter().enumerate() {
        assert!(r.error.is_none(), "request {i}: {:?}", r.error);
        assert_eq!(r.tokens, want[i], "request {i}");
    }
    assert!(out.metrics.drafted > 0, "the head drafted nothing");
    drop(engine);
    drop(model);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

/// A BF16 head's draft step reads each of its stored weights once (the layer's
/// `input_layernorm`, which normalizes the embedding half of the input, included once), one
/// embedding row of the target's, and nothing of `d2t`: the checkpoint's own bytes say how many.
#[test]
fn a_draft_step_reads_each_stored_weight_once() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = target(&gpu, "bytes");
    let dir = drafter_fixtures::write_eagle3("bytes", &tiny(), &[1, 2, 3], &DRAFT_VOCAB);
    let file = std::fs::read(dir.join("model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&file).unwrap();
    let weights: usize = tensors
        .tensors()
        .into_iter()
        .filter(|(name, _)| name != "d2t" && name != "t2d")
        .map(|(_, view)| view.data().len())
        .sum();
    let head = load(&dir, &model, MtpQuantization::Bf16);
    let embedding_row = model.config().hidden_size * 2;
    assert_eq!(head.bytes_per_draft(), weights + embedding_row);
}
