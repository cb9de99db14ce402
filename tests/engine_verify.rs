//! Rejection sampling is lossless: over many seeded trials, the tokens verification emits
//! follow the target's sampling distribution, whatever the drafter's `q`.
//!
//! The expected distribution is written here from the definitions (softmax at temperature
//! T, then the `top_k` most likely tokens, then the smallest most-likely prefix of those
//! whose renormalised mass reaches `top_p`, the crossing token kept, renormalised), never
//! taken from the code under test. Chi-square tests (`stats/mod.rs`) at significance 0.001
//! with the degrees of freedom of the cells actually compared; the seeds are fixed, so the
//! outcome is deterministic.

mod stats;

use rand::rngs::SmallRng;
use rand::SeedableRng;
use specdraft::engine::{sample_from, target_probs, verify, SamplingParams};
use stats::{chi_square, max_diff, reference, reference_probs, Fit};

const TRIALS: usize = 40_000;

fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        seed: 0,
    }
}

/// The settings every sampled test runs: temperature below, at and above 1, top-k alone,
/// top-p alone, and both at once (where applying top-p before top-k would differ).
fn settings() -> Vec<SamplingParams> {
    vec![
        params(0.6, 0, 1.0),
        params(1.0, 3, 1.0),
        params(1.4, 0, 0.8),
        params(1.2, 3, 0.7),
        params(2.0, 2, 0.9),
    ]
}

fn rows() -> Vec<Vec<f32>> {
    vec![
        vec![0.1, 1.2, -0.5, 0.7, 0.3, 0.9],
        vec![1.0, -1.0, 0.5, 0.0, 0.8, 0.6],
        vec![0.0, 0.4, 0.0, -0.3, 0.2, 0.1],
    ]
}

#[test]
fn the_helpers_are_right() {
    stats::check_helpers();
}

/// `target_probs` of `row`, widened to compare with the f64 reference.
fn probs_f64(row: &[f32], s: &SamplingParams) -> Vec<f64> {
    let p = target_probs(row, s, None).expect("an allowed token");
    p.into_iter().map(f64::from).collect()
}

#[test]
fn target_probs_is_the_definition() {
    let mut cases = 0;
    let (mut temperature_matters, mut cut_order_matters) = (false, false);
    for row in rows() {
        for s in settings().into_iter().chain([
            params(0.3, 0, 0.5),
            params(1.0, 1, 1.0),
            params(1.0, 6, 0.999),
            params(3.0, 5, 0.95),
        ]) {
            let (got, want) = (probs_f64(&row, &s), reference(&row, &s));
            assert!(
                max_diff(&got, &want) < 1e-6,
                "{s:?} on {row:?}: {got:?} vs {want:?}"
            );
            cases += 1;
            // The cases have power: ignoring the temperature, or cutting top-p over the
            // whole distribution before top-k, gives a different answer somewhere.
            let at_one = reference_probs(&row, 1.0, s.top_k, s.top_p as f64);
            temperature_matters |= max_diff(&at_one, &want) > 0.01;
            let p_first = top_p_before_top_k(&row, &s);
            cut_order_matters |= max_diff(&p_first, &want) > 0.01;
        }
    }
    assert!(cases > 20 && temperature_matters && cut_order_matters);
}

/// A row of SmolLM2's vocabulary (49,152 ids), flat enough that the nucleus holds thousands
/// of ids, with runs of equal logits (so the cut lands among ties) and `-inf` logits (no
/// mass): the same tokens kept as the definition keeps, every probability within 1e-6 of it.
#[test]
fn target_probs_is_the_definition_on_a_vocabulary_row() {
    use rand::Rng;
    let mut r = SmallRng::seed_from_u64(17);
    let row: Vec<f32> = (0..49_152)
        .map(|_| match r.random_range(0..40) {
            0 => f32::NEG_INFINITY,
            1..10 => (r.random_range(0..50) as f32) / 10.0,
            _ => r.random::<f32>() * 8.0 - 4.0,
        })
        .collect();
    let mut nucleus_sizes = Vec::new();
    for s in [
        params(0.8, 0, 1.0),
        params(0.8, 0, 0.9),
        params(1.3, 0, 0.95),
        params(0.7, 2000, 0.95),
        params(1.0, 40, 1.0),
    ] {
        let (got, want) = (probs_f64(&row, &s), reference(&row, &s));
        let kept = |p: &[f64]| p.iter().map(|&x| x > 0.0).collect::<Vec<_>>();
        assert!(kept(&got) == kept(&want), "{s:?}: a different set kept");
        assert!(max_diff(&got, &want) < 1e-6, "{s:?}");
        nucleus_sizes.push(want.iter().filter(|&&x| x > 0.0).count());
    }
    // The cuts have power: the nucleus takes several rounds of chunks, top-k cuts alone,
    // and top-p cuts inside top-k's 2,000.
    let n = &nucleus_sizes;
    assert!(
        n[1] > 1000 && n[2] > n[1] && (1000..2000).contains(&n[3]) && n[4] == 40,
        "{n:?}"
    );
}

