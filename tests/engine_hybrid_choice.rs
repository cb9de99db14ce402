//! How a `Hybrid` picks among members that all have a draft, driven by the engine on a table
//! target with members scripted from the true greedy continuation.
//!
//! What it proves: under the default `HybridChoice::Measured`, a first member whose first
//! drafts miss takes exactly one step (the first, when nothing is measured yet) and a later
//! member that is right takes every other; a first member that is right keeps every step;
//! under `HybridChoice::First` the first member with a draft takes every step, right or
//! wrong. Greedy output is plain greedy output throughout, and the ledger ends where it began.

mod engine_common;
mod hybrid_common;

use engine_common::{cpu, table};
use hybrid_common::{Ev, Log, Recorder, Scripted, HYBRID};
use specdraft::engine::{DraftPolicyKind, GenerateRequest, SpecEngine};
use specdraft::speculative::{DraftProposer, Hybrid, HybridChoice};
use std::sync::{Arc, Mutex};

const MAX: usize = 60;
const VOCAB: u32 = 48;
const PROMPT: [u32; 7] = [3, 1, 4, 1, 5, 9, 2];

/// Two drafts, the first wrong.
fn wrong(_pos: usize) -> Option<(usize, usize)> {
    Some((2, 0))
}

/// Three drafts, all right.
fn right(_pos: usize) -> Option<(usize, usize)> {
    Some((3, usize::MAX))
}

/// Steps taken by each of the two members in one greedy run of a hybrid picking by `choice`,
/// where member `wrong_member` drafts by `wrong` and the other by `right`: the hybrid's drafts
/// show whose they were by their first token.
fn wins(wrong_member: usize, choice: HybridChoice) -> [usize; 2] {
    let mut plans: [hybrid_common::Plan; 2] = [right, right];
    plans[wrong_member] = wrong;
    let gpu = cpu();
    let target = table(&gpu);
    let request = || GenerateRequest::new(PROMPT.to_vec(), MAX).ignore_eos();
    let plain = SpecEngine::new(target.clone(), None, 0).unwrap();
    let plain_out = plain.generate(vec![request()]).results.remove(0).tokens;
    let full: Vec<u32> = PROMPT.iter().chain(&plain_out).copied().collect();
    let log: Log = Arc::new(Mutex::new(Vec::new()));
    let members = (0..2)
        .map(|i| {
            let drafter = Arc::new(Scripted {
                fulls: vec![full.clone()],
                plan: plans[i],
                vocab: VOCAB,
            });
            Recorder::member(i, ["A", "B"][i], drafter, &log)
        })
        .collect();
    let hybrid: Arc<dyn DraftProposer> = Arc::new(Recorder {
        who: HYBRID,
        batch: false,
        inner: Arc::new(Hybrid::new(members, None).unwrap().with_choice(choice)),
        log: log.clone(),
    });
    let before = gpu.ledger().live_count();
    let engine = SpecEngine::new(target.clone(), Some(hybrid), 3)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed);
    let r = engine.generate(vec![request()]).results.remove(0);
    assert!(r.error.is_none(), "{:?}", r.error);
    assert_eq!(r.tokens, plain_out, "greedy output is plain greedy output");
    drop(engine);
    assert_eq!(gpu.ledger().live_count(), before);
    let mut wins = [0; 2];
    for e in log.lock().unwrap().iter() {
        if let Ev::Propose {
            who: HYBRID,
            pos,
            drafts,
            ..
        } = e
        {
            if let Some(&first) = drafts.first() {
                let by_wrong = first != full[pos + 1];
                wins[if by_wrong {
                    wrong_member
                } else {
                    1 - wrong_member
                }] += 1;
            }
        }
    }
    wins
}

#[test]
fn a_first_member_whose_first_drafts_miss_yields_every_later_step_to_one_that_is_right() {
    let [a, b] = wins(0, HybridChoice::Measured);
    assert_eq!(a, 1, "the missing member takes only the first step");
    assert!(b >= 15, "the right member takes the rest: {b}");
}

#[test]
fn a_first_member_that_is_right_keeps_every_step() {
    let [a, b] = wins(1, HybridChoice::Measured);
    assert_eq!(b, 0);
    assert!(a >= 15, "{a}");
}

#[test]
fn the_fixed_order_gives_every_step_to_the_first_member_with_a_draft() {
    let [a, b] = wins(0, HybridChoice::First);
    assert_eq!(b, 0);
    // Every draft misses, so each step commits one token: the prefill emits the first, and the
    // last step may draft nothing (one token is left to emit).
    assert_eq!(a, MAX - 2);
}
