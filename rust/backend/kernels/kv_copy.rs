//! Arguments of the in-cache slot copy, with its one `validate` (see the module docs of
//! `kernels`): the op that compacts a verified draft tree's accepted path in a paged KV
//! cache, moving each accepted node's key and value rows down to the rows right after the
//! sequence's prefix.
//!
//! Invariant: the copies run in order, and no copy reads a slot an earlier copy wrote, so
//! the result is what copying the rows one at a time gives; `validate` refuses any list
//! that would read an overwritten row (a path's nodes only move to lower rows, which
//! never does).

use super::check::{apart, count, invalid, CheckedMemory, Operand};
use crate::backend::{BackendError, DevicePtr, Dtype};
use std::collections::HashSet;

/// For `i` in order, slot `dst[i]` of `k_cache` and of `v_cache` (BF16 `[num_slots,
/// kv_heads, head_dim]`, slot = block * block_size + offset) gets a copy of slot `src[i]`'s
/// row, bits unchanged. A slot `>= num_slots` is an error, and so is a `src[i]` that an
/// earlier copy wrote (`src[i] == dst[j]` for some `j < i`, unless that copy left it as it
/// was, `src[j] == dst[j]`). The caches are apart from each other and from the slot lists.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvCopyArgs<P = DevicePtr> {
    /// BF16 `[num_slots, kv_heads, head_dim]`: the key cache, copied within.
    pub k_cache: P,
    /// BF16 `[num_slots, kv_heads, head_dim]`: the value cache, copied within.
    pub v_cache: P,
    /// u32 `[copies]`: the slot each copy reads.
    pub src: P,
    /// u32 `[copies]`: the slot each copy writes.
    pub dst: P,
    /// Copies, run in order.
    pub copies: usize,
    /// KV heads per row.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Slots in each cache (blocks times block size).
    pub num_slots: usize,
    /// The stream the op is queued on.
    pub stream: u64,
}

/// A validated [`KvCopyArgs`] and the slots it read.
pub struct CheckedKvCopy<R> {
    /// The arguments, with pointers resolved.
    pub args: KvCopyArgs<R>,
    /// The slot each copy reads, read from the device.
    pub src: Vec<u32>,
    /// The slot each copy writes, read from the device.
    pub dst: Vec<u32>,
}

/// The first copy that reads a slot an earlier copy overwrote, with what is wrong.
fn order_fault(src: &[u32], dst: &[u32]) -> Option<String> {
    let mut written: HashSet<u32> = HashSet::new();
    for (i, (&s, &d)) in src.iter().zip(dst).enumerate() {
        if written.contains(&s) {
            return Some(format!(
                "copy {i} reads slot {s}, which an earlier copy overwrote"
            ));
        }
        if s != d {
            written.insert(d);
        }
    }
    None
}

impl KvCopyArgs {
    /// The checks every backend makes before it runs the op.
    pub fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<CheckedKvCopy<M::Range>, BackendError> {
        let op = "kv_copy";
        let width = count(op, &[self.kv_heads, self.head_dim])?;
        let index = |ptr, what| -> Result<(Operand<'static>, M::Range, Vec<u32>), BackendError> {
            let operand = Operand::new(op, ptr, self.copies, Dtype::U32, what)?;
            let range = operand.check(mem)?;
            let values = mem.read_u32(&range, ptr, self.copies, self.stream)?;
            Ok((operand, range, values))
        };
        let (src_op, src_range, src) = index(self.src, "kv_copy src")?;
        let (dst_op, dst_range, dst) = index(self.dst, "kv_copy dst")?;
        if let Some(&bad) = src
            .iter()
            .chain(&dst)
            .find(|&&s| s as usize >= self.num_slots)
        {
            return Err(invalid(
                op,
                format!(
                    "slot {bad} is outside the cache of {} slots",
                    self.num_slots
                ),
            ));
        }
        if let Some(fault) = order_fault(&src, &dst) {
            return Err(invalid(op, fault));
        }
        let cache_n = count(op, &[self.num_slots, width])?;
        let k_cache = Operand::new(op, self.k_cache, cache_n, Dtype::Bf16, "kv_copy k_cache")?;
        let v_cache = Operand::new(op, self.v_cache, cache_n, Dtype::Bf16, "kv_copy v_cache")?;
        let args = KvCopyArgs {
            k_cache: k_cache.check(mem)?,
            v_cache: v_cache.check(mem)?,
            src: src_range,
            dst: dst_range,
            copies: self.copies,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            num_slots: self.num_slots,
            stream: self.stream,
        };
        for cache in [k_cache, v_cache] {
            for list in [src_op, dst_op] {
                apart(op, cache, list)?;
            }
        }
        apart(op, k_cache, v_cache)?;
        Ok(CheckedKvCopy { args, src, dst })
    }
}

#[cfg(test)]
mod tests {
    use super::order_fault;

    #[test]
    fn a_path_moving_down_is_in_order_and_a_read_after_write_is_not() {
        // Path nodes 1 and 2 after a prefix ending at row 9: rows 11, 12 -> 10, 11.
        assert_eq!(order_fault(&[11, 12], &[10, 11]), None);
        // A copy onto itself overwrites nothing.
        assert_eq!(order_fault(&[10, 12], &[10, 11]), None);
        assert_eq!(
            order_fault(&[12, 11], &[11, 10]).as_deref(),
            Some("copy 1 reads slot 11, which an earlier copy overwrote")
        );
    }
}
