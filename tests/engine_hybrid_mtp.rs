//! `Hybrid` with learned members on the real target model (a tiny seeded Llama of three
//! layers, CPU backend) and a random `MtpHead` beside it: greedy output with
//! `Hybrid([PromptLookup, MtpHead])` is plain greedy output, both members drafting; with the
//! target's layer count the MTP member's catch-up is exact: its drafter KV has a row for every
//! position at every propose, and each of its drafts is what a fresh head prefilled with the
//! teacher-forced hiddens of the same tokens drafts (bit for bit on the CPU); and each member
//! naming target layers is given exactly its own columns of the capture, for the rows since
//! its own previous propose, one sequence at a time or in a member's batch; and the hybrid's
//! batches draft what its sequences draft one by one (the conformance check).

mod hybrid_common;
#[allow(unused_imports)] // the helpers re-export a GGUF writer this test does not use
mod model_util;
mod mtp_common;

use half::bf16;
use hybrid_common::{Ev, Log, Recorder, Scripted};
use model_util::{propose_each, temp_dir, write_hf, Tiny};
use specdraft::backend::{DevicePtr, GpuBackend, GpuBackendExt};
use specdraft::engine::{DraftPolicyKind, GenerateRequest, SpecEngine};
use specdraft::model::{ForwardContext, LoadOptions, LogitRows, ModelLevers, TargetModel};
use specdraft::speculative::conformance::{check_proposer_on, CheckOptions};
use specdraft::speculative::{
    DraftProposer, Hybrid, HybridMember, MtpHead, MtpQuantization, PromptLookup, ProposerState,
};
use specdraft::Result;
use std::sync::{Arc, Mutex};

const LAYERS: usize = 3;
const MAX: usize = 28;

fn tiny() -> Tiny {
    Tiny {
        hidden: mtp_common::HIDDEN,
        vocab: mtp_common::VOCAB,
        layers: LAYERS,
        ..Tiny::default()
    }
}

fn load(gpu: &Arc<dyn GpuBackend>, tag: &str) -> Arc<TargetModel> {
    let t = tiny();
    let dir = temp_dir(&format!("engine_hybrid_{tag}"));
    write_hf(&dir, &t, &t.tensors(9));
    let opts = LoadOptions {
        max_rows: 64,
        max_seq_len: Some(128),
        kv_blocks: Some(64),
    };
    Arc::new(TargetModel::load(&dir, gpu.clone(), opts).unwrap())
}

fn head(target: &Arc<TargetModel>, tag: &str, levers: &ModelLevers) -> Arc<MtpHead> {
    let dir = mtp_common::scratch_dir(&format!("engine_hybrid_head_{tag}"));
    mtp_common::write_checkpoint(&dir, "deepseek_v3", 5);
    Arc::new(
        MtpHead::from_checkpoint_for_target(
            &dir,
            target.clone(),
            MtpQuantization::Bf16,
            0,
            128,
            64,
            levers,
        )
        .unwrap(),
    )
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12],
        vec![30, 7, 31, 7, 32, 7, 30, 7],
        vec![50, 51, 52, 53, 54, 55, 56, 57, 58],
        vec![70, 3],
    ]
}

fn requests() -> Vec<GenerateRequest> {
    prompts()
        .into_iter()
        .map(|p| GenerateRequest::new(p, MAX).ignore_eos())
        .collect()
}

/// Each prompt followed by its plain greedy output.
fn fulls(model: &Arc<TargetModel>) -> Vec<Vec<u32>> {
    let plain = SpecEngine::new(model.clone(), None, 0).unwrap();
    let g = plain.generate(requests());
    prompts()
        .iter()
        .zip(g.results)
        .map(|(p, r)| {
            assert!(r.error.is_none(), "{:?}", r.error);
            p.iter().chain(&r.tokens).copied().collect()
        })
        .collect()
}

