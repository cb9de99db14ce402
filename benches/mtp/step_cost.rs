//! The draft step's cost against the target's, on the real default model and its shipped
//! head: the median time of a one-row target decode step, of one draft step of the head
//! (a `propose` of one draft: one row through the head and the argmax over the draft
//! vocabulary) and of a whole 3-draft `propose`, measured interleaved in the same rounds so
//! that a change of machine load hits all three alike (medians, and minimums: the least
//! disturbed rounds of a shared machine). One JSON line per storage of the
//! head's projections; the goal is a draft step of at most 15% of the target's step. For
//! BF16 projections, one more line (`mtp_declined_steps`) compares a batch's declined steps
//! with the rows written at once against rows deferred to the next drafting step; for Q8_0
//! ones (the CPU's), `mtp_tree_batch` compares trees grown one by one and together
//! (`mtp/tree_batch.rs`).
//!
//! Wall-clock time is not proportional to work on a loaded machine: a call longer than the
//! scheduler's slice is preempted and waits on the run queue while other processes run, so
//! a 3-draft propose (three times a draft step's work) read 8x a draft step's median on the
//! 2-core machine at load 10-20, against 2-3x on a quiet machine. Each timed call therefore
//! also reports how long the calling thread waited on the run queue during it, from Linux's
//! `/proc/thread-self/schedstat` (nanoseconds; `NaN` where it cannot be read): wall time
//! minus that wait is what the call itself took.

use super::default_model::model_path;
use specdraft::backend::quant::BlockFormat;
use specdraft::backend::{ArgmaxArgs, CpuBackend, DevicePtr, GpuBackend, GpuBackendExt};
use specdraft::model::{ForwardContext, LoadOptions, LogitRows, ModelLevers, TargetModel};
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization, ProposerState};
use std::sync::Arc;
use std::time::Instant;

/// The shipped head trained for the default model.
const HEAD_DIR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/python/specdraft/heads/smollm2-mtp"
);
/// A draft step may cost at most this fraction of a one-row target step.
const GOAL: f64 = 0.15;

/// `(median, minimum)` of the times: on a shared machine the minimum is the run least
/// disturbed by other processes, the median the typical one.
pub fn stats(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0])
}

/// The calling thread's seconds waiting on a run queue so far, or `None` where Linux's
/// `/proc/thread-self/schedstat` cannot be read. (Its on-CPU figure is not used: the kernel
/// pool's workers share the work, and other threads' counters lag by up to a tick.)
fn runqueue_seconds() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    text.split_whitespace()
        .nth(1)?
        .parse::<f64>()
        .ok()
        .map(|ns| ns * 1e-9)
}

/// One timed call: wall-clock seconds, and the calling thread's seconds on the run queue
/// during it (`NaN` without schedstats).
#[derive(Clone, Copy)]
pub struct Sample {
    pub wall: f64,
    waiting: f64,
}

pub fn timed(f: impl FnOnce()) -> Sample {
    let before = runqueue_seconds();
    let t = Instant::now();
    f();
    let wall = t.elapsed().as_secs_f64();
    let waiting = match (before, runqueue_seconds()) {
        (Some(w0), Some(w1)) => w1 - w0,
        _ => f64::NAN,
    };
    Sample { wall, waiting }
}

/// `(median, minimum)` of wall time, and the median run-queue wait.
struct Summary {
    wall: (f64, f64),
    waiting: f64,
}

fn summarize(samples: &[Sample]) -> Summary {
    let pick = |f: fn(&Sample) -> f64| samples.iter().map(f).collect::<Vec<f64>>();
    Summary {
        wall: stats(&mut pick(|s| s.wall)),
        waiting: stats(&mut pick(|s| s.waiting)).0,
    }
}

/// Greedy argmax of logits row `row`.
fn pick(gpu: &dyn GpuBackend, logits: DevicePtr, row: usize, vocab: usize, out: DevicePtr) -> u32 {
    gpu.argmax(ArgmaxArgs {
        out,
        logits: logits.offset(row * vocab * 4),
        bitmask: None,
        rows: 1,
        vocab,
        stream: 0,
    })
    .expect("argmax");
    gpu.download::<u32>(out, 1).expect("download")[0]
}

