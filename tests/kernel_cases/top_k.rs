//! The `top_k` case: random logits with ties, non-finite values and per-row masks,
//! against an expectation sorted here in f64, on the reference and on the device.

use super::{both, close, exact, rng, uniform, Scope, F32_RTOL};
use rand::Rng;
use specdraft::backend::{Dtype, GpuBackend, GpuBackendExt, TopKArgs};

/// Each row's expected `(ids, probs)`: the allowed finite logits sorted by value, then id,
/// the first `k` kept with `exp(l - max) / sum(exp)` over every finite logit; the places
/// left are `u32::MAX` and 0.
fn expected(logits: &[f32], mask: Option<&[i32]>, width: usize, k: usize) -> (Vec<u32>, Vec<f32>) {
    let words = width.div_ceil(32);
    let (mut ids, mut probs) = (Vec::new(), Vec::new());
    for (r, row) in logits.chunks(width).enumerate() {
        let finite: Vec<(usize, f64)> = row
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i, f64::from(l)))
            .collect();
        let max = finite
            .iter()
            .map(|&(_, l)| l)
            .fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = finite.iter().map(|&(_, l)| (l - max).exp()).sum();
        let allowed = |i: usize| mask.is_none_or(|m| (m[r * words + i / 32] >> (i % 32)) & 1 == 1);
        let mut kept: Vec<(usize, f64)> = finite.into_iter().filter(|&(i, _)| allowed(i)).collect();
        kept.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for j in 0..k {
            match kept.get(j) {
                Some(&(i, l)) => {
                    ids.push(i as u32);
                    probs.push(((l - max).exp() / sum) as f32);
                }
                None => {
                    ids.push(u32::MAX);
                    probs.push(0.0);
                }
            }
        }
    }
    (ids, probs)
}

/// `top_k` of `rows` rows of `width` logits, keeping `k`. Row 0 holds its maximum up to six
/// times (the lower ids must come first); with `masked`, row 1 allows nothing and row 2
/// only two ids; row 3 is all `-inf` and row 4 has NaNs and infinities among its values.
pub fn top_k(
    dut: &dyn GpuBackend,
    rows: usize,
    width: usize,
    k: usize,
    masked: bool,
    seed: u64,
) -> Result<(), String> {
    let mut logits = uniform(seed, rows * width, -10.0, 10.0);
    // Ties 128, 256 and 512 ids apart meet in one thread of a block of up to that many.
    let top = logits[..width].iter().copied().fold(f32::MIN, f32::max);
    for at in [1, 129, 257, 513, width / 2, width - 1] {
        if at < width {
            logits[at] = top;
        }
    }
    if rows > 3 {
        logits[3 * width..4 * width].fill(f32::NEG_INFINITY);
    }
    if rows > 4 {
        for (i, l) in logits[4 * width..5 * width].iter_mut().enumerate() {
            match i % 5 {
                1 => *l = f32::NAN,
                3 => *l = f32::NEG_INFINITY,
                4 if i % 2 == 0 => *l = f32::INFINITY,
                _ => {}
            }
        }
    }
    let words = width.div_ceil(32);
    let mut r = rng(seed + 1);
    let mut mask: Vec<i32> = (0..rows * words).map(|_| r.random::<i32>()).collect();
    if rows > 2 {
        mask[words..2 * words].fill(0);
        mask[2 * words..3 * words].fill(0);
        mask[2 * words] = 0b1001;
    }
    let mask = masked.then_some(mask);
    let (want_ids, want_probs) = expected(&logits, mask.as_deref(), width, k);
    let ((got_ids, got_probs), (ref_ids, ref_probs)) = both(dut, |b| {
        let s = Scope::new(b);
        let pl = s.f32(&logits)?;
        let pm = mask.as_deref().map(|m| s.i32(m)).transpose()?;
        let ids = s.out(Dtype::U32, rows * k)?;
        let probs = s.out(Dtype::F32, rows * k)?;
        b.top_k(TopKArgs {
            ids,
            probs,
            logits: pl,
            bitmask: pm,
            rows,
            width,
            k,
            stream: 0,
        })?;
        Ok((
            b.download::<u32>(ids, rows * k)?,
            b.download::<f32>(probs, rows * k)?,
        ))
    })?;
    exact("top_k ids (reference)", &ref_ids, &want_ids)?;
    close(
        "top_k probs (reference)",
        &ref_probs,
        &want_probs,
        F32_RTOL,
        0.0,
    )?;
    exact("top_k ids", &got_ids, &want_ids)?;
    close("top_k probs", &got_probs, &want_probs, F32_RTOL, 0.0)
}
