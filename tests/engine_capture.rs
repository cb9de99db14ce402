//! Target layer capture through the engine, on the real target model (a tiny seeded Llama of
//! three layers, CPU backend): a proposer that names `target_layer_ids` is given, at every
//! `prefill_drafter` and `propose` (and in each entry of a `propose_batch`'s
//! `ctx.target_hidden_stacks`), exactly the rows a teacher-forced forward of the same tokens
//! captures (bit for bit: the CPU kernels give each row the same bits whatever else
//! is in the batch), across prefill chunks, verify rows and preemption recompute; `k = 1 +
//! num_accepted` rows at each propose; greedy output is unchanged; a proposer that names no
//! layer makes the engine capture, allocate and copy nothing for it; and `block_gamma` sets
//! the draft count.

mod capture_spy;
mod engine_common;
#[allow(unused_imports)] // the helpers re-export a GGUF writer this test does not use
mod model_util;

use capture_spy::{check_rows, StackSpy};
use engine_common::counting::counting;
use model_util::*;
use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{
    DraftPolicyKind, GenerateRequest, Generation, KvPoolStatus, SpecEngine, Target, TargetOutput,
};
use specdraft::memory::BufferArena;
use specdraft::model::{KvSequence, LoadOptions, ModelConfig, TargetModel};
use specdraft::speculative::DraftProposer;
use specdraft::Result;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The layers every capturing proposer here names: the last (whose output is the final
/// hidden, so its column must equal `target_hidden`) and the first, in that order.
const LAYERS: [usize; 2] = [2, 0];
const MAX_TOKENS: usize = 24;

fn tiny() -> Tiny {
    Tiny {
        layers: 3,
        ..Tiny::default()
    }
}

fn load(
    gpu: &Arc<dyn GpuBackend>,
    tag: &str,
    max_rows: usize,
    kv_blocks: usize,
) -> Arc<TargetModel> {
    let t = tiny();
    let dir = temp_dir(&format!("engine_capture_{tag}"));
    write_hf(&dir, &t, &t.tensors(9));
    let opts = LoadOptions {
        max_rows,
        max_seq_len: Some(128),
        kv_blocks: Some(kv_blocks),
    };
    Arc::new(TargetModel::load(&dir, gpu.clone(), opts).unwrap())
}

/// Prompts of 5 to 38 tokens: most longer than the 8-row chunks of the engines below.
fn prompts() -> Vec<Vec<u32>> {
    [21usize, 38, 5, 30, 17]
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            (0..len)
                .map(|k| ((i * 13 + k * 7 + k * k) % 90 + 3) as u32)
                .collect()
        })
        .collect()
}

fn requests(prompts: &[Vec<u32>]) -> Vec<GenerateRequest> {
    prompts
        .iter()
        .map(|p| GenerateRequest::new(p.clone(), MAX_TOKENS).ignore_eos())
        .collect()
}

fn outputs(g: &Generation) -> Vec<Vec<u32>> {
    g.results
        .iter()
        .enumerate()
        .map(|(i, r)| {
            assert!(r.error.is_none(), "request {i}: {:?}", r.error);
            r.tokens.clone()
        })
        .collect()
}

/// Each prompt followed by its plain greedy output.
fn greedy_fulls(model: &Arc<TargetModel>, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let engine = SpecEngine::new(model.clone(), None, 0).unwrap();
    let out = outputs(&engine.generate(requests(prompts)));
    prompts
        .iter()
        .zip(out)
        .map(|(p, o)| p.iter().chain(&o).copied().collect())
        .collect()
}

