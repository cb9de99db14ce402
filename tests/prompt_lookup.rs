//! PromptLookup drafts the true continuation of repetitive text, nothing without a repeat,
//! as many tokens as the occurrence matches, honours the grammar mask, its batch path equals
//! its per-sequence path, and its index drafts what a linear scan of the history finds.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{CpuBackend, DevicePtr};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig, ModelLevers};
use specdraft::speculative::conformance::{check_proposer, CheckOptions};
use specdraft::speculative::{
    bitmask_words, match_confidence, DraftProposer, DraftTree, PromptLookup, ProposerState,
};
use std::sync::Arc;

#[path = "reference/ngram_scan.rs"]
mod ngram_scan;
use ngram_scan::linear_scan;

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

/// `propose_tree` of at most `budget` nodes after `last` at `pos`, without a mask.
fn propose_tree(
    p: &PromptLookup,
    ctx: &ForwardContext<'_>,
    s: &mut dyn ProposerState,
    last: u32,
    pos: usize,
    budget: usize,
) -> DraftTree {
    p.propose_tree(
        last,
        DevicePtr::NULL,
        pos,
        budget,
        s,
        ctx,
        0,
        None,
        None,
        None,
    )
    .unwrap()
}

#[test]
fn batch_confidence_grows_with_the_match_whatever_was_asked() {
    let ctx = ctx(1000);
    let p = PromptLookup::new(1, 3).unwrap();
    // "1 2 3" matches 4 tokens counting back ("7 1 2 3"); "5 6" matches 2; "40" nothing.
    let prompts: [&[u32]; 3] = [&[7, 1, 2, 3, 4, 5, 0, 7, 1, 2], &[5, 6, 5], &[30]];
    let last = [3, 6, 40];
    let run = |n: usize| {
        let mut states: Vec<Box<dyn ProposerState>> =
            prompts.iter().map(|pr| prefilled(&p, &ctx, pr)).collect();
        let mut refs: Vec<&mut dyn ProposerState> = states
            .iter_mut()
            .map(|s| -> &mut dyn ProposerState { &mut **s })
            .collect();
        let positions: Vec<usize> = prompts.iter().map(|pr| pr.len()).collect();
        let mut conf = Vec::new();
        let drafts = p
            .propose_batch(
                &last,
                &[DevicePtr::NULL; 3],
                &positions,
                n,
                &mut refs,
                &ctx,
                0,
                Some(&mut conf),
            )
            .unwrap()
            .unwrap();
        (drafts, conf)
    };
    let (drafts, conf) = run(4);
    assert_eq!(drafts, vec![vec![4, 5, 0, 7], vec![5, 6], vec![]]);
    assert_eq!(conf, vec![vec![0.8; 4], vec![2.0 / 3.0; 2], vec![]]);
    assert_eq!(match_confidence(4), 0.8);
    // Asking for one draft reports the same confidence in it: the calibration by
    // confidence must not shift with the count the policy chose.
    let (drafts, conf) = run(1);
    assert_eq!(drafts, vec![vec![4], vec![5], vec![]]);
    assert_eq!(conf, vec![vec![0.8], vec![2.0 / 3.0], vec![]]);
    // Asking for none drafts nothing and reports nothing.
    let (drafts, conf) = run(0);
    assert!(drafts.iter().all(Vec::is_empty) && conf.iter().all(Vec::is_empty));
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
    // After "7 10" only "10" matches (its most recent occurrence is preceded by 6, not 7):
    // a one-token match earns one draft.
    let drafts = propose(&p, &ctx, &mut *s, 10, prompt.len(), 5, None);
    assert_eq!(drafts, vec![20]);
    p.after_verify(1, &mut *s, 0).unwrap();
    // "10 20 30" matches the second copy, and the tokens before it agree back to "10":
    // three matched tokens, three drafts.
    let drafts = propose(&p, &ctx, &mut *s, 30, prompt.len() + 2, 8, None);
    assert_eq!(drafts, vec![40, 50, 60]);
    p.after_verify(3, &mut *s, 0).unwrap();
    // "10 .. 70" now matches 7 tokens of the second copy: 7 drafts, running on past the
    // copy into the "7" and the answer that followed it.
    let drafts = propose(&p, &ctx, &mut *s, 70, prompt.len() + 6, 8, None);
    assert_eq!(drafts, vec![40, 80, 90, 7, 10, 20, 30]);
    // num_drafts still caps it.
    let drafts = propose(&p, &ctx, &mut *s, 70, prompt.len() + 6, 2, None);
    assert_eq!(drafts, vec![40, 80]);
}

