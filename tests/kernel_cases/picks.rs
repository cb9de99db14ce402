//! The pick cases, exact: `argmax` (ties to the lower index, NaN, optional masks) and `pick`.

use super::*;

pub fn argmax(
    dut: &dyn GpuBackend,
    rows: usize,
    vocab: usize,
    masked: bool,
    seed: u64,
) -> Result<(), String> {
    let mut logits = uniform(seed, rows * vocab, -10.0, 10.0);
    // Ties: row 0 gets its maximum twice, and the lower index must win.
    if vocab > 3 {
        let (i, _) = logits[..vocab]
            .iter()
            .enumerate()
            .fold((0, f32::MIN), |a, (i, &v)| if v > a.1 { (i, v) } else { a });
        logits[vocab - 1] = logits[i];
        logits[1.min(i)] = logits[i];
    }
    // NaN never counts: row 0 starts with one (the first id a thread scans), and with
    // three rows or more, row 2 is NaN but for its last id.
    logits[0] = f32::NAN;
    if rows > 2 {
        logits[2 * vocab..3 * vocab - 1].fill(f32::NAN);
    }
    let words = vocab.div_ceil(32);
    let mut r = rng(seed + 1);
    let mut mask: Vec<i32> = (0..rows * words).map(|_| r.random::<i32>()).collect();
    if masked && rows > 1 {
        // Nothing allowed in row 1: the answer is u32::MAX.
        mask[words..2 * words].fill(0);
    }
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let pl = s.f32(&logits)?;
        let pm = if masked { Some(s.i32(&mask)?) } else { None };
        let o = s.out(Dtype::U32, rows)?;
        b.argmax(ArgmaxArgs {
            out: o,
            logits: pl,
            bitmask: pm,
            rows,
            vocab,
            stream: 0,
        })?;
        b.download::<u32>(o, rows)
    })?;
    // The reference row by row: the host's greedy pick, NaN and mask rules included.
    let expected: Vec<u32> = (0..rows)
        .map(|r| {
            let row_mask = masked.then(|| &mask[r * words..(r + 1) * words]);
            host_argmax(&logits[r * vocab..(r + 1) * vocab], row_mask).unwrap_or(u32::MAX)
        })
        .collect();
    exact("argmax (reference)", &want, &expected)?;
    exact("argmax", &got, &want)
}

/// `pick` of one value a row, against the values indexed here; every fourth row's index is
/// past the row (`u32::MAX`, or `width` itself), which gives 0.
pub fn pick(dut: &dyn GpuBackend, rows: usize, width: usize, seed: u64) -> Result<(), String> {
    let values = uniform(seed, rows * width, -3.0, 3.0);
    let mut r = rng(seed + 1);
    let index: Vec<u32> = (0..rows)
        .map(|i| match i % 4 {
            3 if i % 8 == 3 => u32::MAX,
            3 => width as u32,
            _ => r.random_range(0..width.max(1)) as u32,
        })
        .collect();
    let expected: Vec<f32> = (0..rows)
        .map(|i| match index[i] as usize {
            j if j < width => values[i * width + j],
            _ => 0.0,
        })
        .collect();
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let (pv, pi) = (s.f32(&values)?, s.u32(&index)?);
        let o = s.out(Dtype::F32, rows)?;
        b.pick(PickArgs {
            out: o,
            values: pv,
            index: pi,
            rows,
            width,
            stream: 0,
        })?;
        b.download::<f32>(o, rows)
    })?;
    exact("pick (reference)", &want, &expected)?;
    exact("pick", &got, &expected)
}
