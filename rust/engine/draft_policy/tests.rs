//! The policy's choices on hand-made cost curves and outcomes.

use super::exploration::{EXPLORE_SHARE, REFRESH_AGE};
use super::probes::PROBE_FIRST;
use super::*;
use crate::engine::cost_model::{CostCurve, CostCurves, FixedCost, MeasuredCost};

fn policy(verify: &[(usize, f64)]) -> DraftPolicy {
    let curves = CostCurves {
        verify: CostCurve::from_points(verify.iter().copied()),
        draft: CostCurve::default(),
    };
    DraftPolicy::new(DraftPolicyKind::Adaptive, Arc::new(FixedCost(curves)))
}

fn fresh(budgets: &[usize]) -> (Vec<SequenceDraftStats>, Vec<usize>) {
    (
        vec![SequenceDraftStats::default(); budgets.len()],
        budgets.to_vec(),
    )
}

fn choose(
    p: &DraftPolicy,
    stats: &[SequenceDraftStats],
    budgets: &[usize],
    others: usize,
) -> Vec<usize> {
    let c: Vec<Candidate<'_>> = stats
        .iter()
        .zip(budgets)
        .map(|(stats, &budget)| Candidate { budget, stats })
        .collect();
    p.plan(&c, others, false).0
}

/// The counts `p` plans for trees (node budgets).
fn choose_trees(p: &DraftPolicy, stats: &[SequenceDraftStats], budgets: &[usize]) -> Vec<usize> {
    let c: Vec<Candidate<'_>> = stats
        .iter()
        .zip(budgets)
        .map(|(stats, &budget)| Candidate { budget, stats })
        .collect();
    p.plan(&c, 0, true).0
}

#[test]
fn cold_start_drafts_then_measures_the_other_end() {
    let (stats, budgets) = fresh(&[4, 2]);
    // Nothing measured: the first sequence's whole budget, none for the others (a few
    // rows more than a plain step, however wide the batch).
    assert_eq!(choose(&policy(&[]), &stats, &budgets, 1), vec![4, 0]);
    // The first sequence with a budget is the one asked.
    assert_eq!(choose(&policy(&[]), &stats, &[0, 2], 1), vec![0, 2]);
    // Measured only at the drafting row count: a plain step next.
    assert_eq!(
        choose(&policy(&[(7, 1.0)]), &stats, &budgets, 1),
        vec![0, 0]
    );
    // Measured only at the plain row count (3 = 2 drafting + 1 other): draft.
    assert_eq!(
        choose(&policy(&[(3, 1.0)]), &stats, &budgets, 1),
        vec![4, 0]
    );
    let fixed = DraftPolicy::new(DraftPolicyKind::Fixed, Arc::new(FixedCost::default()));
    assert_eq!(choose(&fixed, &stats, &budgets, 0), vec![4, 2]);
}

#[test]
fn the_count_follows_acceptance_against_the_row_cost() {
    // One row 1.0 s, each more 0.25 s: a draft pays when accepted more than 1 in 4.
    let p = policy(&[(1, 1.0), (2, 1.25)]);
    let mut stats = SequenceDraftStats::default();
    // Always accepted: the whole budget.
    for _ in 0..6 {
        stats.asked = Some(4);
        p.observe(&mut stats, 4, 4);
    }
    assert_eq!(choose(&p, std::slice::from_ref(&stats), &[4], 0), vec![4]);
    // A fresh policy and a sequence whose first draft is always rejected: none.
    let p = policy(&[(1, 1.0), (2, 1.25)]);
    let mut stats = SequenceDraftStats::default();
    for _ in 0..6 {
        stats.asked = Some(4);
        p.observe(&mut stats, 4, 0);
    }
    assert_eq!(choose(&p, std::slice::from_ref(&stats), &[4], 0), vec![0]);
    // Idle long enough, it is probed with one draft; a failed probe doubles the wait.
    for _ in 0..PROBE_FIRST {
        stats.asked = Some(0);
        p.observe(&mut stats, 0, 0);
    }
    assert_eq!(choose(&p, std::slice::from_ref(&stats), &[4], 0), vec![1]);
    stats.asked = Some(1);
    stats.probe.probing = true;
    p.observe(&mut stats, 1, 0);
    assert_eq!(p.probe_wait(&stats), 2 * PROBE_FIRST);
    // A new sequence starts with the wait the failed probe left.
    assert_eq!(
        p.probe_wait(&SequenceDraftStats::default()),
        2 * PROBE_FIRST
    );
    assert_eq!(choose(&p, std::slice::from_ref(&stats), &[4], 0), vec![0]);
}

