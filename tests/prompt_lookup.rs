//! PromptLookup drafts the true continuation of repetitive text, nothing without a repeat,
//! honours the grammar mask, and its batch path equals its per-sequence path.

use specdraft::backend::{CpuBackend, DevicePtr};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig, ModelLevers};
use specdraft::speculative::conformance::{check_proposer, CheckOptions};
use specdraft::speculative::{bitmask_words, DraftProposer, PromptLookup, ProposerState};
use std::sync::Arc;

fn ctx(vocab: usize) -> ForwardContext<'static> {
    ForwardContext::new(
        Arc::new(CpuBackend::new()),
        Arc::new(BufferArena::empty(4)),
        Arc::new(ModelConfig::tiny(vocab)),
        ModelLevers::default(),
    )
}

fn prefilled(p: &PromptLookup, ctx: &ForwardContext<'_>, prompt: &[u32]) -> Box<dyn ProposerState> {
    let mut s = p.alloc_state(&*ctx.gpu).unwrap();
    assert_eq!(
        p.prefill_drafter(prompt, DevicePtr::NULL, &mut *s, ctx, 0)
            .unwrap(),
        0
    );
    s
}

fn propose(
    p: &PromptLookup,
    ctx: &ForwardContext<'_>,
    s: &mut dyn ProposerState,
    last: u32,
    pos: usize,
    n: usize,
    mask: Option<&[i32]>,
) -> Vec<u32> {
    p.propose(last, DevicePtr::NULL, pos, n, s, ctx, 0, None, mask, None)
        .unwrap()
}

#[test]
fn drafts_the_true_continuation_of_a_repeated_passage() {
    let ctx = ctx(1000);
    let p = PromptLookup::new(1, 3).unwrap();
    // "def f ( x ) : return x + 1" twice; the answer starts repeating it.
    let passage = [10, 20, 30, 40, 50, 60, 70, 40, 80, 90];
    let mut prompt = passage.to_vec();
    prompt.extend([5, 6]);
    prompt.extend(passage);
    prompt.extend([7]);
    let mut s = prefilled(&p, &ctx, &prompt);
    // The model emits 10 20 at positions P, P+1: after "10" the lookup must continue the passage.
    let drafts = propose(&p, &ctx, &mut *s, 10, prompt.len(), 5, None);
    assert_eq!(drafts, vec![20, 30, 40, 50, 60]);
    p.after_verify(5, &mut *s, 0).unwrap();
    // The most recent occurrence of "50 60 70" is the second copy, followed by "7" and then
    // by what was generated after it.
    let drafts = propose(&p, &ctx, &mut *s, 70, prompt.len() + 6, 8, None);
    assert_eq!(drafts, vec![40, 80, 90, 7, 10, 20, 30, 40]);
}

#[test]
fn most_recent_match_wins_and_longer_ngrams_first() {
    let p = PromptLookup::new(1, 2).unwrap();
    // Suffix [1, 2] occurs twice: followed by 3 (old) and by 4 (recent).
    assert_eq!(p.lookup(&[1, 2, 3, 9, 1, 2, 4, 8, 1, 2], 1, None), vec![4]);
    // Bigram [7, 2] decides over the unigram [2] that occurs more recently.
    assert_eq!(p.lookup(&[7, 2, 5, 6, 2, 9, 7, 2], 1, None), vec![5]);
    // A min_ngram of 2 refuses to match a single token.
    let strict = PromptLookup::new(2, 2).unwrap();
    assert_eq!(strict.lookup(&[3, 4, 5, 3], 3, None), Vec::<u32>::new());
    assert!(PromptLookup::new(0, 2).is_err());
    assert!(PromptLookup::new(3, 2).is_err());
}

#[test]
fn default_needs_two_matching_tokens() {
    let p = PromptLookup::default();
    assert_eq!((p.min_ngram(), p.max_ngram()), (2, 4));
    // "7" recurs, but no two-token suffix does: no drafts.
    assert!(p.lookup(&[7, 1, 2, 3, 7], 4, None).is_empty());
    assert_eq!(p.lookup(&[9, 7, 1, 2, 9, 7], 2, None), vec![1, 2]);
}

#[test]
fn drafts_nothing_without_a_repeat() {
    let ctx = ctx(1000);
    let p = PromptLookup::default();
    let prompt: Vec<u32> = (0..50).collect();
    let mut s = prefilled(&p, &ctx, &prompt);
    assert!(propose(&p, &ctx, &mut *s, 999, 50, 4, None).is_empty());
    p.after_verify(0, &mut *s, 0).unwrap();
    assert!(propose(&p, &ctx, &mut *s, 998, 51, 4, None).is_empty());
}

#[test]
fn stops_before_the_first_forbidden_token() {
    let ctx = ctx(64);
    let p = PromptLookup::new(1, 4).unwrap();
    let prompt = [1, 2, 3, 4, 5, 1];
    let mut s = prefilled(&p, &ctx, &prompt);
    let mut mask = vec![0i32; bitmask_words(64)];
    for t in [2u32, 3, 5] {
        mask[(t / 32) as usize] |= 1 << (t % 32);
    }
    // Continuation is 2 3 4 5; 4 is forbidden so drafting stops after 2 3.
    assert_eq!(propose(&p, &ctx, &mut *s, 1, 5, 4, Some(&mask)), vec![2, 3]);
    // Proposing again from the same position is idempotent.
    assert_eq!(propose(&p, &ctx, &mut *s, 1, 5, 4, None), vec![2, 3, 4, 5]);
}

#[test]
fn bad_input_is_an_error() {
    let ctx = ctx(64);
    let p = PromptLookup::default();
    let mut s = prefilled(&p, &ctx, &[1, 2, 3]);
    let err = p
        .propose(
            64,
            DevicePtr::NULL,
            3,
            4,
            &mut *s,
            &ctx,
            0,
            None,
            None,
            None,
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("token id 64 is outside the vocabulary of 64"),
        "{err}"
    );
    let err = p.after_verify(3, &mut *s, 0).unwrap_err();
    assert!(err.to_string().contains("3 accepted"), "{err}");
    let mut other = prefilled(&p, &ctx, &[1]);
    assert!(p
        .prefill_drafter(&[1, 99], DevicePtr::NULL, &mut *other, &ctx, 0)
        .is_err());
}

#[test]
fn passes_the_conformance_check() {
    let report = check_proposer(&PromptLookup::default(), &CheckOptions::default());
    assert!(report.is_ok(), "{report}");
    for check in [
        "propose",
        "propose_batch",
        "grammar mask",
        "free_state: leaks",
        "after_verify",
    ] {
        assert!(
            report.checks_run.iter().any(|c| c == check),
            "{check} did not run: {:?}",
            report.checks_run
        );
    }
}
