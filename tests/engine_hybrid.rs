//! `Hybrid` driven by the engine on a table target, with members whose drafts are scripted
//! from the true greedy continuation: under the fixed order (`HybridChoice::First`; the
//! measured choice has `engine_hybrid_choice`) each step's winner is the first member with a
//! confident draft and its drafts are the hybrid's; `after_verify` gives the winner the accepted count,
//! a member whose drafts lost the common prefix of its drafts with the accepted ones and a
//! member asked for none 0, once per propose; the winner's accepted drafts reach every other
//! member as catch-up proposes, so each member's history is the sequence's; greedy output is
//! plain greedy output; and a failing member fails the sequence naming it, with every
//! member's state freed.

mod engine_common;
mod hybrid_common;

use engine_common::{cpu, table};
use hybrid_common::{check_rules, Ev, Faulty, Log, Recorder, Scripted, HYBRID};
use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{DraftPolicyKind, GenerateRequest, SpecEngine};
use specdraft::model::ForwardContext;
use specdraft::speculative::{DraftProposer, Hybrid, HybridChoice, HybridMember, PromptLookup};
use std::sync::{Arc, Mutex};

const MAX: usize = 30;
const VOCAB: u32 = 48;

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 2, 3, 4, 5, 6, 7, 1, 2, 3],
        vec![9, 9, 8, 7, 9, 9, 8],
        vec![40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42, 43],
        vec![5],
    ]
}

fn request(p: &[u32]) -> GenerateRequest {
    GenerateRequest::new(p.to_vec(), MAX).ignore_eos()
}

/// Each prompt followed by its plain greedy output.
fn fulls(target: &Arc<TableTarget>) -> Vec<Vec<u32>> {
    let plain = SpecEngine::new(target.clone(), None, 0).unwrap();
    prompts()
        .iter()
        .map(|p| {
            let r = plain.generate(vec![request(p)]).results.remove(0);
            assert!(r.error.is_none(), "{:?}", r.error);
            p.iter().chain(&r.tokens).copied().collect()
        })
        .collect()
}

/// At multiples of three: three drafts, the second wrong (one accepted).
fn every_third(pos: usize) -> Option<(usize, usize)> {
    pos.is_multiple_of(3).then_some((3, 1))
}

/// At positions 2 mod 3: one right draft at even ones (short of `min_drafts` 2: drafts that
/// lose), else three drafts, the second wrong (one accepted).
fn short_or_wrong(pos: usize) -> Option<(usize, usize)> {
    match (pos % 3, pos % 2) {
        (2, 0) => Some((1, usize::MAX)),
        (2, _) => Some((3, 1)),
        _ => None,
    }
}

/// Always drafts, the draft at index `pos % 3` wrong.
fn always(pos: usize) -> Option<(usize, usize)> {
    Some((4, pos % 3))
}

#[test]
fn each_step_drafts_with_the_first_confident_member_and_every_member_stays_in_step() {
    let gpu = cpu();
    let target = table(&gpu);
    let fulls = fulls(&target);
    let log: Log = Arc::new(Mutex::new(Vec::new()));
    let scripted = |plan: hybrid_common::Plan| -> Arc<dyn DraftProposer> {
        Arc::new(Scripted {
            fulls: fulls.clone(),
            plan,
            vocab: VOCAB,
        })
    };
    let mins = [1, 2, 1];
    let members = vec![
        Recorder::member(0, "EveryThird", scripted(every_third), &log),
        Recorder::member(1, "ShortOrWrong", scripted(short_or_wrong), &log).with_min_drafts(2),
        Recorder::member(2, "Always", scripted(always), &log),
    ];
    let hybrid: Arc<dyn DraftProposer> = Arc::new(Recorder {
        who: HYBRID,
        batch: false,
        // `check_rules` models the fixed order.
        inner: Arc::new(
            Hybrid::new(members, None)
                .unwrap()
                .with_choice(HybridChoice::First),
        ),
        log: log.clone(),
    });
    let engine = SpecEngine::new(target.clone(), Some(hybrid), 4)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed);
    let before = gpu.ledger().live_count();
    let mut wins = [0; 3];
    let mut lost = [0; 3];
    let mut replayed = [0; 3];
    for (p, full) in prompts().iter().zip(&fulls) {
        log.lock().unwrap().clear();
        let r = engine.generate(vec![request(p)]).results.remove(0);
        assert!(r.error.is_none(), "{:?}", r.error);
        assert_eq!(
            &full[p.len()..],
            r.tokens.as_slice(),
            "greedy output is plain greedy output"
        );
        let events = log.lock().unwrap().clone();
        let [w, l, c] = check_rules(&events, &mins, full);
        for i in 0..3 {
            wins[i] += w[i];
            lost[i] += l[i];
            replayed[i] += c[i];
        }
    }
    // Every member won some steps, the one with min_drafts 2 also lost with drafts, and every
    // member caught up on some tokens.
    assert!(wins.iter().all(|&w| w > 0), "wins {wins:?}");
    assert!(lost[1] > 0, "member 1 never lost with drafts: {lost:?}");
    assert!(
        replayed.iter().all(|&c| c > 0),
        "caught-up tokens {replayed:?}"
    );
    assert_eq!(gpu.ledger().live_count(), before);
}

