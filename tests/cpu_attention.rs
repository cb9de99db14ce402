//! The CPU backend's paged attention against a straightforward f64 attention written here,
//! over odd shapes (head sizes, group sizes 1, 3 and 4, contexts of 0 to 300 rows across
//! block boundaries, scattered blocks); and each row's output bitwise the same alone, in a
//! verify batch of 1 to 16 rows, in a long prefill chunk, next to other sequences, on 1 to 3
//! threads and on the portable instruction set; and rows under a tree mask (a draft tree's
//! verify) against the f64 attention over the prefix and their ancestors.
//!
//! Bound against the f64 attention: the output is rounded to BF16 once (half a unit in the
//! last place, 2^-8 relative at most) and computed in f32 (under 1e-5 of the values' scale,
//! which is 1 here), so `|got - want| <= 2^-8 |want| + 1e-5`.

use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::quant::{Isa, KernelPool};
use specdraft::backend::{CpuBackend, GpuBackend, GpuBackendExt, Kernels, PagedAttentionArgs};

/// A paged cache of `seq_lens.len()` sequences, their blocks shuffled through it.
struct Cache {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    max_blocks: usize,
    table: Vec<u32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Uniform values in [lo, hi], rounded to BF16 so that both sides see the same inputs.
fn values(r: &mut SmallRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n)
        .map(|_| bf16::from_f32(r.random_range(lo..=hi)).to_f32())
        .collect()
}