#[test]
fn most_recent_match_wins_and_longer_ngrams_first() {
    let p = PromptLookup::new(1, 2).unwrap();
    // Suffix [1, 2] occurs twice: followed by 3 (old) and by 4 (recent).
    assert_eq!(p.lookup(&[1, 2, 3, 9, 1, 2, 4, 8, 1, 2], 1, None), vec![4]);
    // Bigram [7, 2] decides over the unigram [2] that occurs more recently.
    assert_eq!(p.lookup(&[7, 2, 5, 6, 2, 9, 7, 2], 1, None), vec![5]);
    // The most recent occurrence wins even when an older one matches further back: the
    // recent one matches 3 tokens ("9 1 2"), so it drafts 3, not the older one's 4.
    assert_eq!(
        p.lookup(&[8, 9, 1, 2, 3, 0, 9, 1, 2, 4, 0, 8, 9, 1, 2], 4, None),
        vec![4, 0, 8]
    );
    // A min_ngram of 2 refuses to match a single token.
    let strict = PromptLookup::new(2, 2).unwrap();
    assert_eq!(strict.lookup(&[3, 4, 5, 3], 3, None), Vec::<u32>::new());
    assert!(PromptLookup::new(0, 2).is_err());
    assert!(PromptLookup::new(3, 2).is_err());
}

#[test]
fn draft_length_grows_with_the_match_length() {
    let p = PromptLookup::default();
    // The history ends in "1 2"; "5 1 2" and "4 5 1 2" match further back in turn.
    let history = |before: &[u32]| -> Vec<u32> {
        let mut h = vec![4, 5, 1, 2, 10, 11, 12, 13, 14, 15, 16];
        h.extend_from_slice(before);
        h.extend([1, 2]);
        h
    };
    assert_eq!(p.lookup(&history(&[9, 9]), 8, None), vec![10, 11]);
    assert_eq!(p.lookup(&history(&[9, 5]), 8, None), vec![10, 11, 12]);
    assert_eq!(p.lookup(&history(&[4, 5]), 8, None), vec![10, 11, 12, 13]);
    // Past max_ngram the count goes on: the whole 6-token run matches.
    let long = [
        7, 8, 4, 5, 1, 2, 10, 11, 12, 13, 14, 15, 16, 3, 7, 8, 4, 5, 1, 2,
    ];
    assert_eq!(p.lookup(&long, 8, None), vec![10, 11, 12, 13, 14, 15]);
    assert_eq!(p.lookup(&long, 4, None), vec![10, 11, 12, 13]);
    assert!(p.lookup(&long, 0, None).is_empty());
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
    let prompt = [9, 1, 2, 3, 4, 5, 9];
    let mut s = prefilled(&p, &ctx, &prompt);
    let mut mask = vec![0i32; bitmask_words(64)];
    for t in [2u32, 3, 5] {
        mask[(t / 32) as usize] |= 1 << (t % 32);
    }
    // "9 1" matches two tokens: continuation 2 3; with the mask it is still 2 3.
    assert_eq!(propose(&p, &ctx, &mut *s, 1, 7, 4, Some(&mask)), vec![2, 3]);
    p.after_verify(2, &mut *s, 0).unwrap();
    // "9 1 2 3 4" matches five: continuation 5 9 1 2; 9 is forbidden, so only 5.
    assert_eq!(propose(&p, &ctx, &mut *s, 4, 10, 4, Some(&mask)), vec![5]);
    // A mask that forbids the first continuation token leaves nothing.
    let even_only: Vec<i32> = vec![0x5555_5555; bitmask_words(64)];
    assert!(propose(&p, &ctx, &mut *s, 4, 10, 4, Some(&even_only)).is_empty());
    // Proposing again from the same position is idempotent.
    assert_eq!(propose(&p, &ctx, &mut *s, 4, 10, 4, None), vec![5, 9, 1, 2]);
    assert_eq!(propose(&p, &ctx, &mut *s, 4, 10, 4, None), vec![5, 9, 1, 2]);
}

