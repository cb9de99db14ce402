//! Steps without drafts leave no gap in `MtpHead`'s KV: a propose of 0 drafts (what the
//! engine sends when its draft policy skips a step) writes the verified token's row, so a
//! head that skipped steps holds the very rows, and drafts the very tokens with the very
//! logits, of a head that drafted every step; per sequence and batched alike.

mod mtp_common;

use mtp_common::*;
use specdraft::model::ModelLevers;
use specdraft::speculative::{DraftProposer, MtpQuantization, MtpState, ProposerState};

/// The pair key of every row the state holds, written or deferred.
fn pair_keys(state: &mut dyn ProposerState) -> Vec<usize> {
    state
        .as_any_mut()
        .downcast_mut::<MtpState>()
        .expect("an MtpState")
        .logical_pair_keys()
}

/// Proposes `n` drafts for every state at `pos` in one `propose_batch` call.
fn propose_batch(f: &Fixture, states: &mut [&mut dyn ProposerState], pos: usize, n: usize) {
    let k = states.len();
    let drafts = f
        .head()
        .propose_batch(
            &vec![f.tokens[pos]; k],
            &vec![f.hidden(pos - 1); k],
            &vec![pos; k],
            n,
            states,
            &f.ctx,
            0,
            None,
        )
        .unwrap()
        .expect("MtpHead proposes in batches");
    assert!(drafts.iter().all(|d| d.len() == n), "{drafts:?}");
}

#[test]
fn a_head_that_skipped_steps_drafts_like_one_that_drafted_every_step() {
    let f = Fixture::new(
        "zero_drafts",
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let head = f.head();
    let prompt = 8;
    // `every` drafts each step; `skips` and `batched` draft nothing on steps 1..=5 (one per
    // sequence, and through propose_batch); every step verifies no draft, so the sequence
    // advances by the target's own token and each state must hold one row per position.
    let (mut every, mut skips, mut batched) = (f.state(), f.state(), f.state());
    for s in [&mut every, &mut skips, &mut batched] {
        assert_eq!(f.prefill(&mut **s, prompt), prompt - 1);
    }
    let skipped = |step: usize| (1..=5).contains(&step);
    for step in 0..8 {
        let pos = prompt + step;
        assert_eq!(f.propose(&mut *every, pos, 3).len(), 3);
        let n = if skipped(step) { 0 } else { 3 };
        let drafts = f.propose(&mut *skips, pos, n);
        assert_eq!(drafts.len(), n, "step {step}");
        propose_batch(&f, &mut [&mut *batched], pos, n);
        for s in [&mut every, &mut skips, &mut batched] {
            head.after_verify(0, &mut **s, 0).unwrap();
        }
        let want: Vec<usize> = (0..pos).collect();
        for (name, s) in [
            ("every", &mut every),
            ("skips", &mut skips),
            ("batched", &mut batched),
        ] {
            assert_eq!(pair_keys(&mut **s), want, "{name} after step {step}");
        }
    }
    // The next propose: same drafts, and the same logits bit for bit at the last step.
    let pos = prompt + 8;
    let drafts = f.propose(&mut *every, pos, 3);
    let logits = head.last_logits(f.gpu.as_ref(), 0).unwrap();
    assert_eq!(f.propose(&mut *skips, pos, 3), drafts);
    assert_eq!(head.last_logits(f.gpu.as_ref(), 0).unwrap(), logits);
    propose_batch(&f, &mut [&mut *batched], pos, 3);
    assert_eq!(head.last_logits(f.gpu.as_ref(), 0).unwrap(), logits);
    for mut s in [every, skips, batched] {
        head.free_state(f.gpu.as_ref(), &mut *s).unwrap();
    }
    f.finish();
}

#[test]
fn an_unverified_zero_draft_propose_is_rolled_back_like_any_other() {
    let f = Fixture::new(
        "zero_drafts_rollback",
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let head = f.head();
    let mut s = f.state();
    f.prefill(&mut *s, 8);
    // Proposing twice from the same point (no after_verify between) keeps one row for it.
    f.propose(&mut *s, 8, 0);
    f.propose(&mut *s, 8, 0);
    assert_eq!(head.drafter_rows(&mut *s), 8);
    // Proposing from the same point again with drafts replaces the pending row.
    assert_eq!(f.propose(&mut *s, 8, 2).len(), 2);
    assert_eq!(head.drafter_rows(&mut *s), 9);
    head.after_verify(0, &mut *s, 0).unwrap();
    assert_eq!(pair_keys(&mut *s), (0..8).collect::<Vec<_>>());
    head.free_state(f.gpu.as_ref(), &mut *s).unwrap();
    f.finish();
}
