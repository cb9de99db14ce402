//! Deferred drafter rows: a propose of 0 drafts keeps its verified row for a later batched
//! write instead of running the head at once. A head that defers must draft exactly what a
//! head that writes each row at once drafts (same tokens, same logits bit for bit), through
//! `propose` and `propose_batch`, across long runs of declined steps (past the backlog bound),
//! rollbacks and re-drafting; and a state freed, reset or emptied with rows deferred leaks
//! nothing.

mod mtp_common;

use mtp_common::*;
use specdraft::model::ModelLevers;
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization, MtpState, ProposerState};

fn mtp(state: &mut dyn ProposerState) -> &mut MtpState {
    state.as_any_mut().downcast_mut::<MtpState>().unwrap()
}

/// The backlog bound the head documents: one chunk of rows.
const BOUND: usize = specdraft::speculative::mtp::MTP_CHUNK_ROWS;

/// Drafts per step: runs of declined steps (one longer than the backlog bound) between
/// drafting steps of varied widths.
fn schedule() -> Vec<usize> {
    let mut s = vec![0, 0, 3, 0, 1, 0, 0, 0, 2];
    s.extend(std::iter::repeat_n(0, BOUND + 7));
    s.extend([3, 0, 3, 3, 0, 0, 1]);
    s
}

/// Proposes with deferral switched as `defer` (the switch only matters for 0 drafts).
fn propose(f: &Fixture, s: &mut dyn ProposerState, pos: usize, n: usize, defer: bool) -> Vec<u32> {
    f.head().set_defer_zero_draft_rows(defer);
    f.propose(s, pos, n)
}

fn propose_batch(
    f: &Fixture,
    states: &mut [&mut dyn ProposerState],
    pos: &[usize],
    n: usize,
) -> Vec<Vec<u32>> {
    f.head()
        .propose_batch(
            &pos.iter().map(|&p| f.tokens[p]).collect::<Vec<_>>(),
            &pos.iter().map(|&p| f.hidden(p - 1)).collect::<Vec<_>>(),
            pos,
            n,
            states,
            &f.ctx,
            0,
            None,
        )
        .unwrap()
        .expect("MtpHead proposes in batches")
}