#[test]
fn a_sequence_turned_down_after_failing_comes_back_only_through_a_probe() {
    // One row 1 s, each more 0.25 s. Another sequence's drafts are always accepted, so
    // the engine's figures are excellent.
    let p = policy(&[(1, 1.0), (2, 1.25)]);
    let mut good = SequenceDraftStats::default();
    for _ in 0..50 {
        good.asked = Some(4);
        p.observe(&mut good, 4, 4);
    }
    // This one's single drafting step failed. Shrunk towards the engine's figures its
    // estimate would still say draft (2/3 at the first position against the 1 in 4 a row
    // needs), so one decline is forced by hand, as the policy makes it in a wide batch.
    let mut weak = SequenceDraftStats {
        asked: Some(2),
        ..SequenceDraftStats::default()
    };
    p.observe(&mut weak, 2, 0);
    assert!(choose(&p, std::slice::from_ref(&weak), &[4], 0)[0] > 0);
    weak.asked = Some(0);
    p.observe(&mut weak, 0, 0);
    // Turned down after a failure, where the engine's figures say drafts pay: exactly
    // one draft after a single idle step (a probe that is expected to pay).
    assert!(p.probe_due(&weak));
    assert_eq!(choose(&p, std::slice::from_ref(&weak), &[4], 0), vec![1]);
    // A failed probe keeps it shut and doubles its wait, so it is probed only after the
    // whole of that wait; an accepted one lets the policy choose again.
    weak.asked = Some(1);
    weak.probe.probing = true;
    p.observe(&mut weak, 1, 0);
    assert_eq!(p.probe_wait(&weak), 2 * PROBE_FIRST);
    for _ in 0..2 * PROBE_FIRST {
        assert_eq!(choose(&p, std::slice::from_ref(&weak), &[4], 0), vec![0]);
        weak.asked = Some(0);
        p.observe(&mut weak, 0, 0);
    }
    assert_eq!(choose(&p, std::slice::from_ref(&weak), &[4], 0), vec![1]);
    weak.asked = Some(1);
    p.observe(&mut weak, 1, 1);
    assert!(choose(&p, std::slice::from_ref(&weak), &[4], 0)[0] > 0);
}

#[test]
fn probes_spend_no_more_than_the_exploration_share_of_the_verify_cost() {
    // One row 1 s, each more 0.25 s; eight sequences whose drafts always fail.
    let p = policy(&[(1, 1.0), (2, 1.25)]);
    let mut stats = vec![SequenceDraftStats::default(); 8];
    for s in &mut stats {
        s.asked = Some(4);
        p.observe(s, 4, 0);
    }
    let steps = 400;
    let mut probes = 0;
    for _ in 0..steps {
        let k = choose(&p, &stats, &[4; 8], 0);
        for (s, &k) in stats.iter_mut().zip(&k) {
            s.probe.probing = k > 0 && p.probe_due(s);
            s.asked = Some(k);
            p.observe(s, k, 0);
        }
        assert!(k.iter().all(|&k| k <= 1), "{k:?}");
        probes += k.iter().sum::<usize>();
    }
    // A plain step (8 rows) costs 0.75 + 8 * 0.25 = 2.75 s, so each earns 1% of it:
    // 0.11 rows at 0.25 s a row; one row may be banked at the start.
    let allowed = 1.0 + steps as f64 * EXPLORE_SHARE * 2.75 / 0.25;
    assert!(
        probes as f64 <= allowed,
        "{probes} probes, {allowed} allowed"
    );
    // Yet the sequences are still probed now and then, so they could recover.
    assert!(
        probes as f64 >= allowed / 2.0,
        "{probes} probes, {allowed} allowed"
    );
}