#[test]
fn stack_rows_are_the_teacher_forced_capture_with_k_equal_one_plus_accepted_batched_or_not() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = load(&gpu, "rows", 64, 64);
    let prompts = prompts();
    let fulls = greedy_fulls(&model, &prompts);
    for (right, batch) in [(true, false), (false, false), (true, true), (false, true)] {
        let spy = Arc::new(StackSpy {
            batch,
            ..StackSpy::new(&LAYERS, fulls.clone(), right)
        });
        let engine = SpecEngine::new(
            model.clone(),
            Some(spy.clone() as Arc<dyn DraftProposer>),
            3,
        )
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed)
        .with_max_batch_tokens(8);
        let g = engine.generate(requests(&prompts));
        let out = outputs(&g);
        for (i, o) in out.iter().enumerate() {
            assert_eq!(
                o[..],
                fulls[i][prompts[i].len()..],
                "right={right}: request {i}"
            );
        }
        let checked = check_rows(&model, &spy, &fulls, &prompts);
        let (ks, owed, batches) = {
            let log = spy.log.lock().unwrap();
            (log.ks.clone(), log.owed.clone(), log.batches.clone())
        };
        // Batched, the sequences propose together (the engine asks one group a step).
        assert_eq!(
            batches.iter().any(|&b| b > 1),
            batch,
            "right={right}, batch={batch}: {batches:?}"
        );
        // Every step proposed: each propose gets exactly 1 + the accepted count.
        assert!(owed.iter().all(|&(k, o)| k == o), "{owed:?}");
        if right {
            // Every draft accepted: 4 rows a propose, but the first after each prefill.
            assert_eq!(
                ks.iter().filter(|&&k| k == 4).count(),
                ks.len() - prompts.len(),
                "{ks:?}"
            );
            assert!(g.metrics.accepted > 0);
        } else {
            assert!(ks.iter().all(|&k| k == 1), "{ks:?}");
            assert_eq!(g.metrics.accepted, 0);
        }
        assert!(checked > 100, "only {checked} rows checked");
    }
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn preemption_recompute_gives_the_same_rows_again() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let plain = load(&gpu, "preempt_plain", 64, 64);
    let prompts = prompts();
    let fulls = greedy_fulls(&plain, &prompts);
    // 8 blocks of 16 rows: a request needs up to 61 rows, so the five outgrow the pool.
    let model = load(&gpu, "preempt", 64, 8);
    let spy = Arc::new(StackSpy::new(&LAYERS, fulls.clone(), true));
    let engine = SpecEngine::new(
        model.clone(),
        Some(spy.clone() as Arc<dyn DraftProposer>),
        3,
    )
    .unwrap()
    .with_draft_policy(DraftPolicyKind::Fixed)
    .with_max_batch_tokens(8);
    let g = engine.generate(requests(&prompts));
    let out = outputs(&g);
    for (i, o) in out.iter().enumerate() {
        assert_eq!(o[..], fulls[i][prompts[i].len()..], "request {i}");
    }
    assert!(g.metrics.preemptions > 0, "nothing was preempted");
    let prefills = spy
        .log
        .lock()
        .unwrap()
        .seen
        .iter()
        .filter(|s| s.what == "prefill_drafter")
        .count();
    assert!(
        prefills > prompts.len(),
        "no recompute prefilled the drafter again"
    );
    check_rows(&model, &spy, &fulls, &prompts);
    let owed = spy.log.lock().unwrap().owed.clone();
    assert!(owed.iter().all(|&(k, o)| k >= o), "{owed:?}");
    drop((engine, model, plain));
    assert_eq!(gpu.ledger().live_count(), 0);
}

/// The real model behind a KV pool report of one-row blocks that, before every third
/// forward, has exactly one block free: the step planned then has room for the decode row
/// of its one sequence and no draft, so the engine does not propose in it.
struct Tight {
    model: Arc<TargetModel>,
    forwards: AtomicUsize,
}

