//! Target layer capture through the engine, on the real target model (a tiny seeded Llama of
//! three layers, CPU backend): a proposer that names `target_layer_ids` is given, at every
//! `prefill_drafter` and `propose` (and in each entry of a `propose_batch`'s
//! `ctx.target_hidden_stacks`), exactly the rows a teacher-forced forward of the same tokens
//! captures (bit for bit: the CPU kernels give each row the same bits whatever else
//! is in the batch), across prefill chunks, verify rows and preemption recompute; `k = 1 +
//! num_accepted` rows at each propose; greedy output is unchanged; a proposer that names no
//! layer makes the engine capture, allocate and copy nothing for it; and `block_gamma` sets
//! the draft count.

mod engine_common;
#[allow(unused_imports)] // the helpers re-export a GGUF writer this test does not use
mod model_util;

use engine_common::counting::counting;
use half::bf16;
use model_util::*;
use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend, GpuBackendExt};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{
    DraftPolicyKind, GenerateRequest, Generation, KvPoolStatus, SpecEngine, Target, TargetOutput,
};
use specdraft::memory::BufferArena;
use specdraft::model::{
    ForwardContext, KvSequence, LoadOptions, LogitRows, ModelConfig, TargetModel,
};
use specdraft::speculative::{DraftProposer, ProposerError, ProposerState};
use specdraft::Result;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

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

/// The capture of `layers` over `tokens` by a teacher-forced forward on a fresh sequence,
/// one row of bits per position.
fn teacher_forced(model: &TargetModel, tokens: &[u32], layers: &[usize]) -> Vec<Vec<u16>> {
    let width = layers.len() * model.config().hidden_size;
    let mut seq = model.new_sequence();
    let mut rows = Vec::new();
    for c in tokens.chunks(model.max_rows()) {
        let out = model
            .forward_capturing(&mut [&mut seq], &[c], LogitRows::LastPerSequence, layers)
            .unwrap();
        let v: Vec<bf16> = model
            .gpu()
            .download(out.hidden_stack.unwrap(), out.rows * width)
            .unwrap();
        rows.extend(
            v.chunks(width)
                .map(|r| r.iter().map(|x| x.to_bits()).collect()),
        );
    }
    model.free_sequence(&mut seq).unwrap();
    rows
}

/// What a capturing proposer was given: for request `full`, the rows it received, each with
/// the position it was computed at.
#[derive(Debug)]
struct Seen {
    full: usize,
    what: &'static str,
    rows: Vec<(usize, Vec<u16>)>,
}

#[derive(Default)]
struct Log {
    seen: Vec<Seen>,
    /// Rows counts `k` given to `propose`, in order.
    ks: Vec<usize>,
    /// What the proposer's own calls owed each propose: `1 + num_accepted` of the
    /// `after_verify` before it (1 after a prefill), beside its `k`.
    owed: Vec<(usize, usize)>,
    /// `num_drafts` of every `propose`.
    asked: Vec<usize>,
    /// Contract breaks seen from inside the proposer.
    broken: Vec<String>,
    /// The size of every `propose_batch` group.
    batches: Vec<usize>,
}

/// Drafts from a known continuation (`right`: the target's own greedy continuation, so
/// every draft is accepted; otherwise always one token off, so none is), and records the
/// stack rows it is given; with `batch`, also through `propose_batch` (groups of up to 4),
/// each sequence from its entry of `ctx.target_hidden_stacks`.
struct StackSpy {
    layers: Vec<usize>,
    fulls: Vec<Vec<u32>>,
    right: bool,
    batch: bool,
    gamma: Option<usize>,
    hidden: usize,
    vocab: u32,
    log: Mutex<Log>,
}

impl StackSpy {
    fn new(layers: &[usize], fulls: Vec<Vec<u32>>, right: bool) -> Self {
        let t = tiny();
        StackSpy {
            layers: layers.to_vec(),
            fulls,
            right,
            batch: false,
            gamma: None,
            hidden: t.hidden,
            vocab: t.vocab as u32,
            log: Mutex::new(Log::default()),
        }
    }