/// The wrong order of the cuts, only to show the cases tell it apart.
fn top_p_before_top_k(row: &[f32], s: &SamplingParams) -> Vec<f64> {
    let nucleus = reference_probs(row, s.temperature as f64, 0, s.top_p as f64);
    let logits: Vec<f32> = nucleus
        .iter()
        .map(|&x| if x > 0.0 { x.ln() as f32 } else { -1e30 })
        .collect();
    reference_probs(&logits, 1.0, s.top_k, 1.0)
}

struct Outcome {
    first: Vec<u64>,
    second_after_accept: Vec<u64>,
    accepted_first: u64,
}

/// Runs `TRIALS` verifications of two drafts drawn from `q` (or fixed when `fixed` is given:
/// the one-hot case) against `rows`.
fn trials(
    rows: &[Vec<f32>],
    s: &SamplingParams,
    q: &[Vec<f32>],
    fixed: Option<[u32; 2]>,
) -> Outcome {
    let v = rows[0].len();
    let r: Vec<&[f32]> = rows.iter().map(|x| x.as_slice()).collect();
    let mut out = Outcome {
        first: vec![0; v],
        second_after_accept: vec![0; v],
        accepted_first: 0,
    };
    for t in 0..TRIALS {
        let mut draft_rng = SmallRng::seed_from_u64(1_000_000 + t as u64);
        let drafts = fixed.unwrap_or_else(|| {
            [
                sample_from(&q[0], &mut draft_rng),
                sample_from(&q[1], &mut draft_rng),
            ]
        });
        let mut rng = SmallRng::seed_from_u64(t as u64);
        let dists = fixed.is_none().then_some(q);
        let verdict = verify(&r, &drafts, dists, s, &mut rng, None).unwrap();
        out.first[verdict.tokens[0] as usize] += 1;
        if verdict.accepted >= 1 {
            out.accepted_first += 1;
            out.second_after_accept[verdict.tokens[1] as usize] += 1;
        }
    }
    out
}

fn assert_fits(what: &str, counts: &[u64], expected: &[f64]) -> Fit {
    let fit = chi_square(counts, expected).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        fit.df >= 1 && fit.passes(),
        "{what}: chi2 {} on {} df, counts {counts:?}, p {expected:?}",
        fit.statistic,
        fit.df
    );
    fit
}

#[test]
fn emitted_tokens_follow_p_when_drafts_follow_a_different_q() {
    let q = vec![
        vec![0.4, 0.05, 0.2, 0.1, 0.2, 0.05],
        vec![0.1, 0.45, 0.1, 0.2, 0.1, 0.05],
    ];
    for s in settings() {
        let p0 = reference(&rows()[0], &s);
        let p1 = reference(&rows()[1], &s);
        let o = trials(&rows(), &s, &q, None);
        assert_fits(&format!("{s:?} first token"), &o.first, &p0);
        assert_fits(&format!("{s:?} second token"), &o.second_after_accept, &p1);
        // Acceptance of the first draft is sum_x min(p(x), q(x)).
        let expected: f64 = p0.iter().zip(&q[0]).map(|(a, &b)| a.min(b as f64)).sum();
        let rate = o.accepted_first as f64 / TRIALS as f64;
        assert!(
            (rate - expected).abs() < 0.01,
            "{s:?}: acceptance {rate} vs {expected}"
        );
    }
    // The test has power: the drafts themselves (distributed as q) fail it by far.
    let mut drafted = vec![0u64; 6];
    for t in 0..TRIALS {
        let mut r = SmallRng::seed_from_u64(1_000_000 + t as u64);
        drafted[sample_from(&q[0], &mut r) as usize] += 1;
    }
    let fit = chi_square(&drafted, &reference(&rows()[0], &params(1.0, 0, 1.0))).unwrap();
    assert!(fit.statistic > 100.0 * stats::critical_value(fit.df, stats::ALPHA));
}

#[test]
fn a_deterministic_drafter_is_lossless() {
    for s in settings() {
        let p0 = reference(&rows()[0], &s);
        let p1 = reference(&rows()[1], &s);
        // Drafts the target likes and drafts it may forbid (outside top-k / top-p).
        let unlikely = (0..6).min_by(|&a, &b| p0[a].total_cmp(&p0[b])).unwrap() as u32;
        for fixed in [[1u32, 0u32], [unlikely, 4]] {
            let o = trials(&rows(), &s, &[], Some(fixed));
            assert_fits(&format!("{s:?} drafts {fixed:?}"), &o.first, &p0);
            // A one-hot q accepts draft x with probability p(x).
            let rate = o.accepted_first as f64 / TRIALS as f64;
            let px = p0[fixed[0] as usize];
            assert!((rate - px).abs() < 0.01, "{s:?} {fixed:?}: {rate} vs {px}");
            if px * TRIALS as f64 > 200.0 {
                assert_fits(
                    &format!("{s:?} drafts {fixed:?} second"),
                    &o.second_after_accept,
                    &p1,
                );
            }
        }
    }
}
