//! Host side of the position and cache kernels (RoPE, KV write and copy, paged and latent
//! attention): the
//! arguments' shared `validate`, the limits of these kernels, then one launch. Split from
//! `ops.rs` only to keep files short; the invariants are those of `ops.rs`.

use super::launch::*;
use crate::backend::kernels::check::{count, invalid};
use crate::backend::kernels::{
    KvCopyArgs, KvWriteArgs, MlaAttentionArgs, PagedAttentionArgs, RopeArgs, RopeStyle,
};
use crate::backend::BackendError;

pub(super) fn rope<L: KernelLauncher>(b: &L, args: RopeArgs) -> Result<(), BackendError> {
    let op = "rope";
    let a = args.validate(b)?;
    let mut l = LaunchArgs::new(op);
    l.ptr(&a.x).ptr(&a.positions).ptr(&a.inv_freq);
    l.int("rows", a.rows)?
        .int("heads", a.heads)?
        .int("head_dim", a.head_dim)?
        .int("rotary_dim", a.rotary_dim)?;
    // The kernel counts pairs over all heads in an int.
    int(
        op,
        "heads * rotary_dim",
        count(op, &[a.heads, a.rotary_dim])?,
    )?;
    l.flag(a.style == RopeStyle::Interleaved);
    if a.rows == 0 || a.rotary_dim == 0 || a.heads == 0 {
        return Ok(());
    }
    b.launch("sd_rope", rows_shape(a.rows, op)?, &l.args, a.stream)
}

pub(super) fn kv_write<L: KernelLauncher>(b: &L, args: KvWriteArgs) -> Result<(), BackendError> {
    let op = "kv_write";
    let a = args.validate(b)?.args;
    let width = a.kv_heads * a.head_dim;
    let mut l = LaunchArgs::new(op);
    l.ptr(&a.k_cache)
        .ptr(&a.v_cache)
        .ptr(&a.k)
        .ptr(&a.v)
        .ptr(&a.slots);
    l.int("rows", a.rows)?
        .int("kv_heads * head_dim", width)?
        .int("num_slots", a.num_slots)?;
    if a.rows == 0 || width == 0 {
        return Ok(());
    }
    b.launch("sd_kv_write", rows_shape(a.rows, op)?, &l.args, a.stream)
}

pub(super) fn kv_copy<L: KernelLauncher>(b: &L, args: KvCopyArgs) -> Result<(), BackendError> {
    let op = "kv_copy";
    let a = args.validate(b)?.args;
    let width = a.kv_heads * a.head_dim;
    let mut l = LaunchArgs::new(op);
    l.ptr(&a.k_cache).ptr(&a.v_cache).ptr(&a.src).ptr(&a.dst);
    l.int("copies", a.copies)?
        .int("kv_heads * head_dim", width)?
        .int("num_slots", a.num_slots)?;
    if a.copies == 0 || width == 0 {
        return Ok(());
    }
    // One block: the copies run in order, a barrier apart (a later copy may write the row
    // an earlier one read).
    let shape = Shape {
        grid: (1, 1, 1),
        block: (ROW_THREADS, 1, 1),
    };
    b.launch("sd_kv_copy", shape, &l.args, a.stream)
}

pub(super) fn paged_attention<L: KernelLauncher>(
    b: &L,
    args: PagedAttentionArgs,
) -> Result<(), BackendError> {
    let op = "paged_attention";
    let checked = args.validate(b)?;
    let a = &checked.args;
    if a.head_dim > ATTN_MAX_HEAD_DIM {
        return Err(invalid(
            op,
            format!(
                "head_dim {} is larger than the CUDA kernel's {ATTN_MAX_HEAD_DIM}",
                a.head_dim
            ),
        ));
    }
    let mut l = LaunchArgs::new(op);
    l.ptr(&a.out).ptr(&a.q).ptr(&a.k_cache).ptr(&a.v_cache);
    // An empty batch reads no table; the kernel gets the null pointer.
    l.opt_ptr((checked.num_seqs > 0).then_some(&a.block_table));
    l.ptr(&a.row_seq).ptr(&a.row_ctx_len);
    // No tree mask: the kernel gets the null pointer.
    l.opt_ptr(a.row_parent.as_ref());
    l.int("heads", a.heads)?
        .int("kv_heads", a.kv_heads)?
        .int("head_dim", a.head_dim)?
        .int("block_size", a.block_size)?
        .int("max_blocks_per_seq", a.max_blocks_per_seq)?
        .float(a.scale);
    if a.rows == 0 || a.heads == 0 {
        return Ok(());
    }
    let shape = Shape {
        grid: (
            grid_dim(op, "heads", a.heads)?,
            grid_dim(op, "rows", a.rows)?,
            1,
        ),
        block: (ATTN_WARPS * 32, 1, 1),
    };
    b.launch("sd_paged_attention", shape, &l.args, a.stream)
}

pub(super) fn mla_attention<L: KernelLauncher>(
    b: &L,
    args: MlaAttentionArgs,
) -> Result<(), BackendError> {
    let op = "mla_attention";
    let checked = args.validate(b)?;
    let a = &checked.args;
    let latent = a.kv_lora_rank + a.rope_dim;
    if a.kv_lora_rank > MLA_MAX_RANK || latent > MLA_MAX_LATENT {
        return Err(invalid(
            op,
            format!(
                "kv_lora_rank {} and latent row {latent} exceed the CUDA kernel's {MLA_MAX_RANK} and {MLA_MAX_LATENT}",
                a.kv_lora_rank
            ),
        ));
    }
    let num_seqs = checked.row_seq.iter().map(|&s| s as usize + 1).max();
    let mut l = LaunchArgs::new(op);
    l.ptr(&a.out)
        .ptr(&a.q)
        .ptr(&a.kv_b)
        .ptr(&a.lo_cache)
        .ptr(&a.hi_cache);
    // An empty batch reads no table; the kernel gets the null pointer.
    l.opt_ptr(num_seqs.map(|_| &a.block_table));
    l.ptr(&a.row_seq).ptr(&a.row_ctx_len);
    // No tree mask: the kernel gets the null pointer.
    l.opt_ptr(a.row_parent.as_ref());
    l.int("heads", a.heads)?
        .int("kv_lora_rank", a.kv_lora_rank)?
        .int("nope_dim", a.nope_dim)?
        .int("rope_dim", a.rope_dim)?
        .int("v_dim", a.v_dim)?
        .int("block_size", a.block_size)?
        .int("max_blocks_per_seq", a.max_blocks_per_seq)?
        .float(a.scale);
    if a.rows == 0 || a.heads == 0 {
        return Ok(());
    }
    let shape = Shape {
        grid: (
            grid_dim(op, "heads", a.heads)?,
            grid_dim(op, "rows", a.rows)?,
            1,
        ),
        block: (MLA_WARPS * 32, 1, 1),
    };
    b.launch("sd_mla_attention", shape, &l.args, a.stream)
}