    fn width(&self) -> usize {
        self.layers.len() * self.hidden
    }

    fn rows(&self, ctx: &ForwardContext<'_>, p: DevicePtr, n: usize) -> Result<Vec<Vec<u16>>> {
        let v: Vec<bf16> = ctx.gpu.download(p, n * self.width())?;
        Ok(v.chunks(self.width())
            .map(|r| r.iter().map(|x| x.to_bits()).collect())
            .collect())
    }

    fn broke(&self, what: String) {
        self.log.lock().unwrap().broken.push(what);
    }
}

struct SpyState {
    full: usize,
    /// Position of the last token the proposer has seen a row for.
    seen_pos: usize,
    /// `1 + num_accepted` of the last `after_verify`, owed by the next propose.
    owed: Option<usize>,
}
specdraft::impl_proposer_state!(SpyState);

fn spy(s: &mut dyn ProposerState) -> Result<&mut SpyState> {
    s.as_any_mut().downcast_mut::<SpyState>().ok_or_else(|| {
        ProposerError::WrongState {
            method: "spy",
            expected: "SpyState",
        }
        .into()
    })
}

impl DraftProposer for StackSpy {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(SpyState {
            full: usize::MAX,
            seen_pos: 0,
            owed: None,
        }))
    }

    fn target_layer_ids(&self) -> Vec<usize> {
        self.layers.clone()
    }

    fn block_gamma(&self) -> Option<usize> {
        self.gamma
    }

    fn prefill_drafter(
        &self,
        prompt: &[u32],
        hiddens: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        _stream: u64,
    ) -> Result<usize> {
        let st = spy(state)?;
        // A recompute after preemption prefills every token but the last: still a prefix.
        st.full = self
            .fulls
            .iter()
            .position(|f| f.starts_with(prompt))
            .expect("a known prompt");
        st.seen_pos = prompt.len() - 1;
        st.owed = Some(1);
        let Some(stack) = ctx.target_hidden_stack else {
            if !self.layers.is_empty() {
                self.broke("prefill_drafter without a stack".into());
            }
            return Ok(0);
        };
        let rows = self.rows(ctx, stack, prompt.len())?;
        // The last layer's column is the final hidden the `hiddens` rows hold.
        let h: Vec<bf16> = ctx.gpu.download(hiddens, prompt.len() * self.hidden)?;
        for (i, r) in rows.iter().enumerate() {
            let want: Vec<u16> = h[i * self.hidden..(i + 1) * self.hidden]
                .iter()
                .map(|x| x.to_bits())
                .collect();
            if r[..self.hidden] != want[..] {
                self.broke(format!(
                    "prefill row {i}: last layer's column is not its hidden"
                ));
            }
        }
        self.log.lock().unwrap().seen.push(Seen {
            full: st.full,
            what: "prefill_drafter",
            // Row i is the hidden computed at prompt position i.
            rows: rows.into_iter().enumerate().collect(),
        });
        Ok(0)
    }

    fn propose(
        &self,
        last: u32,
        target_hidden: DevicePtr,
        position: usize,
        n: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        _stream: u64,
        _d: Option<DevicePtr>,
        _mask: Option<&[i32]>,
        stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        let st = spy(state)?;
        let full = &self.fulls[st.full];
        if full[position] != last {
            self.broke(format!(
                "propose: token {last} at {position}, not {}",
                full[position]
            ));
        }
        // The rows of every token since the last one seen, each computed one position before.
        let k = position - st.seen_pos;
        let Some(owed) = st.owed.take() else {
            self.broke(format!(
                "propose at {position} without a prefill or after_verify"
            ));
            return Ok(Vec::new());
        };
        st.seen_pos = position;
        {
            let mut log = self.log.lock().unwrap();
            log.ks.push(k);
            log.owed.push((k, owed));
            log.asked.push(n);
        }
        match stack {
            None if !self.layers.is_empty() => self.broke("propose without a stack".into()),
            Some(_) if self.layers.is_empty() => self.broke("a stack for no layers".into()),
            None => {}
            Some(p) => {
                let rows = self.rows(ctx, p, k)?;
                let h: Vec<bf16> = ctx.gpu.download(target_hidden, self.hidden)?;
                let last_row: Vec<u16> = h.iter().map(|x| x.to_bits()).collect();
                if rows[k - 1][..self.hidden] != last_row[..] {
                    self.broke(format!(
                        "propose at {position}: last row is not target_hidden"
                    ));
                }
                let first = position + 1 - k;
                self.log.lock().unwrap().seen.push(Seen {
                    full: st.full,
                    what: "propose",
                    rows: rows
                        .into_iter()
                        .enumerate()
                        .map(|(i, r)| (first + i - 1, r))
                        .collect(),
                });
            }
        }
        if ctx.target_hidden_stack.is_some() {
            self.broke("propose's context carries a stack".into());
        }
        if self.layers.is_empty() {
            let tags: Vec<String> = ctx
                .gpu
                .ledger()
                .live_report()
                .into_iter()
                .map(|a| a.tag)
                .filter(|t| t.contains("stack"))
                .collect();
            if !tags.is_empty() {
                self.broke(format!("capture buffers live without capture: {tags:?}"));
            }
        }
        let next = &full[(position + 1).min(full.len())..];
        Ok(next
            .iter()
            .take(n)
            .map(|&t| if self.right { t } else { (t + 1) % self.vocab })
            .collect())
    }

    fn after_verify(&self, a: usize, state: &mut dyn ProposerState, _stream: u64) -> Result<()> {
        spy(state)?.owed = Some(1 + a);
        Ok(())
    }

    fn propose_batch_max(&self, _buffers: &BufferArena, _config: &ModelConfig) -> usize {
        if self.batch {
            4
        } else {
            1
        }
    }

    fn propose_batch(
        &self,
        last: &[u32],
        hiddens: &[DevicePtr],
        positions: &[usize],
        n: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
        _conf: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        if !self.batch {
            return Ok(None);
        }
        self.log.lock().unwrap().batches.push(last.len());
        match ctx.target_hidden_stacks {
            Some(s) if s.len() != last.len() => {
                self.broke(format!("{} stacks for {} sequences", s.len(), last.len()));
                return Ok(None);
            }
            None if !self.layers.is_empty() => {
                self.broke("propose_batch without stacks".into());
                return Ok(None);
            }
            _ => {}
        }
        let stacks = ctx.target_hidden_stacks;
        let drafts = propose_each(
            self, last, hiddens, positions, n, states, ctx, stream, stacks,
        )?;
        Ok(Some(drafts))
    }
}

