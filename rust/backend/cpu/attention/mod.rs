//! The CPU paged attention: grouped-query attention over a paged BF16 cache, fast for a
//! decode row, a verify step's few rows and a prefill chunk's hundreds alike.
//!
//! Work is split into tasks of (tile, KV head, part of its query-head group): a tile is up to
//! [`TILE_ROWS`] consecutive query rows of one sequence, so every query vector of the tile and
//! of the group reads each key and value once, widened to f32 a block of [`KEYS`] positions
//! at a time into per-thread scratch. A sequence with several tiles (a prefill chunk) has its
//! keys and values widened once for all of them, by a first pool job. When there are too few
//! tiles and KV heads to keep the pool busy (a single decode row), a group is split over
//! several tasks; the units left over by whole rounds of the pool (a verify step's third KV
//! head on two threads) are split into runs of rows ([`plan`]).
//!
//! Each query (row, head) is computed in two exact passes, the definition the tests hold
//! every instruction set and every tiling to:
//! - score `j` is `(sum over d, in order, of q[d] * k_j[d]) * scale`, each product fused into
//!   the sum (a multiply-add, rounded once: half the instructions of a multiply and an add,
//!   and the portable path's `f32::mul_add` gives the same bits);
//! - `p_j = exp(score_j - max)` with [`math::exp_nonpositive`], and the total of the `p_j`
//!   is kept in eight lanes (`j % 8`), summed pairwise at the end;
//! - output `d` is `(sum over j, in order, of p_j * v_j[d]) / total`, each product fused
//!   into the sum, rounded to BF16 (zero for a row that attends to nothing).
//!
//! Under a tree mask (`row_parent`), a row's weights are the softmax of the scores it
//! attends to, gathered in order (its branch's prefix, then its ancestors' rows and its own),
//! and zero elsewhere, so a chain's rows are bitwise the rows without a mask.
//!
//! Invariant: a row's arithmetic depends only on its own query, its context length (and its
//! ancestors', under a tree mask) and the cache, never on the other rows of its batch, tile
//! or task, nor on the pool's size or instruction set, so a row's output is bitwise the same
//! whatever it is computed with.
//! Tiling shares loads, never operations. The AVX2 and AVX-512 paths are the same source
//! compiled with those features enabled (lane-wise multiplies and adds, no reassociation),
//! which is why they match the portable path bit for bit.

pub(crate) mod math;
mod plan;
mod reader;
#[cfg(target_arch = "x86_64")]
mod transpose;
#[cfg(target_arch = "x86_64")]
mod zmm;

use super::shared_out::SharedOut;
use crate::backend::const_count::with_count;
use crate::backend::quant::{Avx2Token, Avx512Token, KernelPool, QuantError};
use half::bf16;
use math::{add_weighted, score_block, softmax_weights, widen};
use plan::{shares, tiles, Share, Tile};
use reader::CacheReader;
use std::cell::RefCell;

/// Key positions per block of the score and value passes (two AVX2 vectors of scores).
const KEYS: usize = 16;
/// Query rows of one sequence that share every key and value load.
const TILE_ROWS: usize = 16;
/// Key blocks the score pass asks the CPU to fetch ahead of the one it computes.
const PREFETCH_BLOCKS: usize = 2;
/// How many query vectors share each load, per instruction set: their scores of a key block
/// (`score`), and their weighted sums of a value row (`value`). Each multiply-add waits on the
/// one before it in its sum, so a pass runs at the rate of its independent sums: eight
/// registers of them keep both vector units busy, and more spill. A key block is two AVX2
/// registers a query and one AVX-512 register, a chunk of weighted values four and two. The
/// AVX-512 build (`zmm`) runs its scores, weights and weighted values in intrinsics (see
/// [`zmm`]), which hold the sixteen sums of eight queries' values where the plain loop,
/// compiled, keeps four queries'. With its 16x16 key transposes (`cpu_attention`, one
/// thread, fastest of six runs, against the plain loops and 8x8 transposes): context 160,
/// 9 rows 61.8 -> 53.3 us; context 400, 9 rows 148.7 -> 128.8 us, one row 56.1 -> 41.5 us.
#[derive(Clone, Copy)]
struct Sharing {
    score: usize,
    value: usize,
    /// The AVX-512 build's proof that the CPU runs [`zmm`]'s intrinsics, which it runs where
    /// the other builds run the plain loops.
    zmm: Option<Avx512Token>,
}

