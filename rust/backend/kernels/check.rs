//! What every op's `validate` is built from: the backend hook that turns a pointer into a
//! ledger-checked range ([`CheckedMemory`]), size arithmetic that cannot overflow, and the
//! aliasing rules between an op's output and its inputs.
//!
//! Invariants: a size reaches a range check only through [`count`] and [`bytes`], which
//! refuse overflow; an [`Operand`] carries the exact bytes an op touches, so the overlap
//! checks see what the kernel will read and write.

use crate::backend::{BackendError, DevicePtr, Dtype};

/// Device memory as an op's validation sees it. Each backend implements it once; every
/// range it hands out lies inside one live allocation of its ledger.
pub trait CheckedMemory {
    /// What a checked range becomes for the kernel: a host view on the CPU, a device
    /// address (and whatever keeps it valid) on the CUDA backends.
    type Range;

    /// Checks that `nbytes` at `ptr` lie in one live allocation; `what` names the operand
    /// in the error.
    fn checked_range(
        &self,
        ptr: DevicePtr,
        nbytes: usize,
        what: &str,
    ) -> Result<Self::Range, BackendError>;

    /// Reads `n` u32 values from a range [`CheckedMemory::checked_range`] returned for
    /// `ptr`: a small index array (token ids, slots, a block table) the checks must see.
    /// Work queued earlier on `stream`, which may have written it, is complete first.
    fn read_u32(
        &self,
        range: &Self::Range,
        ptr: DevicePtr,
        n: usize,
        stream: u64,
    ) -> Result<Vec<u32>, BackendError>;
}

pub(crate) fn invalid(op: &'static str, message: String) -> BackendError {
    BackendError::InvalidArgument { op, message }
}

/// The product of `dims`, or an error naming the op if it overflows.
pub(crate) fn count(op: &'static str, dims: &[usize]) -> Result<usize, BackendError> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| invalid(op, format!("sizes {dims:?} overflow")))
}

/// Bytes of `n` elements of `dtype`, or an error naming the op and operand on overflow.
pub(crate) fn bytes(
    op: &'static str,
    n: usize,
    dtype: Dtype,
    what: &str,
) -> Result<usize, BackendError> {
    n.checked_mul(dtype.size())
        .ok_or_else(|| invalid(op, format!("{what}: {n} elements overflow")))
}

/// One operand of an op: where it is, how many bytes the op touches there, the alignment
/// its element type needs, and its name in messages (`"rms_norm x"`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operand<'a> {
    pub op: &'static str,
    pub ptr: DevicePtr,
    pub nbytes: usize,
    pub align: usize,
    pub what: &'a str,
}

impl<'a> Operand<'a> {
    /// `n` elements of `dtype` at `ptr`.
    pub fn new(
        op: &'static str,
        ptr: DevicePtr,
        n: usize,
        dtype: Dtype,
        what: &'a str,
    ) -> Result<Self, BackendError> {
        Ok(Operand {
            op,
            ptr,
            nbytes: bytes(op, n, dtype, what)?,
            align: dtype.size(),
            what,
        })
    }

    /// The ledger-checked range of this operand. A misaligned address is refused first: a
    /// GPU faults on it and the CPU cannot view it as elements.
    pub fn check<M: CheckedMemory + ?Sized>(self, mem: &M) -> Result<M::Range, BackendError> {
        let misalignment = self.ptr.addr() % self.align as u64;
        if misalignment != 0 {
            return Err(invalid(
                self.op,
                format!(
                    "{}: the address is {misalignment} bytes past a multiple of its {}-byte elements",
                    self.what, self.align
                ),
            ));
        }
        mem.checked_range(self.ptr, self.nbytes, self.what)
    }

    /// Bytes this operand shares with `other` (0 when either is empty).
    fn shared_bytes(self, other: Operand<'_>) -> u64 {
        let (a0, b0) = (self.ptr.addr(), other.ptr.addr());
        let (a1, b1) = (
            a0.saturating_add(self.nbytes as u64),
            b0.saturating_add(other.nbytes as u64),
        );
        a1.min(b1).saturating_sub(a0.max(b0))
    }
}

/// The output of an op may not share a byte with this input.
pub(crate) fn apart(
    op: &'static str,
    out: Operand<'_>,
    input: Operand<'_>,
) -> Result<(), BackendError> {
    match out.shared_bytes(input) {
        0 => Ok(()),
        shared => Err(invalid(
            op,
            format!(
                "{} overlaps {} ({shared} bytes shared); this op needs them apart",
                out.what, input.what
            ),
        )),
    }
}

/// The output of an op may be this input itself (computed in place) or apart from it, but
/// not a partial overlap, which would read values the op has already overwritten.
pub(crate) fn same_or_apart(
    op: &'static str,
    out: Operand<'_>,
    input: Operand<'_>,
) -> Result<(), BackendError> {
    if out.ptr == input.ptr && out.nbytes == input.nbytes {
        return Ok(());
    }
    match out.shared_bytes(input) {
        0 => Ok(()),
        shared => Err(invalid(
            op,
            format!(
                "{} partly overlaps {} ({shared} bytes shared); it must be that buffer itself or apart from it",
                out.what, input.what
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(addr: u64, nbytes: usize, what: &'static str) -> Operand<'static> {
        Operand {
            op: "t",
            ptr: DevicePtr(addr),
            nbytes,
            align: 1,
            what,
        }
    }

    #[test]
    fn overlap_rules() {
        let out = at(0x1000, 64, "out");
        assert!(apart("t", out, at(0x1040, 8, "x")).is_ok());
        assert!(apart("t", out, at(0x0fc0, 64, "x")).is_ok());
        let err = apart("t", out, at(0x103f, 8, "x")).unwrap_err();
        assert!(
            err.to_string().contains("out overlaps x (1 bytes shared)"),
            "{err}"
        );
        // Empty ranges touch nothing.
        assert!(apart("t", out, at(0x1010, 0, "x")).is_ok());
        assert!(same_or_apart("t", out, at(0x1000, 64, "x")).is_ok());
        assert!(same_or_apart("t", out, at(0x2000, 64, "x")).is_ok());
        let err = same_or_apart("t", out, at(0x1020, 64, "x")).unwrap_err();
        assert!(
            err.to_string().contains("partly overlaps x (32 bytes"),
            "{err}"
        );
        assert!(same_or_apart("t", out, at(0x1000, 32, "x")).is_err());
    }

    #[test]
    fn sizes_that_overflow_are_errors() {
        assert_eq!(count("t", &[3, 4, 5]).unwrap(), 60);
        assert!(count("t", &[usize::MAX, 2]).is_err());
        assert!(bytes("t", usize::MAX / 2, Dtype::F32, "x").is_err());
    }
}
