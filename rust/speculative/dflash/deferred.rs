//! Deferred context rows: a propose of 0 drafts keeps its captured rows for a later batched
//! write instead of running the context forward at once.
//!
//! While the draft policy declines, the engine still proposes 0 drafts each step so the
//! head's context has no gap, and nothing reads that context until the next block. Writing
//! each step's one row runs `fc` and every draft layer's key and value projections for one
//! row: the weights are read once per row, a few percent of a target step on a CPU. So the
//! rows are copied aside (the stack is valid only for the step) and written in one forward
//! of up to [`DEFERRED_ROWS`] rows before the head next drafts, or when that many have
//! built up. The context written, and so the drafts, are the same as writing each row at
//! once.
//!
//! Invariants:
//! - Deferred rows are consecutive positions `first .. first + len`, all after every written
//!   context row; `len <= DEFERRED_ROWS`.
//! - A drafting propose adds its own rows to the backlog and writes the whole of it in one
//!   forward before its block; `keep_before`, `clear` and `drop_rows` of the state discard
//!   deferred rows with written ones.
//! - Where the written rows would not fit (the state's budget or the pool), the flush drops
//!   the context as writing them at once would have; it never fails the call for it.

use super::forward::Scratch;
use super::head::{DFlashHead, CONTEXT_CHUNK_ROWS};
use super::state::DFlashState;
use crate::backend::{DevicePtr, GpuBackend};
use std::sync::atomic::Ordering;

/// Deferred rows a state holds at most before they are written: one context chunk.
pub const DEFERRED_ROWS: usize = CONTEXT_CHUNK_ROWS;

/// Captured rows waiting for their context write, in a state-owned buffer.
#[derive(Debug, Default)]
pub(crate) struct DeferredRows {
    /// BF16 `[DEFERRED_ROWS, taps * hidden]`, allocated at the first deferral.
    pub buf: DevicePtr,
    /// The position of the first deferred row.
    pub first: usize,
    pub len: usize,
}

impl DeferredRows {
    /// Drops the rows at or after position `start`.
    pub fn keep_before(&mut self, start: usize) {
        self.len = self.len.min(start.saturating_sub(self.first));
    }

    /// Frees the buffer (once); the rows are gone afterwards.
    pub fn free(&mut self, gpu: &dyn GpuBackend) -> crate::Result<()> {
        self.len = 0;
        let buf = std::mem::take(&mut self.buf);
        if !buf.is_null() {
            gpu.free(buf)?;
        }
        Ok(())
    }
}

impl DFlashHead {
    /// Whether proposes of 0 drafts defer their rows.
    pub(crate) fn defers_rows(&self) -> bool {
        self.defer_rows.load(Ordering::Relaxed)
    }

    /// Turns deferring the context rows of proposes without drafts on or off (on by
    /// default). Off, each such propose writes its rows at once: the reference the deferred
    /// path must match.
    pub fn set_defer_zero_draft_rows(&self, on: bool) {
        self.defer_rows.store(on, Ordering::Relaxed);
    }

    /// Keeps `k` captured rows from `stack` (computed at `start ..`) for a later write. A
    /// backlog that would overflow is written first; a run too long to keep is written at
    /// once. False when such a run did not fit and the context was dropped.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn defer_context(
        &self,
        gpu: &dyn GpuBackend,
        sc: &Scratch,
        st: &mut DFlashState,
        stack: DevicePtr,
        start: usize,
        k: usize,
        stream: u64,
    ) -> crate::Result<bool> {
        let d = &st.deferred;
        let follows = d.len == 0 || d.first + d.len == start;
        if !follows || d.len + k > DEFERRED_ROWS {
            // Where the backlog is dropped, the context restarts from these rows.
            self.flush_deferred(gpu, sc, st, stream)?;
        }
        if k > DEFERRED_ROWS {
            return self.write_context(gpu, sc, st, stack, start, k, stream);
        }
        let row_bytes = self.stack_row_bytes();
        let d = &mut st.deferred;
        if d.buf.is_null() {
            d.buf = gpu.alloc(DEFERRED_ROWS * row_bytes, "dflash:deferred_rows")?;
        }
        if d.len == 0 {
            d.first = start;
        }
        gpu.copy_dtod(
            d.buf.offset(d.len * row_bytes),
            stack,
            k * row_bytes,
            stream,
        )?;
        d.len += k;
        Ok(true)
    }

    /// Writes every deferred row of `st` in one context forward. False when they did not fit
    /// and the context was dropped.
    pub(crate) fn flush_deferred(
        &self,
        gpu: &dyn GpuBackend,
        sc: &Scratch,
        st: &mut DFlashState,
        stream: u64,
    ) -> crate::Result<bool> {
        let (buf, first, n) = (st.deferred.buf, st.deferred.first, st.deferred.len);
        if n == 0 {
            return Ok(true);
        }
        st.deferred.len = 0;
        self.write_context(gpu, sc, st, buf, first, n, stream)
    }

    /// Writes `n` context rows from `rows` (computed at `first ..`) after the state's rows,
    /// or drops the whole context where they do not fit (false).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_context(
        &self,
        gpu: &dyn GpuBackend,
        sc: &Scratch,
        st: &mut DFlashState,
        rows: DevicePtr,
        first: usize,
        n: usize,
        stream: u64,
    ) -> crate::Result<bool> {
        if st.reserve(gpu, &self.pool, st.rows() + n, stream)? {
            self.append_context(gpu, sc, st, rows, first, n, stream)?;
            Ok(true)
        } else {
            st.drop_rows(&self.pool)?;
            Ok(false)
        }
    }
}
