//! Arguments of the position and cache ops (RoPE, KV write, paged attention), each with its
//! one `validate` (see the module docs of `kernels`).

use super::check::{apart, count, invalid, CheckedMemory, Operand};
use super::RopeStyle;
use crate::backend::{BackendError, DevicePtr, Dtype};

/// Rotates the first `rotary_dim` elements of every head of `x` (BF16 `[rows, heads,
/// head_dim]`, in place) by `positions[r] * inv_freq[i]`; `inv_freq` f32 `[rotary_dim / 2]`
/// carries the base and any scaling, `positions` u32 `[rows]`. `x` is apart from both.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeArgs<P = DevicePtr> {
    /// BF16 `[rows, heads, head_dim]`, rotated in place.
    pub x: P,
    /// u32 `[rows]`: each row's token position.
    pub positions: P,
    /// f32 `[rotary_dim / 2]`: the inverse frequency of each rotated pair.
    pub inv_freq: P,
    /// Token rows in `x`.
    pub rows: usize,
    /// Heads per row.
    pub heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Leading elements of each head that are rotated (even, at most `head_dim`).
    pub rotary_dim: usize,
    /// Which elements pair up in a rotation.
    pub style: RopeStyle,
    /// The stream the op is queued on.
    pub stream: u64,
}

impl RopeArgs {
    /// The checks every backend makes before it runs the op.
    pub fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<RopeArgs<M::Range>, BackendError> {
        let op = "rope";
        let (rd, hd) = (self.rotary_dim, self.head_dim);
        if rd > hd || rd % 2 != 0 {
            return Err(invalid(
                op,
                format!("rotary_dim {rd} must be even and at most head_dim {hd}"),
            ));
        }
        let positions = Operand::new(op, self.positions, self.rows, Dtype::U32, "rope positions")?;
        let inv_freq = Operand::new(op, self.inv_freq, rd / 2, Dtype::F32, "rope inv_freq")?;
        let n = count(op, &[self.rows, self.heads, hd])?;
        let x = Operand::new(op, self.x, n, Dtype::Bf16, "rope x")?;
        let args = RopeArgs {
            positions: positions.check(mem)?,
            inv_freq: inv_freq.check(mem)?,
            x: x.check(mem)?,
            rows: self.rows,
            heads: self.heads,
            head_dim: hd,
            rotary_dim: rd,
            style: self.style,
            stream: self.stream,
        };
        apart(op, x, positions)?;
        apart(op, x, inv_freq)?;
        Ok(args)
    }
}

/// Writes key and value rows into a paged cache: row `r` of `k` / `v` (BF16 `[rows,
/// kv_heads, head_dim]`) goes to slot `slots[r]` of `k_cache` / `v_cache` (BF16
/// `[num_slots, kv_heads, head_dim]`, slot = block * block_size + offset). A slot
/// `>= num_slots` is an error; the two caches are apart from each other and from the inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvWriteArgs<P = DevicePtr> {
    /// BF16 `[num_slots, kv_heads, head_dim]`: the key cache written into.
    pub k_cache: P,
    /// BF16 `[num_slots, kv_heads, head_dim]`: the value cache written into.
    pub v_cache: P,
    /// BF16 `[rows, kv_heads, head_dim]`: the key rows to write.
    pub k: P,
    /// BF16 `[rows, kv_heads, head_dim]`: the value rows to write.
    pub v: P,
    /// u32 `[rows]`: the cache slot of each row.
    pub slots: P,
    /// Rows to write.
    pub rows: usize,
    /// KV heads per row.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Slots in each cache (blocks times block size).
    pub num_slots: usize,
    /// The stream the op is queued on.
    pub stream: u64,
}

/// A validated [`KvWriteArgs`] and the slots it read.
pub struct CheckedKvWrite<R> {
    /// The arguments, with pointers resolved.
    pub args: KvWriteArgs<R>,
    /// The slot of each row, read from the device.
    pub slots: Vec<u32>,
}

