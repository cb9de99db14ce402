//! SuffixDecoding drafts what a brute-force count of continuations over the stored token
//! streams gives, keeps its shared tree within the bound (evicting the oldest outputs),
//! passes the conformance check, and rejects bad input with errors that name it.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{CpuBackend, DevicePtr};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig, ModelLevers};
use specdraft::speculative::conformance::{check_proposer, CheckOptions};
use specdraft::speculative::{
    bitmask_words, DraftProposer, ProposerState, SuffixDecoding, SuffixDecodingOptions, SuffixState,
};
use std::collections::VecDeque;
use std::sync::Arc;

#[path = "reference/suffix_count.rs"]
mod suffix_count;
use suffix_count::{distinct_strings, Reference};

fn ctx(vocab: usize) -> ForwardContext<'static> {
    ForwardContext::new(
        Arc::new(CpuBackend::new()),
        Arc::new(BufferArena::empty(4)),
        Arc::new(ModelConfig::tiny(vocab)),
        ModelLevers::default(),
    )
}

fn options(
    max_depth: usize,
    min_token_prob: f32,
    factor: f32,
    nodes: usize,
) -> SuffixDecodingOptions {
    SuffixDecodingOptions {
        max_depth,
        min_token_prob,
        max_spec_factor: factor,
        max_tree_nodes: nodes,
    }
}

fn prefilled(
    p: &SuffixDecoding,
    ctx: &ForwardContext<'_>,
    prompt: &[u32],
) -> Box<dyn ProposerState> {
    let mut s = p.alloc_state(&*ctx.gpu).unwrap();
    assert_eq!(
        p.prefill_drafter(prompt, DevicePtr::NULL, &mut *s, ctx, 0)
            .unwrap(),
        0
    );
    s
}

