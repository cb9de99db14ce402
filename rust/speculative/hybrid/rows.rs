//! A member's view of the hybrid's captured rows: the columns of its own `target_layer_ids`,
//! in its order, as the contiguous BF16 `[rows, n_member * hidden]` block the protocol
//! promises it.
//!
//! Invariants: a view is a pointer into the hybrid's rows when those columns already lie side
//! by side in the member's order and the rows are contiguous that way (one row, or every
//! column); otherwise the columns are gathered with `copy_rows` into a buffer the caller owns.
//! The hybrid's rows are never written.

use super::state::Scratch;
use super::Hybrid;
use crate::backend::{CopyRowsArgs, DevicePtr, Dtype, GpuBackend};

impl Hybrid {
    /// Bytes of one captured row of the hybrid (every column).
    pub(super) fn stack_row_bytes(&self, hidden: usize) -> usize {
        self.layers.len() * hidden * Dtype::Bf16.size()
    }

    /// The target's final hidden (before the norm) of row `row` of `stack`: a `[1, hidden]`
    /// view, when the hybrid captures the last layer.
    pub(super) fn final_hidden(
        &self,
        stack: DevicePtr,
        row: usize,
        hidden: usize,
    ) -> Option<DevicePtr> {
        self.final_column.map(|c| {
            stack.offset(row * self.stack_row_bytes(hidden) + c * hidden * Dtype::Bf16.size())
        })
    }

    /// Member `i`'s columns of rows `first .. first + rows` of `stack` (`None` for a member
    /// that names no layers).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn member_rows(
        &self,
        i: usize,
        gpu: &dyn GpuBackend,
        stack: DevicePtr,
        first: usize,
        rows: usize,
        hidden: usize,
        scratch: &mut Scratch,
        stream: u64,
    ) -> crate::Result<Option<DevicePtr>> {
        let cols = &self.columns[i];
        let Some(&c0) = cols.first() else {
            return Ok(None);
        };
        let el = Dtype::Bf16.size();
        let at = stack.offset(first * self.stack_row_bytes(hidden));
        let side_by_side = cols.iter().enumerate().all(|(j, &c)| c == c0 + j);
        if side_by_side && (rows == 1 || cols.len() == self.layers.len()) {
            return Ok(Some(at.offset(c0 * hidden * el)));
        }
        let width = cols.len() * hidden;
        let dst = scratch.room(gpu, rows * width * el)?;
        for (j, &c) in cols.iter().enumerate() {
            gpu.copy_rows(CopyRowsArgs {
                dst,
                src: at.offset(c * hidden * el),
                rows,
                width: hidden,
                col: j * hidden,
                dst_stride: width,
                src_stride: self.layers.len() * hidden,
                stream,
            })?;
        }
        Ok(Some(dst))
    }
}
