//! Arguments of multi-head latent attention (DeepSeek-V3's MLA) over a paged latent cache,
//! in the absorbed form, with its one `validate` (see the module docs of `kernels`).
//!
//! The cache holds one latent row a token, `[c_kv (kv_lora_rank) | k_rope (rope_dim)]`,
//! shared by every head, split in two halves: the first `latent / 2` elements in `lo_cache`,
//! the rest in `hi_cache` (so `kv_write` and `kv_copy` move a row whole, as a key and a
//! value row). The op never forms per-head keys or values: each head's no-RoPE query is
//! absorbed through `kv_b`'s key rows into the latent space, scores are `q_lat . c_kv +
//! q_rope . k_rope`, and the weighted sum of the `c_kv` rows goes out through `kv_b`'s value
//! rows, which is exactly attention over `k = [kv_b_k c_kv | k_rope]`, `v = kv_b_v c_kv`.
//!
//! Invariant: what a row attends to is what [`PagedAttentionArgs`] says for the same
//! `row_seq`, `row_ctx_len`, `row_parent` and block table (causality in the lengths, the same
//! tree mask), so the target's batching and tree verification hold for MLA layers unchanged.

use super::attention::{paged_rows, PagedRowArgs};
use super::check::{apart, count, invalid, CheckedMemory, Operand};
use super::PagedAttentionArgs;
use crate::backend::{BackendError, DevicePtr, Dtype};

/// Latent attention for `rows` query rows of `heads` heads. Row `r`, head `h` has the query
/// `q[r, h] = [q_nope (nope_dim) | q_rope (rope_dim)]` (BF16, `q_rope` already rotated) and
/// attends, as in [`PagedAttentionArgs`], to cached latent rows `j` of sequence `row_seq[r]`
/// (`[c_kv_j | k_rope_j]`, read from `lo_cache` / `hi_cache` through `block_table`):
/// - `q_lat[c] = sum_d q_nope[d] * kv_b[h * (nope_dim + v_dim) + d, c]`;
/// - `score_j = (q_lat . c_kv_j + q_rope . k_rope_j) * scale`, softmax over the attended `j`;
/// - `lat = sum_j p_j c_kv_j`, and
///   `out[r, h, e] = sum_c kv_b[h * (nope_dim + v_dim) + nope_dim + e, c] * lat[c]`, rounded
///   to BF16 (zero for a row attending to nothing).
///
/// `kv_b` is BF16 `[heads * (nope_dim + v_dim), kv_lora_rank]` (Hugging Face's
/// `kv_b_proj.weight`). Sums are f32. `out` BF16 `[rows, heads, v_dim]` is apart from every
/// input. `kv_lora_rank + rope_dim` is even.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaAttentionArgs<P = DevicePtr> {
    /// BF16 `[rows, heads, v_dim]`: the attention output, before `o_proj`.
    pub out: P,
    /// BF16 `[rows, heads, nope_dim + rope_dim]`: the queries, RoPE part rotated.
    pub q: P,
    /// BF16 `[heads * (nope_dim + v_dim), kv_lora_rank]`: the latent's up-projection.
    pub kv_b: P,
    /// BF16 `[num_slots, latent / 2]`: the first half of each slot's latent row.
    pub lo_cache: P,
    /// BF16 `[num_slots, latent / 2]`: the second half of each slot's latent row.
    pub hi_cache: P,
    /// u32 `[num_seqs, max_blocks_per_seq]`: each sequence's KV blocks in order.
    pub block_table: P,
    /// u32 `[rows]`: the sequence each query row belongs to.
    pub row_seq: P,
    /// u32 `[rows]`: how many cached rows each query row attends to.
    pub row_ctx_len: P,
    /// u32 `[rows]`: the tree mask, as [`PagedAttentionArgs::row_parent`].
    pub row_parent: Option<P>,
    /// Query rows.
    pub rows: usize,
    /// Query heads per row.
    pub heads: usize,
    /// Elements of the compressed latent (`c_kv`).
    pub kv_lora_rank: usize,
    /// Elements of each head's query without RoPE.
    pub nope_dim: usize,
    /// Elements of the rotated part (each head's query, and the shared key).
    pub rope_dim: usize,
    /// Elements of each head's value.
    pub v_dim: usize,
    /// Cache rows per KV block.
    pub block_size: usize,
    /// Columns of `block_table`.
    pub max_blocks_per_seq: usize,
    /// Multiplier of the scores before softmax (`1 / sqrt(nope_dim + rope_dim)`).
    pub scale: f32,
    /// The stream the op is queued on.
    pub stream: u64,
}

