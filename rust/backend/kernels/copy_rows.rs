//! Arguments of the strided row copy, with its one `validate` (see the module docs of
//! `kernels`): the op that gathers the hidden rows of several layers side by side into one
//! `[rows, n * hidden]` buffer (the target's layer capture).

use super::check::{apart, bytes, count, invalid, CheckedMemory, Operand};
use crate::backend::{BackendError, DevicePtr, Dtype};

/// `dst[r * dst_stride + col + i] = src[r * src_stride + i]` for `r < rows`, `i < width`:
/// the bits of BF16 elements copied unchanged. `src` is read as `rows` rows `src_stride`
/// elements apart, `dst` written at column `col` of rows `dst_stride` apart; the elements of
/// `dst` outside those columns are left as they were. `width <= src_stride` and
/// `col + width <= dst_stride`. `dst` is apart from `src`.
///
/// The ranges checked against the ledger are the spans the op touches: from element `col`
/// of `dst` (element 0 of `src`) to the end of the last row's `width` elements.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CopyRowsArgs<P = DevicePtr> {
    /// BF16 rows `dst_stride` elements apart; after validation, the span from column `col`.
    pub dst: P,
    /// BF16 rows `src_stride` elements apart.
    pub src: P,
    /// Rows to copy.
    pub rows: usize,
    /// Elements copied from each row.
    pub width: usize,
    /// The column of `dst` each row's elements start at.
    pub col: usize,
    /// Elements from one `dst` row to the next.
    pub dst_stride: usize,
    /// Elements from one `src` row to the next.
    pub src_stride: usize,
    /// The stream the op is queued on.
    pub stream: u64,
}

/// Elements of a `rows`-row span whose rows are `stride` apart and whose last row ends
/// `width` elements in (0 when there are no rows).
fn span(op: &'static str, rows: usize, stride: usize, width: usize) -> Result<usize, BackendError> {
    if rows == 0 {
        return Ok(0);
    }
    count(op, &[rows - 1, stride])?
        .checked_add(width)
        .ok_or_else(|| invalid(op, format!("{rows} rows of stride {stride} overflow")))
}

impl CopyRowsArgs {
    /// The checks every backend makes before it runs the op.
    pub fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<CopyRowsArgs<M::Range>, BackendError> {
        let op = "copy_rows";
        if self.width > self.src_stride {
            return Err(invalid(
                op,
                format!(
                    "width {} is wider than the source rows (stride {})",
                    self.width, self.src_stride
                ),
            ));
        }
        if self.col.saturating_add(self.width) > self.dst_stride {
            return Err(invalid(
                op,
                format!(
                    "columns {}..{} do not fit destination rows of stride {}",
                    self.col,
                    self.col.saturating_add(self.width),
                    self.dst_stride
                ),
            ));
        }
        let src_n = span(op, self.rows, self.src_stride, self.width)?;
        let dst_n = span(op, self.rows, self.dst_stride, self.width)?;
        let src = Operand::new(op, self.src, src_n, Dtype::Bf16, "copy_rows src")?;
        let col_bytes = bytes(op, self.col, Dtype::Bf16, "copy_rows col")?;
        let dst_at = self
            .dst
            .addr()
            .checked_add(col_bytes as u64)
            .map(DevicePtr)
            .ok_or_else(|| invalid(op, format!("column {} overflows the address", self.col)))?;
        let dst = Operand::new(op, dst_at, dst_n, Dtype::Bf16, "copy_rows dst")?;
        let args = CopyRowsArgs {
            src: src.check(mem)?,
            dst: dst.check(mem)?,
            rows: self.rows,
            width: self.width,
            col: self.col,
            dst_stride: self.dst_stride,
            src_stride: self.src_stride,
            stream: self.stream,
        };
        apart(op, dst, src)?;
        Ok(args)
    }
}
