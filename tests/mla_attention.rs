//! The CPU backend's multi-head latent attention (`mla_attention`, the absorbed form) against
//! a straightforward f64 attention written here in the non-absorbed form: per head, keys
//! `[kv_b_k c_kv | k_rope]` and values `kv_b_v c_kv` formed from each cached latent row,
//! then plain softmax attention. Two sequences with their blocks shuffled through the cache,
//! causal rows across block boundaries, a row that attends to nothing, a draft tree's rows;
//! and the arguments the op refuses, by name.
//!
//! Bound: the output is rounded to BF16 once (2^-8 relative at most) and computed in f32
//! (well under 1e-4 at these sizes and a scale of 1), so `|got - want| <= 2^-8 |want| + 1e-4`.

use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{
    BackendError, CpuBackend, DevicePtr, GpuBackend, GpuBackendExt, Kernels, MlaAttentionArgs,
    PagedAttentionArgs,
};

const HEADS: usize = 3;
const RANK: usize = 10;
const NOPE: usize = 6;
const ROPE: usize = 4;
const VDIM: usize = 5;
const LATENT: usize = RANK + ROPE;
const BLOCK: usize = 4;
const MAX_BLOCKS: usize = 5;

fn values(r: &mut SmallRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| bf16::from_f32(r.random_range(-1.5f32..=1.5)).to_f32())
        .collect()
}

/// Latent rows of two sequences, their blocks shuffled through the cache, and the inputs.
struct Case {
    table: Vec<u32>,
    /// `[slots, LATENT]`.
    latent: Vec<f32>,
    /// `[HEADS * (NOPE + VDIM), RANK]`.
    kv_b: Vec<f32>,
}

impl Case {
    fn new(seed: u64) -> Case {
        let mut r = SmallRng::seed_from_u64(seed);
        let blocks = 2 * MAX_BLOCKS + 3;
        let mut ids: Vec<u32> = (0..blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, r.random_range(0..=i));
        }
        Case {
            table: ids[..2 * MAX_BLOCKS].to_vec(),
            latent: values(&mut r, blocks * BLOCK * LATENT),
            kv_b: values(&mut r, HEADS * (NOPE + VDIM) * RANK),
        }
    }

    fn row(&self, seq: usize, j: usize) -> &[f32] {
        let slot = self.table[seq * MAX_BLOCKS + j / BLOCK] as usize * BLOCK + j % BLOCK;
        &self.latent[slot * LATENT..(slot + 1) * LATENT]
    }

    /// The f64 attention of one query row `q` (`[HEADS, NOPE + ROPE]`) over cached rows
    /// `cols` of `seq`, in the non-absorbed form.
    fn reference(&self, q: &[f32], seq: usize, cols: &[usize]) -> Vec<f64> {
        let mut out = vec![0f64; HEADS * VDIM];
        let scale = 1.0 / ((NOPE + ROPE) as f64).sqrt();
        for h in 0..HEADS {
            let w = |row: usize, c: usize| self.kv_b[(h * (NOPE + VDIM) + row) * RANK + c] as f64;
            let up = |c_kv: &[f32], row: usize| -> f64 {
                (0..RANK).map(|c| w(row, c) * c_kv[c] as f64).sum()
            };
            let qh = &q[h * (NOPE + ROPE)..(h + 1) * (NOPE + ROPE)];
            let scores: Vec<f64> = cols
                .iter()
                .map(|&j| {
                    let l = self.row(seq, j);
                    let key: Vec<f64> = (0..NOPE)
                        .map(|d| up(&l[..RANK], d))
                        .chain(l[RANK..].iter().map(|&x| x as f64))
                        .collect();
                    qh.iter().zip(&key).map(|(&a, b)| a as f64 * b).sum::<f64>() * scale
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = p.iter().sum();
            for e in 0..VDIM {
                out[h * VDIM + e] = cols
                    .iter()
                    .zip(&p)
                    .map(|(&j, p)| p * up(&self.row(seq, j)[..RANK], NOPE + e))
                    .sum::<f64>()
                    / total;
            }
        }
        out
    }
}

struct Call<'a> {
    q: &'a [f32],
    seqs: &'a [u32],
    lens: &'a [u32],
    parents: Option<&'a [u32]>,
    latent_width: usize,
    out_at_q: bool,
}

/// Runs the op over `call`; the output, or the op's refusal.
fn run(b: &CpuBackend, case: &Case, call: Call<'_>) -> Result<Vec<f32>, BackendError> {
    let rows = call.seqs.len();
    let half = LATENT / 2;
    let lo: Vec<f32> = case
        .latent
        .chunks(LATENT)
        .flat_map(|r| r[..half].to_vec())
        .collect();
    let hi: Vec<f32> = case
        .latent
        .chunks(LATENT)
        .flat_map(|r| r[half..].to_vec())
        .collect();
    let n_out = rows * HEADS * VDIM;
    let ptrs: Vec<DevicePtr> = vec![
        b.upload_bf16(call.q, "q").unwrap(),
        b.upload_bf16(&case.kv_b, "kv_b").unwrap(),
        b.upload_bf16(&lo, "lo").unwrap(),
        b.upload_bf16(&hi, "hi").unwrap(),
        b.upload(&case.table, "table").unwrap(),
        b.upload(call.seqs, "seqs").unwrap(),
        b.upload(call.lens, "lens").unwrap(),
        // Poisoned (NaN), so that an element left unwritten shows.
        b.upload(&vec![0xFFFFu16; n_out.max(1)], "out").unwrap(),
    ];
    let parents = call.parents.map(|p| b.upload(p, "parents").unwrap());
    let out = if call.out_at_q { ptrs[0] } else { ptrs[7] };
    let result = b.mla_attention(MlaAttentionArgs {
        out,
        q: ptrs[0],
        kv_b: ptrs[1],
        lo_cache: ptrs[2],
        hi_cache: ptrs[3],
        block_table: ptrs[4],
        row_seq: ptrs[5],
        row_ctx_len: ptrs[6],
        row_parent: parents,
        rows,
        heads: HEADS,
        kv_lora_rank: call.latent_width - ROPE,
        nope_dim: NOPE,
        rope_dim: ROPE,
        v_dim: VDIM,
        block_size: BLOCK,
        max_blocks_per_seq: MAX_BLOCKS,
        scale: 1.0 / ((NOPE + ROPE) as f32).sqrt(),
        stream: 0,
    });
    let got = b.download_bf16(ptrs[7], n_out).unwrap();
    for p in ptrs.into_iter().chain(parents) {
        b.free(p).unwrap();
    }
    assert_eq!(b.ledger().live_count(), 0);
    result.map(|()| got)
}

