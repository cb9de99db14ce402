//! `MtpHead` on a backend that runs the CUDA kernels (the emulator in CI, a GPU in the device
//! script) against the same head on the CPU reference, and inside the engine.
//!
//! Both heads load the same tiny checkpoint and get identical inputs at every step: each
//! propose drafts one token from the fixture's token and hidden (the draft is then rejected,
//! so the next step's input does not depend on it), and the logits of every step are
//! compared within a tolerance relative to the largest logit:
//! - [`EMU_LOGIT_RTOL`] for the emulator: the same kernel sources compiled for the host, so
//!   the only differences are the order of f32 sums and the host's libm; measured at about
//!   1.5e-7 of the scale (no BF16 activation rounded differently). One activation rounded
//!   the other way (a BF16 step, 2^-8 of one element) moves the logits by well under the
//!   tolerance, a wrong kernel (a missed row, a wrong scale, a swapped operand) by their
//!   own size.
//! - [`GPU_LOGIT_RTOL`] for a GPU, whose exp, sin and fused multiply-adds differ from the
//!   host's: every activation between ops is rounded to BF16 and the head stacks about ten
//!   such roundings (norms, eh_proj, attention, MLP or experts, final norm, NVFP4 LM head),
//!   so a few percent of the scale bounds an honest difference (the target model's GPU test
//!   allows 2% for two layers).
//!
//! A draft must equal the reference's wherever the reference's top two logits are further
//! apart than twice the tolerance.
#![allow(dead_code)]

use crate::mtp_common::{scratch_dir, write_checkpoint_with, HIDDEN, VOCAB};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{GenerateRequest, SpecEngine};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig, ModelLevers};
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization};
use std::sync::Arc;

/// Logit tolerance on the emulator, relative to the largest logit (see the module docs).
pub const EMU_LOGIT_RTOL: f32 = 2e-3;
/// Logit tolerance on a GPU, relative to the largest logit (see the module docs).
pub const GPU_LOGIT_RTOL: f32 = 0.03;

/// Dense and MoE layouts: `(layout, moe)`. The device script runs them all; the emulator
/// (a host thread per CUDA thread, seconds per forward) one of each kind.
pub const LAYOUTS: [(&str, bool); 4] = [
    ("deepseek_v3", false),
    ("mimo", false),
    ("glm4_moe", true),
    ("qwen3_next", true),
];

const PROMPT: usize = 5;
const STEPS: usize = 3;
const CHAINED: usize = 2;

/// What one head computed: per step, the draft and the logits of its forward.
struct Run {
    drafts: Vec<u32>,
    logits: Vec<Vec<f32>>,
    chained: Vec<u32>,
}

/// The head of a tiny checkpoint of `layout` on `gpu`, and the checkpoint's config.
fn load(
    gpu: &Arc<dyn GpuBackend>,
    layout: &str,
    moe: bool,
    quant: MtpQuantization,
) -> (MtpHead, ModelConfig) {
    let dir = scratch_dir(&format!(
        "mtp_backends_{layout}_{moe}_{quant:?}_{}",
        gpu.name()
    ));
    write_checkpoint_with(&dir, layout, 13, moe);
    let levers = ModelLevers::default();
    let head = MtpHead::from_checkpoint(&dir, gpu.clone(), quant, 0, 64, 64, &levers).unwrap();
    (
        head,
        ModelConfig::from_file(dir.join("config.json")).unwrap(),
    )
}

fn run(gpu: Arc<dyn GpuBackend>, layout: &str, moe: bool, quant: MtpQuantization) -> Run {
    let (head, config) = load(&gpu, layout, moe, quant);
    let ctx = ForwardContext::new(
        gpu.clone(),
        Arc::new(BufferArena::empty(16)),
        Arc::new(config),
        ModelLevers::default(),
    );
    let rows = PROMPT + STEPS + 1;
    let mut rng = SmallRng::seed_from_u64(29);
    let h: Vec<f32> = (0..rows * HIDDEN)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let tokens: Vec<u32> = (0..rows)
        .map(|_| rng.random_range(0..VOCAB as u32))
        .collect();
    let hid = gpu.upload_bf16(&h, "test:hiddens").unwrap();
    let at = |p: usize| hid.offset(p * HIDDEN * 2);
    let g = gpu.as_ref();
    let mut st = head.alloc_state_for(g, 128).unwrap();
    head.prefill_drafter(&tokens[..PROMPT], hid, &mut *st, &ctx, 0)
        .unwrap();
    let mut out = Run {
        drafts: Vec::new(),
        logits: Vec::new(),
        chained: Vec::new(),
    };
    for (p, &token) in tokens.iter().enumerate().skip(PROMPT).take(STEPS) {
        let propose = |n: usize, st: &mut dyn specdraft::speculative::ProposerState| {
            head.propose(token, at(p - 1), p, n, st, &ctx, 0, None, None, None)
                .unwrap()
        };
        let d = propose(1, &mut *st);
        out.drafts.push(d[0]);
        out.logits.push(head.last_logits(g, 0).unwrap());
        head.after_verify(0, &mut *st, 0).unwrap();
        if p + 1 == PROMPT + STEPS {
            // The head feeding its own hidden back: several drafts in one propose.
            out.chained = propose(CHAINED, &mut *st);
            head.after_verify(0, &mut *st, 0).unwrap();
        }
    }
    head.free_state(g, &mut *st).unwrap();
    gpu.free(hid).unwrap();
    let (total, free) = head.kv_blocks();
    assert_eq!(total, free, "drafter KV blocks still held");
    drop(head);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
    out
}

