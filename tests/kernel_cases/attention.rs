//! The attention cases: paged attention over a case's heads and contexts, MLA attention,
//! and paged attention under a draft tree's mask.

use super::*;

/// A paged attention batch: `ctx[s]` cached rows for sequence s, blocks scattered through
/// the cache, and the last `queries` positions of each sequence as query rows (causal).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    dut: &dyn GpuBackend,
    ctx: &[usize],
    queries: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    seed: u64,
) -> Result<(), String> {
    let max_blocks = ctx
        .iter()
        .map(|c| c.div_ceil(block_size))
        .max()
        .unwrap_or(1)
        .max(1);
    let num_blocks = ctx.len() * max_blocks + 3;
    let mut r = rng(seed);
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, r.random_range(0..=i));
    }
    let table: Vec<u32> = ids[..ctx.len() * max_blocks].to_vec();
    let (mut row_seq, mut row_len) = (Vec::new(), Vec::new());
    for (s, &c) in ctx.iter().enumerate() {
        for q in 0..queries.min(c) {
            row_seq.push(s as u32);
            row_len.push((c - queries.min(c) + q + 1) as u32);
        }
    }
    let rows = row_seq.len();
    let width = kv_heads * head_dim;
    let q = uniform(seed + 1, rows * heads * head_dim, -1.0, 1.0);
    let kc = uniform(seed + 2, num_blocks * block_size * width, -1.0, 1.0);
    let vc = uniform(seed + 3, num_blocks * block_size * width, -1.0, 1.0);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let (pq, pk, pv) = (s.bf16(&q)?, s.bf16(&kc)?, s.bf16(&vc)?);
        let (pt, ps, pl) = (s.u32(&table)?, s.u32(&row_seq)?, s.u32(&row_len)?);
        let o = s.out(Dtype::Bf16, rows * heads * head_dim)?;
        b.paged_attention(PagedAttentionArgs {
            out: o,
            q: pq,
            k_cache: pk,
            v_cache: pv,
            block_table: pt,
            row_seq: ps,
            row_ctx_len: pl,
            row_parent: None,
            rows,
            heads,
            kv_heads,
            head_dim,
            block_size,
            max_blocks_per_seq: max_blocks,
            scale,
            stream: 0,
        })?;
        b.download_bf16(o, rows * heads * head_dim)
    })?;
    close("paged_attention", &got, &want, BF16_RTOL, 2e-3)
}

/// The sizes of one latent attention case: `(heads, kv_lora_rank, nope_dim, rope_dim,
/// v_dim, block_size)`.
pub type MlaShape = (usize, usize, usize, usize, usize, usize);

/// A latent attention batch: causal rows of sequences with `ctx` cached rows (the last
/// `queries` positions of each), then a draft tree's verify rows (a prefix of 9, the root
/// and five nodes: two children of the root, a grandchild, a great-grandchild), blocks
/// scattered through the cache, under the tree mask.
pub fn mla_attention(
    dut: &dyn GpuBackend,
    ctx: &[usize],
    queries: usize,
    shape: MlaShape,
    seed: u64,
) -> Result<(), String> {
    let (heads, rank, nope, rope, v_dim, block_size) = shape;
    let none = PagedAttentionArgs::NO_PARENT;
    let (mut row_seq, mut row_len, mut row_parent) = (Vec::new(), Vec::new(), Vec::new());
    for (s, &c) in ctx.iter().enumerate() {
        for q in 0..queries.min(c) {
            row_seq.push(s as u32);
            row_len.push((c - queries.min(c) + q + 1) as u32);
            row_parent.push(none);
        }
    }
    let tree_seq = ctx.len() as u32;
    let root = row_seq.len() as u32;
    for (i, parent) in [none, 0, 0, 1, 3, 4].into_iter().enumerate() {
        row_seq.push(tree_seq);
        row_len.push(10 + i as u32);
        row_parent.push(if parent == none { none } else { root + parent });
    }
    let all_ctx: Vec<usize> = ctx.iter().copied().chain([15]).collect();
    let max_blocks = all_ctx
        .iter()
        .map(|c| c.div_ceil(block_size))
        .max()
        .unwrap_or(1)
        .max(1);
    let num_blocks = all_ctx.len() * max_blocks + 3;
    let mut r = rng(seed);
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, r.random_range(0..=i));
    }
    let table: Vec<u32> = ids[..all_ctx.len() * max_blocks].to_vec();
    let rows = row_seq.len();
    let half = (rank + rope) / 2;
    let w = 1.0 / (rank as f32).sqrt();
    let q = uniform(seed + 1, rows * heads * (nope + rope), -1.0, 1.0);
    let kv_b = uniform(seed + 2, heads * (nope + v_dim) * rank, -w, w);
    let lo = uniform(seed + 3, num_blocks * block_size * half, -2.0, 2.0);
    let hi = uniform(seed + 4, num_blocks * block_size * half, -2.0, 2.0);
    let n_out = rows * heads * v_dim;
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let o = s.out(Dtype::Bf16, n_out)?;
        b.mla_attention(MlaAttentionArgs {
            out: o,
            q: s.bf16(&q)?,
            kv_b: s.bf16(&kv_b)?,
            lo_cache: s.bf16(&lo)?,
            hi_cache: s.bf16(&hi)?,
            block_table: s.u32(&table)?,
            row_seq: s.u32(&row_seq)?,
            row_ctx_len: s.u32(&row_len)?,
            row_parent: Some(s.u32(&row_parent)?),
            rows,
            heads,
            kv_lora_rank: rank,
            nope_dim: nope,
            rope_dim: rope,
            v_dim,
            block_size,
            max_blocks_per_seq: max_blocks,
            scale: 1.0 / ((nope + rope) as f32).sqrt(),
            stream: 0,
        })?;
        b.download_bf16(o, n_out)
    })?;
    close("mla_attention", &got, &want, BF16_RTOL, 2e-3)
}