#[test]
fn a_block_drafter_pays_one_block_forward_whatever_the_count() {
    // A verify row costs 0.1 s on a 1 s step; drafting costs 1 s a draft when read along
    // the count. Drafts are always accepted.
    let curves = || CostCurves {
        verify: CostCurve::from_points([(1, 1.0), (2, 1.1)]),
        draft: CostCurve::from_points((0..=4).map(|k| (k, k as f64))),
    };
    let accepted = |p: &DraftPolicy| {
        let mut stats = SequenceDraftStats::default();
        for _ in 0..6 {
            stats.asked = Some(4);
            p.observe(&mut stats, 4, 4);
        }
        stats
    };
    // Token by token, 4 drafts would cost 4 s of drafting for 4 tokens: none pays.
    let p = DraftPolicy::new(DraftPolicyKind::Adaptive, Arc::new(FixedCost(curves())));
    assert_eq!(choose(&p, &[accepted(&p)], &[4], 0), vec![0]);
    // One block forward (1 s) drafts all 4: the whole budget pays.
    let p = DraftPolicy::new(DraftPolicyKind::Adaptive, Arc::new(FixedCost(curves())))
        .for_block_drafter(true);
    assert_eq!(choose(&p, &[accepted(&p)], &[4], 0), vec![4]);
    assert_eq!(
        (0..=5).map(|k| p.draft_abscissa(k)).collect::<Vec<_>>(),
        [0, 1, 1, 1, 1, 1]
    );
}

#[test]
fn a_flat_measured_cost_does_not_make_a_useless_drafter_free() {
    // Noise flattened the measured slope: rows look free. A drafter rejected 50 times
    // running still gets nothing, since a row costs at least a share of a plain row.
    let p = policy(&[(1, 1.0), (2, 1.0), (3, 0.9)]);
    let mut stats = SequenceDraftStats::default();
    for _ in 0..50 {
        stats.asked = Some(4);
        p.observe(&mut stats, 4, 0);
    }
    assert_eq!(choose(&p, std::slice::from_ref(&stats), &[4], 0), vec![0]);
}

#[test]
fn rows_past_the_knee_of_a_bent_cost_are_priced_at_its_steeper_slope() {
    use crate::engine::cost_fit::{BENT, BENT_LINE};
    // Eight sequences whose first drafts are accepted about half the time. A plain step
    // (8 rows) sits at the knee of the measured curve, past which a row costs 0.1 s
    // against 1.07 s for 8 tokens: a draft then pays only when accepted more than about
    // 3 times in 4. The straight line through the same points (0.037 s a row from
    // 1.18 s) would pay for one accepted 1 time in 4.
    let half = |p: &DraftPolicy| {
        let mut stats = SequenceDraftStats::default();
        for step in 0..40 {
            stats.asked = Some(1);
            p.observe(&mut stats, 1, step % 2);
        }
        vec![stats; 8]
    };
    let bent = policy(&BENT);
    let k = choose(&bent, &half(&bent), &[4; 8], 0);
    assert_eq!(k, vec![0; 8]);
    let (a, b) = BENT_LINE;
    let straight = policy(&[(1, a + b), (2, a + 2.0 * b)]);
    let k = choose(&straight, &half(&straight), &[4; 8], 0);
    assert!(k.iter().all(|&k| k > 0), "{k:?}");
    // Below the knee the flat part holds: one sequence (1 row) drafts there.
    let k = choose(&bent, &half(&bent)[..1], &[4], 0);
    assert!(k[0] > 0, "{k:?}");
    // Four sequences (4 rows) take the cheap rows up to the knee, one first draft each,
    // and none past it, where a second draft (about 0.3 tokens, worth 0.08 s) would cost
    // 0.1 s; read as cheap everywhere, each would be asked for all 4.
    let k = choose(&bent, &half(&bent)[..4], &[4; 4], 0);
    assert_eq!(k, vec![1; 4]);
}