/// Runs the comparison and prints one JSON line per projection storage.
pub fn run(quick: bool) {
    let path = model_path();
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let opts = LoadOptions {
        max_rows: 64,
        max_seq_len: Some(512),
        kv_blocks: Some(64),
    };
    let model = Arc::new(TargetModel::load(&path, gpu.clone(), opts).expect("model loads"));
    let (vocab, h) = (model.config().vocab_size, model.config().hidden_size);
    let pick_buf = gpu.alloc(4, "bench argmax").expect("alloc");
    // A realistic context: a prompt and 32 greedy tokens after it.
    let mut tokens: Vec<u32> = vec![
        504, 3575, 282, 4649, 314, 7042, 28, 284, 260, 3575, 282, 7158, 314,
    ];
    let mut seq = model.new_sequence();
    let out = model
        .forward_with(&mut [&mut seq], &[&tokens], LogitRows::LastPerSequence)
        .expect("prefill");
    let mut next = pick(gpu.as_ref(), out.logits, 0, vocab, pick_buf);
    for _ in 0..32 {
        tokens.push(next);
        let out = model.forward(&mut [&mut seq], &[&[next]]).expect("decode");
        next = pick(gpu.as_ref(), out.logits, 0, vocab, pick_buf);
    }
    // The target hidden of every context position, kept apart from the model's scratch.
    model.trim(&mut seq, 0).expect("trim");
    let out = model
        .forward_with(&mut [&mut seq], &[&tokens], LogitRows::LastPerSequence)
        .expect("context forward");
    let row_bytes = h * 2;
    let hiddens = gpu
        .alloc(tokens.len() * row_bytes, "bench hiddens")
        .expect("alloc");
    gpu.copy_dtod(hiddens, out.hiddens, tokens.len() * row_bytes, 0)
        .expect("copy");
    let base_len = seq.len();
    let position = tokens.len();
    let last_hidden = hiddens.offset((position - 1) * row_bytes);
    let levers = ModelLevers::default();
    let ctx = ForwardContext::new(
        gpu.clone(),
        model.buffers().clone(),
        model.config().clone(),
        levers,
    );
    let storages = [
        MtpQuantization::Bf16,
        MtpQuantization::Block(BlockFormat::Q8_0),
        MtpQuantization::Fp8,
        MtpQuantization::Nvfp4,
    ];
    let rounds = if quick { 5 } else { 21 };
    for quant in storages {
        let head = MtpHead::from_checkpoint_for_target(
            HEAD_DIR,
            model.clone(),
            quant,
            0,
            512,
            64,
            &levers,
        )
        .expect("head loads");
        let mut st = head.alloc_state_for(gpu.as_ref(), 512).expect("state");
        head.prefill_drafter(&tokens, hiddens, &mut *st, &ctx, 0)
            .expect("drafter prefill");
        let mut propose = |n: usize| {
            // Proposing again from the same position rolls the unverified rows back first.
            head.propose(
                next,
                last_hidden,
                position,
                n,
                &mut *st,
                &ctx,
                0,
                None,
                None,
                None,
            )
            .expect("propose")
        };
        let drafts = propose(3);
        let (mut target, mut one, mut three) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            target.push(timed(|| {
                model.forward(&mut [&mut seq], &[&[next]]).expect("step");
            }));
            model.trim(&mut seq, base_len).expect("trim");
            one.push(timed(|| {
                propose(1);
            }));
            three.push(timed(|| {
                propose(3);
            }));
        }
        let (target_t, one_t, three_t) = (summarize(&target), summarize(&one), summarize(&three));
        let (target, one, three) = (target_t.wall, one_t.wall, three_t.wall);
        println!(
            "{}",
            serde_json::json!({
                "bench": "mtp_step_cost", "backend": gpu.name(),
                "model": path.display().to_string(), "head": "smollm2-mtp",
                "projections": quant.name(), "lm_head": head.lm_head_format(),
                "draft_vocab": head.draft_vocab_size(), "context_tokens": position,
                "rounds": rounds,
                "target_step_ms": target.0 * 1e3, "draft_step_ms": one.0 * 1e3,
                "propose3_ms": three.0 * 1e3,
                "draft_step_vs_target": one.0 / target.0, "propose3_vs_target": three.0 / target.0,
                "min_target_step_ms": target.1 * 1e3, "min_draft_step_ms": one.1 * 1e3,
                "min_propose3_ms": three.1 * 1e3,
                "min_draft_step_vs_target": one.1 / target.1,
                "min_propose3_vs_target": three.1 / target.1,
                "propose3_vs_draft_step": three.0 / one.0,
                "target_step_runqueue_ms": target_t.waiting * 1e3,
                "draft_step_runqueue_ms": one_t.waiting * 1e3,
                "propose3_runqueue_ms": three_t.waiting * 1e3,
                "goal_draft_step_vs_target": GOAL, "meets_goal": one.0 / target.0 <= GOAL,
                "weight_bytes_per_draft": head.bytes_per_draft(),
                "target_weight_bytes_per_token": model.weight_bytes_per_token(),
                "drafts": drafts,
            })
        );
        head.free_state(gpu.as_ref(), &mut *st).expect("free state");
        let cycle = Cycle {
            tokens: &tokens,
            hiddens,
            ctx: &ctx,
        };
        if quant == MtpQuantization::Bf16 {
            declined_steps(&head, &cycle, target.0, rounds);
        }
        if quant == MtpQuantization::Block(BlockFormat::Q8_0) {
            // The storage the shipped head takes on the CPU.
            super::tree_batch::run(&head, &cycle, target.0, rounds);
        }
    }
    model.free_sequence(&mut seq).expect("free sequence");
    gpu.free(hiddens).expect("free");
    gpu.free(pick_buf).expect("free");
}

