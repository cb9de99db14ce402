//! The target's sampling distribution for one logits row ([`target_probs`]): what sampled
//! verification accepts drafts against and draws corrections from, once for every verify
//! row of every sampled sequence, so it is written to cost a few passes over the row.
//!
//! - The exponentials are taken in f32 lanes through the attention's vectorisable `exp`
//!   (within 2 ulp) and summed in f64 lanes; every probability is then within 1e-6 of the f64
//!   definition (the tests bound it). A scalar f64 `exp` a logit took 0.4 ms a row of 49,152
//!   ids on a 2-core EPYC, where this takes 0.07-0.1 ms.
//! - `top_k` / `top_p` find the kept tokens by selection, not by sorting the vocabulary:
//!   the cut is tried among the ids above a weight floor first (a prefix of the order, few
//!   on a language model's row; when it holds fewer than `top_k`, one bounded pass takes the
//!   `top_k` heaviest), `select_nth_unstable` isolates the `top_k` most likely,
//!   and the nucleus is sorted a chunk at a time (64 ids, then four times more each round)
//!   until its mass reaches `top_p`. On SmolLM2's own rows a full sort took 2.3 ms; the cut
//!   now takes 0.13-0.14 ms with `top_p` 0.95 or `top_k` 50, all passes included. The cut is
//!   applied in place: no second row is allocated (see [`keep_only`]).
//!
//! Invariants: the tokens kept are exactly those the definition keeps (descending by
//! probability, ties to the lower id, so truncation is deterministic); the result sums to 1
//! over allowed tokens only; `None` exactly when no allowed logit is above `-inf`.

use super::draw::{positive_sum, LANES};
use super::{argmax, SamplingParams};
use crate::backend::exp_nonpositive;
use crate::speculative::{bitmask_allows, bitmask_words};

/// Ids of the nucleus sorted in the first round of the top-p cut.
const FIRST_NUCLEUS_CHUNK: usize = 64;
/// The weights (the heaviest id's is 1) above which ids are tried for the cut, in turn:
/// `exp(-12)`, then `exp(-24)`, under which a chat model's row rarely holds a kept token.
const CANDIDATE_FLOORS: [f32; 2] = [6.144_212_4e-6, 3.775_134_5e-11];

/// The target's sampling distribution for one row: masked, divided by the temperature,
/// softmaxed, cut to `top_k` and `top_p`, renormalised. `None` when no token is allowed.
/// Greedy parameters give the one-hot distribution of [`argmax`].
pub fn target_probs(
    logits: &[f32],
    params: &SamplingParams,
    mask: Option<&[i32]>,
) -> Option<Vec<f32>> {
    if params.is_greedy() {
        let pick = argmax(logits, mask)? as usize;
        let mut p = vec![0.0; logits.len()];
        p[pick] = 1.0;
        return Some(p);
    }
    let max = allowed_max(logits, mask);
    if max == f32::NEG_INFINITY {
        return None;
    }
    // Clamped so that a subnormal temperature's inverse stays finite (0 * inf is NaN).
    let inv_t = (1.0 / f64::from(params.temperature)).min(f64::from(f32::MAX)) as f32;
    let mut p = weights(logits, max, inv_t, mask);
    let kept = kept_ids(&p, params.top_k, params.top_p);
    if let Some(ids) = kept {
        keep_only(&mut p, &ids);
    }
    let scale = (1.0 / positive_sum(&p)) as f32;
    for x in p.iter_mut() {
        *x *= scale;
    }
    Some(p)
}

/// Zeroes every weight of `p` but those of `ids`, in place. A fresh zeroed row of the
/// vocabulary's width would cost more than the cut: at 196 KB for the default model it is
/// mapped afresh from the system on most calls, and its page faults cost about as much as
/// the whole distribution (`top_p` rows took 0.28 ms where temperature alone took 0.09).
fn keep_only(p: &mut [f32], ids: &[usize]) {
    let mut kept = vec![0i32; bitmask_words(p.len())];
    for &i in ids {
        kept[i / 32] |= 1 << (i % 32);
    }
    zero_disallowed(p, &kept);
}

