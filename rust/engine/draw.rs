//! Drawing one id from a row of weights ([`sample_from`]), as sampled verification does for
//! every correction and bonus token: once for each sampled sequence at each step.
//!
//! A row is a vocabulary wide (49,152 ids on the default model), so the draw sums it in
//! chunks of [`DRAW_CHUNK`] ids (f64 lanes, vectorised), walks the chunk sums to the chunk the
//! draw lands in, and scans only that chunk. A scan of the whole row in one f64 running sum
//! took 40-45 µs on SmolLM2's rows on a 2-core EPYC; this takes 10-12.
//!
//! Invariants: an id is drawn with probability its weight over the row's total, counting
//! negative and NaN weights as 0 (up to f64 rounding at the edges between ids); an id of zero
//! weight is never drawn while any weight is positive; a row with no positive weight draws
//! id 0. Excluded ids ([`sample_excluding`]) count as weight 0, unless that leaves no mass.

use rand::rngs::SmallRng;
use rand::Rng;

/// Ids summed into one partial sum: small enough that the chunk a draw lands in is scanned
/// in well under a microsecond, large enough that walking the sums costs nothing.
const DRAW_CHUNK: usize = 512;
/// Independent partial results of a scan over a row, so that the loop vectorises.
pub(crate) const LANES: usize = 16;

/// Draws an index from `weights` (non-negative, not necessarily normalised).
pub fn sample_from(weights: &[f32], rng: &mut SmallRng) -> u32 {
    sample_excluding(weights, &[], rng)
}

/// Draws an index from `weights` with the ids of `excluded` counted as weight 0: the
/// residual a rejected one-hot draft leaves. When that leaves no positive weight (the row's
/// mass was all on excluded ids, up to rounding), draws from the whole row instead.
pub(crate) fn sample_excluding(weights: &[f32], excluded: &[u32], rng: &mut SmallRng) -> u32 {
    let sums: Vec<f64> = weights
        .chunks(DRAW_CHUNK)
        .enumerate()
        .map(|(c, chunk)| chunk_mass(chunk, c * DRAW_CHUNK, excluded))
        .collect();
    let total: f64 = sums.iter().sum();
    if total <= 0.0 && !excluded.is_empty() {
        return sample_excluding(weights, &[], rng);
    }
    let target = rng.random::<f64>() * total;
    let mut before = 0.0;
    let mut last_chunk = None;
    for (c, &mass) in sums.iter().enumerate() {
        if mass <= 0.0 {
            continue;
        }
        last_chunk = Some(c);
        if target < before + mass {
            return scan_chunk(weights, c, before, target, excluded);
        }
        before += mass;
    }
    // Rounding can leave `target` a hair above the sum: the last id with mass wins.
    match last_chunk {
        Some(c) => scan_chunk(weights, c, f64::NEG_INFINITY, f64::INFINITY, excluded),
        None => 0,
    }
}

/// The sum of the positive weights of `w` (negative and NaN weights count as 0), in f64
/// lanes: vectorised, and as accurate as a sequential f64 sum.
pub(crate) fn positive_sum(w: &[f32]) -> f64 {
    let mut lanes = [0.0f64; LANES];
    let mut groups = w.chunks_exact(LANES);
    for g in &mut groups {
        for (l, &x) in lanes.iter_mut().zip(g) {
            // `max` maps NaN to 0 too.
            *l += f64::from(x.max(0.0));
        }
    }
    let tail: f64 = groups
        .remainder()
        .iter()
        .map(|&x| f64::from(x.max(0.0)))
        .sum();
    lanes.iter().sum::<f64>() + tail
}

/// Whether id `i` counts towards the draw: positive weight, not excluded.
fn counts(weights: &[f32], excluded: &[u32], i: usize) -> bool {
    weights[i] > 0.0 && !excluded.contains(&(i as u32))
}