fn propose(
    p: &SuffixDecoding,
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

fn history_of(s: &dyn ProposerState) -> Vec<u32> {
    s.as_any()
        .downcast_ref::<SuffixState>()
        .unwrap()
        .history()
        .to_vec()
}

#[test]
fn a_repeated_prompt_drafts_its_earlier_output_from_the_first_token() {
    let ctx = ctx(64);
    let p = SuffixDecoding::default();
    assert_eq!(
        p.prompt_context(),
        SuffixDecodingOptions::default().max_depth / 2
    );
    // Two earlier requests with different prompts (alike at the end, as a chat template
    // makes them) whose outputs start with the same token and then part.
    let prompts = [vec![5, 6, 7, 8, 1, 2], vec![9, 10, 11, 12, 1, 2]];
    let outputs = [vec![20, 21, 22, 23, 24, 25], vec![20, 30, 31, 32, 33, 34]];
    for (prompt, output) in prompts.iter().zip(&outputs) {
        let mut s = prefilled(&p, &ctx, prompt);
        for (i, &t) in output.iter().enumerate() {
            propose(&p, &ctx, &mut *s, t, prompt.len() + i, 0, None);
            p.after_verify(0, &mut *s, 0).unwrap();
        }
        p.free_state(&*ctx.gpu, &mut *s).unwrap();
    }
    // The second prompt again: from its first generated token, its own earlier output.
    for (prompt, output) in prompts.iter().zip(&outputs) {
        let mut s = prefilled(&p, &ctx, prompt);
        let drafts = propose(&p, &ctx, &mut *s, output[0], prompt.len(), 4, None);
        assert_eq!(drafts, output[1..5], "prompt {prompt:?}");
        p.free_state(&*ctx.gpu, &mut *s).unwrap();
    }
}

#[test]
fn drafts_equal_a_brute_force_count_on_random_streams() {
    let vocab = 64;
    let ctx = ctx(vocab);
    let mut rng = SmallRng::seed_from_u64(5);
    let (mut proposes, mut nonempty, mut from_shared) = (0, 0, 0);
    for o in [
        options(6, 0.1, 1.0, 1 << 20),
        options(4, 0.3, 2.0, 1 << 20),
        options(8, 0.0, 0.5, 1 << 20),
        options(2, 0.5, 1.0, 1 << 20),
    ] {
        let p = SuffixDecoding::new(o).unwrap();
        let reference = Reference::of(&o);
        let mut outputs: Vec<Vec<u32>> = Vec::new();
        for _ in 0..8 {
            let alphabet = rng.random_range(2..5u32);
            let prompt: Vec<u32> = (0..rng.random_range(0..30))
                .map(|_| rng.random_range(0..alphabet))
                .collect();
            let mut s = prefilled(&p, &ctx, &prompt);
            let (mut history, mut prompt_len) = (prompt.clone(), prompt.len());
            for _ in 0..80 {
                let pos = if !history.is_empty() && rng.random_bool(0.15) {
                    rng.random_range(history.len().saturating_sub(4)..history.len())
                } else {
                    history.len()
                };
                let last = rng.random_range(0..alphabet);
                let n = rng.random_range(0..7);
                let mask: Option<Vec<i32>> = rng
                    .random_bool(0.2)
                    .then(|| (0..bitmask_words(vocab)).map(|_| rng.random()).collect());
                history.truncate(pos);
                prompt_len = prompt_len.min(pos);
                history.push(last);
                let drafts = propose(&p, &ctx, &mut *s, last, pos, n, mask.as_deref());
                let (want, _) = reference.drafts(&outputs, &history, n, mask.as_deref());
                assert_eq!(
                    drafts, want,
                    "{o:?}\nhistory {history:?}\noutputs {outputs:?}"
                );
                let own = reference.drafts(&[], &history, n, mask.as_deref()).0;
                from_shared += usize::from(own != want);
                proposes += 1;
                nonempty += usize::from(!drafts.is_empty());
                let accepted = rng.random_range(0..=drafts.len());
                p.after_verify(accepted, &mut *s, 0).unwrap();
                history.extend_from_slice(&drafts[..accepted]);
            }
            assert_eq!(history_of(&*s), history);
            p.free_state(&*ctx.gpu, &mut *s).unwrap();
            if history.len() > prompt_len {
                // The output goes in after the prompt's last max_depth / 2 tokens.
                outputs.push(history[prompt_len.saturating_sub(o.max_depth / 2)..].to_vec());
            }
        }
        assert_eq!(p.shared_tree().unwrap().outputs, outputs.len());
    }
    // The comparison means something only if drafts were common and the shared tree
    // decided some of them.
    assert!(nonempty * 2 > proposes, "{nonempty} of {proposes}");
    assert!(from_shared * 20 > proposes, "{from_shared} of {proposes}");
}

#[test]
fn batch_drafts_and_confidences_equal_the_reference() {
    let vocab = 32;
    let ctx = ctx(vocab);
    let o = options(6, 0.05, 1.0, 1 << 20);
    let p = SuffixDecoding::new(o).unwrap();
    let reference = Reference::of(&o);
    let mut rng = SmallRng::seed_from_u64(9);
    let outputs: Vec<Vec<u32>> = (0..5)
        .map(|_| (0..40).map(|_| rng.random_range(0..4)).collect())
        .collect();
    for out in &outputs {
        p.remember_output(out).unwrap();
    }
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|_| {
            (0..rng.random_range(1..20))
                .map(|_| rng.random_range(0..4))
                .collect()
        })
        .collect();
    let mut states: Vec<Box<dyn ProposerState>> =
        prompts.iter().map(|pr| prefilled(&p, &ctx, pr)).collect();
    let last: Vec<u32> = prompts.iter().map(|_| rng.random_range(0..4)).collect();
    let positions: Vec<usize> = prompts.iter().map(|pr| pr.len()).collect();
    let hiddens = vec![DevicePtr::NULL; prompts.len()];
    let mut conf = Vec::new();
    let drafts = {
        let mut refs: Vec<&mut dyn ProposerState> = states
            .iter_mut()
            .map(|s| -> &mut dyn ProposerState { &mut **s })
            .collect();
        p.propose_batch(
            &last,
            &hiddens,
            &positions,
            5,
            &mut refs,
            &ctx,
            0,
            Some(&mut conf),
        )
        .unwrap()
        .unwrap()
    };
    let mut drafted = 0;
    for (i, pr) in prompts.iter().enumerate() {
        let mut history = pr.clone();
        history.push(last[i]);
        let (want, probs) = reference.drafts(&outputs, &history, 5, None);
        assert_eq!(drafts[i], want, "sequence {i}");
        let probs: Vec<f32> = probs.iter().map(|&x| x as f32).collect();
        assert_eq!(conf[i], probs, "sequence {i}");
        drafted += want.len();
    }
    assert!(drafted > 0);
    for mut s in states {
        p.free_state(&*ctx.gpu, &mut *s).unwrap();
    }
}