/// Zeroes every weight of `p` whose id `mask` does not allow (a grammar bitmask: bit
/// `i % 32` of word `i / 32`, as [`bitmask_allows`] reads it; ids past its end are not
/// allowed), 64 ids at a time: a span allowing nothing is one fill, one allowing all is
/// skipped, and only mixed spans are masked id by id.
fn zero_disallowed(p: &mut [f32], mask: &[i32]) {
    let word = |w: usize| mask.get(w).map_or(0, |&x| u64::from(x as u32));
    for (c, chunk) in p.chunks_mut(64).enumerate() {
        let bits = word(2 * c) | word(2 * c + 1) << 32;
        if bits == 0 {
            chunk.fill(0.0);
        } else if bits != u64::MAX {
            for (j, x) in chunk.iter_mut().enumerate() {
                if bits >> j & 1 == 0 {
                    *x = 0.0;
                }
            }
        }
    }
}

/// `exp((x - max) / T)` for every allowed finite logit, 0 elsewhere (masked, NaN, `-inf`);
/// when `max` is `+inf`, 1 on the allowed `+inf` logits (they share the mass) and 0 elsewhere.
fn weights(logits: &[f32], max: f32, inv_t: f32, mask: Option<&[i32]>) -> Vec<f32> {
    let mut p: Vec<f32> = if max == f32::INFINITY {
        logits
            .iter()
            .map(|&x| if x == f32::INFINITY { 1.0 } else { 0.0 })
            .collect()
    } else {
        // One expression without branches, so that the loop vectorises: a comparison that
        // NaN and `-inf` fail (the clamped `exp` would give them a tiny mass) selects 0.
        logits
            .iter()
            .map(|&x| {
                let w = exp_nonpositive((x - max) * inv_t);
                if x > f32::NEG_INFINITY {
                    w
                } else {
                    0.0
                }
            })
            .collect()
    };
    if let Some(m) = mask {
        zero_disallowed(&mut p, m);
    }
    p
}

/// The largest logit `allowed` keeps, NaN never counting (`-inf` when there is none).
fn allowed_max(logits: &[f32], mask: Option<&[i32]>) -> f32 {
    let Some(m) = mask else {
        // Lanes, so that the scan vectorises; a NaN compares false and never enters one.
        let mut top = [f32::NEG_INFINITY; LANES];
        let mut chunks = logits.chunks_exact(LANES);
        for c in &mut chunks {
            for (t, &x) in top.iter_mut().zip(c) {
                *t = if x > *t { x } else { *t };
            }
        }
        return chunks
            .remainder()
            .iter()
            .chain(&top)
            .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    };
    logits
        .iter()
        .enumerate()
        .filter(|&(i, x)| !x.is_nan() && bitmask_allows(m, i as u32))
        .fold(f32::NEG_INFINITY, |m, (_, &x)| m.max(x))
}

/// The ids `top_k` and then `top_p` keep of the weights `p` (not necessarily normalised;
/// the heaviest is 1), or `None` when the parameters cut nothing. The order is descending by
/// weight, ties to the lower id; `top_p` keeps the shortest prefix of the `top_k` kept whose
/// weight reaches `top_p` of theirs (the crossing token kept), all of them if rounding never
/// reaches it.
///
/// A language model's row puts nearly all its weight on few ids, so the cut is first tried
/// among the ids above each of [`CANDIDATE_FLOORS`] in turn: those form a prefix of the
/// order, so when they hold all `top_k` and the nucleus, the cut is exact. A floor holding
/// fewer than `top_k` ids hands over to one bounded pass that takes the `top_k` heaviest
/// ([`heaviest`]); without `top_k`, a nucleus the floors cannot hold (a flat row) is cut
/// from every id of positive weight.
fn kept_ids(p: &[f32], top_k: usize, top_p: f32) -> Option<Vec<usize>> {
    if !(top_k > 0 && top_k < p.len() || top_p < 1.0) {
        return None;
    }
    // Without `top_k`, `top_p` is a share of the whole row's weight.
    let whole = (top_k == 0 || top_k >= p.len()).then(|| positive_sum(p));
    // The last floor, the least positive f32, leaves nothing out, so its cut decides.
    let mut kept = None;
    for floor in CANDIDATE_FLOORS.into_iter().chain([f32::from_bits(1)]) {
        let mut left_out = false;
        let mut few = Vec::new();
        for (i, &w) in p.iter().enumerate() {
            if w >= floor {
                few.push(i);
            } else {
                left_out |= w > 0.0;
            }
        }
        kept = cut(p, few, top_k, top_p, whole, left_out);
        if kept.is_some() {
            break;
        }
        if whole.is_none() {
            // With `top_k`, `cut` declines only a floor holding fewer than `top_k` ids: one
            // bounded pass finds the `top_k` heaviest, where another floor might hold too
            // few again and a pass over every id would select among tens of thousands.
            let (heaviest, left_out) = heaviest(p, top_k);
            return cut(p, heaviest, top_k, top_p, None, left_out);
        }
    }
    kept
}

