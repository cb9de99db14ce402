//! The confidences a `Hybrid`'s `propose_batch` reports, driven by the engine at batch 4 on a
//! table target, with two scripted members under the fixed order (`HybridChoice::First`):
//! member A drafts at even positions only, member B at every position, each reporting a
//! confidence of its own in every draft.
//!
//! What it proves: each sequence of a batch gets the confidences of the member whose drafts
//! it returned (A's at even positions, B's at odd ones), one a draft, and an empty list where
//! nothing was drafted or the winner reported nothing (it does not batch, or batches without
//! confidences); a batch's lone sequence is asked through its members' `propose_batch`, so it
//! too is reported on; greedy output is plain output, and the ledger ends where it began.

#[path = "model_util/batch.rs"]
mod batch;
mod engine_common;
mod hybrid_common;

use engine_common::{cpu, table};
use hybrid_common::{Ev, Log, Recorder, Scripted, HYBRID};
use specdraft::backend::DevicePtr;
use specdraft::engine::{DraftPolicyKind, GenerateRequest, SpecEngine};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig};
use specdraft::speculative::{
    DelegatingProposer, DraftProposer, Hybrid, HybridChoice, ProposerState,
};
use specdraft::Result;
use std::sync::{Arc, Mutex};

const MAX: usize = 24;
const VOCAB: u32 = 48;
const A_CONF: f32 = 0.75;
const B_CONF: f32 = 0.25;

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 2, 3, 4, 5, 6, 7, 1, 2, 3],
        vec![9, 9, 8, 7, 9, 9, 8],
        vec![40, 41, 42, 43, 44, 45, 46, 47],
        vec![5],
        vec![11, 12],
    ]
}

fn request(p: &[u32]) -> GenerateRequest {
    GenerateRequest::new(p.to_vec(), MAX).ignore_eos()
}

/// Two right drafts at even positions.
fn even(pos: usize) -> Option<(usize, usize)> {
    pos.is_multiple_of(2).then_some((2, usize::MAX))
}

/// Two drafts everywhere, the first or the second wrong (so sequences move on by one token
/// or two, and a batch's positions mix even and odd).
fn always(pos: usize) -> Option<(usize, usize)> {
    Some((2, (pos / 2) % 2))
}

/// How a member batches.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Batching {
    /// Batches, reporting its confidence in every draft.
    Reporting(f32),
    /// Batches, reporting nothing.
    Silent,
    /// Proposes one sequence at a time.
    Never,
}

/// `inner` batched by proposing each sequence in turn, as `batching` says.
struct Confident {
    inner: Scripted,
    batching: Batching,
}

#[allow(clippy::too_many_arguments)]
impl DelegatingProposer for Confident {
    fn inner(&self) -> &dyn DraftProposer {
        &self.inner
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
        conf: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        let drafts = batch::propose_each(self, last, h, pos, n, s, ctx, st, None)?;
        if let (Batching::Reporting(c), Some(out)) = (self.batching, conf) {
            *out = drafts.iter().map(|d| vec![c; d.len()]).collect();
        }
        Ok(Some(drafts))
    }
    fn propose_batch_max(&self, _buffers: &BufferArena, _config: &ModelConfig) -> usize {
        match self.batching {
            Batching::Never => 1,
            _ => 8,
        }
    }
}

/// One sequence of a batch, as the hybrid answered it: position, drafts, confidences.
type Seen = (usize, Vec<u32>, Vec<f32>);