/// A validated [`MlaAttentionArgs`] and the index arrays it read.
pub struct CheckedMla<R> {
    /// The arguments, with pointers resolved.
    pub args: MlaAttentionArgs<R>,
    /// The sequence of each query row, read from the device.
    pub row_seq: Vec<u32>,
    /// The context length of each query row, read from the device.
    pub row_ctx_len: Vec<u32>,
    /// Each query row's parent row, read from the device, when there is a tree mask.
    pub row_parent: Option<Vec<u32>>,
    /// `[num_seqs, max_blocks_per_seq]`, `num_seqs` the largest `row_seq` plus one.
    pub block_table: Vec<u32>,
}

impl MlaAttentionArgs {
    /// Elements of one cached latent row.
    pub fn latent(&self) -> usize {
        self.kv_lora_rank + self.rope_dim
    }

    /// The checks every backend makes before it runs the op. The caches are checked over
    /// every slot the block table names.
    pub fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<CheckedMla<M::Range>, BackendError> {
        let op = "mla_attention";
        let (rows, heads) = (self.rows, self.heads);
        let (rank, nope, rope, vd) = (self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim);
        let latent = rank
            .checked_add(rope)
            .ok_or_else(|| invalid(op, "kv_lora_rank + rope_dim overflows".into()))?;
        if rank == 0 || latent % 2 != 0 || self.block_size == 0 {
            return Err(invalid(
                op,
                format!(
                    "kv_lora_rank {rank} must be non-zero, kv_lora_rank + rope_dim ({latent}) even, block_size non-zero"
                ),
            ));
        }
        let mbps = self.max_blocks_per_seq;
        let paged = paged_rows(
            op,
            mem,
            PagedRowArgs {
                rows,
                row_seq: self.row_seq,
                row_ctx_len: self.row_ctx_len,
                row_parent: self.row_parent,
                block_table: self.block_table,
                max_blocks_per_seq: mbps,
                block_size: self.block_size,
                stream: self.stream,
            },
        )?;
        let max_block = paged.max_block;
        let cache_n = count(op, &[max_block + 1, self.block_size, latent / 2])?;
        let q_n = count(op, &[rows, heads, nope + rope])?;
        let kv_b_n = count(op, &[heads, nope + vd, rank])?;
        let q = Operand::new(op, self.q, q_n, Dtype::Bf16, "mla_attention q")?;
        let kv_b = Operand::new(op, self.kv_b, kv_b_n, Dtype::Bf16, "mla_attention kv_b")?;
        let lo = Operand::new(
            op,
            self.lo_cache,
            cache_n,
            Dtype::Bf16,
            "mla_attention lo_cache",
        )?;
        let hi = Operand::new(
            op,
            self.hi_cache,
            cache_n,
            Dtype::Bf16,
            "mla_attention hi_cache",
        )?;
        let (q_range, kv_b_range) = (q.check(mem)?, kv_b.check(mem)?);
        let (lo_range, hi_range) = (lo.check(mem)?, hi.check(mem)?);
        let out_n = count(op, &[rows, heads, vd])?;
        let out = Operand::new(op, self.out, out_n, Dtype::Bf16, "mla_attention out")?;
        let args = MlaAttentionArgs {
            out: out.check(mem)?,
            q: q_range,
            kv_b: kv_b_range,
            lo_cache: lo_range,
            hi_cache: hi_range,
            block_table: paged.table_range,
            row_seq: paged.seq_range,
            row_ctx_len: paged.len_range,
            row_parent: paged.parent_range,
            rows,
            heads,
            kv_lora_rank: rank,
            nope_dim: nope,
            rope_dim: rope,
            v_dim: vd,
            block_size: self.block_size,
            max_blocks_per_seq: mbps,
            scale: self.scale,
            stream: self.stream,
        };
        for input in [q, kv_b, lo, hi].into_iter().chain(paged.operands) {
            apart(op, out, input)?;
        }
        Ok(CheckedMla {
            args,
            row_seq: paged.row_seq,
            row_ctx_len: paged.row_ctx_len,
            row_parent: paged.row_parent,
            block_table: paged.block_table,
        })
    }
}

/// The cached rows a query row attends to, increasing: under a tree mask, its own row and
/// its ancestors' up to the first without a parent, and that one's whole context; without
/// one, `0..row_ctx_len[r]` (see [`PagedAttentionArgs`]).
pub fn attended_rows(r: usize, row_ctx_len: &[u32], row_parent: Option<&[u32]>) -> Vec<usize> {
    let mut own = Vec::new();
    let mut at = r;
    if let Some(parents) = row_parent {
        while parents[at] != PagedAttentionArgs::NO_PARENT {
            own.push(row_ctx_len[at] as usize - 1);
            at = parents[at] as usize;
        }
    }
    let mut all: Vec<usize> = (0..row_ctx_len[at] as usize).collect();
    all.extend(own.into_iter().rev());
    all
}
