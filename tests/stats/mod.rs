//! Goodness-of-fit statistics for the sampling tests, written from the textbook definitions
//! so no test takes its expected distribution or its critical value from the code under test.
//!
//! Invariants of [`chi_square`]:
//! - a cell whose expected probability is zero must have no observations (an emitted token
//!   the distribution forbids is a failure, never a dropped cell);
//! - cells whose expected count is below [`MIN_EXPECTED`] are merged, explicitly, into one
//!   pooled cell (and the pool into the smallest other cell while it is still too small);
//! - the degrees of freedom are the cells actually compared, minus one.
#![allow(dead_code)]

pub mod paths;

/// Smallest expected count for a cell to stand on its own (the usual rule for Pearson's test).
pub const MIN_EXPECTED: f64 = 5.0;

/// Significance of every chi-square test in the suite. The seeds are fixed, so the outcome
/// is deterministic; this is the chance that a correct sampler fails a given test.
pub const ALPHA: f64 = 1e-3;

/// The natural log of the gamma function (Lanczos, g = 7, nine terms; about 1e-15 relative).
fn ln_gamma(x: f64) -> f64 {
    const G: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    let x = x - 1.0;
    let mut a = G[0];
    let t = x + 7.5;
    for (i, g) in G.iter().enumerate().skip(1) {
        a += g / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// The regularized upper incomplete gamma function Q(a, x) (series below a + 1, Lentz's
/// continued fraction above it).
fn gamma_q(a: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    let front = (-x + a * x.ln() - ln_gamma(a)).exp();
    if x < a + 1.0 {
        let (mut sum, mut term, mut n) = (1.0 / a, 1.0 / a, a);
        for _ in 0..1000 {
            n += 1.0;
            term *= x / n;
            sum += term;
            if term.abs() < sum.abs() * 1e-16 {
                break;
            }
        }
        1.0 - sum * front
    } else {
        let tiny = 1e-300;
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / tiny;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..1000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let delta = d * c;
            h *= delta;
            if (delta - 1.0).abs() < 1e-16 {
                break;
            }
        }
        front * h
    }
}

/// P(X > x) for X chi-square distributed with `df` degrees of freedom.
pub fn chi_square_sf(x: f64, df: usize) -> f64 {
    gamma_q(df as f64 / 2.0, x / 2.0)
}

/// The value a chi-square variable with `df` degrees of freedom exceeds with probability
/// `alpha` (bisection on the survival function).
pub fn critical_value(df: usize, alpha: f64) -> f64 {
    assert!(df > 0, "no degrees of freedom");
    let (mut lo, mut hi) = (0.0, 10.0 * df as f64 + 100.0);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if chi_square_sf(mid, df) > alpha {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// The sampling distribution of one logits row, from the definitions, in f64: softmax at
/// `temperature`, then the `top_k` most likely tokens (0: all; equal probabilities by token
/// id), then the smallest most-likely prefix of those whose renormalised mass reaches
/// `top_p` (the crossing token kept), renormalised.
pub fn reference_probs(logits: &[f32], temperature: f64, top_k: usize, top_p: f64) -> Vec<f64> {
    let scaled: Vec<f64> = logits.iter().map(|&l| l as f64 / temperature).collect();
    let max = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = scaled.iter().map(|s| (s - max).exp()).collect();
    let z: f64 = w.iter().sum();
    let p: Vec<f64> = w.iter().map(|x| x / z).collect();
    // Most likely first; equal probabilities by token id.
    let mut rank: Vec<usize> = (0..p.len()).collect();
    rank.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    let k = if top_k == 0 {
        p.len()
    } else {
        top_k.min(p.len())
    };
    let kept_mass: f64 = rank[..k].iter().map(|&i| p[i]).sum();
    let mut keep = 0;
    let mut cum = 0.0;
    for &i in &rank[..k] {
        cum += p[i] / kept_mass;
        keep += 1;
        if cum >= top_p {
            break;
        }
    }
    let mass: f64 = rank[..keep].iter().map(|&i| p[i]).sum();
    let mut out = vec![0.0; p.len()];
    for &i in &rank[..keep] {
        out[i] = p[i] / mass;
    }
    out
}

/// The largest absolute difference of two distributions.
pub fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

/// [`reference_probs`] for `SamplingParams`.
pub fn reference(logits: &[f32], s: &specdraft::engine::SamplingParams) -> Vec<f64> {
    reference_probs(logits, s.temperature as f64, s.top_k, s.top_p as f64)
}

/// One Pearson chi-square comparison of observed counts with expected probabilities.
#[derive(Clone, Debug)]
pub struct Fit {
    /// The statistic.
    pub statistic: f64,
    /// Cells compared minus one.
    pub df: usize,
    /// The cells pooled because their expected count was too small (token ids).
    pub pooled: Vec<usize>,
}

impl Fit {
    /// Whether the counts are consistent with the distribution at [`ALPHA`].
    pub fn passes(&self) -> bool {
        self.df == 0 || self.statistic < critical_value(self.df, ALPHA)
    }

    /// Adds an independent comparison (statistics and degrees of freedom add).
    pub fn add(&mut self, other: &Fit) {
        self.statistic += other.statistic;
        self.df += other.df;
        self.pooled.extend_from_slice(&other.pooled);
    }

    /// No comparison yet.
    pub fn empty() -> Fit {
        Fit {
            statistic: 0.0,
            df: 0,
            pooled: Vec::new(),
        }
    }
}

/// Pearson's chi-square of `counts` against the probabilities `expected` (normalised here).
/// Errors when a zero-probability cell was observed.
pub fn chi_square(counts: &[u64], expected: &[f64]) -> Result<Fit, String> {
    assert_eq!(counts.len(), expected.len(), "one count per cell");
    let n: u64 = counts.iter().sum();
    let total: f64 = expected.iter().sum();
    let mut cells: Vec<(f64, f64)> = Vec::new(); // (observed, expected count)
    let mut pool = (0.0, 0.0);
    let mut pooled = Vec::new();
    for (i, (&o, &p)) in counts.iter().zip(expected).enumerate() {
        let e = p / total * n as f64;
        if p <= 0.0 {
            if o > 0 {
                return Err(format!(
                    "cell {i} has probability 0 but was observed {o} times"
                ));
            }
        } else if e < MIN_EXPECTED {
            pool.0 += o as f64;
            pool.1 += e;
            pooled.push(i);
        } else {
            cells.push((o as f64, e));
        }
    }
    if pool.1 > 0.0 {
        // A pool still too small joins the smallest standing cell.
        while pool.1 < MIN_EXPECTED && !cells.is_empty() {
            let smallest = (0..cells.len())
                .min_by(|&a, &b| cells[a].1.total_cmp(&cells[b].1))
                .unwrap_or(0);
            let (o, e) = cells.swap_remove(smallest);
            pool.0 += o;
            pool.1 += e;
        }
        cells.push(pool);
    }
    let statistic = cells.iter().map(|(o, e)| (o - e).powi(2) / e).sum();
    Ok(Fit {
        statistic,
        df: cells.len().saturating_sub(1),
        pooled,
    })
}

/// Pins the helpers to published values; call it from one test of each binary that uses
/// them, so a broken helper cannot make every test pass.
pub fn check_helpers() {
    // Upper 0.001 points of the chi-square distribution (standard tables).
    for (df, want) in [
        (1, 10.828),
        (2, 13.816),
        (3, 16.266),
        (4, 18.467),
        (7, 24.322),
        (10, 29.588),
        (30, 59.703),
    ] {
        let got = critical_value(df, 1e-3);
        assert!((got - want).abs() < 2e-3, "df {df}: {got} vs {want}");
    }
    // Pooling: cells 3 and 4 expect 2 and 1 of 100 and are merged, and the pool (3 < 5)
    // joins the smallest standing cell (27): three cells remain. Cell 5 is impossible.
    let fit = chi_square(&[40, 30, 27, 2, 1, 0], &[0.4, 0.3, 0.27, 0.02, 0.01, 0.0]).unwrap();
    assert_eq!((fit.df, fit.pooled.clone()), (2, vec![3, 4]));
    assert!(fit.statistic.abs() < 1e-12);
    assert!(chi_square(&[1, 1], &[1.0, 0.0]).is_err());
    // The reference on values worked by hand: logits ln(2, 4, 1, 3).
    let l = [2f32.ln(), 4f32.ln(), 1f32.ln(), 3f32.ln()];
    let r = reference_probs(&l, 1.0, 0, 1.0);
    assert!(max_diff(&r, &[0.2, 0.4, 0.1, 0.3]) < 1e-7, "{r:?}");
    // T = 2 takes square roots of the weights.
    let s: Vec<f64> = [2f64, 4.0, 1.0, 3.0].iter().map(|x| x.sqrt()).collect();
    let z: f64 = s.iter().sum();
    let want: Vec<f64> = s.iter().map(|x| x / z).collect();
    assert!(max_diff(&reference_probs(&l, 2.0, 0, 1.0), &want) < 1e-7);
    // top_k 2 keeps 4 and 3: 4/7, 3/7.
    let r = reference_probs(&l, 1.0, 2, 1.0);
    assert!(
        max_diff(&r, &[0.0, 4.0 / 7.0, 0.0, 3.0 / 7.0]) < 1e-7,
        "{r:?}"
    );
    // top_p 0.5: 0.4 does not reach it, 0.4 + 0.3 does; the crossing token stays.
    let r = reference_probs(&l, 1.0, 0, 0.5);
    assert!(
        max_diff(&r, &[0.0, 4.0 / 7.0, 0.0, 3.0 / 7.0]) < 1e-7,
        "{r:?}"
    );
    // top_k 3 then top_p 0.6 of the renormalised 4/9, 3/9, 2/9: 4/9 < 0.6 <= 7/9.
    let r = reference_probs(&l, 1.0, 3, 0.6);
    assert!(
        max_diff(&r, &[0.0, 4.0 / 7.0, 0.0, 3.0 / 7.0]) < 1e-7,
        "{r:?}"
    );
    // top_p 0.75 after top_k 3 needs 7/9 (two tokens); before it, 0.75 of the full mass
    // would need three: the order of the cuts matters.
    let r = reference_probs(&l, 1.0, 3, 0.75);
    assert_eq!(r.iter().filter(|&&x| x > 0.0).count(), 2, "{r:?}");
}