#[test]
fn a_proposer_that_returns_nothing_costs_no_rows() {
    // A row costs half a plain step, drafting is free. A proposer that returns 4 right
    // drafts one step in 4 and none otherwise pays: counted as 4 rows every step for an
    // expected 1 token it would not (3 s for 2 tokens against 1 s for 1).
    let p = policy(&[(1, 1.0), (2, 1.5)]);
    let mut stats = SequenceDraftStats::default();
    for step in 0..40 {
        stats.asked = Some(4);
        if step % 4 == 0 {
            p.observe(&mut stats, 4, 4);
        } else {
            p.observe(&mut stats, 0, 0);
        }
    }
    assert!(choose(&p, std::slice::from_ref(&stats), &[4], 0)[0] > 0);
}

#[test]
fn a_stale_wide_cost_is_measured_again_only_where_drafts_could_pay() {
    // Early, under load, 5 rows took 10 s; since then only plain 1 s steps ran.
    let setup = || {
        let cost = Arc::new(MeasuredCost::new(0.05));
        cost.record_verify(5, 10.0);
        for _ in 0..REFRESH_AGE - 1 {
            cost.record_verify(1, 1.0);
        }
        let p = DraftPolicy::new(DraftPolicyKind::Adaptive, cost.clone());
        (cost, p)
    };
    let observed = |p: &DraftPolicy, accepted: usize| {
        let mut stats = SequenceDraftStats::default();
        for _ in 0..6 {
            stats.asked = Some(4);
            p.observe(&mut stats, 4, accepted);
        }
        stats
    };
    // Runs `steps` steps of one sequence whose verify really costs `per_row` a row
    // beyond 1 s and whose drafts are all accepted (`right`) or all rejected; returns
    // the counts asked.
    let run = |cost: &MeasuredCost,
               p: &DraftPolicy,
               stats: &mut SequenceDraftStats,
               right: bool,
               per_row: f64,
               steps: u64| {
        (0..steps)
            .map(|_| {
                let k = choose(p, std::slice::from_ref(stats), &[4], 0)[0];
                cost.record_verify(1 + k, 1.0 + per_row * k as f64);
                stats.probe.probing = k > 0 && p.probe_due(stats);
                stats.asked = Some(k);
                p.observe(stats, k, if right { k } else { 0 });
                k
            })
            .collect::<Vec<usize>>()
    };
    // Always right, rows cheap (0.25 s) in truth: nothing before the wide end is
    // REFRESH_AGE records old, a refresh within two more REFRESH_AGE, and from then
    // on the line is right again and the whole budget is asked.
    let (cost, p) = setup();
    let mut oracle = observed(&p, 4);
    assert_eq!(choose(&p, std::slice::from_ref(&oracle), &[4], 0), vec![0]);
    let asks = run(&cost, &p, &mut oracle, true, 0.25, 3 * REFRESH_AGE);
    let first = asks.iter().position(|&k| k > 0).expect("never refreshed");
    assert!(first > 0 && first <= 2 * REFRESH_AGE as usize, "{asks:?}");
    assert!(asks[first + 30..].iter().all(|&k| k == 4), "{asks:?}");
    // Rows as dear as the old figure said: refreshed at most once in REFRESH_AGE
    // records, and otherwise left at none.
    let (cost, p) = setup();
    let mut oracle = observed(&p, 4);
    let asks = run(&cost, &p, &mut oracle, true, 2.25, 10 * REFRESH_AGE);
    let drafting = asks.iter().filter(|&&k| k > 0).count();
    assert!((1..=10).contains(&drafting), "{drafting} of {}", asks.len());
    // Never right: no refresh, however stale; only the one-draft probes, ever rarer.
    let (cost, p) = setup();
    let mut random = observed(&p, 0);
    let asks = run(&cost, &p, &mut random, false, 0.25, 10 * REFRESH_AGE);
    let probes = asks.iter().filter(|&&k| k > 0).count();
    assert!(asks.iter().all(|&k| k <= 1) && probes <= 20, "{asks:?}");
}

