//! The hybrid's verification bookkeeping (the module documentation's "Verification"), for a
//! chain step (`after_verify`) and a tree step (`after_verify_tree`) alike.
//!
//! Invariants:
//! - The committed drafts are the winner's nodes on the accepted path, in order.
//! - Each member is settled on the longest path of its own drafts that the committed
//!   drafts follow (the winner on the accepted path itself): with `after_verify` and the
//!   path's length where its drafts form a chain, with `after_verify_tree` and the path
//!   where they branch, so a member with its own KV keeps that path's rows.
//! - Every member is settled even after one fails; the first failure is returned.
//! - What a member's path leaves of the committed drafts is what it catches up on next.

use super::state::{HybridState, Step};
use super::Hybrid;
use crate::speculative::error::bad;
use crate::speculative::DraftTree;

impl Hybrid {
    /// Settles `step` of `st` on `path`, the accepted nodes of the winner's drafts (empty
    /// where nobody drafted), checked by the caller.
    pub(super) fn settle(
        &self,
        st: &mut HybridState,
        step: Step,
        path: &[usize],
        stream: u64,
    ) -> crate::Result<()> {
        let won = step.winner.map(|w| &step.drafts[w]);
        let committed: Vec<u32> = path
            .iter()
            .map(|&k| won.map_or(0, |t| t.tokens[k]))
            .collect();
        st.odds
            .settle(step.winner.map(|w| (w, step.drafts[w].len())), path.len());
        let mut first_error = None;
        for (i, drafts) in step.drafts.iter().enumerate() {
            let own = if step.winner == Some(i) {
                path.to_vec()
            } else {
                drafts.accepted_path(&committed)
            };
            let prop = self.members[i].proposer.as_ref();
            let state = &mut *st.members[i];
            let r = if drafts.is_chain() {
                prop.after_verify(own.len(), state, stream)
                    .map_err(|e| self.member_error("after_verify", i, e))
            } else {
                prop.after_verify_tree(&own, state, stream)
                    .map_err(|e| self.member_error("after_verify_tree", i, e))
            };
            if let Err(e) = r {
                first_error.get_or_insert(e);
            }
            st.accepted[i] = own.len();
            st.missed[i] = committed[own.len()..].to_vec();
            st.missed_from[i] = step.position + 1 + own.len();
        }
        st.last_position = Some(step.position);
        first_error.map_or(Ok(()), Err)
    }

    /// The pending step of `st`, for `method` to settle.
    pub(super) fn pending(st: &mut HybridState, method: &'static str) -> crate::Result<Step> {
        st.step
            .take()
            .ok_or_else(|| bad(method, "no propose is waiting for its verify".into()))
    }
}

/// Why `path` cannot settle a step whose winner drafted `won` (`None`: nobody drafted),
/// told through `after_verify_tree` (`tree`) or `after_verify`.
pub(super) fn path_fault(won: Option<&DraftTree>, path: &[usize], tree: bool) -> Option<String> {
    let empty = DraftTree::default();
    let won = won.unwrap_or(&empty);
    if !tree && !won.is_chain() {
        return Some(
            "the last propose_tree returned a tree that branches: it is settled with after_verify_tree"
                .into(),
        );
    }
    if path.len() > won.len() {
        return Some(format!(
            "{} drafts accepted but the last propose returned {}",
            path.len(),
            won.len()
        ));
    }
    DraftTree::path_fault(&won.parents, won.len(), path)
        .map(|fault| format!("the accepted path is not a path of the tree: {fault}"))
}
