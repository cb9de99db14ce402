//! The KV carry check: after `take_drafter_kv` a state behaves as freshly allocated, and
//! `install_drafter_kv` restores exactly what was taken.

use super::driver::Checker;
use super::guard::{guarded, guarded_value};
use super::synthetic::Sequence;

/// `take_drafter_kv` leaves a fresh state, and `install_drafter_kv` restores what was taken.
pub(super) fn check_kv_carry(checker: &mut Checker<'_>, seq: &mut Sequence) {
    let (p, gpu, n) = (
        checker.proposer,
        checker.gpu.clone(),
        checker.options.num_drafts,
    );
    let budget = Checker::budget(seq);
    let (last, pos, hidden) = (seq.truth[seq.pos], seq.pos, checker.hidden_for(seq));
    // Both states below are as fresh: neither was given captured rows yet.
    let stack = checker.last_stack_row(seq);
    let Some(state) = seq.state.as_mut() else {
        return;
    };
    let Some(taken) = guarded_value(&mut checker.report, "take_drafter_kv", || {
        p.take_drafter_kv(&mut **state)
    }) else {
        return;
    };
    let Some((blocks, rows, key)) = taken else {
        return;
    };
    checker.report.ran("take_drafter_kv: fresh state");
    let (rows_after, key_after) = (p.drafter_rows(&mut **state), p.last_pair_key(&mut **state));
    if rows_after != 0 || key_after.is_some() {
        checker.report.violate(
            "take_drafter_kv: fresh state",
            format!("after take, drafter_rows is {rows_after} and last_pair_key is {key_after:?}"),
            "after take_drafter_kv the state must behave as freshly allocated (0 rows, no pair key)",
        );
    }
    if let Some(mut fresh) = guarded(&mut checker.report, "alloc_state_for", || {
        p.alloc_state_for(&*gpu, budget)
    }) {
        let ctx = &checker.ctx;
        let from_fresh = guarded(&mut checker.report, "propose", || {
            p.propose(last, hidden, pos, n, &mut *fresh, ctx, 0, None, None, stack)
        });
        let from_taken = guarded(&mut checker.report, "propose", || {
            p.propose(
                last,
                hidden,
                pos,
                n,
                &mut **state,
                ctx,
                0,
                None,
                None,
                stack,
            )
        });
        if from_fresh.is_some() && from_taken.is_some() && from_fresh != from_taken {
            checker.report.violate(
                "take_drafter_kv: fresh state",
                format!("after take, propose drafted {from_taken:?}; a fresh state drafts {from_fresh:?}"),
                "clear everything the taken blocks described (rows, pair keys, cached drafts) in take_drafter_kv",
            );
        }
        guarded(&mut checker.report, "free_state", || {
            p.free_state(&*gpu, &mut *fresh)
        });
    }
    let Some(mut target) = guarded(&mut checker.report, "alloc_state_for", || {
        p.alloc_state_for(&*gpu, budget)
    }) else {
        p.free_drafter_kv(&blocks);
        return;
    };
    checker.report.ran("install_drafter_kv");
    let installed = guarded_value(&mut checker.report, "install_drafter_kv", || {
        p.install_drafter_kv(&mut *target, blocks.clone(), rows, key)
    });
    match installed {
        Some(true) => {
            let (r, k) = (p.drafter_rows(&mut *target), p.last_pair_key(&mut *target));
            if r != rows || k != key {
                checker.report.violate(
                    "install_drafter_kv",
                    format!("installed {rows} rows with pair key {key:?}, the state reports {r} rows and {k:?}"),
                    "install_drafter_kv must restore exactly what take_drafter_kv returned",
                );
            }
        }
        _ => {
            guarded_value(&mut checker.report, "free_drafter_kv", || {
                p.free_drafter_kv(&blocks)
            });
        }
    }
    guarded(&mut checker.report, "free_state", || {
        p.free_state(&*gpu, &mut *target)
    });
}