fn call<'a>(q: &'a [f32], seqs: &'a [u32], lens: &'a [u32]) -> Call<'a> {
    Call {
        q,
        seqs,
        lens,
        parents: None,
        latent_width: LATENT,
        out_at_q: false,
    }
}

fn check(got: &[f32], want: &[f64], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let bound = w.abs() / 256.0 + 1e-4;
        assert!(
            (*g as f64 - w).abs() <= bound,
            "{what}: element {i} is {g}, the f64 attention {w} (bound {bound})"
        );
    }
}

#[test]
fn latent_attention_matches_the_non_absorbed_f64_attention() {
    let b = CpuBackend::new();
    let case = Case::new(5);
    let mut r = SmallRng::seed_from_u64(6);
    // Every causal length of sequence 0 up to 19 (across four block boundaries), some of
    // sequence 1, and a row attending to nothing.
    let mut rows: Vec<(u32, u32)> = (1..=19).map(|l| (0, l)).collect();
    rows.extend([(1, 1), (1, 8), (1, 17), (0, 0)]);
    let q = values(&mut r, rows.len() * HEADS * (NOPE + ROPE));
    let (seqs, lens): (Vec<u32>, Vec<u32>) = rows.iter().copied().unzip();
    let got = run(&b, &case, call(&q, &seqs, &lens)).unwrap();
    let per_q = HEADS * (NOPE + ROPE);
    for (i, &(seq, len)) in rows.iter().enumerate() {
        let cols: Vec<usize> = (0..len as usize).collect();
        let want = match len {
            0 => vec![0.0; HEADS * VDIM],
            _ => case.reference(&q[i * per_q..(i + 1) * per_q], seq as usize, &cols),
        };
        let what = format!("row {i} (sequence {seq}, {len} rows)");
        check(&got[i * HEADS * VDIM..(i + 1) * HEADS * VDIM], &want, &what);
    }
}

#[test]
fn tree_rows_attend_to_their_prefix_and_ancestors_only() {
    let b = CpuBackend::new();
    let case = Case::new(8);
    let mut r = SmallRng::seed_from_u64(9);
    // A prefix of 7 rows; the root at row 7, children 8 and 9, 10 a child of 8, 11 of 10.
    let parents = [PagedAttentionArgs::NO_PARENT, 0, 0, 1, 3];
    let lens = [8u32, 9, 10, 11, 12];
    let seqs = [1u32; 5];
    let q = values(&mut r, 5 * HEADS * (NOPE + ROPE));
    let mut c = call(&q, &seqs, &lens);
    c.parents = Some(&parents);
    let got = run(&b, &case, c).unwrap();
    let branches: [&[usize]; 5] = [&[], &[8], &[9], &[8, 10], &[8, 10, 11]];
    let per_q = HEADS * (NOPE + ROPE);
    for (i, own) in branches.iter().enumerate() {
        let cols: Vec<usize> = (0..8).chain(own.iter().copied()).collect();
        let want = case.reference(&q[i * per_q..(i + 1) * per_q], 1, &cols);
        check(
            &got[i * HEADS * VDIM..(i + 1) * HEADS * VDIM],
            &want,
            &format!("tree row {i}"),
        );
    }
}

#[test]
fn bad_latent_attention_arguments_are_refused_by_name() {
    let b = CpuBackend::new();
    let case = Case::new(1);
    let q = vec![0.5f32; 2 * HEADS * (NOPE + ROPE)];
    let refused = |c: Call<'_>| run(&b, &case, c).unwrap_err().to_string();
    let mut odd = call(&q, &[0, 0], &[1, 2]);
    odd.latent_width = LATENT - 1;
    let err = refused(odd);
    assert!(
        err.contains("mla_attention") && err.contains("even"),
        "{err}"
    );
    let err = refused(call(&q, &[0, 0], &[1, 21]));
    assert!(
        err.contains("row 1 attends to 21 rows, more than its block table holds"),
        "{err}"
    );
    let mut aliased = call(&q, &[0, 0], &[1, 2]);
    aliased.out_at_q = true;
    let err = refused(aliased);
    assert!(
        err.contains("mla_attention out") && err.contains("mla_attention q"),
        "{err}"
    );
    let mut bad_tree = call(&q, &[0, 0], &[3, 2]);
    bad_tree.parents = Some(&[PagedAttentionArgs::NO_PARENT, 0]);
    let err = refused(bad_tree);
    assert!(err.contains("a parent's own row comes first"), "{err}");
}