impl KvWriteArgs {
    /// The checks every backend makes before it runs the op.
    pub fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<CheckedKvWrite<M::Range>, BackendError> {
        let op = "kv_write";
        let width = count(op, &[self.kv_heads, self.head_dim])?;
        let slots = Operand::new(op, self.slots, self.rows, Dtype::U32, "kv_write slots")?;
        let slots_range = slots.check(mem)?;
        let values = mem.read_u32(&slots_range, self.slots, self.rows, self.stream)?;
        if let Some(&bad) = values.iter().find(|&&s| s as usize >= self.num_slots) {
            return Err(invalid(
                op,
                format!(
                    "slot {bad} is outside the cache of {} slots",
                    self.num_slots
                ),
            ));
        }
        let rows_n = count(op, &[self.rows, width])?;
        let cache_n = count(op, &[self.num_slots, width])?;
        let k = Operand::new(op, self.k, rows_n, Dtype::Bf16, "kv_write k")?;
        let k_cache = Operand::new(op, self.k_cache, cache_n, Dtype::Bf16, "kv_write k_cache")?;
        let v = Operand::new(op, self.v, rows_n, Dtype::Bf16, "kv_write v")?;
        let v_cache = Operand::new(op, self.v_cache, cache_n, Dtype::Bf16, "kv_write v_cache")?;
        let (k_range, k_cache_range) = (k.check(mem)?, k_cache.check(mem)?);
        let (v_range, v_cache_range) = (v.check(mem)?, v_cache.check(mem)?);
        let args = KvWriteArgs {
            k_cache: k_cache_range,
            v_cache: v_cache_range,
            k: k_range,
            v: v_range,
            slots: slots_range,
            rows: self.rows,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            num_slots: self.num_slots,
            stream: self.stream,
        };
        for cache in [k_cache, v_cache] {
            for input in [k, v, slots] {
                apart(op, cache, input)?;
            }
        }
        apart(op, k_cache, v_cache)?;
        Ok(CheckedKvWrite {
            args,
            slots: values,
        })
    }
}

/// Grouped-query attention over a paged cache, for prefill and decode alike. Query row `r`
/// (BF16 `q[r, heads, head_dim]`) belongs to sequence `row_seq[r]` and attends to that
/// sequence's first `row_ctx_len[r]` cached rows (causality is in the lengths); cached row
/// `j` of sequence `s` is slot `block_table[s, j / block_size] * block_size + j %
/// block_size`. Query head `h` reads KV head `h / (heads / kv_heads)`. Scores are scaled by
/// `scale`; `out` BF16 `[rows, heads, head_dim]` is apart from every input.
///
/// A tree mask (`row_parent`) narrows what a row attends to: a row with parent row `p` (an
/// earlier row of the same sequence, with a shorter context) attends to what `p` attends to
/// and to its own cached row, `row_ctx_len[r] - 1`; a row without one
/// ([`PagedAttentionArgs::NO_PARENT`]) attends to its whole context as above. So in a verify
/// forward of a draft tree whose nodes sit in consecutive cache rows after the sequence's
/// prefix, the last verified token's row has no parent and each node's row names its
/// parent's: each node sees the prefix and its own ancestors, not its siblings' branches. A
/// chain (each row the parent of the next) attends as without a mask.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PagedAttentionArgs<P = DevicePtr> {
    /// BF16 `[rows, heads, head_dim]`: the attention output.
    pub out: P,
    /// BF16 `[rows, heads, head_dim]`: the queries.
    pub q: P,
    /// BF16 `[num_slots, kv_heads, head_dim]`: the paged key cache.
    pub k_cache: P,
    /// BF16 `[num_slots, kv_heads, head_dim]`: the paged value cache.
    pub v_cache: P,
    /// u32 `[num_seqs, max_blocks_per_seq]`: each sequence's KV blocks in order.
    pub block_table: P,
    /// u32 `[rows]`: the sequence each query row belongs to.
    pub row_seq: P,
    /// u32 `[rows]`: how many cached rows each query row attends to.
    pub row_ctx_len: P,
    /// u32 `[rows]`: each row's parent row in this call, or [`Self::NO_PARENT`]; `None`
    /// for no tree mask.
    pub row_parent: Option<P>,
    /// Query rows.
    pub rows: usize,
    /// Query heads per row.
    pub heads: usize,
    /// KV heads per row (divides `heads`).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Cache rows per KV block.
    pub block_size: usize,
    /// Columns of `block_table`.
    pub max_blocks_per_seq: usize,
    /// Multiplier of the scores before softmax (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// The stream the op is queued on.
    pub stream: u64,
}

/// A validated [`PagedAttentionArgs`] and the index arrays it read.
pub struct CheckedAttention<R> {
    /// The arguments, with pointers resolved.
    pub args: PagedAttentionArgs<R>,
    /// The sequence of each query row, read from the device.
    pub row_seq: Vec<u32>,
    /// The context length of each query row, read from the device.
    pub row_ctx_len: Vec<u32>,
    /// Each query row's parent row, read from the device, when there is a tree mask.
    pub row_parent: Option<Vec<u32>>,
    /// `[num_seqs, max_blocks_per_seq]`, `num_seqs` the largest `row_seq` plus one.
    pub block_table: Vec<u32>,
    /// Sequences the table covers.
    pub num_seqs: usize,
}