impl Target for Tight {
    type KvSequence = KvSequence;
    fn config(&self) -> &Arc<ModelConfig> {
        Target::config(&*self.model)
    }
    fn gpu(&self) -> &Arc<dyn GpuBackend> {
        Target::gpu(&*self.model)
    }
    fn max_seq_len(&self) -> usize {
        Target::max_seq_len(&*self.model)
    }
    fn new_sequence(&self) -> KvSequence {
        Target::new_sequence(&*self.model)
    }
    fn seq_len(&self, seq: &KvSequence) -> usize {
        seq.len()
    }
    fn forward(&self, seqs: &mut [&mut KvSequence], tokens: &[&[u32]]) -> Result<TargetOutput> {
        self.forward_capturing(seqs, tokens, false, &[])
    }
    fn check_capture(&self, layers: &[usize]) -> std::result::Result<(), String> {
        self.model.check_capture(layers)
    }
    fn forward_capturing(
        &self,
        seqs: &mut [&mut KvSequence],
        tokens: &[&[u32]],
        last_logits_only: bool,
        layers: &[usize],
    ) -> Result<TargetOutput> {
        self.forwards.fetch_add(1, Ordering::Relaxed);
        Target::forward_capturing(&*self.model, seqs, tokens, last_logits_only, layers)
    }
    fn trim(&self, seq: &mut KvSequence, new_len: usize) -> Result<()> {
        Target::trim(&*self.model, seq, new_len)
    }
    fn free_sequence(&self, seq: &mut KvSequence) -> Result<()> {
        Target::free_sequence(&*self.model, seq)
    }
    fn buffers(&self) -> &Arc<BufferArena> {
        Target::buffers(&*self.model)
    }
    fn kv_pool(&self) -> Option<KvPoolStatus> {
        let tight = self.forwards.load(Ordering::Relaxed) % 3 == 2;
        Some(KvPoolStatus {
            block_size: 1,
            num_blocks: 1 << 20,
            num_free: if tight { 1 } else { 1 << 16 },
        })
    }
}

#[test]
fn a_step_without_a_propose_adds_its_row_to_the_next_propose() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = load(&gpu, "tight", 64, 64);
    let prompts = vec![prompts()[0].clone()];
    let fulls = greedy_fulls(&model, &prompts);
    let target = Arc::new(Tight {
        model: model.clone(),
        forwards: AtomicUsize::new(0),
    });
    let spy = Arc::new(StackSpy::new(&LAYERS, fulls.clone(), true));
    let engine = SpecEngine::new(target, Some(spy.clone() as Arc<dyn DraftProposer>), 3)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed);
    let out = outputs(&engine.generate(requests(&prompts)));
    assert_eq!(out[0][..], fulls[0][prompts[0].len()..]);
    check_rows(&model, &spy, &fulls, &prompts);
    // After a step without a propose, the next one gets that step's row as well.
    let owed = spy.log.lock().unwrap().owed.clone();
    assert!(owed.iter().all(|&(k, o)| k == o || k == o + 1), "{owed:?}");
    assert!(
        owed.iter().any(|&(k, o)| k == o + 1),
        "no step went without a propose: {owed:?}"
    );
    drop(engine);
    drop(model);
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn a_proposer_that_names_no_layer_makes_the_engine_capture_nothing() {
    let counting = Arc::new(counting());
    let gpu: Arc<dyn GpuBackend> = counting.clone();
    let model = load(&gpu, "nothing", 64, 64);
    let prompts = prompts();
    let fulls = greedy_fulls(&model, &prompts);
    let before = gpu.ledger().live_count();
    // The spy checks, at every propose, that it gets no stack and that no capture buffer
    // is live; the counter, that the capture kernel never runs.
    let spy = Arc::new(StackSpy::new(&[], fulls.clone(), true));
    let engine = SpecEngine::new(
        model.clone(),
        Some(spy.clone() as Arc<dyn DraftProposer>),
        3,
    )
    .unwrap()
    .with_max_batch_tokens(8);
    assert_eq!(engine.capture_layers(), &[] as &[usize]);
    outputs(&engine.generate(requests(&prompts)));
    let log = spy.log.lock().unwrap();
    assert!(log.broken.is_empty(), "{:#?}", log.broken);
    assert!(!log.ks.is_empty());
    drop(log);
    assert_eq!(counting.observer.copy_rows.load(Ordering::Relaxed), 0);
    assert_eq!(gpu.ledger().live_count(), before);
    drop(engine);
    // The same engine with a proposer that names two layers runs the kernel twice a forward.
    let spy = Arc::new(StackSpy::new(&LAYERS, fulls, true));
    let engine = SpecEngine::new(model.clone(), Some(spy as Arc<dyn DraftProposer>), 3)
        .unwrap()
        .with_max_batch_tokens(8);
    outputs(&engine.generate(requests(&prompts)));
    let calls = counting.observer.copy_rows.load(Ordering::Relaxed);
    assert!(
        calls > 0 && calls.is_multiple_of(2),
        "{calls} capture copies"
    );
    drop((engine, model));
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn layer_ids_are_checked_when_the_engine_is_built() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let model = load(&gpu, "ids", 64, 16);
    for (layers, says) in [
        (
            vec![0, 3],
            "layer id 3 is out of range: the model has 3 decoder layers",
        ),
        (
            vec![1, 1],
            "layer id 1 is named twice (the model has 3 decoder layers)",
        ),
    ] {
        let spy = Arc::new(StackSpy::new(&layers, Vec::new(), true));
        let err = SpecEngine::new(model.clone(), Some(spy as Arc<dyn DraftProposer>), 3)
            .err()
            .expect("refused");
        let msg = err.to_string();
        assert!(
            msg.contains("target_layer_ids") && msg.contains(says),
            "{msg}"
        );
    }
    // A target that cannot capture refuses any layer, when the engine is built.
    let table = Arc::new(TableTarget::new(gpu.clone(), 48, 64, 16, 1, 0.2).unwrap());
    let spy = Arc::new(StackSpy::new(&[0], Vec::new(), true));
    let err = SpecEngine::new(table, Some(spy as Arc<dyn DraftProposer>), 3)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("cannot capture"), "{err}");
}