/// What a teacher-forced forward of `tokens` on a fresh sequence computes at every position:
/// the capture of `layers` (one row of bits per position), and the final hiddens (BF16 `[len,
/// hidden]`) in a device buffer the caller frees.
fn teacher_forced(
    model: &TargetModel,
    tokens: &[u32],
    layers: &[usize],
) -> (Vec<Vec<u16>>, DevicePtr) {
    let h = model.config().hidden_size;
    let width = layers.len() * h;
    let gpu = model.gpu();
    let mut seq = model.new_sequence();
    let mut rows = Vec::new();
    let hiddens = gpu.alloc(tokens.len() * h * 2, "test:hiddens").unwrap();
    let mut at = 0;
    for c in tokens.chunks(model.max_rows()) {
        let out = model
            .forward_capturing(&mut [&mut seq], &[c], LogitRows::LastPerSequence, layers)
            .unwrap();
        gpu.copy_dtod(hiddens.offset(at * h * 2), out.hiddens, c.len() * h * 2, 0)
            .unwrap();
        at += c.len();
        if let Some(stack) = out.hidden_stack {
            let v: Vec<bf16> = gpu.download(stack, out.rows * width).unwrap();
            rows.extend(
                v.chunks(width)
                    .map(|r| r.iter().map(|x| x.to_bits()).collect()),
            );
        }
    }
    model.free_sequence(&mut seq).unwrap();
    (rows, hiddens)
}

#[test]
fn greedy_output_with_prompt_lookup_and_an_mtp_head_is_plain_output() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(specdraft::backend::CpuBackend::new());
    let model = load(&gpu, "greedy");
    let fulls = fulls(&model);
    let mtp = head(&model, "greedy", &ModelLevers::default());
    for (target_layers, batch) in [(Some(LAYERS), false), (None, false), (Some(LAYERS), true)] {
        let log: Log = Arc::new(Mutex::new(Vec::new()));
        let head_member = match batch {
            true => Recorder::batching_member(1, "MtpHead", mtp.clone(), &log),
            false => Recorder::member(1, "MtpHead", mtp.clone(), &log),
        };
        let members = vec![
            Recorder::member(0, "PromptLookup", Arc::new(PromptLookup::default()), &log),
            head_member,
        ];
        let hybrid = Arc::new(Hybrid::new(members, target_layers).unwrap());
        let engine = SpecEngine::new(model.clone(), Some(hybrid), 4)
            .unwrap()
            .with_draft_policy(DraftPolicyKind::Fixed);
        let want: Vec<usize> = target_layers.map(|n| vec![n - 1]).unwrap_or_default();
        assert_eq!(engine.capture_layers(), want.as_slice());
        // A first run allocates the model's capture buffer, which the model keeps.
        let first = engine.generate(requests());
        let before = gpu.ledger().live_count();
        let g = engine.generate(requests());
        for (r, full) in g
            .results
            .iter()
            .chain(&first.results)
            .zip(fulls.iter().cycle())
        {
            assert!(r.error.is_none(), "{:?}", r.error);
            assert_eq!(
                r.tokens.as_slice(),
                &full[full.len() - MAX..],
                "{target_layers:?}"
            );
        }
        let drafted = |who: usize| {
            log.lock()
                .unwrap()
                .iter()
                .filter(|e| matches!(e, Ev::Propose { who: w, drafts, .. } if *w == who && !drafts.is_empty()))
                .count()
        };
        assert!(
            drafted(0) > 0 && drafted(1) > 0,
            "both members draft ({target_layers:?})"
        );
        // Batching, the head is asked for several sequences in one call.
        let widest = log
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| match e {
                Ev::Batch { who: 1, size, .. } => Some(*size),
                _ => None,
            })
            .max();
        assert_eq!(widest.is_some_and(|w| w > 1), batch, "{widest:?}");
        assert_eq!(
            gpu.ledger().live_count(),
            before,
            "{:?}",
            gpu.ledger().live_report()
        );
    }
}