impl Cache {
    fn new(
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        seq_lens: &[usize],
        seed: u64,
    ) -> Cache {
        let mut r = SmallRng::seed_from_u64(seed);
        let max_blocks = seq_lens
            .iter()
            .map(|l| l.div_ceil(block_size))
            .max()
            .unwrap_or(1)
            .max(1);
        // Spare blocks, so that the used ones are not a prefix of the cache.
        let num_blocks = seq_lens.len() * max_blocks + 5;
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, r.random_range(0..=i));
        }
        let n = num_blocks * block_size * kv_heads * head_dim;
        // Keys up to 3 in size, so that scores spread over several units and the softmax is
        // not flat.
        Cache {
            heads,
            kv_heads,
            head_dim,
            block_size,
            max_blocks,
            table: ids[..seq_lens.len() * max_blocks].to_vec(),
            k: values(&mut r, n, -3.0, 3.0),
            v: values(&mut r, n, -1.0, 1.0),
        }
    }

    fn kv_at<'a>(&self, cache: &'a [f32], seq: usize, j: usize, kv_head: usize) -> &'a [f32] {
        let block = self.table[seq * self.max_blocks + j / self.block_size] as usize;
        let slot = block * self.block_size + j % self.block_size;
        let at = (slot * self.kv_heads + kv_head) * self.head_dim;
        &cache[at..at + self.head_dim]
    }

    /// The f64 attention of query `q` (one row, every head) of `seq` over its first `len`
    /// cached rows.
    fn reference(&self, q: &[f32], seq: usize, len: usize) -> Vec<f64> {
        self.reference_over(q, seq, &(0..len).collect::<Vec<_>>())
    }

    /// The f64 attention of query `q` of `seq` over the cached rows `cols` alone.
    fn reference_over(&self, q: &[f32], seq: usize, cols: &[usize]) -> Vec<f64> {
        let (hd, group) = (self.head_dim, self.heads / self.kv_heads);
        let scale = 1.0 / (hd as f64).sqrt();
        let mut out = vec![0f64; self.heads * hd];
        for h in 0..self.heads {
            let qh = &q[h * hd..(h + 1) * hd];
            let scores: Vec<f64> = cols
                .iter()
                .map(|&j| {
                    let k = self.kv_at(&self.k, seq, j, h / group);
                    scale
                        * qh.iter()
                            .zip(k)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for (&j, w) in cols.iter().zip(&weights) {
                let v = self.kv_at(&self.v, seq, j, h / group);
                for d in 0..hd {
                    out[h * hd + d] += w / total * v[d] as f64;
                }
            }
        }
        out
    }

    /// Runs one call: row `i` is `(seq, len)` with query `qs[i]`; returns the output's bits.
    fn run(&self, b: &CpuBackend, rows: &[(usize, usize)], qs: &[&[f32]]) -> Vec<u16> {
        self.try_run(b, rows, qs, None).unwrap()
    }

    /// [`Self::run`] under the tree mask `parents` when given.
    fn try_run(
        &self,
        b: &CpuBackend,
        rows: &[(usize, usize)],
        qs: &[&[f32]],
        parents: Option<&[u32]>,
    ) -> Result<Vec<u16>, specdraft::backend::BackendError> {
        let n = rows.len() * self.heads * self.head_dim;
        let q: Vec<f32> = qs.iter().flat_map(|q| q.iter().copied()).collect();
        let seqs: Vec<u32> = rows.iter().map(|r| r.0 as u32).collect();
        let lens: Vec<u32> = rows.iter().map(|r| r.1 as u32).collect();
        let num_seqs = seqs.iter().max().map_or(0, |&s| s as usize + 1);
        let ptrs = [
            b.upload_bf16(&q, "q").unwrap(),
            b.upload_bf16(&self.k, "k").unwrap(),
            b.upload_bf16(&self.v, "v").unwrap(),
            b.upload(&self.table[..num_seqs * self.max_blocks], "table")
                .unwrap(),
            b.upload(&seqs, "seqs").unwrap(),
            b.upload(&lens, "lens").unwrap(),
            // Poisoned (NaN), so that an element left unwritten shows.
            b.upload(&vec![0xFFFFu16; n.max(1)], "out").unwrap(),
        ];
        let parent_ptr = parents.map(|p| b.upload(p, "parents").unwrap());
        let result = b.paged_attention(PagedAttentionArgs {
            out: ptrs[6],
            q: ptrs[0],
            k_cache: ptrs[1],
            v_cache: ptrs[2],
            block_table: ptrs[3],
            row_seq: ptrs[4],
            row_ctx_len: ptrs[5],
            row_parent: parent_ptr,
            rows: rows.len(),
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            max_blocks_per_seq: self.max_blocks,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
            stream: 0,
        });
        let out = b.download::<u16>(ptrs[6], n).unwrap();
        for p in ptrs.into_iter().chain(parent_ptr) {
            b.free(p).unwrap();
        }
        assert_eq!(b.ledger().live_count(), 0);
        result.map(|()| out)
    }
}

/// Every causal row of `seq_lens` (lengths 1..=len of each sequence, all in one call, plus a
/// row that attends to nothing) against the f64 attention.
fn check_against_reference(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    seq_lens: &[usize],
    seed: u64,
) {
    let c = Cache::new(heads, kv_heads, head_dim, block_size, seq_lens, seed);
    let mut r = SmallRng::seed_from_u64(seed + 1);
    let mut rows = vec![(0, 0)];
    for (s, &len) in seq_lens.iter().enumerate() {
        rows.extend((1..=len).map(|l| (s, l)));
    }
    let width = heads * head_dim;
    let qs: Vec<Vec<f32>> = rows
        .iter()
        .map(|_| values(&mut r, width, -1.0, 1.0))
        .collect();
    let q_refs: Vec<&[f32]> = qs.iter().map(|q| &q[..]).collect();
    let b = CpuBackend::new();
    let got = c.run(&b, &rows, &q_refs);
    for (i, &(s, len)) in rows.iter().enumerate() {
        let want = c.reference(&qs[i], s, len);
        for (e, (&g, &w)) in got[i * width..(i + 1) * width]
            .iter()
            .zip(&want)
            .enumerate()
        {
            let g = bf16::from_bits(g).to_f64();
            assert!(
                (g - w).abs() <= w.abs() / 256.0 + 1e-5,
                "heads {heads}/{kv_heads} dim {head_dim} block {block_size}: sequence {s}, \
                 context {len}, head {}, element {}: got {g}, want {w}",
                e / head_dim,
                e % head_dim
            );
        }
    }
}

#[test]
fn matches_f64_attention_smollm2_shape() {
    // Nine heads on three KV heads (groups of 3), 64 wide, blocks of 16.
    check_against_reference(9, 3, 64, 16, &[300, 33, 1], 11);
}

#[test]
fn matches_f64_attention_odd_shapes() {
    // No grouping, odd widths, blocks that do not divide the key blocks.
    check_against_reference(2, 2, 17, 5, &[130, 7], 21);
    // Groups of 4, a head narrower than a vector.
    check_against_reference(8, 2, 5, 3, &[70, 16, 2], 31);
    // Groups of 3 on one KV head, wide heads, one block per row.
    check_against_reference(3, 1, 128, 1, &[40], 41);
    // Groups of 4, blocks as long as the context.
    check_against_reference(4, 1, 64, 64, &[64, 65], 51);
}

/// `(name, backend)`: the default, and pools of other sizes and of every instruction set
/// this CPU runs (the AVX2 and AVX-512 builds of the kernel among them).
fn backends() -> Vec<(String, CpuBackend)> {
    let spin = KernelPool::DEFAULT_SPIN;
    let mut v: Vec<(String, CpuBackend)> = [1, 2, 3]
        .map(|t| (format!("{t} threads"), CpuBackend::with_threads(t)))
        .into();
    for isa in Isa::available() {
        let pool = KernelPool::with_options(2, isa, spin);
        v.push((
            format!("{}, two threads", isa.name()),
            CpuBackend::with_kernel_pool(pool),
        ));
    }
    v
}

/// Each row of sequence 0 (query `p - 1` at context `p`) computed alone on the default
/// backend, then in other batches on other backends: the bits must not move.
fn check_rows_bitwise(heads: usize, kv_heads: usize, head_dim: usize, block_size: usize) {
    let len = 300;
    let c = Cache::new(heads, kv_heads, head_dim, block_size, &[len, 40, 9], 61);
    let mut r = SmallRng::seed_from_u64(62);
    let width = heads * head_dim;
    let qs: Vec<Vec<f32>> = (0..len).map(|_| values(&mut r, width, -2.0, 2.0)).collect();
    let other: Vec<f32> = values(&mut r, width, -2.0, 2.0);
    let alone: Vec<Vec<u16>> = {
        let b = CpuBackend::new();
        (1..=len)
            .map(|p| c.run(&b, &[(0, p)], &[&qs[p - 1]]))
            .collect()
    };
    for (name, b) in backends() {
        let check = |what: &str, rows: &[(usize, usize)]| {
            let q_refs: Vec<&[f32]> = rows
                .iter()
                .map(|&(s, p)| if s == 0 { &qs[p - 1][..] } else { &other[..] })
                .collect();
            let got = c.run(&b, rows, &q_refs);
            for (i, &(s, p)) in rows.iter().enumerate() {
                if s == 0 {
                    assert!(
                        got[i * width..(i + 1) * width] == alone[p - 1][..],
                        "{name}, {what}: the row at context {p} differs from the row alone"
                    );
                }
            }
        };
        // Verify steps of k rows at a few points of the sequence, one also between rows of
        // other sequences (a batched verify).
        for k in 1..=16 {
            for start in [1, 90, len - k + 1] {
                let rows: Vec<_> = (start..start + k).map(|p| (0, p)).collect();
                check(&format!("{k} rows from {start}"), &rows);
            }
            let mut rows = vec![(1, 40)];
            rows.extend((150..150 + k).map(|p| (0, p)));
            rows.extend([(2, 9), (1, 17)]);
            check(&format!("{k} rows among other sequences"), &rows);
        }
        // A prefill: the whole sequence in one chunk, and in chunks of 128.
        let all: Vec<_> = (1..=len).map(|p| (0, p)).collect();
        check("one chunk of 300 rows", &all);
        for chunk in all.chunks(128) {
            check("a chunk of 128 rows", chunk);
        }
    }
}

#[test]
fn rows_are_bitwise_the_same_in_any_batch_smollm2_shape() {
    check_rows_bitwise(9, 3, 64, 16);
}

#[test]
fn rows_are_bitwise_the_same_in_any_batch_odd_shape() {
    check_rows_bitwise(8, 2, 17, 5);
}

#[test]
fn a_nan_key_poisons_exactly_the_rows_that_attend_to_it() {
    let mut c = Cache::new(3, 1, 8, 4, &[20], 71);
    let at = c.table[2] as usize * c.block_size * c.head_dim; // position 8's key
    c.k[at] = f32::NAN;
    let mut r = SmallRng::seed_from_u64(72);
    let rows: Vec<_> = (1..=20).map(|p| (0, p)).collect();
    let qs: Vec<Vec<f32>> = rows.iter().map(|_| values(&mut r, 24, -1.0, 1.0)).collect();
    let q_refs: Vec<&[f32]> = qs.iter().map(|q| &q[..]).collect();
    let got = c.run(&CpuBackend::new(), &rows, &q_refs);
    for (i, &(_, p)) in rows.iter().enumerate() {
        let nans = got[i * 24..(i + 1) * 24]
            .iter()
            .filter(|&&x| bf16::from_bits(x).is_nan())
            .count();
        assert_eq!(nans, if p > 8 { 24 } else { 0 }, "context {p}");
    }
}

/// Rows that attend past their own position, as a block drafter's do (DFlash: every row of
/// a block sees the whole context and the whole block): each row is given a context length,
/// not a causal one. Blocks of 8, 4, 16 and 17 rows (one tile, a part of one, exactly one,
/// two) with every row at the same length, and a run whose lengths fall and rise, on every
/// pool size and instruction set, against the f64 attention.
fn check_non_causal_blocks(heads: usize, kv_heads: usize, head_dim: usize, block_size: usize) {
    // (sequence, context rows before the block, rows of the block)
    let blocks = [(0, 37, 8), (1, 0, 4), (2, 130, 16), (3, 60, 17)];
    let lens: Vec<usize> = blocks.iter().map(|&(_, c, g)| c + g).collect();
    let c = Cache::new(
        heads,
        kv_heads,
        head_dim,
        block_size,
        &[lens[0], lens[1], lens[2], lens[3], 20],
        81,
    );
    let mut rows = Vec::new();
    for &(s, ctx, g) in &blocks {
        rows.extend((0..g).map(|_| (s, ctx + g)));
    }
    rows.extend([(4, 20), (4, 7), (4, 20), (4, 1)]);
    let mut r = SmallRng::seed_from_u64(82);
    let width = heads * head_dim;
    let qs: Vec<Vec<f32>> = rows
        .iter()
        .map(|_| values(&mut r, width, -1.0, 1.0))
        .collect();
    let q_refs: Vec<&[f32]> = qs.iter().map(|q| &q[..]).collect();
    for (name, b) in backends() {
        let got = c.run(&b, &rows, &q_refs);
        for (i, &(s, len)) in rows.iter().enumerate() {
            let want = c.reference(&qs[i], s, len);
            for (e, (&g, &w)) in got[i * width..(i + 1) * width]
                .iter()
                .zip(&want)
                .enumerate()
            {
                let g = bf16::from_bits(g).to_f64();
                assert!(
                    (g - w).abs() <= w.abs() / 256.0 + 1e-5,
                    "{name}: row {i} (sequence {s}, context {len}), head {}, element {}: got {g}, want {w}",
                    e / head_dim,
                    e % head_dim
                );
            }
        }
    }
}

#[test]
fn non_causal_blocks_match_f64_attention() {
    check_non_causal_blocks(9, 3, 64, 16);
    check_non_causal_blocks(4, 1, 16, 16);
    check_non_causal_blocks(8, 2, 17, 5);
}

/// A verify forward of a draft tree: sequence 0 has `prefix` cached rows, then the last
/// verified token's row (no parent) and one row per node in order, node `i`'s parent the row
/// of `tree[i]` (`None`: the last verified token). Returns the call's rows and parents, and
/// for each row the cached rows it may attend to: the prefix, the last verified token's row
/// and those of its ancestors and itself. Rows of sequence 1 (causal, no parent) come first.
#[allow(clippy::type_complexity)]
fn tree_call(
    prefix: usize,
    tree: &[Option<usize>],
    other: &[usize],
) -> (Vec<(usize, usize)>, Vec<u32>, Vec<Vec<usize>>) {
    let none = PagedAttentionArgs::NO_PARENT;
    let mut rows: Vec<(usize, usize)> = other.iter().map(|&l| (1, l)).collect();
    let mut parents = vec![none; rows.len()];
    let mut cols: Vec<Vec<usize>> = other.iter().map(|&l| (0..l).collect()).collect();
    let root = rows.len();
    rows.push((0, prefix + 1));
    parents.push(none);
    cols.push((0..=prefix).collect());
    for (i, parent) in tree.iter().enumerate() {
        let parent_row = parent.map_or(root, |p| root + 1 + p);
        rows.push((0, prefix + 2 + i));
        parents.push(parent_row as u32);
        let mut c = cols[parent_row].clone();
        c.push(prefix + 1 + i);
        cols.push(c);
    }
    (rows, parents, cols)
}

/// Random trees of up to 20 nodes (so a tree spans two tiles), a chain, and stars, on every
/// pool size and instruction set: each row against the f64 attention over the rows it may
/// attend to; the chain's rows bitwise the rows without a mask.
#[test]
fn tree_rows_attend_to_their_prefix_and_ancestors_only() {
    let (heads, kv_heads, head_dim, block_size) = (9, 3, 64, 16);
    let prefix = 45;
    let c = Cache::new(
        heads,
        kv_heads,
        head_dim,
        block_size,
        &[prefix + 24, 30],
        91,
    );
    let mut r = SmallRng::seed_from_u64(92);
    let mut trees: Vec<Vec<Option<usize>>> = (0..6)
        .map(|t| {
            let n = [5, 8, 16, 20, 12, 3][t];
            (0..n)
                .map(|i| {
                    let p = r.random_range(0..=i);
                    (p < i).then_some(p)
                })
                .collect()
        })
        .collect();
    trees.push((0..10).map(|i: usize| i.checked_sub(1)).collect());
    trees.push(vec![None; 12]);
    let width = heads * head_dim;
    for (name, b) in backends() {
        for (t, tree) in trees.iter().enumerate() {
            let (rows, parents, cols) = tree_call(prefix, tree, &[30, 7]);
            let qs: Vec<Vec<f32>> = rows
                .iter()
                .map(|_| values(&mut r, width, -1.0, 1.0))
                .collect();
            let q_refs: Vec<&[f32]> = qs.iter().map(|q| &q[..]).collect();
            let got = c.try_run(&b, &rows, &q_refs, Some(&parents)).unwrap();
            for (i, &(s, _)) in rows.iter().enumerate() {
                let want = c.reference_over(&qs[i], s, &cols[i]);
                for (e, (&g, &w)) in got[i * width..(i + 1) * width]
                    .iter()
                    .zip(&want)
                    .enumerate()
                {
                    let g = bf16::from_bits(g).to_f64();
                    assert!(
                        (g - w).abs() <= w.abs() / 256.0 + 1e-5,
                        "{name}, tree {t}: row {i}, element {e}: got {g}, want {w}"
                    );
                }
            }
            if t == 6 {
                let plain = c.run(&b, &rows, &q_refs);
                assert!(
                    got == plain,
                    "{name}: a chain under the mask differs from no mask"
                );
            }
        }
    }
}

#[test]
fn a_tree_mask_that_breaks_its_contract_is_refused() {
    let c = Cache::new(2, 1, 8, 4, &[12, 12], 101);
    let q = [0.5f32; 16];
    let qs: Vec<&[f32]> = vec![&q[..]; 3];
    let none = PagedAttentionArgs::NO_PARENT;
    let b = CpuBackend::new();
    type Case<'a> = (&'a [(usize, usize)], [u32; 3], &'a str);
    let cases: [Case; 3] = [
        (
            &[(0, 5), (0, 6), (0, 7)],
            [none, 2, 1],
            "row 1's parent 2 is not an earlier row",
        ),
        (
            &[(0, 5), (1, 6), (1, 7)],
            [none, 0, 1],
            "row 1 (sequence 1) has parent 0 of sequence 0",
        ),
        (
            &[(0, 5), (0, 5), (0, 7)],
            [none, 0, 1],
            "row 1 attends to 5 rows, its parent 0 to 5",
        ),
    ];
    for (rows, parents, words) in cases {
        let err = c.try_run(&b, rows, &qs, Some(&parents)).unwrap_err();
        assert!(err.to_string().contains(words), "{err}");
    }
    let fine = c.try_run(&b, &[(0, 5), (0, 6), (0, 7)], &qs, Some(&[none, 0, 0]));
    assert!(fine.is_ok(), "{fine:?}");
}