#[test]
fn drafts_equal_a_linear_scan_on_random_streams() {
    let vocab = 64;
    let ctx = ctx(vocab);
    let mut rng = SmallRng::seed_from_u64(11);
    let mut proposes = 0;
    let mut nonempty = 0;
    for (min, max) in [(1, 1), (1, 3), (2, 4), (3, 6)] {
        let p = PromptLookup::new(min, max).unwrap();
        for _ in 0..6 {
            // Few distinct tokens, so matches of every width happen often.
            let alphabet = rng.random_range(2..6u32);
            let prompt: Vec<u32> = (0..rng.random_range(0..40))
                .map(|_| rng.random_range(0..alphabet))
                .collect();
            let mut s = prefilled(&p, &ctx, &prompt);
            let mut history = prompt.clone();
            for _ in 0..300 {
                // Mostly the next position; sometimes a re-propose further back, with
                // another token, which must forget what came after it.
                let pos = if !history.is_empty() && rng.random_bool(0.15) {
                    rng.random_range(history.len().saturating_sub(5)..history.len())
                } else {
                    history.len()
                };
                let last = rng.random_range(0..alphabet);
                let n = rng.random_range(0..8);
                let mask: Option<Vec<i32>> = rng
                    .random_bool(0.2)
                    .then(|| (0..bitmask_words(vocab)).map(|_| rng.random()).collect());
                history.truncate(pos);
                history.push(last);
                let drafts = propose(&p, &ctx, &mut *s, last, pos, n, mask.as_deref());
                let want = linear_scan(min, max, &history, n, mask.as_deref());
                assert_eq!(drafts, want, "min {min} max {max}, history {history:?}");
                proposes += 1;
                nonempty += usize::from(!drafts.is_empty());
                let accepted = rng.random_range(0..=drafts.len());
                p.after_verify(accepted, &mut *s, 0).unwrap();
                history.extend_from_slice(&drafts[..accepted]);
            }
            let st = s
                .as_any()
                .downcast_ref::<specdraft::speculative::PromptLookupState>()
                .unwrap();
            assert_eq!(st.history(), &history[..]);
        }
    }
    // The comparison means something only if most proposes found a match.
    assert!(nonempty * 2 > proposes, "{nonempty} of {proposes}");
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

#[test]
fn a_tree_branches_over_the_earlier_matches_and_follows_the_path_it_is_told() {
    let ctx = ctx(1000);
    assert!(!PromptLookup::default().grows_trees());
    let p = PromptLookup::new(2, 3).unwrap().with_trees(true);
    assert!(p.grows_trees());
    // The suffix "33 1 2" never occurred; "1 2" did three times, after a different token
    // each time (so each match is two tokens long): followed by "5 6", by "8 9" and by
    // "5 7", newest last. The newest gives propose's chain; the others branch where they
    // differ from it.
    let prompt = [3, 1, 2, 5, 6, 4, 1, 2, 8, 9, 0, 1, 2, 5, 7, 33, 1];
    let pos = prompt.len();
    let mut s = prefilled(&p, &ctx, &prompt);
    let chain = propose(&p, &ctx, &mut *s, 2, pos, 4, None);
    assert_eq!(chain, [5, 7]);
    p.after_verify(0, &mut *s, 0).unwrap();
    let tree = propose_tree(&p, &ctx, &mut *s, 2, pos, 4);
    assert_eq!(tree.fault(4, 1000), None);
    assert_eq!(tree.tokens, [5, 7, 8, 9]);
    assert_eq!(tree.parents, [None, Some(0), None, Some(2)]);
    // The third match ("5 6") would need a fifth node: the budget holds.
    let small = propose_tree(&p, &ctx, &mut *s, 2, pos, 3);
    assert_eq!(small.tokens, [5, 7, 8]);
    let tree = propose_tree(&p, &ctx, &mut *s, 2, pos, 6);
    assert_eq!(tree.tokens, [5, 7, 8, 9, 6]);
    assert_eq!(tree.parents, [None, Some(0), None, Some(2), Some(0)]);
    // A path that is not one is refused; the second branch enters the history.
    assert!(p.after_verify_tree(&[2, 1], &mut *s, 0).is_err());
    assert!(p.after_verify(3, &mut *s, 0).is_err());
    p.after_verify_tree(&[2, 3], &mut *s, 0).unwrap();
    let hist = s
        .as_any()
        .downcast_ref::<specdraft::speculative::PromptLookupState>()
        .unwrap()
        .history()
        .to_vec();
    assert_eq!(hist[pos..], [2, 8, 9]);
}