/// `MtpHead`, logging for every propose its position, the drafts asked and returned, and the
/// drafter rows the state held before it.
struct Logged {
    inner: Arc<MtpHead>,
    log: Mutex<Vec<ProposeCall>>,
}

/// One logged propose: position, token drafted from, drafts asked, drafts returned, drafter
/// rows held before it.
type ProposeCall = (usize, u32, usize, Vec<u32>, usize);

#[allow(clippy::too_many_arguments)]
impl DraftProposer for Logged {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        self.inner.alloc_state(gpu)
    }
    fn alloc_state_for(&self, gpu: &dyn GpuBackend, b: usize) -> Result<Box<dyn ProposerState>> {
        self.inner.alloc_state_for(gpu, b)
    }
    fn propose(
        &self,
        last: u32,
        h: DevicePtr,
        pos: usize,
        n: usize,
        s: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        st: u64,
        d: Option<DevicePtr>,
        m: Option<&[i32]>,
        k: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        let rows = self.inner.drafter_rows(s);
        let out = self.inner.propose(last, h, pos, n, s, ctx, st, d, m, k)?;
        self.log
            .lock()
            .unwrap()
            .push((pos, last, n, out.clone(), rows));
        Ok(out)
    }
    fn after_verify(&self, a: usize, s: &mut dyn ProposerState, st: u64) -> Result<()> {
        self.inner.after_verify(a, s, st)
    }
    fn catchup_batch(
        &self,
        t: &[Vec<u32>],
        h: &[Vec<DevicePtr>],
        fp: &[usize],
        s: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        st: u64,
    ) -> Result<usize> {
        self.inner.catchup_batch(t, h, fp, s, ctx, st)
    }
    fn prefill_drafter(
        &self,
        p: &[u32],
        h: DevicePtr,
        s: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        st: u64,
    ) -> Result<usize> {
        self.inner.prefill_drafter(p, h, s, ctx, st)
    }
    fn free_state(&self, gpu: &dyn GpuBackend, s: &mut dyn ProposerState) -> Result<()> {
        self.inner.free_state(gpu, s)
    }
    fn prefill_hidden_rows(&self, max_seq_len: usize) -> usize {
        self.inner.prefill_hidden_rows(max_seq_len)
    }
}

/// Every third position: three right drafts (all accepted), so the MTP member misses them.
fn every_third(pos: usize) -> Option<(usize, usize)> {
    pos.is_multiple_of(3).then_some((3, usize::MAX))
}