#[test]
fn losing_drafts_are_credited_with_their_common_prefix_with_the_accepted_ones() {
    // Member 0 always returns one right draft (short of its min_drafts 2), so member 1's
    // drafts win, and member 0's draft is accepted with them whenever their first is.
    let gpu = cpu();
    let target = table(&gpu);
    let fulls = fulls(&target);
    let log: Log = Arc::new(Mutex::new(Vec::new()));
    let members = vec![
        Recorder::member(
            0,
            "Short",
            Arc::new(Scripted {
                fulls: fulls.clone(),
                plan: |_| Some((1, usize::MAX)),
                vocab: VOCAB,
            }),
            &log,
        )
        .with_min_drafts(2),
        Recorder::member(
            1,
            "Right",
            Arc::new(Scripted {
                fulls: fulls.clone(),
                plan: |pos| Some((3, pos % 5)),
                vocab: VOCAB,
            }),
            &log,
        ),
    ];
    let hybrid: Arc<dyn DraftProposer> = Arc::new(Recorder {
        who: HYBRID,
        batch: false,
        inner: Arc::new(
            Hybrid::new(members, None)
                .unwrap()
                .with_choice(HybridChoice::First),
        ),
        log: log.clone(),
    });
    let engine = SpecEngine::new(target.clone(), Some(hybrid), 3)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed);
    let p = &prompts()[0];
    let r = engine.generate(vec![request(p)]).results.remove(0);
    assert!(r.error.is_none(), "{:?}", r.error);
    let events = log.lock().unwrap().clone();
    check_rules(&events, &[2, 1], &fulls[0]);
    let credited = events
        .iter()
        .filter(|e| {
            matches!(
                e,
                Ev::After {
                    who: 0,
                    accepted: 1
                }
            )
        })
        .count();
    assert!(
        credited > 0,
        "member 0's losing draft was never credited: {events:?}"
    );
}

#[test]
fn in_a_batch_greedy_output_is_plain_output_and_every_member_has_its_sequence() {
    let gpu = cpu();
    let target = table(&gpu);
    let fulls = fulls(&target);
    let log: Log = Arc::new(Mutex::new(Vec::new()));
    let members = vec![
        Recorder::member(0, "PromptLookup", Arc::new(PromptLookup::default()), &log),
        Recorder::member(
            1,
            "Always",
            Arc::new(Scripted {
                fulls: fulls.clone(),
                plan: always,
                vocab: VOCAB,
            }),
            &log,
        ),
    ];
    let hybrid = Arc::new(Hybrid::new(members, None).unwrap());
    let before = gpu.ledger().live_count();
    let engine = SpecEngine::new(target.clone(), Some(hybrid), 4).unwrap();
    let g = engine.generate(prompts().iter().map(|p| request(p)).collect());
    for (r, full) in g.results.iter().zip(&fulls) {
        assert!(r.error.is_none(), "{:?}", r.error);
        assert_eq!(&full[full.len() - MAX..], r.tokens.as_slice());
    }
    assert!(g.metrics.accepted > 0);
    // Each member's history is its sequence's, but for the last step's accepted drafts it
    // did not draft (at most 4) and the last token.
    let mut freed = 0;
    for e in log.lock().unwrap().iter() {
        if let Ev::Free { who, history } = e {
            let full = fulls.iter().find(|f| f.starts_with(&history[..1])).unwrap();
            assert_eq!(history.as_slice(), &full[..history.len()], "member {who}");
            assert!(history.len() + 5 >= full.len(), "member {who}: {history:?}");
            freed += 1;
        }
    }
    assert_eq!(freed, 2 * prompts().len());
    assert_eq!(gpu.ledger().live_count(), before);
}