#[test]
fn picks_the_most_frequent_continuation_and_stops_below_the_threshold() {
    let ctx = ctx(100);
    let p = SuffixDecoding::new(options(8, 0.3, 1.0, 1 << 20)).unwrap();
    // "1 2 3" went on with "4 5 6" twice and "9" once.
    for out in [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], [1, 2, 3, 4, 5, 6]] {
        p.remember_output(&out).unwrap();
    }
    let mut long = prefilled(&p, &ctx, &[50, 1, 2]);
    // Match "1 2 3" (3 tokens): "4" with probability 2/3, then "5" and "6" always.
    assert_eq!(propose(&p, &ctx, &mut *long, 3, 3, 8, None), vec![4, 5, 6]);
    // A match of one token ("3") drafts at most one.
    let mut short = prefilled(&p, &ctx, &[50]);
    assert_eq!(propose(&p, &ctx, &mut *short, 3, 1, 8, None), vec![4]);
    // Above the threshold of 2/3 nothing is drafted.
    let strict = SuffixDecoding::new(options(8, 0.7, 1.0, 1 << 20)).unwrap();
    strict
        .remember_output(&[1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3, 4])
        .unwrap();
    let mut s = prefilled(&strict, &ctx, &[50, 1, 2]);
    assert!(propose(&strict, &ctx, &mut *s, 3, 3, 8, None).is_empty());
    strict.free_state(&*ctx.gpu, &mut *s).unwrap();
    for mut st in [long, short] {
        p.free_state(&*ctx.gpu, &mut *st).unwrap();
    }
}

#[test]
fn shared_tree_stays_within_its_bound_and_evicts_the_oldest() {
    let max_nodes = 300;
    let o = options(6, 0.1, 1.0, max_nodes);
    let p = SuffixDecoding::new(o).unwrap();
    let mut rng = SmallRng::seed_from_u64(3);
    // The same bound, kept by brute force: newest outputs first, oldest dropped.
    let mut kept: VecDeque<Vec<u32>> = VecDeque::new();
    let mut peak_bytes = 0;
    for i in 0..400 {
        let len = if i % 50 == 49 {
            400
        } else {
            rng.random_range(1..60)
        };
        let output: Vec<u32> = (0..len).map(|_| rng.random_range(0..12)).collect();
        p.remember_output(&output).unwrap();
        let fits = |streams: &VecDeque<Vec<u32>>| {
            let all: Vec<Vec<u32>> = streams.iter().cloned().collect();
            distinct_strings(&all, o.max_depth) <= max_nodes
                && all.iter().map(Vec::len).sum::<usize>() <= max_nodes
        };
        kept.push_back(Vec::new());
        for &t in &output {
            kept.back_mut().unwrap().push(t);
            while !fits(&kept) && kept.len() > 1 {
                kept.pop_front();
            }
            if !fits(&kept) {
                kept.back_mut().unwrap().pop();
                break;
            }
        }
        if kept.back().is_some_and(Vec::is_empty) {
            kept.pop_back();
        }
        let stats = p.shared_tree().unwrap();
        assert!(stats.nodes <= max_nodes, "{stats:?}");
        assert!(stats.tokens <= max_nodes, "{stats:?}");
        let all: Vec<Vec<u32>> = kept.iter().cloned().collect();
        assert_eq!(
            stats.nodes,
            distinct_strings(&all, o.max_depth),
            "after output {i}"
        );
        assert_eq!(
            (stats.outputs, stats.tokens),
            (kept.len(), all.iter().map(Vec::len).sum())
        );
        peak_bytes = peak_bytes.max(stats.bytes);
    }
    // Memory is bounded by the node bound, not by what went through: at most 160 bytes a
    // node of the bound plus a fixed few kilobytes.
    assert!(peak_bytes <= 160 * max_nodes + 8192, "{peak_bytes} bytes");
}

#[test]
fn a_sequences_own_tree_is_exact_and_forgets_what_a_re_propose_takes_back() {
    let ctx = ctx(16);
    let p = SuffixDecoding::new(options(5, 0.1, 1.0, 0)).unwrap();
    let mut rng = SmallRng::seed_from_u64(1);
    let prompt: Vec<u32> = (0..200).map(|_| rng.random_range(0..6)).collect();
    let mut s = prefilled(&p, &ctx, &prompt);
    let st = |s: &dyn ProposerState| {
        s.as_any()
            .downcast_ref::<SuffixState>()
            .unwrap()
            .tree_nodes()
    };
    let before = st(&*s);
    assert_eq!(before, distinct_strings(std::slice::from_ref(&prompt), 5));
    propose(&p, &ctx, &mut *s, 15, 200, 4, None);
    let mut with_15 = prompt.clone();
    with_15.push(15);
    assert_eq!(st(&*s), distinct_strings(&[with_15], 5));
    // Re-proposing further back drops everything after that point from the tree.
    propose(&p, &ctx, &mut *s, 14, 150, 4, None);
    let mut cut = prompt[..150].to_vec();
    cut.push(14);
    assert_eq!(st(&*s), distinct_strings(&[cut.clone()], 5));
    assert_eq!(history_of(&*s), cut);
    // max_tree_nodes 0 keeps no outputs.
    p.free_state(&*ctx.gpu, &mut *s).unwrap();
    assert_eq!(p.shared_tree().unwrap().outputs, 0);
}

