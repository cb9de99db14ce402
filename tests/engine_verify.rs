//! Rejection sampling is lossless: over many seeded trials, the tokens verification emits
//! follow the target's distribution `p`, whatever the drafter's `q`. Chi-square at a fixed
//! significance (0.001, 4 degrees of freedom: critical value 18.467); the seeds are fixed,
//! so the outcome is deterministic.

mod engine_common;

use rand::rngs::SmallRng;
use rand::SeedableRng;
use specdraft::engine::{sample_from, target_probs, verify, SamplingParams};

const CRITICAL_DF4_P001: f64 = 18.467;
const TRIALS: usize = 40_000;

fn chi_square(counts: &[u64], expected: &[f32]) -> f64 {
    let n: u64 = counts.iter().sum();
    counts
        .iter()
        .zip(expected)
        .filter(|(_, &e)| e > 0.0)
        .map(|(&o, &e)| {
            let e = e as f64 * n as f64;
            (o as f64 - e).powi(2) / e
        })
        .sum()
}

struct Outcome {
    first: Vec<u64>,
    second_after_accept: Vec<u64>,
    accepted_first: u64,
}

/// Runs `TRIALS` verifications of two drafts drawn from `q` (or fixed when `fixed` is
/// given: the one-hot case) against rows with distributions `p0`, `p1`, `p2`.
fn trials(
    rows: &[Vec<f32>],
    params: &SamplingParams,
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
        let verdict = verify(&r, &drafts, dists, params, &mut rng, None).unwrap();
        out.first[verdict.tokens[0] as usize] += 1;
        if verdict.accepted >= 1 {
            out.accepted_first += 1;
            out.second_after_accept[verdict.tokens[1] as usize] += 1;
        }
    }
    out
}

fn rows() -> Vec<Vec<f32>> {
    vec![
        vec![0.1, 1.2, -0.5, 0.7, 0.3],
        vec![1.0, -1.0, 0.5, 0.0, 0.8],
        vec![0.0, 0.0, 0.0, 0.0, 0.0],
    ]
}

#[test]
fn emitted_tokens_follow_p_when_drafts_follow_a_different_q() {
    let params = SamplingParams::sampled(0.9, 0);
    let q = vec![
        vec![0.4, 0.05, 0.25, 0.1, 0.2],
        vec![0.1, 0.5, 0.1, 0.2, 0.1],
    ];
    let p0 = target_probs(&rows()[0], &params, None).unwrap();
    let p1 = target_probs(&rows()[1], &params, None).unwrap();
    let o = trials(&rows(), &params, &q, None);
    let x0 = chi_square(&o.first, &p0);
    let x1 = chi_square(&o.second_after_accept, &p1);
    assert!(
        x0 < CRITICAL_DF4_P001,
        "first token: chi2 {x0}, counts {:?}, p {p0:?}",
        o.first
    );
    assert!(
        x1 < CRITICAL_DF4_P001,
        "second token: chi2 {x1}, counts {:?}, p {p1:?}",
        o.second_after_accept
    );
    // The test has power: the drafts themselves (distributed as q) fail it by far.
    let mut drafted = vec![0u64; 5];
    for t in 0..TRIALS {
        drafted[sample_from(&q[0], &mut SmallRng::seed_from_u64(1_000_000 + t as u64)) as usize] +=
            1;
    }
    assert!(chi_square(&drafted, &p0) > 100.0 * CRITICAL_DF4_P001);
    // Acceptance of the first draft is sum_x min(p(x), q(x)).
    let expected: f32 = p0.iter().zip(&q[0]).map(|(a, b)| a.min(*b)).sum();
    let rate = o.accepted_first as f32 / TRIALS as f32;
    assert!(
        (rate - expected).abs() < 0.01,
        "acceptance {rate} vs {expected}"
    );
}