#[test]
fn a_failing_member_fails_its_sequence_naming_it_and_every_state_is_freed() {
    let gpu = cpu();
    let target = table(&gpu);
    let fulls = fulls(&target);
    let before = gpu.ledger().live_count();
    let members = vec![
        HybridMember::new(
            "Always",
            Arc::new(Scripted {
                fulls: fulls.clone(),
                plan: always,
                vocab: VOCAB,
            }),
        ),
        HybridMember::new(
            "Holder",
            Arc::new(Faulty {
                fail_from: usize::MAX,
                fail_alloc: false,
            }),
        ),
        HybridMember::new(
            "Faulty",
            Arc::new(Faulty {
                fail_from: 14,
                fail_alloc: false,
            }),
        ),
    ];
    let hybrid = Arc::new(Hybrid::new(members, None).unwrap());
    let engine = SpecEngine::new(target.clone(), Some(hybrid), 4).unwrap();
    let g = engine.generate(prompts().iter().map(|p| request(p)).collect());
    for (i, r) in g.results.iter().enumerate() {
        let msg = r.error.as_ref().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            msg.contains("propose: hybrid member 2 (Faulty) failed")
                && msg.contains("planted failure at position 14"),
            "request {i}: {msg:?}"
        );
    }
    assert_eq!(
        gpu.ledger().live_count(),
        before,
        "{:?}",
        gpu.ledger().live_report()
    );

    // A member whose alloc_state fails: the members made before it are freed again.
    let members = vec![
        HybridMember::new(
            "Holder",
            Arc::new(Faulty {
                fail_from: usize::MAX,
                fail_alloc: false,
            }),
        ),
        HybridMember::new(
            "NoState",
            Arc::new(Faulty {
                fail_from: usize::MAX,
                fail_alloc: true,
            }),
        ),
    ];
    let hybrid = Hybrid::new(members, None).unwrap();
    let err = hybrid
        .alloc_state(gpu.as_ref())
        .err()
        .expect("alloc_state fails");
    assert!(
        err.to_string()
            .contains("alloc_state_for: hybrid member 1 (NoState) failed"),
        "{err}"
    );
    assert_eq!(gpu.ledger().live_count(), before);
}