/// The context a declined-steps cycle replays.
pub struct Cycle<'a> {
    pub tokens: &'a [u32],
    pub hiddens: DevicePtr,
    pub ctx: &'a ForwardContext<'a>,
}

/// Sequences proposed together, and declined steps before each drafting one.
const BATCH: usize = 4;
const DECLINED: usize = 8;

/// The head's cost while the draft policy declines: a cycle of `DECLINED` steps of no drafts
/// then one 3-draft step, for `BATCH` sequences proposed together, with the rows of declined
/// steps written at once or deferred to the drafting step, timed in alternation (medians and
/// minimums, and each against a one-row target step).
fn declined_steps(head: &MtpHead, c: &Cycle<'_>, target_step: f64, rounds: usize) {
    let gpu = c.ctx.gpu.as_ref();
    let row_bytes = c.ctx.config.hidden_size * 2;
    let end = c.tokens.len();
    let start = end - DECLINED;
    let mut states: Vec<_> = (0..BATCH)
        .map(|_| head.alloc_state_for(gpu, 512).expect("state"))
        .collect();
    let mut cycle = |defer: bool| {
        head.set_defer_zero_draft_rows(defer);
        for st in states.iter_mut() {
            head.prefill_drafter(&c.tokens[..start], c.hiddens, &mut **st, c.ctx, 0)
                .expect("drafter prefill");
        }
        let (mut declined, mut drafting) = (0.0, 0.0);
        for pos in start..=end {
            let n = if pos == end { 3 } else { 0 };
            let token = c.tokens.get(pos).copied().unwrap_or(c.tokens[end - 1]);
            let hidden = c.hiddens.offset((pos - 1) * row_bytes);
            let mut refs: Vec<&mut dyn ProposerState> = states
                .iter_mut()
                .map(|s| s.as_mut() as &mut dyn ProposerState)
                .collect();
            let t = timed(|| {
                head.propose_batch(
                    &[token; BATCH],
                    &[hidden; BATCH],
                    &[pos; BATCH],
                    n,
                    &mut refs,
                    c.ctx,
                    0,
                    None,
                )
                .expect("propose_batch");
                for st in refs.iter_mut() {
                    head.after_verify(0, &mut **st, 0).expect("after_verify");
                }
            });
            if n == 0 {
                declined += t.wall;
            } else {
                drafting += t.wall;
            }
        }
        (declined / DECLINED as f64, drafting, declined + drafting)
    };
    let (mut eager, mut lazy) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        eager.push(cycle(false));
        lazy.push(cycle(true));
    }
    head.set_defer_zero_draft_rows(true);
    let pick = |v: &[(f64, f64, f64)], f: fn(&(f64, f64, f64)) -> f64| {
        stats(&mut v.iter().map(f).collect::<Vec<_>>())
    };
    let field = |v: &[(f64, f64, f64)]| [pick(v, |x| x.0), pick(v, |x| x.1), pick(v, |x| x.2)];
    let (e, l) = (field(&eager), field(&lazy));
    println!(
        "{}",
        serde_json::json!({
            "bench": "mtp_declined_steps", "backend": gpu.name(), "batch": BATCH,
            "declined_steps_per_cycle": DECLINED, "rounds": rounds,
            "target_step_ms": target_step * 1e3,
            "eager_declined_step_ms": e[0].0 * 1e3, "deferred_declined_step_ms": l[0].0 * 1e3,
            "eager_drafting_step_ms": e[1].0 * 1e3, "deferred_drafting_step_ms": l[1].0 * 1e3,
            "eager_cycle_ms": e[2].0 * 1e3, "deferred_cycle_ms": l[2].0 * 1e3,
            "deferred_vs_eager_cycle": l[2].0 / e[2].0,
            "min_deferred_vs_eager_cycle": l[2].1 / e[2].1,
            "eager_declined_step_vs_target": e[0].0 / target_step,
            "deferred_declined_step_vs_target": l[0].0 / target_step,
        })
    );
    for mut st in states {
        head.free_state(gpu, &mut *st).expect("free state");
    }
}