#[test]
fn a_deterministic_drafter_is_lossless_with_top_k_and_top_p() {
    let params = SamplingParams {
        temperature: 1.3,
        top_p: 0.95,
        top_k: 4,
        seed: 0,
    };
    let p0 = target_probs(&rows()[0], &params, None).unwrap();
    let p1 = target_probs(&rows()[1], &params, None).unwrap();
    assert_eq!(
        p0.iter().filter(|&&x| x == 0.0).count(),
        1,
        "top_k 4 drops one of five"
    );
    for fixed in [[1u32, 0u32], [2, 4]] {
        let o = trials(&rows(), &params, &[], Some(fixed));
        let x0 = chi_square(&o.first, &p0);
        assert!(
            x0 < CRITICAL_DF4_P001,
            "drafts {fixed:?}: chi2 {x0}, counts {:?}",
            o.first
        );
        // A one-hot q accepts draft x with probability p(x).
        let rate = o.accepted_first as f32 / TRIALS as f32;
        assert!(
            (rate - p0[fixed[0] as usize]).abs() < 0.01,
            "{rate} vs {}",
            p0[fixed[0] as usize]
        );
        if o.accepted_first > 0 {
            let x1 = chi_square(&o.second_after_accept, &p1);
            assert!(x1 < CRITICAL_DF4_P001, "second: chi2 {x1}");
        }
        // A token outside top-k is never emitted.
        let dropped = p0.iter().position(|&x| x == 0.0).unwrap();
        assert_eq!(o.first[dropped], 0);
    }
}

/// Two-sample chi-square for equal sample sizes: sum of (a - b)^2 / (a + b) over cells.
fn two_sample(a: &[u64], b: &[u64]) -> (f64, usize) {
    let mut x = 0.0;
    let mut cells = 0;
    for (&u, &v) in a.iter().zip(b) {
        if u + v > 0 {
            x += (u as f64 - v as f64).powi(2) / (u + v) as f64;
            cells += 1;
        }
    }
    (x, cells)
}

#[test]
fn engine_sampling_with_drafts_matches_plain_sampling() {
    use specdraft::backend::{CpuBackend, GpuBackend};
    use specdraft::engine::testing::TableTarget;
    use specdraft::engine::{GenerateRequest, SpecEngine};
    use specdraft::speculative::DraftProposer;
    use std::sync::Arc;

    // Vocabulary 8, context-dependent logits; tokens at output positions 1 and 2 (the first
    // two that verification decides) over 3000 seeds, speculative vs plain.
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let target = Arc::new(TableTarget::new(gpu, 8, 64, 64, 21, 0.3).unwrap());
    let counts = |p: Option<Arc<dyn DraftProposer>>| {
        let engine = SpecEngine::new(target.clone(), p, 3).unwrap();
        let mut c = vec![vec![0u64; 8]; 2];
        let mut accepted = 0;
        let requests = (0..3000u64)
            .map(|seed| {
                GenerateRequest::new(vec![1, 2, 3, 1, 2, 3, 1, 2], 3)
                    .with_sampling(SamplingParams::sampled(1.0, seed))
            })
            .collect();
        for r in engine.generate(requests).results {
            assert!(r.error.is_none());
            c[0][r.tokens[1] as usize] += 1;
            c[1][r.tokens[2] as usize] += 1;
            accepted += r.metrics.accepted;
        }
        (c, accepted)
    };
    let (plain, _) = counts(None);
    // The oracle drafts the target's argmax continuation: accepted often, not always.
    let oracle = engine_common::Oracle {
        target: target.clone(),
        fail: None,
    };
    let (spec, accepted) = counts(Some(Arc::new(oracle)));
    assert!(
        (1000..5000).contains(&accepted),
        "{accepted} of 6000 drafts accepted"
    );
    // 8 cells: 7 degrees of freedom, critical value 24.32 at 0.001.
    for k in 0..2 {
        let (x, cells) = two_sample(&plain[k], &spec[k]);
        assert!(
            cells > 2 && x < 24.32,
            "position {}: chi2 {x}, {:?} vs {:?}",
            k + 1,
            plain[k],
            spec[k]
        );
    }
}