/// The gap between the largest and the second largest logit.
fn margin(logits: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in logits {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// `MtpHead` on `dut` gives the CPU's logits (within `rtol` of their scale) and drafts, for
/// one layout.
pub fn compare_with_cpu(
    dut: Arc<dyn GpuBackend>,
    layout: &str,
    moe: bool,
    quant: MtpQuantization,
    rtol: f32,
) {
    let want = run(Arc::new(CpuBackend::new()), layout, moe, quant);
    let got = run(dut.clone(), layout, moe, quant);
    let mut decided = 0;
    for (step, (g, w)) in got.logits.iter().zip(&want.logits).enumerate() {
        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
        let tol = rtol * scale;
        let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            g.len() == w.len() && diff <= tol,
            "{layout} (moe {moe}) on {}: step {step}: logits differ by {diff} (tolerance {tol})",
            dut.name()
        );
        if margin(w) > 2.0 * tol {
            decided += 1;
            assert_eq!(
                got.drafts[step], want.drafts[step],
                "{layout} (moe {moe}): step {step}"
            );
        }
    }
    assert!(
        decided > 0,
        "{layout}: no step had a clear winner to compare"
    );
    // Chained drafts feed the head's own hidden back; near-ties aside they match too.
    let same = got
        .chained
        .iter()
        .zip(&want.chained)
        .filter(|(a, b)| a == b)
        .count();
    assert!(
        same + 1 >= CHAINED && got.chained.len() == CHAINED,
        "{layout} (moe {moe}): chained drafts {:?} vs {:?}",
        got.chained,
        want.chained
    );
}

/// The engine on `dut` with `MtpHead` drafting (chains, or with `trees` EAGLE-2 trees, which
/// the two sequences grow together) keeps plain greedy output, drafts as the CPU's head does
/// (near-ties aside), and leaves nothing allocated.
pub fn engine_keeps_greedy_output(dut: Arc<dyn GpuBackend>, layout: &str, moe: bool, trees: bool) {
    let prompts: Vec<Vec<u32>> = vec![vec![1, 2, 3, 4, 5, 1, 2, 3], vec![50, 60, 70, 80, 50]];
    let generate = |gpu: &Arc<dyn GpuBackend>, with_head: bool| {
        let target = Arc::new(TableTarget::new(gpu.clone(), VOCAB, 128, 32, 2, 0.1).unwrap());
        let head = with_head.then(|| {
            let head = load(gpu, layout, moe, MtpQuantization::Bf16).0;
            head.set_grow_trees(trees);
            Arc::new(head) as Arc<dyn DraftProposer>
        });
        let engine = SpecEngine::new(target, head, 3).unwrap();
        assert_eq!(engine.drafts_trees(), with_head && trees);
        let requests = prompts
            .iter()
            .map(|p| GenerateRequest::new(p.clone(), 12).ignore_eos())
            .collect();
        let g = engine.generate(requests);
        let out: Vec<Vec<u32>> = g
            .results
            .into_iter()
            .map(|r| {
                assert!(r.error.is_none(), "{:?}", r.error);
                r.tokens
            })
            .collect();
        (out, g.metrics.drafted, g.metrics.accepted)
    };
    let (plain, _, _) = generate(&dut, false);
    let (spec, drafted, accepted) = generate(&dut, true);
    assert_eq!(
        spec,
        plain,
        "{layout} (moe {moe}, trees {trees}) on {}",
        dut.name()
    );
    assert!(drafted > 0);
    let cpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let (cpu_plain, cpu_drafted, cpu_accepted) = generate(&cpu, true);
    assert_eq!(cpu_plain, plain, "the table target is backend-independent");
    // Same drafts give the same acceptance; allow a near-tie or two.
    assert!(
        drafted.abs_diff(cpu_drafted) <= 3 && accepted.abs_diff(cpu_accepted) <= 3,
        "{layout}: drafted/accepted {drafted}/{accepted} vs the CPU's {cpu_drafted}/{cpu_accepted}"
    );
    assert_eq!(
        dut.ledger().live_count(),
        0,
        "{:?}",
        dut.ledger().live_report()
    );
}