/// Runs `steps` steps of `width` sequences whose drafts are each accepted with chance
/// `p` (the first rejection ends a step's run) under a fixed cost of `per_row` seconds a
/// verify row beyond a 1 s plain step of `width` rows; returns the steps that asked for
/// no drafts and the steps in all.
fn idle_steps(width: usize, p: f64, per_row: f64, steps: usize) -> (usize, usize) {
    use rand::{Rng, SeedableRng};
    let plain = 1.0 - per_row * width as f64;
    let policy = policy(&[
        (width, 1.0),
        (width + 1, plain + per_row * (width + 1) as f64),
    ]);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let mut stats = vec![SequenceDraftStats::default(); width];
    let mut idle = 0;
    for _ in 0..steps {
        let k = choose(&policy, &stats, &vec![4; width], 0);
        for (s, &k) in stats.iter_mut().zip(&k) {
            s.probe.probing = k > 0 && policy.probe_due(s);
            s.asked = Some(k);
            let accepted = (0..k).take_while(|_| rng.random_bool(p)).count();
            policy.observe(s, k, accepted);
            idle += usize::from(k == 0);
        }
    }
    (idle, steps * width)
}

#[test]
fn a_good_drafter_in_a_wide_batch_is_not_shut_out_by_one_rejection() {
    // Four sequences, drafts accepted 3 times in 4, a verify row 15% of a plain step's
    // cost (so a first draft pays when accepted more than about 2 times in 3). A
    // rejection can turn a sequence down (its estimate is near the bar), but the
    // engine's figures say a draft pays, so it is probed back after one idle step
    // rather than after the probe wait and the exploration budget: it asks for drafts
    // on most steps (when a turned-down sequence waited for those, 72% of them idled).
    let (idle, all) = idle_steps(4, 0.75, 0.15, 300);
    assert!(idle * 3 <= all, "{idle} idle of {all}");
    // A drafter that is never right is still turned down on nearly every step.
    let (idle, all) = idle_steps(4, 0.0, 0.1, 300);
    assert!(idle * 20 >= all * 19, "{idle} idle of {all}");
}

#[test]
fn a_tree_is_credited_with_the_nodes_on_its_path_not_its_depth() {
    // One row 1.0 s, each more 0.25 s. Trees of 4 nodes whose accepted path is nodes 0 and
    // 2 (node 1 a wrong sibling of node 0, node 3 one of node 2): 2 tokens for 4 rows.
    let p = policy(&[(1, 1.0), (2, 1.25)]);
    let mut stats = SequenceDraftStats::default();
    for _ in 0..30 {
        stats.asked = Some(4);
        stats.tree_path = Some(vec![0, 2]);
        p.observe(&mut stats, 4, 2);
    }
    // Node by node: 1 token for 1 node (rate 2 / 1.25), 1 for 2, 2 for 3 (3 / 1.75), 2
    // for 4: three nodes pay best. Read by depth (accepted twice, then rejected), 2 nodes
    // would look like 2 tokens (3 / 1.5), though a tree of 2 holds node 1, the sibling.
    assert_eq!(
        choose_trees(&p, std::slice::from_ref(&stats), &[4]),
        vec![3]
    );
    assert_eq!(choose(&p, std::slice::from_ref(&stats), &[4], 0), vec![2]);
    // A tree whose path is its whole budget is asked for all of it.
    let p = policy(&[(1, 1.0), (2, 1.25)]);
    let mut stats = SequenceDraftStats::default();
    for _ in 0..30 {
        stats.asked = Some(4);
        stats.tree_path = Some(vec![0, 1, 2, 3]);
        p.observe(&mut stats, 4, 4);
    }
    assert_eq!(
        choose_trees(&p, std::slice::from_ref(&stats), &[4]),
        vec![4]
    );
    // Trees whose nodes are all rejected get none.
    let p = policy(&[(1, 1.0), (2, 1.25)]);
    let mut stats = SequenceDraftStats::default();
    for _ in 0..30 {
        stats.asked = Some(4);
        stats.tree_path = Some(vec![]);
        p.observe(&mut stats, 4, 0);
    }
    assert_eq!(
        choose_trees(&p, std::slice::from_ref(&stats), &[4]),
        vec![0]
    );
}