/// Runs `Hybrid([Scripted, Logged MtpHead])` one prompt at a time and returns, for each
/// drafting propose of the MTP member, whether its drafts equal those of a fresh head
/// prefilled with the teacher-forced hiddens of the tokens before it; every propose is checked
/// to find a drafter row for every earlier position.
fn mtp_member_against_reference(target_layers: Option<usize>, kv_exact: bool) -> Vec<bool> {
    let gpu: Arc<dyn GpuBackend> = Arc::new(specdraft::backend::CpuBackend::new());
    // Tests run in parallel threads: each call writes and maps its own files, so no test
    // rewrites a file another one has mapped.
    let tag = format!("exact_{target_layers:?}_{kv_exact}");
    let model = load(&gpu, &tag);
    let levers = ModelLevers {
        mtp_kv_exact: kv_exact,
        ..ModelLevers::default()
    };
    let mtp = head(&model, &tag, &levers);
    let fulls = fulls(&model);
    let logged = Arc::new(Logged {
        inner: mtp.clone(),
        log: Mutex::new(Vec::new()),
    });
    let members = vec![
        HybridMember::new(
            "Scripted",
            Arc::new(Scripted {
                fulls: fulls.clone(),
                plan: every_third,
                vocab: mtp_common::VOCAB as u32,
            }),
        ),
        HybridMember::new("MtpHead", logged.clone()),
    ];
    let hybrid = Arc::new(Hybrid::new(members, target_layers).unwrap());
    let engine = SpecEngine::new(model.clone(), Some(hybrid), 3)
        .unwrap()
        .with_levers(levers)
        .with_draft_policy(DraftPolicyKind::Fixed);
    let ctx = ForwardContext::new(
        gpu.clone(),
        model.buffers().clone(),
        model.config().clone(),
        levers,
    );
    let hb = model.config().hidden_size * 2;
    let mut same = Vec::new();
    let mut caught_up_then_drafted = 0;
    for (i, p) in prompts().iter().enumerate() {
        let r = engine
            .generate(vec![GenerateRequest::new(p.clone(), MAX).ignore_eos()])
            .results
            .remove(0);
        assert!(r.error.is_none(), "{:?}", r.error);
        let full = &fulls[i];
        assert_eq!(r.tokens.as_slice(), &full[p.len()..]);
        let calls = std::mem::take(&mut *logged.log.lock().unwrap());
        let mut previous = None;
        for (pos, last, n, drafts, rows) in calls {
            assert_eq!(last, full[pos], "the token at {pos}");
            assert_eq!(
                rows,
                pos - 1,
                "prompt {i}: drafter rows before the propose at {pos}"
            );
            let prev = previous.replace((pos, n));
            if n == 0 {
                continue;
            }
            // A propose of no drafts just before: a token the member caught up on.
            caught_up_then_drafted += usize::from(prev == Some((pos - 1, 0)));
            let (_, hiddens) = teacher_forced(&model, &full[..pos], &[]);
            let mut st = mtp.alloc_state(gpu.as_ref()).unwrap();
            mtp.prefill_drafter(&full[..pos], hiddens, st.as_mut(), &ctx, 0)
                .unwrap();
            let want = mtp
                .propose(
                    full[pos],
                    hiddens.offset((pos - 1) * hb),
                    pos,
                    n,
                    st.as_mut(),
                    &ctx,
                    0,
                    None,
                    None,
                    None,
                )
                .unwrap();
            mtp.free_state(gpu.as_ref(), st.as_mut()).unwrap();
            gpu.free(hiddens).unwrap();
            same.push(drafts == want);
        }
    }
    assert!(
        caught_up_then_drafted > 0,
        "the MTP member drafted after catching up"
    );
    same
}

#[test]
fn with_the_target_layer_count_the_mtp_members_catch_up_is_exact() {
    // Under mtp_kv_exact the head's own accepted drafts get exact rows too, so every row is
    // the reference's; without it they keep the rows written while drafting, and only the
    // row count is checked (inside).
    let same = mtp_member_against_reference(Some(LAYERS), true);
    assert!(!same.is_empty());
    assert!(
        same.iter().all(|&s| s),
        "drafts that differ from the reference: {same:?}"
    );
    mtp_member_against_reference(Some(LAYERS), false);
}

#[test]
fn without_it_the_catch_up_leaves_no_gap_but_is_approximate() {
    for kv_exact in [false, true] {
        let same = mtp_member_against_reference(None, kv_exact);
        if kv_exact {
            // Rows from the step's hidden, not each token's: the drafts come out otherwise.
            assert!(same.iter().any(|&s| !s), "{same:?}");
        }
    }
}

/// Drafts by `plan` from the true continuation and checks the captured rows it is given
/// against a teacher-forced capture of its layers: at prefill every prompt row, at each
/// propose the rows of the tokens since its own previous propose. With `batch` it also
/// proposes in batches (each sequence from its entry of `ctx.target_hidden_stacks`), and
/// counts them in `batches`.
struct StackSpy {
    batch: bool,
    batches: Mutex<Vec<usize>>,
    layers: Vec<usize>,
    fulls: Vec<Vec<u32>>,
    /// Per full sequence, the teacher-forced capture of `layers` at every position.
    captured: Vec<Vec<Vec<u16>>>,
    plan: hybrid_common::Plan,
    hidden: usize,
    broken: Mutex<Vec<String>>,
    /// Row counts given to proposes.
    ks: Mutex<Vec<usize>>,
}