/// Runs the prompts at batch 4 through a hybrid of A (reporting [`A_CONF`]) and B (batching
/// as `b` says), checking greedy output and the ledger, and returns the hybrid's batches as
/// logged: each sequence's position, drafts and reported confidences.
fn batches(b: Batching) -> Vec<Vec<Seen>> {
    let gpu = cpu();
    let target = table(&gpu);
    let plain = SpecEngine::new(target.clone(), None, 0).unwrap();
    let plain_out: Vec<Vec<u32>> = plain
        .generate(prompts().iter().map(|p| request(p)).collect())
        .results
        .into_iter()
        .map(|r| r.tokens)
        .collect();
    let fulls: Vec<Vec<u32>> = prompts()
        .iter()
        .zip(&plain_out)
        .map(|(p, o)| p.iter().chain(o).copied().collect())
        .collect();
    let log: Log = Arc::new(Mutex::new(Vec::new()));
    let member = |who: usize, name: &str, plan: hybrid_common::Plan, batching: Batching| {
        let inner = Scripted {
            fulls: fulls.clone(),
            plan,
            vocab: VOCAB,
        };
        let drafter = Arc::new(Confident { inner, batching });
        Recorder::batching_member(who, name, drafter, &log)
    };
    let members = vec![
        member(0, "A", even, Batching::Reporting(A_CONF)),
        member(1, "B", always, b),
    ];
    let hybrid = Hybrid::new(members, None)
        .unwrap()
        .with_choice(HybridChoice::First);
    let spy: Arc<dyn DraftProposer> = Arc::new(Recorder {
        who: HYBRID,
        batch: true,
        inner: Arc::new(hybrid),
        log: log.clone(),
    });
    let before = gpu.ledger().live_count();
    let engine = SpecEngine::new(target.clone(), Some(spy), 2)
        .unwrap()
        .with_max_batch(4)
        .with_draft_policy(DraftPolicyKind::Fixed);
    let g = engine.generate(prompts().iter().map(|p| request(p)).collect());
    for (r, plain) in g.results.iter().zip(&plain_out) {
        assert!(r.error.is_none(), "{:?}", r.error);
        assert_eq!(&r.tokens, plain, "greedy output is plain output");
    }
    drop(engine);
    assert_eq!(gpu.ledger().live_count(), before);
    let log = log.lock().unwrap();
    // The hybrid's drafts for each sequence are logged, in order, after its batch.
    let mut out = Vec::new();
    for (i, e) in log.iter().enumerate() {
        let Ev::Batch {
            who: HYBRID,
            size,
            positions,
            confs,
        } = e
        else {
            continue;
        };
        assert_eq!(confs.len(), *size, "one list of confidences per sequence");
        let drafts = log[i + 1..]
            .iter()
            .filter_map(|e| match e {
                Ev::Propose {
                    who: HYBRID,
                    drafts,
                    ..
                } => Some(drafts.clone()),
                _ => None,
            })
            .take(*size);
        let batch = positions.iter().zip(drafts).zip(confs);
        out.push(batch.map(|((&p, d), c)| (p, d, c.clone())).collect());
    }
    out
}

/// The confidences expected for a sequence at `pos` that drafted `drafts`, B batching as `b`.
fn expected(pos: usize, drafts: &[u32], b: Batching) -> Vec<f32> {
    let conf = match (even(pos), b) {
        _ if drafts.is_empty() => None,
        (Some(_), _) => Some(A_CONF),
        (None, Batching::Reporting(c)) => Some(c),
        (None, _) => None,
    };
    conf.map_or_else(Vec::new, |c| vec![c; drafts.len()])
}

fn check(b: Batching) {
    let (mut a_won, mut b_won, mut b_alone) = (0, 0, 0);
    for batch in batches(b) {
        for (pos, drafts, confs) in &batch {
            assert_eq!(
                confs,
                &expected(*pos, drafts, b),
                "B {b:?}: the sequence at {pos} drafted {drafts:?}"
            );
            match even(*pos) {
                _ if drafts.is_empty() => {}
                Some(_) => a_won += 1,
                None => b_won += 1,
            }
        }
        // B is asked for drafts only by the sequences A left: where that is one of several,
        // the hybrid asks B for a group of one.
        let asking_b = batch.iter().filter(|(p, ..)| even(*p).is_none()).count();
        if batch.len() > 1 && asking_b == 1 {
            b_alone += 1;
        }
    }
    assert!(
        a_won > 0 && b_won > 0,
        "B {b:?}: A won {a_won}, B won {b_won}"
    );
    assert!(b_alone > 0, "no batch asked B for one sequence alone");
}

#[test]
fn each_sequence_gets_its_winners_confidences() {
    check(Batching::Reporting(B_CONF));
}

#[test]
fn a_winner_that_reports_nothing_gives_an_empty_list() {
    check(Batching::Silent);
    check(Batching::Never);
}