/// A verify forward of draft trees under the tree mask: sequence `s` of `trees` has
/// `trees[s].0` cached prefix rows, then the last verified token's row (no parent) and one
/// row per node, node `i` the child of node `trees[s].1[i]` (`None`: of the last verified
/// token), in consecutive cache rows; a last sequence of causal rows without a parent runs
/// in the same call. Random trees (seeded) of up to 20 nodes, with a chain and a star.
pub fn paged_attention_tree(dut: &dyn GpuBackend, seed: u64) -> Result<(), String> {
    let (heads, kv_heads, head_dim, block_size) = (9, 3, 64, 16);
    let mut r = rng(seed);
    let mut trees: Vec<(usize, Vec<Option<usize>>)> = [(37, 20), (0, 6), (130, 9)]
        .iter()
        .map(|&(prefix, n)| {
            let tree = (0..n)
                .map(|i| {
                    let p = r.random_range(0..=i);
                    (p < i).then_some(p)
                })
                .collect();
            (prefix, tree)
        })
        .collect();
    trees.push((20, (0..7).map(|i: usize| i.checked_sub(1)).collect()));
    trees.push((5, vec![None; 5]));
    let none = PagedAttentionArgs::NO_PARENT;
    let (mut row_seq, mut row_len, mut row_parent) = (Vec::new(), Vec::new(), Vec::new());
    let mut ctx = Vec::new();
    for (s, (prefix, tree)) in trees.iter().enumerate() {
        let root = row_seq.len();
        row_seq.push(s as u32);
        row_len.push(*prefix as u32 + 1);
        row_parent.push(none);
        for (i, parent) in tree.iter().enumerate() {
            row_seq.push(s as u32);
            row_len.push((prefix + 2 + i) as u32);
            row_parent.push(parent.map_or(root, |p| root + 1 + p) as u32);
        }
        ctx.push(prefix + 1 + tree.len());
    }
    let plain = trees.len() as u32;
    for len in 10..15 {
        row_seq.push(plain);
        row_len.push(len);
        row_parent.push(none);
    }
    ctx.push(14);
    let max_blocks = ctx
        .iter()
        .map(|c| c.div_ceil(block_size))
        .max()
        .unwrap_or(1);
    let num_blocks = ctx.len() * max_blocks + 3;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, r.random_range(0..=i));
    }
    let table: Vec<u32> = ids[..ctx.len() * max_blocks].to_vec();
    let rows = row_seq.len();
    let width = kv_heads * head_dim;
    let q = uniform(seed + 1, rows * heads * head_dim, -1.0, 1.0);
    let kc = uniform(seed + 2, num_blocks * block_size * width, -2.0, 2.0);
    let vc = uniform(seed + 3, num_blocks * block_size * width, -1.0, 1.0);
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let o = s.out(Dtype::Bf16, rows * heads * head_dim)?;
        b.paged_attention(PagedAttentionArgs {
            out: o,
            q: s.bf16(&q)?,
            k_cache: s.bf16(&kc)?,
            v_cache: s.bf16(&vc)?,
            block_table: s.u32(&table)?,
            row_seq: s.u32(&row_seq)?,
            row_ctx_len: s.u32(&row_len)?,
            row_parent: Some(s.u32(&row_parent)?),
            rows,
            heads,
            kv_heads,
            head_dim,
            block_size,
            max_blocks_per_seq: max_blocks,
            scale: 1.0 / (head_dim as f32).sqrt(),
            stream: 0,
        })?;
        b.download_bf16(o, rows * heads * head_dim)
    })?;
    close(
        "paged_attention under a tree mask",
        &got,
        &want,
        BF16_RTOL,
        2e-3,
    )
}