const AVX2_SHARING: Sharing = Sharing {
    score: 4,
    value: 2,
    zmm: None,
};

impl Sharing {
    fn avx512(proof: Avx512Token) -> Sharing {
        Sharing {
            score: 8,
            value: 8,
            zmm: Some(proof),
        }
    }
}

/// The shape of one paged attention call (see `PagedAttentionArgs`).
#[derive(Clone, Copy, Debug)]
pub(super) struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub max_blocks_per_seq: usize,
    pub scale: f32,
}

/// The validated inputs: BF16 queries `[rows, heads, head_dim]` and caches `[slots, kv_heads,
/// head_dim]`, and the index arrays read from the device.
pub(super) struct AttentionInputs<'a> {
    pub q: &'a [bf16],
    pub k_cache: &'a [bf16],
    pub v_cache: &'a [bf16],
    pub block_table: &'a [u32],
    pub row_seq: &'a [u32],
    pub row_ctx_len: &'a [u32],
    /// Each row's parent row (the tree mask), when there is one.
    pub row_parent: Option<&'a [u32]>,
}

/// Per-thread buffers, reused from call to call so that no task allocates once warm.
#[derive(Default)]
struct Scratch {
    queries: Vec<f32>,
    scores: Vec<f32>,
    keys: Vec<f32>,
    values: Vec<f32>,
    acc: Vec<f32>,
    totals: Vec<f32>,
    /// A tree row's own cached row and its ancestors', increasing, and their weights.
    branch: Vec<usize>,
    branch_weights: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

fn resize(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

/// Runs the attention of every row of `inputs` into `out` (BF16 `[rows, heads, head_dim]`).
pub(super) fn paged_attention(
    pool: &KernelPool,
    shape: &AttentionShape,
    inputs: &AttentionInputs,
    out: &mut [bf16],
) -> Result<(), QuantError> {
    if out.is_empty() {
        return Ok(());
    }
    let tiles = tiles(inputs.row_seq, inputs.row_ctx_len);
    let isa = pool.level();
    let (widened, buffer) = widen_shared(pool, shape, inputs, &tiles)?;
    let slot_len = 2 * KEYS * shape.head_dim;
    let group = shape.heads / shape.kv_heads;
    let shares = shares(
        &tiles,
        shape.kv_heads,
        group,
        pool.threads(),
        inputs.row_ctx_len,
    );
    let shared = SharedOut::new(out);
    pool.run(shares.len(), &|t| {
        let Share {
            tile,
            kv_head,
            ref heads,
        } = shares[t];
        let blocks = widened.iter().find(|w| w.seq == tile.seq).map(|w| {
            let first = (w.first_slot + kv_head * w.blocks) * slot_len;
            &buffer[first..first + w.blocks * slot_len]
        });
        let task = Task {
            reader: CacheReader {
                shape,
                inputs,
                seq: tile.seq,
                ctx: tile.ctx,
                kv_head,
                isa,
            },
            tile,
            heads: heads.clone(),
            widened: blocks,
        };
        SCRATCH.with(|cell| {
            let scratch = &mut cell.borrow_mut();
            match (isa.avx512(), isa.avx2()) {
                #[cfg(target_arch = "x86_64")]
                (Some(proof), _) => task.run_avx512(proof, scratch, shared),
                #[cfg(target_arch = "x86_64")]
                (None, Some(proof)) => task.run_avx2(proof, scratch, shared),
                _ => task.run(scratch, shared, AVX2_SHARING),
            }
        })
    })
}

/// The key and value blocks of a sequence with several tiles, widened once for all of them:
/// its slots `first_slot ..` of the shared buffer, `[kv_heads, blocks]`, each slot its
/// transposed keys (as [`CacheReader::load_keys`]) then its values.
struct Widened {
    seq: usize,
    first_slot: usize,
    blocks: usize,
}

/// Widens the keys and values of every sequence with more than one tile, on the pool.
fn widen_shared(
    pool: &KernelPool,
    shape: &AttentionShape,
    inputs: &AttentionInputs,
    tiles: &[Tile],
) -> Result<(Vec<Widened>, Vec<f32>), QuantError> {
    // (sequence, tiles, longest context)
    let mut seqs: Vec<(usize, usize, usize)> = Vec::new();
    for t in tiles {
        match seqs.iter_mut().find(|e| e.0 == t.seq) {
            Some(e) => (e.1, e.2) = (e.1 + 1, e.2.max(t.ctx)),
            None => seqs.push((t.seq, 1, t.ctx)),
        }
    }
    let mut widened = Vec::new();
    let mut slots = 0;
    let mut ctxs = Vec::new();
    for &(seq, count, ctx) in &seqs {
        if count > 1 {
            let blocks = ctx.div_ceil(KEYS);
            widened.push(Widened {
                seq,
                first_slot: slots,
                blocks,
            });
            ctxs.push(ctx);
            slots += blocks * shape.kv_heads;
        }
    }
    let slot_len = 2 * KEYS * shape.head_dim;
    let mut buffer = vec![0f32; slots * slot_len];
    if slots > 0 {
        let shared = SharedOut::new(&mut buffer);
        let isa = pool.level();
        pool.run(slots, &|t| {
            let w = widened.iter().rposition(|w| w.first_slot <= t).unwrap_or(0);
            let (kv_head, b) = (
                (t - widened[w].first_slot) / widened[w].blocks,
                (t - widened[w].first_slot) % widened[w].blocks,
            );
            let reader = CacheReader {
                shape,
                inputs,
                seq: widened[w].seq,
                ctx: ctxs[w],
                kv_head,
                isa,
            };
            // SAFETY: slot `t` is written by task `t` alone.
            let (keys, values) =
                unsafe { shared.chunk(t, slot_len) }.split_at_mut(KEYS * shape.head_dim);
            match isa.avx2() {
                #[cfg(target_arch = "x86_64")]
                Some(proof) => reader.load_block_avx2(proof, b * KEYS, keys, values),
                _ => reader.load_block(b * KEYS, keys, values),
            }
        })?;
    }
    Ok((widened, buffer))
}

/// For a row under the tree mask with a parent: fills `rows` with the cached rows of the row
/// and of its ancestors below the first one without a parent, increasing, and returns that
/// ancestor's context length, the prefix every row of the branch sees. `None` for a row that
/// attends to its whole context.
fn branch(
    row_parent: &[u32],
    row_ctx_len: &[u32],
    r: usize,
    rows: &mut Vec<usize>,
) -> Option<usize> {
    let no_parent = crate::backend::PagedAttentionArgs::NO_PARENT;
    if row_parent[r] == no_parent {
        return None;
    }
    rows.clear();
    let mut at = r;
    // Validation made each parent an earlier row, so the walk ends.
    while row_parent[at] != no_parent {
        rows.push(row_ctx_len[at] as usize - 1);
        at = row_parent[at] as usize;
    }
    rows.reverse();
    Some(row_ctx_len[at] as usize)
}

/// The weights of a tree row whose scores are `row`: a softmax over the `prefix` and the
/// `branch` rows alone (gathered next to the prefix, so the sum runs as for a row that
/// attended to those only), every other weight zero, which adds nothing in the value pass.
/// Returns the total.
fn masked_softmax(
    row: &mut [f32],
    prefix: usize,
    branch: &[usize],
    weights: &mut Vec<f32>,
    softmax: impl Fn(&mut [f32]) -> f32,
) -> f32 {
    // Each branch row is at or after its gathered place (rows increase from `prefix`), so
    // moving them in order overwrites only scores already moved or masked.
    for (x, &j) in branch.iter().enumerate() {
        row[prefix + x] = row[j];
    }
    let total = softmax(&mut row[..prefix + branch.len()]);
    weights.clear();
    weights.extend_from_slice(&row[prefix..prefix + branch.len()]);
    row[prefix..].fill(0.0);
    for (&j, &w) in branch.iter().zip(weights.iter()) {
        row[j] = w;
    }
    total
}

/// One task: the rows of a tile, the query heads `heads` of one KV head.
struct Task<'a> {
    reader: CacheReader<'a>,
    tile: Tile,
    heads: std::ops::Range<usize>,
    /// The tile's sequence widened by [`widen_shared`] (this KV head's slots), if it was.
    widened: Option<&'a [f32]>,
}

impl Task<'_> {
    /// [`Self::run`] compiled with AVX2 and FMA, which the proof says this CPU runs.
    #[cfg(target_arch = "x86_64")]
    fn run_avx2(&self, _: Avx2Token, scratch: &mut Scratch, out: SharedOut<bf16>) {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn build(task: &Task, scratch: &mut Scratch, out: SharedOut<bf16>) {
            task.run(scratch, out, AVX2_SHARING)
        }
        // SAFETY: the proof says this CPU runs AVX2 and FMA.
        unsafe { build(self, scratch, out) }
    }

