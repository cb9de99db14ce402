//! [`SharedOut`]: one output slice that the pool's tasks write in disjoint parts.
//!
//! A task closure must be `Sync`, so it cannot hold the `&mut [T]` it writes; it holds this
//! instead and takes its own part. Invariants: every part handed out lies inside the slice
//! `new` was given (checked); that no two live parts overlap is the caller's promise, and the
//! call that made it keeps the `&mut [T]` borrowed (the lifetime) until every task has run.

use std::marker::PhantomData;

/// A slice's address and length, shareable between pool tasks.
pub(super) struct SharedOut<'a, T> {
    ptr: *mut T,
    len: usize,
    _slice: PhantomData<&'a mut [T]>,
}

impl<T> Clone for SharedOut<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedOut<'_, T> {}

// SAFETY: tasks write only their own disjoint parts (the caller's promise on `slice` and
// `chunk`), and the borrow of the slice outlives every task.
unsafe impl<T: Send> Send for SharedOut<'_, T> {}
unsafe impl<T: Send> Sync for SharedOut<'_, T> {}

impl<'a, T> SharedOut<'a, T> {
    pub(super) fn new(v: &'a mut [T]) -> Self {
        SharedOut {
            ptr: v.as_mut_ptr(),
            len: v.len(),
            _slice: PhantomData,
        }
    }

    /// Elements `start..start + n`.
    ///
    /// # Safety
    /// No other live part may overlap it.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn slice(&self, start: usize, n: usize) -> &mut [T] {
        assert!(
            start <= self.len && n <= self.len - start,
            "output part out of range"
        );
        // SAFETY: in range (checked); disjointness is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), n) }
    }

    /// Chunk `t` of `size` elements (the last may be short, and chunks past the end empty).
    ///
    /// # Safety
    /// No two live chunks may overlap: each task takes only its own `t`.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn chunk(&self, t: usize, size: usize) -> &mut [T] {
        let start = (t * size).min(self.len);
        let end = (start + size).min(self.len);
        // SAFETY: the same promise, passed on.
        unsafe { self.slice(start, end - start) }
    }
}