#[test]
fn free_state_frees_every_member_even_after_one_fails() {
    /// Its free_state fails, freeing nothing of its own (it holds nothing).
    struct BadFree;
    #[allow(clippy::too_many_arguments)]
    impl DraftProposer for BadFree {
        fn alloc_state(
            &self,
            _gpu: &dyn GpuBackend,
        ) -> specdraft::Result<Box<dyn specdraft::speculative::ProposerState>> {
            Ok(Box::new(hybrid_common::Prompt::default()))
        }
        fn propose(
            &self,
            _l: u32,
            _h: DevicePtr,
            _p: usize,
            _n: usize,
            _s: &mut dyn specdraft::speculative::ProposerState,
            _c: &ForwardContext<'_>,
            _st: u64,
            _d: Option<DevicePtr>,
            _m: Option<&[i32]>,
            _k: Option<DevicePtr>,
        ) -> specdraft::Result<Vec<u32>> {
            Ok(Vec::new())
        }
        fn after_verify(
            &self,
            _a: usize,
            _s: &mut dyn specdraft::speculative::ProposerState,
            _st: u64,
        ) -> specdraft::Result<()> {
            Ok(())
        }
        fn free_state(
            &self,
            _gpu: &dyn GpuBackend,
            _s: &mut dyn specdraft::speculative::ProposerState,
        ) -> specdraft::Result<()> {
            Err(specdraft::speculative::ProposerError::Failed {
                method: "free_state".into(),
                message: "planted".into(),
            }
            .into())
        }
    }
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let holder = || -> Arc<dyn DraftProposer> {
        Arc::new(Faulty {
            fail_from: usize::MAX,
            fail_alloc: false,
        })
    };
    let hybrid = Hybrid::new(
        vec![
            HybridMember::new("Holder", holder()),
            HybridMember::new("BadFree", Arc::new(BadFree)),
            HybridMember::new("Holder", holder()),
        ],
        None,
    )
    .unwrap();
    let mut st = hybrid.alloc_state(gpu.as_ref()).unwrap();
    assert_eq!(gpu.ledger().live_count(), 2);
    let err = hybrid.free_state(gpu.as_ref(), st.as_mut()).unwrap_err();
    assert!(
        err.to_string()
            .contains("free_state: hybrid member 1 (BadFree) failed"),
        "{err}"
    );
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

#[test]
fn a_block_member_is_asked_for_at_most_gamma_minus_one_and_the_hybrid_has_no_block_size() {
    /// Returns as many drafts as asked (all token 1) and says it is a block drafter of γ 3.
    struct Block(Mutex<Vec<usize>>);
    #[allow(clippy::too_many_arguments)]
    impl DraftProposer for Block {
        fn alloc_state(
            &self,
            _gpu: &dyn GpuBackend,
        ) -> specdraft::Result<Box<dyn specdraft::speculative::ProposerState>> {
            Ok(Box::new(hybrid_common::Prompt::default()))
        }
        fn propose(
            &self,
            _l: u32,
            _h: DevicePtr,
            _p: usize,
            n: usize,
            _s: &mut dyn specdraft::speculative::ProposerState,
            _c: &ForwardContext<'_>,
            _st: u64,
            _d: Option<DevicePtr>,
            _m: Option<&[i32]>,
            _k: Option<DevicePtr>,
        ) -> specdraft::Result<Vec<u32>> {
            self.0.lock().unwrap().push(n);
            Ok(vec![1; n])
        }
        fn after_verify(
            &self,
            _a: usize,
            _s: &mut dyn specdraft::speculative::ProposerState,
            _st: u64,
        ) -> specdraft::Result<()> {
            Ok(())
        }
        fn block_gamma(&self) -> Option<usize> {
            Some(3)
        }
    }
    let block = Arc::new(Block(Mutex::new(Vec::new())));
    let hybrid = Hybrid::new(vec![HybridMember::new("Block", block.clone())], None).unwrap();
    assert_eq!(hybrid.block_gamma(), None);
    let gpu = cpu();
    let target = table(&gpu);
    let engine = SpecEngine::new(target, Some(Arc::new(hybrid)), 5)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed);
    assert_eq!(engine.num_drafts(), 5);
    let r = engine.generate(vec![request(&[3, 4, 5])]).results.remove(0);
    assert!(r.error.is_none(), "{:?}", r.error);
    let asked = block.0.lock().unwrap().clone();
    assert!(asked.contains(&2), "{asked:?}");
    assert!(asked.iter().all(|&n| n <= 2), "{asked:?}");
}

#[test]
fn construction_refuses_what_cannot_work() {
    let member = || HybridMember::new("PromptLookup", Arc::new(PromptLookup::default()));
    let cases: Vec<(specdraft::Result<Hybrid>, &str)> = vec![
        (
            Hybrid::new(vec![], None).map_err(Into::into),
            "at least one member",
        ),
        (
            Hybrid::new(vec![member().with_min_drafts(0)], None).map_err(Into::into),
            "member 0 (PromptLookup) has min_drafts 0",
        ),
        (
            Hybrid::new(vec![member()], Some(0)).map_err(Into::into),
            "target_layers is 0",
        ),
    ];
    for (r, want) in cases {
        let msg = r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains(want), "{msg:?} should say {want:?}");
    }
    // With the target's layer count it names the last layer, after its members' own.
    let h = Hybrid::new(vec![member()], Some(30)).unwrap();
    assert_eq!(h.target_layer_ids(), vec![29]);
}