#[test]
fn block_gamma_sets_the_draft_count_whatever_num_drafts_says() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let table = Arc::new(TableTarget::new(gpu.clone(), 48, 256, 64, 11, 0.2).unwrap());
    let prompts = [vec![1u32, 2, 3, 4, 5, 6, 7, 1, 2, 3]];
    let plain = SpecEngine::new(table.clone(), None, 0).unwrap();
    let out = plain.generate(vec![
        GenerateRequest::new(prompts[0].clone(), 40).ignore_eos()
    ]);
    let full: Vec<u32> = prompts[0]
        .iter()
        .chain(&out.results[0].tokens)
        .copied()
        .collect();
    for (gamma, num_drafts, want) in [(Some(5), 2, 4), (Some(1), 6, 1), (None, 2, 2)] {
        let mut spy = StackSpy::new(&[], vec![full.clone()], true);
        spy.gamma = gamma;
        let spy = Arc::new(spy);
        let engine = SpecEngine::new(
            table.clone(),
            Some(spy.clone() as Arc<dyn DraftProposer>),
            num_drafts,
        )
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed);
        assert_eq!(engine.num_drafts(), want, "gamma {gamma:?}");
        let g = engine.generate(vec![
            GenerateRequest::new(prompts[0].clone(), 40).ignore_eos()
        ]);
        assert_eq!(outputs(&g)[0], out.results[0].tokens);
        let asked = spy.log.lock().unwrap().asked.clone();
        // Every propose but those near the end (where max_tokens leaves less room) asks `want`.
        assert!(asked.len() > 3, "{asked:?}");
        assert!(
            asked[..asked.len() - 2].iter().all(|&n| n == want),
            "gamma {gamma:?}: {asked:?}"
        );
    }
    // γ wins over a num_drafts of 0, which is otherwise refused with a proposer.
    let mut spy = StackSpy::new(&[], vec![full], true);
    spy.gamma = Some(3);
    let engine = SpecEngine::new(
        table.clone(),
        Some(Arc::new(spy) as Arc<dyn DraftProposer>),
        0,
    )
    .unwrap();
    assert_eq!(engine.num_drafts(), 2);
}