fn logits(head: &MtpHead, f: &Fixture) -> Vec<u32> {
    // Compared as bits: equal floats would hide a -0.0 / 0.0 or NaN payload difference.
    let l = head.last_logits(f.gpu.as_ref(), 0).unwrap();
    l.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn deferred_rows_draft_bit_identical_to_rows_written_at_once() {
    let f = Fixture::new(
        "deferred_single",
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let head = f.head();
    let (mut eager, mut lazy) = (f.state(), f.state());
    f.prefill(&mut *eager, 8);
    f.prefill(&mut *lazy, 8);
    let mut pos = 8;
    let mut max_deferred = 0;
    let mut drafted_after_backlog = 0;
    for (step, &n) in schedule().iter().enumerate() {
        // Step 12: an unverified propose is redone from an earlier point first.
        if step == 12 {
            propose(&f, &mut *eager, pos, 0, false);
            propose(&f, &mut *lazy, pos, 0, true);
            pos -= 2;
        }
        let want = propose(&f, &mut *eager, pos, n, false);
        let want_logits = (n > 0).then(|| logits(head, &f));
        let got = propose(&f, &mut *lazy, pos, n, true);
        assert_eq!(got, want, "drafts at step {step}");
        if let Some(w) = want_logits {
            assert_eq!(logits(head, &f), w, "logits at step {step}");
            assert_eq!(mtp(&mut *lazy).deferred_rows(), 0, "step {step}");
            assert_eq!(
                mtp(&mut *lazy).pair_keys(),
                mtp(&mut *eager).pair_keys(),
                "written rows at step {step}"
            );
            drafted_after_backlog += usize::from(max_deferred == BOUND);
        }
        let accepted = want.len().min(step % 3);
        head.after_verify(accepted, &mut *eager, 0).unwrap();
        head.after_verify(accepted, &mut *lazy, 0).unwrap();
        assert_eq!(
            mtp(&mut *lazy).logical_pair_keys(),
            mtp(&mut *eager).pair_keys(),
            "rows after step {step}"
        );
        assert_eq!(
            head.drafter_rows(&mut *lazy),
            head.drafter_rows(&mut *eager)
        );
        let d = mtp(&mut *lazy).deferred_rows();
        assert!(d <= BOUND, "{d} rows deferred, bound {BOUND}");
        max_deferred = max_deferred.max(d);
        pos += accepted + 1;
    }
    assert_eq!(
        max_deferred, BOUND,
        "the schedule reaches the backlog bound"
    );
    assert!(drafted_after_backlog > 0);
    for mut s in [eager, lazy] {
        head.free_state(f.gpu.as_ref(), &mut *s).unwrap();
    }
    f.finish();
}

#[test]
fn batched_deferred_rows_draft_like_rows_written_at_once() {
    let f = Fixture::new(
        "deferred_batch",
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let head = f.head();
    // Two sequences at different positions, proposed together in one propose_batch.
    let starts = [8usize, 13];
    let mut eager: Vec<_> = starts.iter().map(|_| f.state()).collect();
    let mut lazy: Vec<_> = starts.iter().map(|_| f.state()).collect();
    for (i, &p) in starts.iter().enumerate() {
        f.prefill(&mut *eager[i], p);
        f.prefill(&mut *lazy[i], p);
    }
    let mut pos = starts.to_vec();
    for (step, &n) in schedule().iter().enumerate() {
        let want: Vec<Vec<u32>> = (0..2)
            .map(|i| propose(&f, &mut *eager[i], pos[i], n, false))
            .collect();
        head.set_defer_zero_draft_rows(true);
        let (a, b) = lazy.split_at_mut(1);
        let got = propose_batch(&f, &mut [&mut *a[0], &mut *b[0]], &pos, n);
        assert_eq!(got, want, "drafts at step {step}");
        for i in 0..2 {
            let accepted = want[i].len().min((step + i) % 3);
            head.after_verify(accepted, &mut *eager[i], 0).unwrap();
            head.after_verify(accepted, &mut *lazy[i], 0).unwrap();
            assert_eq!(
                mtp(&mut *lazy[i]).logical_pair_keys(),
                mtp(&mut *eager[i]).pair_keys(),
                "sequence {i} after step {step}"
            );
            pos[i] += accepted + 1;
        }
    }
    // One more drafting step from the same point: the last logits row, bit for bit.
    let want = propose(&f, &mut *eager[1], pos[1], 3, false);
    let want_logits = logits(head, &f);
    assert_eq!(propose(&f, &mut *lazy[1], pos[1], 3, true), want);
    assert_eq!(logits(head, &f), want_logits);
    for mut s in eager.into_iter().chain(lazy) {
        head.free_state(f.gpu.as_ref(), &mut *s).unwrap();
    }
    f.finish();
}

#[test]
fn states_freed_reset_or_emptied_with_rows_deferred_leak_nothing() {
    let f = Fixture::new(
        "deferred_free",
        "deepseek_v3",
        ModelLevers::default(),
        MtpQuantization::Bf16,
    );
    let head = f.head();
    head.set_defer_zero_draft_rows(true);
    let defer = |s: &mut dyn ProposerState, from: usize, steps: usize| {
        for pos in from..from + steps {
            f.propose(s, pos, 0);
            head.after_verify(0, s, 0).unwrap();
        }
        assert_eq!(mtp(s).deferred_rows(), steps);
    };
    // Freed (a removed or finished sequence).
    let mut freed = f.state();
    f.prefill(&mut *freed, 8);
    defer(&mut *freed, 8, 5);
    head.free_state(f.gpu.as_ref(), &mut *freed).unwrap();
    // Reset by a new prefill: the deferred rows go, the new prompt's rows are all it holds.
    let mut reset = f.state();
    f.prefill(&mut *reset, 8);
    defer(&mut *reset, 8, 4);
    assert_eq!(f.prefill(&mut *reset, 6), 5);
    assert_eq!(
        mtp(&mut *reset).logical_pair_keys(),
        (0..5).collect::<Vec<_>>()
    );
    head.free_state(f.gpu.as_ref(), &mut *reset).unwrap();
    // Emptied for carrying (preemption, a finished turn): only written rows are carried,
    // with the key of the newest written one, so the receiver catches up the rest.
    let mut carried = f.state();
    f.prefill(&mut *carried, 8);
    defer(&mut *carried, 8, 3);
    let (blocks, rows, key) = head.take_drafter_kv(&mut *carried).unwrap();
    assert_eq!((rows, key), (7, Some(6)));
    assert_eq!(head.drafter_rows(&mut *carried), 0);
    head.free_drafter_kv(&blocks);
    head.free_state(f.gpu.as_ref(), &mut *carried).unwrap();
    f.finish();
}