/// The positive weight of `chunk` (whose first id is `first`), excluded ids left out.
fn chunk_mass(chunk: &[f32], first: usize, excluded: &[u32]) -> f64 {
    let end = first + chunk.len();
    if excluded
        .iter()
        .any(|&x| (first..end).contains(&(x as usize)))
    {
        return chunk
            .iter()
            .enumerate()
            .filter(|&(i, _)| !excluded.contains(&((first + i) as u32)))
            .map(|(_, &w)| f64::from(w.max(0.0)))
            .sum();
    }
    positive_sum(chunk)
}

/// The id of chunk `c` where the running sum from `before` first passes `target`; its last
/// counting id when rounding keeps it from passing (the draw landed in this chunk's mass).
fn scan_chunk(weights: &[f32], c: usize, before: f64, target: f64, excluded: &[u32]) -> u32 {
    let ids = c * DRAW_CHUNK..weights.len().min((c + 1) * DRAW_CHUNK);
    let mut cum = before;
    let mut last = ids.start;
    for i in ids {
        if counts(weights, excluded, i) {
            cum += f64::from(weights[i]);
            last = i;
            if target < cum {
                return i as u32;
            }
        }
    }
    last as u32
}

#[cfg(test)]
mod tests {
    use super::{sample_excluding, sample_from, DRAW_CHUNK};
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    /// Counts of `n` draws of each id.
    fn counts(weights: &[f32], excluded: &[u32], n: usize) -> Vec<usize> {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut c = vec![0; weights.len()];
        for _ in 0..n {
            c[sample_excluding(weights, excluded, &mut rng) as usize] += 1;
        }
        c
    }

    #[test]
    fn draws_follow_the_weights_across_chunks() {
        // Mass in three chunks, the middle one's on its first and last ids, and zeros,
        // negatives and NaN that must never be drawn.
        let mut w = vec![0.0f32; 3 * DRAW_CHUNK + 7];
        let heavy = [
            (3, 1.0),
            (DRAW_CHUNK, 2.0),
            (2 * DRAW_CHUNK - 1, 3.0),
            (3 * DRAW_CHUNK + 6, 4.0),
        ];
        for &(i, x) in &heavy {
            w[i] = x;
        }
        w[10] = -5.0;
        w[11] = f32::NAN;
        let n = 100_000;
        let c = counts(&w, &[], n);
        for &(i, x) in &heavy {
            let expected = n as f64 * f64::from(x) / 10.0;
            let sd = (expected * (1.0 - f64::from(x) / 10.0)).sqrt();
            assert!(
                (c[i] as f64 - expected).abs() < 5.0 * sd,
                "id {i}: {} of {expected}",
                c[i]
            );
        }
        assert_eq!(c.iter().sum::<usize>(), n);
        assert_eq!(
            heavy.iter().map(|&(i, _)| c[i]).sum::<usize>(),
            n,
            "an id without mass"
        );
    }

    #[test]
    fn excluded_ids_are_never_drawn_while_others_have_mass() {
        let mut w = vec![0.0f32; 2 * DRAW_CHUNK];
        w[5] = 10.0;
        w[6] = 1.0;
        w[DRAW_CHUNK + 1] = 1.0;
        let c = counts(&w, &[5], 20_000);
        assert_eq!(c[5], 0);
        assert!(
            c[6] > 9_000 && c[DRAW_CHUNK + 1] > 9_000,
            "{} {}",
            c[6],
            c[DRAW_CHUNK + 1]
        );
        // All the mass excluded: the whole row is drawn from.
        let c = counts(&w, &[5, 6, DRAW_CHUNK as u32 + 1], 1_000);
        assert!(c[5] > 0);
    }

    #[test]
    fn a_row_without_mass_draws_id_0_and_the_top_of_the_draw_lands_on_the_last_id() {
        let mut rng = SmallRng::seed_from_u64(1);
        assert_eq!(sample_from(&[0.0, -1.0, f32::NAN], &mut rng), 0);
        let mut w = vec![0.0f32; DRAW_CHUNK + 3];
        w[1] = 1e-30;
        w[DRAW_CHUNK + 1] = 1.0;
        // Every draw lands on the heavy id; the tiny one is drawn with probability 1e-30.
        assert!((0..1000).all(|_| sample_from(&w, &mut rng) as usize == DRAW_CHUNK + 1));
    }
}