#[test]
fn passes_the_conformance_check() {
    for (label, p) in [
        ("default", SuffixDecoding::default()),
        (
            "small",
            SuffixDecoding::new(options(3, 0.0, 2.0, 50)).unwrap(),
        ),
    ] {
        for seed in 0..3 {
            let report = check_proposer(
                &p,
                &CheckOptions {
                    label: label.into(),
                    seed,
                    ..CheckOptions::default()
                },
            );
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
                    "{check}: {:?}",
                    report.checks_run
                );
            }
        }
        // Every checked sequence's output reached the shared tree when it was freed.
        assert!(p.shared_tree().unwrap().outputs > 0);
    }
}

#[test]
fn bad_input_gets_clear_errors_and_zero_drafts_gets_none() {
    let ctx = ctx(64);
    let p = SuffixDecoding::default();
    let mut s = prefilled(&p, &ctx, &[1, 2, 3, 1, 2]);
    let err = p
        .propose(
            64,
            DevicePtr::NULL,
            5,
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
            .contains("propose: token id 64 is outside the vocabulary of 64"),
        "{err}"
    );
    // num_drafts 0: no drafts, and the token is still learned.
    assert!(propose(&p, &ctx, &mut *s, 3, 5, 0, None).is_empty());
    assert_eq!(history_of(&*s), vec![1, 2, 3, 1, 2, 3]);
    assert_eq!(propose(&p, &ctx, &mut *s, 3, 5, 4, None), vec![1, 2, 3]);
    let err = p.after_verify(4, &mut *s, 0).unwrap_err();
    assert!(
        err.to_string().contains("4 accepted, but only 3 drafts"),
        "{err}"
    );
    let err = p
        .prefill_drafter(&[1, 70], DevicePtr::NULL, &mut *s, &ctx, 0)
        .unwrap_err();
    assert!(
        err.to_string().contains("prefill_drafter: token id 70"),
        "{err}"
    );
    let mut foreign: Box<dyn ProposerState> = Box::new(Foreign);
    let err = p.after_verify(0, &mut *foreign, 0).unwrap_err();
    assert!(err.to_string().contains("not a SuffixState"), "{err}");
    let err = p
        .propose_batch(
            &[1, 2],
            &[DevicePtr::NULL],
            &[0, 0],
            4,
            &mut [],
            &ctx,
            0,
            None,
        )
        .unwrap_err();
    assert!(err.to_string().contains("slices differ in length"), "{err}");
    for (o, what) in [
        (
            options(1, 0.1, 1.0, 10),
            "max_depth must be in 2..=4096, got 1",
        ),
        (
            options(24, 1.5, 1.0, 10),
            "min_token_prob must be in [0, 1], got 1.5",
        ),
        (
            options(24, f32::NAN, 1.0, 10),
            "min_token_prob must be in [0, 1], got NaN",
        ),
        (
            options(24, 0.1, -1.0, 10),
            "max_spec_factor must be finite and >= 0, got -1",
        ),
        (
            options(24, 0.1, 1.0, usize::MAX),
            "max_tree_nodes must be at most",
        ),
    ] {
        let err = SuffixDecoding::new(o).unwrap_err();
        assert!(err.to_string().contains(what), "{err}");
    }
    p.free_state(&*ctx.gpu, &mut *s).unwrap();
    // An output stored under a larger vocabulary drafts only ids inside this one.
    let q = SuffixDecoding::default();
    q.remember_output(&[1, 2, 3, 100, 4]).unwrap();
    let wide = self::ctx(128);
    for (c, want) in [(&ctx, vec![]), (&wide, vec![100, 4])] {
        let mut t = prefilled(&q, c, &[9, 1, 2]);
        assert_eq!(propose(&q, c, &mut *t, 3, 3, 4, None), want);
        q.free_state(&*c.gpu, &mut *t).unwrap();
    }
}

/// A state of another proposer's type.
struct Foreign;
specdraft::impl_proposer_state!(Foreign);