/// The `k` heaviest ids of positive weight (descending by weight, ties to the lower id, as
/// the cut orders them), in no particular order, and whether ids of positive weight were
/// left out. One pass, holding `k` ids in a heap whose top is the lightest kept.
fn heaviest(p: &[f32], k: usize) -> (Vec<usize>, bool) {
    /// An id ordered so that the heap's greatest is the one to drop first: lighter, or as
    /// heavy with a higher id.
    struct Lightest(f32, usize);
    impl Ord for Lightest {
        fn cmp(&self, other: &Self) -> std::cmp::Ordering {
            other.0.total_cmp(&self.0).then(self.1.cmp(&other.1))
        }
    }
    impl PartialOrd for Lightest {
        fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(other))
        }
    }
    impl PartialEq for Lightest {
        fn eq(&self, other: &Self) -> bool {
            self.cmp(other).is_eq()
        }
    }
    impl Eq for Lightest {}

    let mut kept = std::collections::BinaryHeap::with_capacity(k + 1);
    let mut left_out = false;
    // Weights are never NaN (`weights` gives those ids 0), so `> 0.0` is the positive ones.
    for (i, &w) in p.iter().enumerate().filter(|&(_, &w)| w > 0.0) {
        if kept.len() < k {
            kept.push(Lightest(w, i));
        } else if kept.peek().is_some_and(|top: &Lightest| w > top.0) {
            // A later id as heavy as the lightest kept loses the tie (ids come in order).
            kept.pop();
            kept.push(Lightest(w, i));
            left_out = true;
        } else {
            left_out = true;
        }
    }
    (kept.into_iter().map(|x| x.1).collect(), left_out)
}

/// [`kept_ids`] among `order`, a prefix of the row's order (every id heavier than any
/// left out, in any order; `left_out` whether ids of positive weight are): `None` when it
/// is too short to decide, that is when it holds fewer than `top_k` ids, or when its weight
/// falls short of `top_p` of `whole` (the row's weight, given without `top_k`).
fn cut(
    p: &[f32],
    mut order: Vec<usize>,
    top_k: usize,
    top_p: f32,
    whole: Option<f64>,
    left_out: bool,
) -> Option<Vec<usize>> {
    let by = |&a: &usize, &b: &usize| p[b].total_cmp(&p[a]).then(a.cmp(&b));
    let total = match whole {
        Some(total) => total,
        None if order.len() < top_k && left_out => return None,
        None => {
            if top_k < order.len() {
                order.select_nth_unstable_by(top_k, by);
                order.truncate(top_k);
            }
            order.iter().map(|&i| f64::from(p[i])).sum()
        }
    };
    if top_p >= 1.0 {
        return Some(order);
    }
    let target = f64::from(top_p) * total;
    let (mut sorted, mut chunk, mut cum) = (0, FIRST_NUCLEUS_CHUNK, 0.0);
    while sorted < order.len() {
        let end = (sorted + chunk).min(order.len());
        // Brings the next `end - sorted` heaviest of the rest to the front, then sorts them:
        // with what is sorted already, the first `end` of the full order.
        if end < order.len() {
            order[sorted..].select_nth_unstable_by(end - sorted, by);
        }
        order[sorted..end].sort_unstable_by(by);
        for n in sorted..end {
            cum += f64::from(p[order[n]]);
            if cum >= target {
                order.truncate(n + 1);
                return Some(order);
            }
        }
        sorted = end;
        chunk *= 4;
    }
    // Rounding kept the sum under the target: everything, unless ids were left out.
    (!left_out || whole.is_none()).then_some(order)
}

#[cfg(test)]
mod tests {
    use super::{kept_ids, target_probs};
    use crate::engine::SamplingParams;

    #[test]
    fn infinite_logits_share_the_mass_and_nan_has_none() {
        let t = SamplingParams::sampled(0.7, 0);
        let (inf, nan) = (f32::INFINITY, f32::NAN);
        let row = [1.0, inf, nan, inf, f32::NEG_INFINITY];
        assert_eq!(
            target_probs(&row, &t, None),
            Some(vec![0.0, 0.5, 0.0, 0.5, 0.0])
        );
        // Id 3 alone allowed of the two.
        assert_eq!(
            target_probs(&row, &t, Some(&[0b11001])),
            Some(vec![0.0, 0.0, 0.0, 1.0, 0.0])
        );
        let p = target_probs(&[0.0, nan, 0.0], &t, None).unwrap();
        assert_eq!(p, vec![0.5, 0.0, 0.5]);
        // A subnormal temperature is greedy in effect, never NaN.
        let cold = SamplingParams::sampled(1e-40, 0);
        let p = target_probs(&[1.0, 3.0, 2.0], &cold, None).unwrap();
        assert_eq!(p[1], 1.0);
        assert!(p[0] < 1e-30 && p[2] < 1e-30);
        assert_eq!(target_probs(&[f32::NEG_INFINITY, nan], &t, None), None);
        assert_eq!(target_probs(&[1.0, 2.0], &t, Some(&[0])), None);
    }

