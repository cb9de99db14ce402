//! The drafter KV pool the engine watches when it admits a sequence: found on the Python
//! proposer object, since only the draft heads (and a `Hybrid` holding one) keep a pool of
//! their own. With a probe the engine lets a waiting prompt start only when the drafter pool
//! has room for it too, so a full drafter pool makes requests wait their turn instead of
//! failing them.
//!
//! Invariant: a probe reports the pool of the head object it was made from, in that head's
//! block size.

use super::dflash::PyDFlashHead;
use super::eagle3::PyEagle3Head;
use super::hybrid::PyHybrid;
use super::mtp::PyMtpHead;
use crate::engine::{drafter_pool_probe, mtp_pool_probe, DrafterPoolProbe};
use crate::speculative::dflash::DFLASH_BLOCK_ROWS;
use crate::speculative::mtp::DRAFTER_BLOCK_SIZE;
use pyo3::prelude::*;

/// The drafter pool of `proposer`: an MTP, EAGLE-3 or DFlash head's own, or a `Hybrid`'s
/// first member that has one; `None` for proposers without a pool.
pub(super) fn drafter_pool_of(proposer: &Bound<'_, PyAny>) -> Option<DrafterPoolProbe> {
    if let Ok(h) = proposer.cast::<PyMtpHead>() {
        return Some(mtp_pool_probe(h.get().head().clone()));
    }
    if let Ok(h) = proposer.cast::<PyEagle3Head>() {
        let head = h.get().head().clone();
        return Some(drafter_pool_probe(DRAFTER_BLOCK_SIZE, move || {
            head.kv_blocks()
        }));
    }
    if let Ok(h) = proposer.cast::<PyDFlashHead>() {
        let head = h.get().head().clone();
        return Some(drafter_pool_probe(DFLASH_BLOCK_ROWS, move || {
            head.kv_blocks()
        }));
    }
    let hybrid = proposer.cast::<PyHybrid>().ok()?;
    let py = proposer.py();
    hybrid
        .get()
        .member_objects()
        .iter()
        .find_map(|m| drafter_pool_of(m.bind(py)))
}