/// Checks every row a spy was given against the teacher-forced capture of its request's
/// whole sequence, and that its rows (prefill and propose together) cover every position
/// from the first on without a gap. Returns how many rows were checked.
fn check_rows(
    model: &TargetModel,
    spy: &StackSpy,
    fulls: &[Vec<u32>],
    prompts: &[Vec<u32>],
) -> usize {
    let log = spy.log.lock().unwrap();
    assert!(log.broken.is_empty(), "{:#?}", log.broken);
    let refs: Vec<Vec<Vec<u16>>> = fulls
        .iter()
        .map(|f| teacher_forced(model, &f[..f.len() - 1], &spy.layers))
        .collect();
    let mut checked = 0;
    for s in &log.seen {
        for (pos, row) in &s.rows {
            assert!(
                *row == refs[s.full][*pos],
                "request {} {}: the row computed at {pos} differs from the teacher-forced one",
                s.full,
                s.what
            );
            checked += 1;
        }
    }
    for (i, p) in prompts.iter().enumerate() {
        let mut at: Vec<usize> = log
            .seen
            .iter()
            .filter(|s| s.full == i)
            .flat_map(|s| s.rows.iter().map(|r| r.0))
            .collect();
        at.sort_unstable();
        at.dedup();
        assert!(
            at.len() > p.len(),
            "request {i}: no propose rows past the prompt"
        );
        let want: Vec<usize> = (0..at.len()).collect();
        assert_eq!(at, want, "request {i}: rows with a gap");
    }
    checked
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