struct SpyState {
    full: usize,
    prev: usize,
}
specdraft::impl_proposer_state!(SpyState);

impl StackSpy {
    fn check(
        &self,
        ctx: &ForwardContext<'_>,
        what: String,
        p: DevicePtr,
        want: &[Vec<u16>],
    ) -> Result<()> {
        let width = self.layers.len() * self.hidden;
        let got: Vec<bf16> = ctx.gpu.download(p, want.len() * width)?;
        for (j, (g, w)) in got.chunks(width).zip(want).enumerate() {
            let g: Vec<u16> = g.iter().map(|x| x.to_bits()).collect();
            if &g != w {
                self.broken.lock().unwrap().push(format!("{what}: row {j}"));
            }
        }
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
impl DraftProposer for StackSpy {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(SpyState { full: 0, prev: 0 }))
    }
    fn target_layer_ids(&self) -> Vec<usize> {
        self.layers.clone()
    }
    fn prefill_drafter(
        &self,
        prompt: &[u32],
        _h: DevicePtr,
        s: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        _st: u64,
    ) -> Result<usize> {
        let st = s.as_any_mut().downcast_mut::<SpyState>().unwrap();
        st.full = self
            .fulls
            .iter()
            .position(|f| f.starts_with(prompt))
            .unwrap();
        st.prev = prompt.len() - 1;
        let stack = ctx
            .target_hidden_stack
            .expect("the prefill's captured rows");
        // Prefill row i is the row computed at prompt position i.
        self.check(
            ctx,
            "prefill".into(),
            stack,
            &self.captured[st.full][..prompt.len()],
        )?;
        Ok(0)
    }
    fn propose(
        &self,
        _last: u32,
        _h: DevicePtr,
        pos: usize,
        n: usize,
        s: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        _st: u64,
        _d: Option<DevicePtr>,
        _m: Option<&[i32]>,
        k: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        let st = s.as_any_mut().downcast_mut::<SpyState>().unwrap();
        let rows = pos - st.prev;
        self.ks.lock().unwrap().push(rows);
        // The token at q is paired with the row computed at q - 1.
        let want = &self.captured[st.full][st.prev..pos];
        self.check(
            ctx,
            format!("propose at {pos}"),
            k.expect("captured rows"),
            want,
        )?;
        st.prev = pos;
        let full = &self.fulls[st.full];
        Ok(match (self.plan)(pos) {
            Some((len, _)) => full[pos + 1..(pos + 1 + len.min(n)).min(full.len())].to_vec(),
            None => Vec::new(),
        })
    }
    fn after_verify(&self, _a: usize, _s: &mut dyn ProposerState, _st: u64) -> Result<()> {
        Ok(())
    }
    fn propose_batch_max(
        &self,
        _b: &specdraft::memory::BufferArena,
        _c: &specdraft::model::ModelConfig,
    ) -> usize {
        if self.batch {
            4
        } else {
            1
        }
    }
    fn propose_batch(
        &self,
        last: &[u32],
        h: &[DevicePtr],
        pos: &[usize],
        n: usize,
        s: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        st: u64,
        _conf: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        if !self.batch {
            return Ok(None);
        }
        let stacks = ctx.target_hidden_stacks.expect("each sequence's rows");
        assert_eq!(stacks.len(), last.len());
        self.batches.lock().unwrap().push(last.len());
        let out = propose_each(self, last, h, pos, n, s, ctx, st, Some(stacks))?;
        Ok(Some(out))
    }
}

#[test]
fn each_member_is_given_its_own_columns_for_the_rows_since_its_own_propose() {
    for batch in [false, true] {
        members_get_their_own_columns(batch);
    }
}