    /// [`Self::run`] compiled with AVX2, FMA and AVX-512 F/BW/VL, which the proof says this
    /// CPU runs, its hot loops in [`zmm`]'s intrinsics.
    #[cfg(target_arch = "x86_64")]
    fn run_avx512(&self, proof: Avx512Token, scratch: &mut Scratch, out: SharedOut<bf16>) {
        #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl")]
        unsafe fn build(
            task: &Task,
            proof: Avx512Token,
            scratch: &mut Scratch,
            out: SharedOut<bf16>,
        ) {
            task.run(scratch, out, Sharing::avx512(proof))
        }
        // SAFETY: the proof says this CPU runs AVX2, FMA and AVX-512 F, BW and VL.
        unsafe { build(self, proof, scratch, out) }
    }

    #[inline(always)]
    fn run(&self, s: &mut Scratch, out: SharedOut<bf16>, sharing: Sharing) {
        let (sh, inputs) = (self.reader.shape, self.reader.inputs);
        let slot_len = 2 * KEYS * sh.head_dim;
        let (hd, tile) = (sh.head_dim, self.tile);
        let hcount = self.heads.len();
        let nq = tile.rows * hcount;
        // A query's scores, one key block longer than its context: rows a power of two
        // apart would share the same few cache sets.
        let padded = tile.ctx.div_ceil(KEYS) * KEYS + KEYS;
        resize(&mut s.queries, nq * hd);
        resize(&mut s.scores, nq * padded);
        resize(&mut s.keys, KEYS * hd);
        resize(&mut s.values, KEYS * hd);
        resize(&mut s.acc, nq * hd);
        resize(&mut s.totals, nq);
        // Query `i` is row `i / hcount` of the tile, head `heads.start + i % hcount`.
        let len = |i: usize| inputs.row_ctx_len[tile.first_row + i / hcount] as usize;
        let q_at = |i: usize| {
            ((tile.first_row + i / hcount) * sh.heads + self.heads.start + i % hcount) * hd
        };
        for (i, q) in s.queries[..nq * hd].chunks_exact_mut(hd).enumerate() {
            widen(&inputs.q[q_at(i)..q_at(i) + hd], q);
        }
        let queries = &s.queries[..nq * hd];
        // Pass 1: the scores, key block by key block.
        if self.widened.is_none() {
            for j0 in (0..PREFETCH_BLOCKS * KEYS).step_by(KEYS) {
                self.reader.prefetch_block(j0);
            }
        }
        for j0 in (0..tile.ctx).step_by(KEYS) {
            let keys = match self.widened {
                Some(w) => &w[j0 / KEYS * slot_len..][..KEYS * hd],
                None => {
                    self.reader.prefetch_block(j0 + PREFETCH_BLOCKS * KEYS);
                    self.reader.load_keys(j0, &mut s.keys[..KEYS * hd]);
                    &s.keys[..KEYS * hd]
                }
            };
            let mut i = 0;
            while i < nq {
                // Queries whose context reaches this block, a run of them at a time.
                if len(i) <= j0 {
                    i += 1;
                    continue;
                }
                let n = (i..nq.min(i + sharing.score))
                    .take_while(|&x| len(x) > j0)
                    .count();
                // A query's scores are the same whichever group computes them.
                let scores = &mut s.scores;
                with_count!(n, "a group of queries", |N| {
                    let qs = std::array::from_fn(|x| &queries[(i + x) * hd..(i + x + 1) * hd]);
                    let block = match sharing.zmm {
                        #[cfg(target_arch = "x86_64")]
                        Some(proof) => zmm::score_block::<N>(proof, qs, keys, sh.scale),
                        _ => score_block::<N>(qs, keys, sh.scale),
                    };
                    for (x, row) in block.iter().enumerate() {
                        let at = (i + x) * padded + j0;
                        scores[at..at + KEYS].copy_from_slice(row);
                    }
                });
                i += n;
            }
        }
        // Pass 2: each query's weights and their total.
        let softmax = |row: &mut [f32]| match sharing.zmm {
            #[cfg(target_arch = "x86_64")]
            Some(proof) => zmm::softmax_weights(proof, row),
            _ => softmax_weights(row),
        };
        for i in 0..nq {
            let row = &mut s.scores[i * padded..i * padded + len(i)];
            let r = tile.first_row + i / hcount;
            s.totals[i] = match inputs
                .row_parent
                .and_then(|p| branch(p, inputs.row_ctx_len, r, &mut s.branch))
            {
                None => softmax(row),
                Some(prefix) => {
                    masked_softmax(row, prefix, &s.branch, &mut s.branch_weights, softmax)
                }
            };
        }
        // Pass 3: the weighted values, value block by value block.
        let acc = &mut s.acc[..nq * hd];
        acc.fill(0.0);
        for j0 in (0..tile.ctx).step_by(KEYS) {
            let values = match self.widened {
                Some(w) => &w[j0 / KEYS * slot_len + KEYS * hd..][..KEYS * hd],
                None => {
                    self.reader.load_values(j0, &mut s.values[..KEYS * hd]);
                    &s.values[..KEYS * hd]
                }
            };
            let keys_of = |i: usize| len(i).saturating_sub(j0).min(KEYS);
            let mut i = 0;
            while i < nq {
                let n = keys_of(i);
                if n == 0 {
                    i += 1;
                    continue;
                }
                // A run of queries that weigh the same keys of this block.
                let count = (i..nq.min(i + sharing.value))
                    .take_while(|&x| keys_of(x) == n)
                    .count();
                let scores = &s.scores;
                let weights = |x: usize| &scores[(i + x) * padded + j0..][..n];
                let acc = &mut acc[i * hd..(i + count) * hd];
                with_count!(count, "a group of queries", |N| {
                    let weights = std::array::from_fn(weights);
                    match sharing.zmm {
                        #[cfg(target_arch = "x86_64")]
                        Some(proof) => {
                            zmm::add_weighted::<N>(proof, acc, weights, &values[..n * hd])
                        }
                        _ => add_weighted::<N>(acc, weights, &values[..n * hd]),
                    }
                });
                i += count;
            }
        }
        for i in 0..nq {
            // SAFETY: (row, head) of query `i` belongs to this task alone.
            let o = unsafe { out.slice(q_at(i), hd) };
            let total = s.totals[i];
            for (o, &a) in o.iter_mut().zip(&acc[i * hd..(i + 1) * hd]) {
                *o = bf16::from_f32(if len(i) == 0 { 0.0 } else { a / total });
            }
        }
    }
}