    /// The definition: every positive weight sorted (descending, ties to the lower id),
    /// cut to `top_k`, then (below 1) to the shortest prefix reaching `top_p` of its mass.
    fn sorted_cut(p: &[f32], top_k: usize, top_p: f32) -> Vec<usize> {
        let mut order: Vec<usize> = (0..p.len()).filter(|&i| p[i] > 0.0).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        if top_k > 0 {
            order.truncate(top_k);
        }
        if top_p >= 1.0 {
            return order;
        }
        let total: f64 = order.iter().map(|&i| f64::from(p[i])).sum();
        let mut cum = 0.0;
        for n in 0..order.len() {
            cum += f64::from(p[order[n]]);
            if cum >= f64::from(top_p) * total {
                order.truncate(n + 1);
                break;
            }
        }
        order
    }

    #[test]
    fn selection_keeps_what_a_full_sort_keeps() {
        use rand::rngs::SmallRng;
        use rand::{Rng, SeedableRng};
        let mut r = SmallRng::seed_from_u64(5);
        for (vocab, levels) in [(10usize, 3), (1000, 7), (49152, 40), (49152, 60)] {
            // Weights 2^-level, the heaviest 1: few levels give ties everywhere (across every
            // chunk boundary of the nucleus), many spread the weights past both floors.
            let p: Vec<f32> = (0..vocab)
                .map(|_| match r.random_range(0..10) {
                    0 => 0.0,
                    _ => 0.5f32.powi(r.random_range(0..levels)),
                })
                .collect();
            for (top_k, top_p) in [
                (0, 0.5),
                (0, 0.9),
                (0, 0.999),
                (0, 0.999_999),
                (1, 1.0),
                (50, 1.0),
                (50, 0.8),
                (5000, 0.95),
                (40_000, 1.0),
                (vocab - 1, 0.99),
            ] {
                let want = sorted_cut(&p, top_k, top_p);
                let Some(mut got) = kept_ids(&p, top_k, top_p) else {
                    // Nothing cut: only a `top_k` past the vocabulary without `top_p`.
                    assert!(
                        top_k >= vocab && top_p >= 1.0,
                        "vocab {vocab}, top_k {top_k}"
                    );
                    assert_eq!(want.len(), p.iter().filter(|&&x| x > 0.0).count());
                    continue;
                };
                if top_p < 1.0 {
                    // The nucleus comes back in order.
                    assert_eq!(got, want, "vocab {vocab}, top_k {top_k}, top_p {top_p}");
                } else {
                    got.sort_unstable_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
                    assert_eq!(got, want, "vocab {vocab}, top_k {top_k}");
                }
            }
        }
        assert_eq!(kept_ids(&[1.0, 2.0], 0, 1.0), None);
        assert_eq!(kept_ids(&[1.0, 2.0], 2, 1.0), None);
    }

    #[test]
    fn a_peaked_row_keeps_its_top_k_from_below_every_floor() {
        // One id holds the row; the others lie below both floors in seven tied levels
        // (hundreds of ids each), so no floor holds `top_k` ids and ties straddle the k-th
        // place.
        let mut p: Vec<f32> = (0..5000)
            .map(|i| match i % 11 {
                0 => 0.0,
                r => 1e-20 * (r % 7 + 1) as f32,
            })
            .collect();
        p[4321] = 1.0;
        let positive = p.iter().filter(|&&x| x > 0.0).count();
        for (top_k, top_p) in [
            (1, 1.0),
            (2, 1.0),
            (50, 1.0),
            (50, 0.5),
            (700, 1.0),
            (3000, 0.999),
            (positive, 1.0),
            (4999, 1.0),
        ] {
            let want = sorted_cut(&p, top_k, top_p);
            let mut got = kept_ids(&p, top_k, top_p).expect("top_k below the vocabulary cuts");
            got.sort_unstable_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            assert_eq!(got, want, "top_k {top_k}, top_p {top_p}");
        }
    }
}