/// The columns test, the members proposing one sequence at a time or (`batch`) in batches.
fn members_get_their_own_columns(batch: bool) {
    let gpu: Arc<dyn GpuBackend> = Arc::new(specdraft::backend::CpuBackend::new());
    let model = load(&gpu, "columns");
    let fulls = fulls(&model);
    let spy = |layers: Vec<usize>, plan: hybrid_common::Plan| {
        let captured = fulls
            .iter()
            .map(|f| {
                let (rows, hiddens) = teacher_forced(&model, f, &layers);
                gpu.free(hiddens).unwrap();
                rows
            })
            .collect();
        Arc::new(StackSpy {
            batch,
            batches: Mutex::new(Vec::new()),
            layers,
            fulls: fulls.clone(),
            captured,
            plan,
            hidden: model.config().hidden_size,
            broken: Mutex::new(Vec::new()),
            ks: Mutex::new(Vec::new()),
        })
    };
    // The hybrid's layers are [1, 0, 2]: the first member's two side by side, the second's
    // one in the middle, then the last layer for the catch-up.
    // A wins every third position (three drafts); B drafts one token everywhere else.
    let a = spy(vec![1, 0], |pos| (pos % 3 == 0).then_some((3, 0)));
    let b = spy(vec![0], |_| Some((1, 0)));
    let members = vec![
        HybridMember::new("A", a.clone()),
        HybridMember::new("B", b.clone()),
    ];
    let hybrid = Arc::new(Hybrid::new(members, Some(LAYERS)).unwrap());
    assert_eq!(hybrid.target_layer_ids(), vec![1, 0, 2]);
    let engine = SpecEngine::new(model.clone(), Some(hybrid), 3)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed);
    let first = engine.generate(requests());
    let before = gpu.ledger().live_count();
    let g = engine.generate(requests());
    for (r, full) in g
        .results
        .iter()
        .chain(&first.results)
        .zip(fulls.iter().cycle())
    {
        assert!(r.error.is_none(), "{:?}", r.error);
        assert_eq!(r.tokens.as_slice(), &full[full.len() - MAX..]);
    }
    assert_eq!(
        gpu.ledger().live_count(),
        before,
        "{:?}",
        gpu.ledger().live_report()
    );
    for (name, s) in [("A", &a), ("B", &b)] {
        let broken = s.broken.lock().unwrap().clone();
        assert!(broken.is_empty(), "member {name}: {broken:?}");
        // Some proposes were given several rows (the gathered copy), some one.
        let ks = s.ks.lock().unwrap().clone();
        assert!(
            ks.contains(&1) && ks.iter().any(|&k| k > 1),
            "member {name}: {ks:?}"
        );
        let batches = s.batches.lock().unwrap().clone();
        assert_eq!(
            batches.iter().any(|&b| b > 1),
            batch,
            "member {name}: {batches:?}"
        );
    }
}

#[test]
fn the_conformance_check_finds_batched_drafts_equal_to_one_by_one_drafts() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(specdraft::backend::CpuBackend::new());
    let model = load(&gpu, "conformance");
    let mtp = head(&model, "conformance", &ModelLevers::default());
    for target_layers in [Some(LAYERS), None] {
        let members = vec![
            HybridMember::new("PromptLookup", Arc::new(PromptLookup::default())),
            HybridMember::new("MtpHead", mtp.clone()),
        ];
        let hybrid = Hybrid::new(members, target_layers).unwrap();
        let options = CheckOptions {
            label: "Hybrid".into(),
            vocab_size: tiny().vocab,
            hidden_size: tiny().hidden,
            num_drafts: 3,
            steps: 12,
            ..CheckOptions::default()
        };
        let report = check_proposer_on(&hybrid, gpu.clone(), &options);
        assert!(report.is_ok(), "{target_layers:?}: {report}");
        assert!(
            report.checks_run.iter().any(|c| c == "propose_batch"),
            "{:?}",
            report.checks_run
        );
    }
}