/// The first row whose parent breaks the mask's contract, with what is wrong.
pub(super) fn parent_fault(
    row_parent: &[u32],
    row_seq: &[u32],
    row_ctx_len: &[u32],
) -> Option<String> {
    row_parent.iter().enumerate().find_map(|(r, &p)| {
        let p = (p != PagedAttentionArgs::NO_PARENT).then_some(p as usize)?;
        if p >= r {
            Some(format!("row {r}'s parent {p} is not an earlier row"))
        } else if row_seq[p] != row_seq[r] {
            Some(format!(
                "row {r} (sequence {}) has parent {p} of sequence {}",
                row_seq[r], row_seq[p]
            ))
        } else if row_ctx_len[p] >= row_ctx_len[r] {
            Some(format!(
                "row {r} attends to {} rows, its parent {p} to {}: a parent's own row comes first",
                row_ctx_len[r], row_ctx_len[p]
            ))
        } else {
            None
        }
    })
}

impl PagedAttentionArgs {
    /// The `row_parent` of a row that attends to its whole context.
    pub const NO_PARENT: u32 = u32::MAX;

    /// The checks every backend makes before it runs the op. The caches are checked over
    /// every slot the block table names.
    pub fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<CheckedAttention<M::Range>, BackendError> {
        let op = "paged_attention";
        let (rows, heads, kv_heads, hd) = (self.rows, self.heads, self.kv_heads, self.head_dim);
        let (block_size, mbps) = (self.block_size, self.max_blocks_per_seq);
        if kv_heads == 0 || heads % kv_heads != 0 || block_size == 0 {
            return Err(invalid(
                op,
                format!(
                    "heads {heads} must be a multiple of kv_heads {kv_heads}, block_size non-zero"
                ),
            ));
        }
        let index =
            |ptr, n, what| -> Result<(Operand<'static>, M::Range, Vec<u32>), BackendError> {
                let operand = Operand::new(op, ptr, n, Dtype::U32, what)?;
                let range = operand.check(mem)?;
                let values = mem.read_u32(&range, ptr, n, self.stream)?;
                Ok((operand, range, values))
            };
        let (seq_op, seq_range, row_seq) = index(self.row_seq, rows, "paged_attention row_seq")?;
        let (len_op, len_range, row_ctx_len) =
            index(self.row_ctx_len, rows, "paged_attention row_ctx_len")?;
        let parents = match self.row_parent {
            Some(ptr) => Some(index(ptr, rows, "paged_attention row_parent")?),
            None => None,
        };
        if let Some(fault) = parents
            .as_ref()
            .and_then(|(_, _, p)| parent_fault(p, &row_seq, &row_ctx_len))
        {
            return Err(invalid(op, fault));
        }
        let num_seqs = row_seq.iter().map(|&s| s as usize + 1).max().unwrap_or(0);
        let (table_op, table_range, block_table) = index(
            self.block_table,
            count(op, &[num_seqs, mbps])?,
            "paged_attention block_table",
        )?;
        let width = count(op, &[kv_heads, hd])?;
        let max_block = block_table.iter().copied().max().unwrap_or(0) as usize;
        let cache_n = count(op, &[max_block + 1, block_size, width])?;
        let q_n = count(op, &[rows, heads, hd])?;
        let q = Operand::new(op, self.q, q_n, Dtype::Bf16, "paged_attention q")?;
        let k_cache = Operand::new(
            op,
            self.k_cache,
            cache_n,
            Dtype::Bf16,
            "paged_attention k_cache",
        )?;
        let v_cache = Operand::new(
            op,
            self.v_cache,
            cache_n,
            Dtype::Bf16,
            "paged_attention v_cache",
        )?;
        let (q_range, k_range, v_range) = (q.check(mem)?, k_cache.check(mem)?, v_cache.check(mem)?);
        let capacity = mbps.saturating_mul(block_size);
        if let Some((r, len)) = row_ctx_len
            .iter()
            .enumerate()
            .find(|(_, &l)| l as usize > capacity)
        {
            return Err(invalid(
                op,
                format!("row {r} attends to {len} rows, more than its block table holds"),
            ));
        }
        let out = Operand::new(op, self.out, q_n, Dtype::Bf16, "paged_attention out")?;
        let (parent_op, parent_range, row_parent) = match parents {
            Some((o, r, v)) => (Some(o), Some(r), Some(v)),
            None => (None, None, None),
        };
        let args = PagedAttentionArgs {
            out: out.check(mem)?,
            q: q_range,
            k_cache: k_range,
            v_cache: v_range,
            block_table: table_range,
            row_seq: seq_range,
            row_ctx_len: len_range,
            row_parent: parent_range,
            rows,
            heads,
            kv_heads,
            head_dim: hd,
            block_size,
            max_blocks_per_seq: mbps,
            scale: self.scale,
            stream: self.stream,
        };
        for input in [q, k_cache, v_cache, table_op, seq_op, len_op]
            .into_iter()
            .chain(parent_op)
        {
            apart(op, out, input)?;
        }
        Ok(CheckedAttention {
            args,
            row_seq,
            row_ctx_len,
            row_parent,
            block_table,
            num_seqs,
        })
    }
}
