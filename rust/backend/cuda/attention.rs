//! Host side of the position and cache kernels (RoPE, KV write, paged attention): the
//! checks of the CPU reference, in its order, then one launch. Split from `ops.rs` only to
//! keep files short; the invariants are those of `ops.rs`.

use super::launch::*;
use crate::backend::kernels::RopeStyle;
use crate::backend::{BackendError, DevicePtr, Dtype};

#[allow(clippy::too_many_arguments)]
pub(super) fn rope<L: KernelLauncher>(
    b: &L,
    x: DevicePtr,
    positions: DevicePtr,
    inv_freq: DevicePtr,
    rows: usize,
    heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    style: RopeStyle,
    stream: u64,
) -> Result<(), BackendError> {
    let op = "rope";
    if rotary_dim > head_dim || rotary_dim % 2 != 0 {
        return Err(invalid(
            op,
            format!("rotary_dim {rotary_dim} must be even and at most head_dim {head_dim}"),
        ));
    }
    check_in_order(
        b,
        op,
        &[
            (positions, rows, Dtype::U32, "rope positions"),
            (inv_freq, rotary_dim / 2, Dtype::F32, "rope inv_freq"),
            (
                x,
                count(op, &[rows, heads, head_dim])?,
                Dtype::Bf16,
                "rope x",
            ),
        ],
    )?;
    let mut a = Args::new(b, op);
    a.ptr(
        x,
        count(op, &[rows, heads, head_dim])?,
        Dtype::Bf16,
        "rope x",
    )?;
    a.ptr(positions, rows, Dtype::U32, "rope positions")?;
    a.ptr(inv_freq, rotary_dim / 2, Dtype::F32, "rope inv_freq")?;
    a.int("rows", rows)?;
    a.int("heads", heads)?;
    a.int("head_dim", head_dim)?;
    a.int("rotary_dim", rotary_dim)?;
    // The kernel counts pairs over all heads in an int.
    int(op, "heads * rotary_dim", count(op, &[heads, rotary_dim])?)?;
    a.args.push(Arg::I32(match style {
        RopeStyle::Half => 0,
        RopeStyle::Interleaved => 1,
    }));
    if rows == 0 || rotary_dim == 0 || heads == 0 {
        return Ok(());
    }
    a.launch("sd_rope", rows_shape(rows, op)?, stream)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn kv_write<L: KernelLauncher>(
    b: &L,
    k_cache: DevicePtr,
    v_cache: DevicePtr,
    k: DevicePtr,
    v: DevicePtr,
    slots: DevicePtr,
    rows: usize,
    kv_heads: usize,
    head_dim: usize,
    num_slots: usize,
    stream: u64,
) -> Result<(), BackendError> {
    let op = "kv_write";
    let width = count(op, &[kv_heads, head_dim])?;
    let slot_values = read_u32(b, slots, rows, "kv_write slots", stream)?;
    if let Some(&bad) = slot_values.iter().find(|&&s| s as usize >= num_slots) {
        return Err(invalid(
            op,
            format!("slot {bad} is outside the cache of {num_slots} slots"),
        ));
    }
    check_in_order(
        b,
        op,
        &[
            (k, count(op, &[rows, width])?, Dtype::Bf16, "kv_write k"),
            (
                k_cache,
                count(op, &[num_slots, width])?,
                Dtype::Bf16,
                "kv_write cache",
            ),
            (v, count(op, &[rows, width])?, Dtype::Bf16, "kv_write v"),
            (
                v_cache,
                count(op, &[num_slots, width])?,
                Dtype::Bf16,
                "kv_write cache",
            ),
        ],
    )?;
    let mut a = Args::new(b, op);
    a.ptr(
        k_cache,
        count(op, &[num_slots, width])?,
        Dtype::Bf16,
        "kv_write cache",
    )?;
    a.ptr(
        v_cache,
        count(op, &[num_slots, width])?,
        Dtype::Bf16,
        "kv_write cache",
    )?;
    a.ptr(k, count(op, &[rows, width])?, Dtype::Bf16, "kv_write k")?;
    a.ptr(v, count(op, &[rows, width])?, Dtype::Bf16, "kv_write v")?;
    a.ptr(slots, rows, Dtype::U32, "kv_write slots")?;
    a.int("rows", rows)?;
    a.int("kv_heads * head_dim", width)?;
    a.int("num_slots", num_slots)?;
    if rows == 0 || width == 0 {
        return Ok(());
    }
    a.launch("sd_kv_write", rows_shape(rows, op)?, stream)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn paged_attention<L: KernelLauncher>(
    b: &L,
    out: DevicePtr,
    q: DevicePtr,
    k_cache: DevicePtr,
    v_cache: DevicePtr,
    block_table: DevicePtr,
    row_seq: DevicePtr,
    row_ctx_len: DevicePtr,
    rows: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    max_blocks_per_seq: usize,
    scale: f32,
    stream: u64,
) -> Result<(), BackendError> {
    let op = "paged_attention";
    if kv_heads == 0 || heads % kv_heads != 0 || block_size == 0 {
        return Err(invalid(
            op,
            format!("heads {heads} must be a multiple of kv_heads {kv_heads}, block_size non-zero"),
        ));
    }
    if head_dim > ATTN_MAX_HEAD_DIM {
        return Err(invalid(
            op,
            format!("head_dim {head_dim} is larger than the CUDA kernel's {ATTN_MAX_HEAD_DIM}"),
        ));
    }
    let seqs = read_u32(b, row_seq, rows, "paged_attention row_seq", stream)?;
    let lens = read_u32(b, row_ctx_len, rows, "paged_attention row_ctx_len", stream)?;
    let num_seqs = seqs.iter().map(|&s| s as usize + 1).max().unwrap_or(0);
    let table = read_u32(
        b,
        block_table,
        count(op, &[num_seqs, max_blocks_per_seq])?,
        "paged_attention block_table",
        stream,
    )?;
    let width = count(op, &[kv_heads, head_dim])?;
    let max_block = table.iter().copied().max().unwrap_or(0) as usize;
    let cache_rows = count(op, &[max_block + 1, block_size])?;
    check_in_order(
        b,
        op,
        &[
            (
                q,
                count(op, &[rows, heads, head_dim])?,
                Dtype::Bf16,
                "paged_attention q",
            ),
            (
                k_cache,
                count(op, &[cache_rows, width])?,
                Dtype::Bf16,
                "paged_attention k_cache",
            ),
            (
                v_cache,
                count(op, &[cache_rows, width])?,
                Dtype::Bf16,
                "paged_attention v_cache",
            ),
        ],
    )?;
    for (r, &len) in lens.iter().enumerate() {
        if len as usize > max_blocks_per_seq.saturating_mul(block_size) {
            return Err(invalid(
                op,
                format!("row {r} attends to {len} rows, more than its block table holds"),
            ));
        }
    }
    let mut a = Args::new(b, op);
    a.ptr(
        out,
        count(op, &[rows, heads, head_dim])?,
        Dtype::Bf16,
        "paged_attention out",
    )?;
    a.ptr(
        q,
        count(op, &[rows, heads, head_dim])?,
        Dtype::Bf16,
        "paged_attention q",
    )?;
    a.ptr(
        k_cache,
        count(op, &[cache_rows, width])?,
        Dtype::Bf16,
        "paged_attention k_cache",
    )?;
    a.ptr(
        v_cache,
        count(op, &[cache_rows, width])?,
        Dtype::Bf16,
        "paged_attention v_cache",
    )?;
    // The reference reads the table only when a sequence uses it; an empty batch may
    // pass any pointer.
    if num_seqs > 0 {
        a.ptr(
            block_table,
            count(op, &[num_seqs, max_blocks_per_seq])?,
            Dtype::U32,
            "paged_attention block_table",
        )?;
    } else {
        a.args.push(Arg::Ptr(0));
    }
    a.ptr(row_seq, rows, Dtype::U32, "paged_attention row_seq")?;
    a.ptr(row_ctx_len, rows, Dtype::U32, "paged_attention row_ctx_len")?;
    a.int("heads", heads)?;
    a.int("kv_heads", kv_heads)?;
    a.int("head_dim", head_dim)?;
    a.int("block_size", block_size)?;
    a.int("max_blocks_per_seq", max_blocks_per_seq)?;
    a.float(scale);
    if rows == 0 || heads == 0 {
        return Ok(());
    }
    let shape = Shape {
        grid: (
            grid_dim(op, "heads", heads)?,
            grid_dim(op, "rows", rows)?,
            1,
        ),
        block: (ATTN_WARPS * 32, 1, 1),
    };
    a.launch("sd_paged_attention", shape, stream)
}
