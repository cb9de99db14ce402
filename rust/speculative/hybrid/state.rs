//! A `Hybrid`'s per-sequence state: one state per member, where each member stands in the
//! sequence, and the latest step until `after_verify` settles it.
//!
//! Invariants:
//! - `members[i]` was made by member `i`'s `alloc_state_for` and is freed by its
//!   `free_state`, once.
//! - `missed[i]` holds the committed tokens member `i` has not been given, in order, the first
//!   at position `missed_from[i]`; it is empty whenever a propose begins drafting.
//! - `step` is `Some` from a propose to its `after_verify`, and records what each member
//!   returned then.
//! - `scratch` buffers belong to this state alone and are freed by `free_state`.

use super::odds::MemberOdds;
use crate::backend::{DevicePtr, GpuBackend};
use crate::speculative::{DraftTree, ProposerState};

/// What one propose did, until `after_verify`.
pub(super) struct Step {
    /// The position drafted from.
    pub position: usize,
    /// Each member's drafts (empty for a member asked for none), as a tree: a chain where
    /// the member was asked with `propose`.
    pub drafts: Vec<DraftTree>,
    /// The member whose drafts were returned.
    pub winner: Option<usize>,
}

/// A device buffer that grows to the largest size asked of it.
#[derive(Default)]
pub(super) struct Scratch {
    pub ptr: DevicePtr,
    pub bytes: usize,
}

impl Scratch {
    /// The buffer, with room for at least `bytes`.
    pub fn room(&mut self, gpu: &dyn GpuBackend, bytes: usize) -> crate::Result<DevicePtr> {
        if bytes > self.bytes {
            let fresh = gpu.alloc(bytes, "hybrid:member_stack")?;
            let old = std::mem::replace(&mut self.ptr, fresh);
            self.bytes = bytes;
            if !old.is_null() {
                gpu.free(old)?;
            }
        }
        Ok(self.ptr)
    }

    /// Frees the buffer, if any.
    pub fn free(&mut self, gpu: &dyn GpuBackend) -> crate::Result<()> {
        let ptr = std::mem::take(&mut self.ptr);
        self.bytes = 0;
        if !ptr.is_null() {
            gpu.free(ptr)?;
        }
        Ok(())
    }
}

/// Per-sequence state of a [`Hybrid`](super::Hybrid).
pub struct HybridState {
    pub(super) members: Vec<Box<dyn ProposerState>>,
    /// Position of each member's latest propose (the last prompt position after a prefill).
    pub(super) seen: Vec<Option<usize>>,
    /// Position of the hybrid's latest propose (the last prompt position after a prefill).
    pub(super) last_position: Option<usize>,
    pub(super) missed: Vec<Vec<u32>>,
    pub(super) missed_from: Vec<usize>,
    pub(super) step: Option<Step>,
    /// Each member's `num_accepted` at the latest `after_verify`.
    pub(super) accepted: Vec<usize>,
    /// Each member's captured columns, gathered for it.
    pub(super) scratch: Vec<Scratch>,
    /// Each member's measured odds of a first draft accepted, in this sequence.
    pub(super) odds: MemberOdds,
    pub(super) freed: bool,
}

crate::impl_proposer_state!(HybridState);

impl HybridState {
    pub(super) fn new(members: Vec<Box<dyn ProposerState>>) -> Self {
        let n = members.len();
        HybridState {
            members,
            seen: vec![None; n],
            last_position: None,
            missed: vec![Vec::new(); n],
            missed_from: vec![0; n],
            step: None,
            accepted: vec![0; n],
            scratch: (0..n).map(|_| Scratch::default()).collect(),
            odds: MemberOdds::new(n),
            freed: false,
        }
    }

    /// Member `i`'s own state.
    pub fn member(&mut self, i: usize) -> Option<&mut (dyn ProposerState + 'static)> {
        self.members.get_mut(i).map(|s| s.as_mut())
    }

    /// The committed tokens member `i` has yet to be given (it catches up on them at the next
    /// propose).
    pub fn missed(&self, i: usize) -> &[u32] {
        self.missed.get(i).map_or(&[], Vec::as_slice)
    }

    /// The member whose drafts the pending step returned, if a step is pending.
    pub fn winner(&self) -> Option<usize> {
        self.step.as_ref().and_then(|s| s.winner)
    }
}
