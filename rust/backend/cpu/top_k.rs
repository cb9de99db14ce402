//! The CPU `top_k`: each row's largest allowed logits with their softmax probabilities
//! ([`crate::backend::TopKArgs`] has the contract).
//!
//! A draft tree runs it for every node it grows, over the whole draft vocabulary, so the
//! softmax denominator is summed in f32 lanes through the attention's vectorisable exp
//! (within 2 ulp a term) and the lanes are added in f64: within 1e-6 of an f64 `exp` a
//! logit, and on a 2-core EPYC 20 µs a row of 8,192 ids where a scalar f64 sum took 56.

use super::exp_nonpositive;

/// Lanes of [`softmax_scale`]'s loops: independent partial results, so that the loops
/// vectorise (the compiler does not reorder a single f32 running sum).
const LANES: usize = 16;

/// The `k` highest finite logits among the ids `allowed` keeps, highest first (ties to the
/// lower id, as argmax picks), each with its softmax probability over every finite logit.
/// Places whose probability rounds to 0 in f32 are left out, so fewer than `k` may come back.
pub(crate) fn top_k_row(
    logits: &[f32],
    k: usize,
    allowed: impl Fn(usize) -> bool,
) -> Vec<(u32, f32)> {
    let (max, sum) = softmax_scale(logits);
    if !max.is_finite() || k == 0 {
        return Vec::new();
    }
    let mut best: Vec<(usize, f32)> = Vec::with_capacity(k + 1);
    for (id, &l) in logits.iter().enumerate() {
        if !l.is_finite() || (best.len() == k && l <= best[k - 1].1) || !allowed(id) {
            continue;
        }
        let at = best.partition_point(|&(_, b)| b >= l);
        best.insert(at, (id, l));
        best.truncate(k);
    }
    best.into_iter()
        .map(|(id, l)| {
            let p = (f64::from(l) - f64::from(max)).exp() / sum;
            (id as u32, p as f32)
        })
        .filter(|&(_, p)| p > 0.0)
        .collect()
}

/// The largest finite logit and the softmax denominator `sum(exp(l - max))` over the finite
/// logits (`-inf` and 0 when there is none).
fn softmax_scale(logits: &[f32]) -> (f32, f64) {
    let finite = |l: f32| if l.is_finite() { l } else { f32::NEG_INFINITY };
    let mut top = [f32::NEG_INFINITY; LANES];
    let mut chunks = logits.chunks_exact(LANES);
    for c in &mut chunks {
        for (m, &l) in top.iter_mut().zip(c) {
            *m = m.max(finite(l));
        }
    }
    let rest = chunks.remainder();
    let max = rest
        .iter()
        .map(|&l| finite(l))
        .chain(top)
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return (max, 0.0);
    }
    let term = |l: f32| {
        if l.is_finite() {
            exp_nonpositive(l - max)
        } else {
            0.0
        }
    };
    let mut sums = [0.0f32; LANES];
    let mut chunks = logits.chunks_exact(LANES);
    for c in &mut chunks {
        for (s, &l) in sums.iter_mut().zip(c) {
            *s += term(l);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&l| f64::from(term(l))).sum();
    (max, sums.iter().map(|&s| f64::from(s)).sum::<f64>() + tail)
}

#[cfg(test)]
mod tests {
    use super::{softmax_scale, top_k_row};

    #[test]
    fn children_are_the_top_logits_with_softmax_probabilities() {
        let logits = [1.0f32, 3.0, 3.0, f32::NAN, 2.0, -50.0];
        let got = top_k_row(&logits, 3, |_| true);
        let ids: Vec<u32> = got.iter().map(|c| c.0).collect();
        assert_eq!(ids, [1, 2, 4], "ties go to the lower id");
        let z: f64 = [1.0f64, 3.0, 3.0, 2.0, -50.0]
            .iter()
            .map(|l| (l - 3.0f64).exp())
            .sum();
        let close = |p: f32, want: f64| (f64::from(p) - want).abs() <= 1e-6 * want;
        assert!(close(got[0].1, 1.0 / z), "{} vs {}", got[0].1, 1.0 / z);
        assert!(close(got[2].1, (-1.0f64).exp() / z));
        let masked: Vec<u32> = top_k_row(&logits, 2, |d| d != 1)
            .iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(masked, [2, 4]);
        assert!(top_k_row(&logits, 2, |_| false).is_empty());
    }

    #[test]
    fn the_softmax_scale_is_the_f64_one_over_the_finite_logits() {
        // 1000 logits (not a multiple of the lanes), some not finite, spread over 60 units.
        let logits: Vec<f32> = (0..1000)
            .map(|i| match i % 97 {
                5 => f32::NEG_INFINITY,
                11 => f32::NAN,
                _ => ((i * 7919) % 6000) as f32 / 100.0 - 30.0,
            })
            .collect();
        let finite = || {
            logits
                .iter()
                .filter(|l| l.is_finite())
                .map(|&l| f64::from(l))
        };
        let max = finite().fold(f64::NEG_INFINITY, f64::max);
        let want: f64 = finite().map(|l| (l - max).exp()).sum();
        let (got_max, got) = softmax_scale(&logits);
        assert_eq!(f64::from(got_max), max);
        assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
        assert_eq!(softmax_scale(&[f32::NAN, f32::NEG_INFINITY]).1, 0.0);
        assert!(softmax_scale(&[]).0.is_infinite());
    }

    #[test]
    fn a_child_whose_probability_rounds_to_zero_is_left_out() {
        let got = top_k_row(&[0.0, -200.0, -20.0], 3, |_| true);
        assert_eq!(got.iter().map(|c| c.0).collect::<Vec<_>>(), [0, 2]);
    }
}
