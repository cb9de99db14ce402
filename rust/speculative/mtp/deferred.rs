//! The rows of the MTP head's proposes without drafts.
//!
//! A propose of 0 drafts keeps the one row a drafting propose writes first (the verified
//! token's, keys and values only), so a step without drafts leaves no gap in the head's KV.
//! While the draft policy declines, nothing reads that KV, so the row is deferred: its token,
//! position and a copy of the target hidden (valid only for the step) are kept, and every
//! deferred row is written in one batched forward before the sequence next drafts, or when
//! a chunk's worth has built up.
//!
//! Invariant: deferred or written at once, the rows written, and so every later draft, are
//! the same (`tests/mtp_deferred_rows.rs` compares the two bit for bit).

use super::draft::DraftSeq;
use super::head::{MtpHead, MTP_CHUNK_ROWS};
use super::state::MtpState;
use crate::backend::GpuBackend;

/// Deferred rows a state holds at most before they are written: one chunk's forward.
pub(crate) const DEFERRED_ROWS: usize = MTP_CHUNK_ROWS;

impl MtpHead {
    /// A propose of no drafts still brings the token being drafted from: its row (the one a
    /// drafting propose writes first) is written here, keys and values only, one multi-row
    /// forward for all of `seqs`, and left pending like a drafting propose's rows, so
    /// `after_verify(0)` keeps it. Without it a step the draft policy skips would leave a
    /// position the head never attends to, and its later drafts would differ from those of a
    /// head that drafted every step.
    pub(super) fn write_verified_rows(
        &self,
        gpu: &dyn GpuBackend,
        seqs: &mut [DraftSeq<'_>],
        stream: u64,
    ) -> crate::Result<()> {
        let items: Vec<_> = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| (i, s.token, s.hidden, s.position))
            .collect();
        let mut states: Vec<&mut MtpState> = seqs.iter_mut().map(|s| &mut *s.state).collect();
        let written = self.write_rows(gpu, &mut states, &items, stream)?;
        for (st, n) in states.iter_mut().zip(written) {
            st.pending = n;
        }
        Ok(())
    }

    /// Whether proposes of no drafts defer their rows (see this module's doc).
    pub(crate) fn defers_rows(&self) -> bool {
        self.defer_rows.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Turns deferring the rows of proposes without drafts on or off (on by default). Off,
    /// each such propose writes its row at once: the reference the deferred path must match.
    pub fn set_defer_zero_draft_rows(&self, on: bool) {
        self.defer_rows
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Keeps the verified row of a propose without drafts for a later write, pending like a
    /// written one. A state whose backlog is full is flushed first (all such in one
    /// forward); a state at its row budget keeps nothing, as a write would not fit either.
    pub(super) fn defer_verified_rows(
        &self,
        gpu: &dyn GpuBackend,
        seqs: &mut [DraftSeq<'_>],
        stream: u64,
    ) -> crate::Result<()> {
        let mut full: Vec<&mut MtpState> = seqs
            .iter_mut()
            .map(|s| &mut *s.state)
            .filter(|st| st.deferred.len() >= DEFERRED_ROWS)
            .collect();
        self.flush_deferred(gpu, &mut full, stream)?;
        let row_bytes = self.spec.target_row_bytes();
        for s in seqs.iter_mut() {
            let st = &mut *s.state;
            if st.logical_rows() >= st.capacity_rows() {
                continue;
            }
            let buf = match st.deferred_hidden {
                Some(b) => b,
                None => {
                    let b = gpu.alloc(DEFERRED_ROWS * row_bytes, "mtp:deferred_hidden")?;
                    st.deferred_hidden = Some(b);
                    b
                }
            };
            let at = buf.offset(st.deferred.len() * row_bytes);
            gpu.copy_dtod(at, s.hidden, row_bytes, stream)?;
            st.deferred.push((s.token, s.position));
            st.pending = 1;
        }
        Ok(())
    }

    /// Writes every deferred row of `states` in one batched KV-only forward (chunked), so
    /// their KV holds what writing each at its step would have left. Deferred rows follow
    /// every written row, so they are written in order after them.
    pub(crate) fn flush_deferred(
        &self,
        gpu: &dyn GpuBackend,
        states: &mut [&mut MtpState],
        stream: u64,
    ) -> crate::Result<()> {
        let row_bytes = self.spec.target_row_bytes();
        let mut items = Vec::new();
        for (i, st) in states.iter_mut().enumerate() {
            let Some(buf) = st.deferred_hidden else {
                continue;
            };
            for (j, (token, pos)) in std::mem::take(&mut st.deferred).into_iter().enumerate() {
                items.push((i, token, buf.offset(j * row_bytes), pos));
            }
        }
        if items.is_empty() {
            return Ok(());
        }
        let pending: Vec<usize> = states.iter().map(|st| st.pending).collect();
        self.write_rows(gpu, states, &items, stream)?;
        // Flushed rows keep their pending status (the newest may not be verified yet).
        for (st, p) in states.iter_mut().zip(pending) {
            st.pending = p.min(st.rows());
        }
        Ok(())
    }
}
