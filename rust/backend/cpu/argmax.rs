//! The argmax of one row, as every backend's `argmax` kernel computes it and as greedy
//! verification on the host picks: the engine's verify and the kernels share this one
//! definition, so a pick made on the device and one made on the host are the same token.

/// The index of the largest allowed logit (ties: the lowest index); `None` when the mask
/// allows no token. NaN logits never win. `mask` is argmax's grammar bitmask (id t allowed
/// when bit t % 32 of word t / 32 is set; a missing word allows nothing).
pub fn argmax(logits: &[f32], mask: Option<&[i32]>) -> Option<u32> {
    let Some(mask) = mask else {
        return argmax_unmasked(logits);
    };
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in logits.iter().enumerate() {
        if (mask.get(i / 32).copied().unwrap_or(0) as u32 >> (i % 32)) & 1 == 0 {
            continue;
        }
        match best {
            None if !x.is_nan() => best = Some((i, x)),
            Some((_, b)) if x > b => best = Some((i, x)),
            _ => {}
        }
    }
    best.map(|(i, _)| i as u32)
}

/// [`argmax`] without a mask, in two passes that vectorise (a greedy step scans a whole
/// vocabulary row): the largest non-NaN value in eight lanes, then the first index holding
/// it. The first index equal to the maximum is exactly the one the one-pass scan keeps
/// (it replaces its pick only on a strictly larger value, and `-0.0 == 0.0`); no index
/// matches when every logit is NaN.
fn argmax_unmasked(logits: &[f32]) -> Option<u32> {
    const LANES: usize = 8;
    let mut top = [f32::NEG_INFINITY; LANES];
    let mut chunks = logits.chunks_exact(LANES);
    for c in &mut chunks {
        for (t, &x) in top.iter_mut().zip(c) {
            // A NaN compares false, so it never enters a lane.
            *t = if x > *t { x } else { *t };
        }
    }
    for (t, &x) in top.iter_mut().zip(chunks.remainder()) {
        *t = if x > *t { x } else { *t };
    }
    let max = top
        .iter()
        .fold(f32::NEG_INFINITY, |m, &t| if t > m { t } else { m });
    logits.iter().position(|&x| x == max).map(|i| i as u32)
}

#[cfg(test)]
mod tests {
    use super::argmax;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn argmax_ties_lowest_and_respects_mask() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0], None), Some(1));
        let mut mask = vec![0i32; 1];
        mask[0] = 0b1001;
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0], Some(&mask)), Some(3));
        assert_eq!(argmax(&[1.0, 3.0], Some(&[0])), None);
        assert_eq!(argmax(&[f32::NAN, 0.5], None), Some(1));
    }

    /// The one-pass definition: the first non-NaN value, replaced only by a strictly larger
    /// one.
    fn first_largest(logits: &[f32]) -> Option<u32> {
        let mut best: Option<(usize, f32)> = None;
        for (i, &x) in logits.iter().enumerate() {
            if !x.is_nan() && best.is_none_or(|(_, b)| x > b) {
                best = Some((i, x));
            }
        }
        best.map(|(i, _)| i as u32)
    }

    #[test]
    fn unmasked_argmax_is_the_first_largest_value() {
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        assert_eq!(argmax(&[], None), None);
        assert_eq!(argmax(&[nan; 11], None), None);
        assert_eq!(argmax(&[nan, -inf, nan, -inf], None), Some(1));
        assert_eq!(argmax(&[-0.0, 0.0, 0.0], None), Some(0));
        assert_eq!(argmax(&[0.0, -0.0], None), Some(0));
        // Ties across lanes and in the remainder past the last full lane group.
        let mut row = vec![-1.0f32; 19];
        row[17] = 5.0;
        row[9] = 5.0;
        assert_eq!(argmax(&row, None), Some(9));
        row[18] = inf;
        assert_eq!(argmax(&row, None), Some(18));
        let mut r = SmallRng::seed_from_u64(7);
        for len in [1usize, 7, 8, 9, 64, 1000, 49152] {
            for _ in 0..20 {
                // Few distinct values, so that ties are common; some NaNs and infinities.
                let row: Vec<f32> = (0..len)
                    .map(|_| match r.random_range(0..40) {
                        0 => nan,
                        1 => -inf,
                        2 => -0.0,
                        k => (k % 9) as f32 - 4.0,
                    })
                    .collect();
                assert_eq!(argmax(&row, None), first_largest(&row), "len {len}");
            }
        }
    }
}
