//! `DelegatingProposer`: a proposer that wraps another and writes only the methods it
//! changes. Every protocol method it does not write goes to its `inner()` proposer, so a
//! wrapper (one that counts calls, logs them, filters drafts or times them) keeps every
//! capability of what it wraps: its batching width, its trees, the target layers it names,
//! its drafter KV. A wrapper that implemented `DraftProposer` by hand and forgot one of those
//! methods would silently fall back to the protocol's default (drafting one sequence at a
//! time, chains instead of trees, no captured layers).
//!
//! A wrapper that changes `propose` also decides about `propose_batch`, `propose_tree` and
//! `propose_tree_batch`, which the engine calls instead of `propose` for batches and trees:
//! delegated, they go to the inner proposer and bypass the change; a batch method answering
//! `Ok(None)` sends the engine back to the per-sequence method.
//!
//! A type implementing `DelegatingProposer` is a `DraftProposer` through a blanket impl.
//! Inside an override, reach the wrapped proposer through `self.inner()`; a caller holding
//! the concrete type with both traits in scope names the trait
//! (`DraftProposer::propose(&wrapper, ...)`), or holds it as `Arc<dyn DraftProposer>` as the
//! engine does.
//!
//! Invariants:
//! - Each method not written by the implementor returns exactly what `inner()`'s returns for
//!   the same arguments.
//! - The trait's methods are the protocol's, from its one method list, so a method added to
//!   the protocol is delegated without a change here.

use super::DraftProposer;

/// Writes [`DelegatingProposer`] (every method defaulting to the inner proposer's) and the
/// blanket `DraftProposer` impl from the protocol's method list.
macro_rules! delegate_every_method {
    ($($variant:ident => fn $name:ident ($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty,
        $answer:ident $(($default:expr))?;)+) => {
        /// A proposer that wraps another (see the module documentation): implement
        /// [`DelegatingProposer::inner`] and the methods to change; the others are the inner
        /// proposer's.
        #[allow(clippy::too_many_arguments, clippy::unused_unit)]
        pub trait DelegatingProposer: Send + Sync {
            /// The proposer every method this type does not write goes to.
            fn inner(&self) -> &dyn DraftProposer;
            $(
                #[doc = concat!(
                    "[`DraftProposer::", stringify!($name), "`]; by default the inner proposer's."
                )]
                fn $name(&self, $($arg: $ty),*) -> $ret {
                    self.inner().$name($($arg),*)
                }
            )+
        }

        #[allow(clippy::too_many_arguments, clippy::unused_unit)]
        impl<T: DelegatingProposer> DraftProposer for T {
            $(
                fn $name(&self, $($arg: $ty),*) -> $ret {
                    DelegatingProposer::$name(self, $($arg),*)
                }
            )+
        }
    };
}

super::with_protocol_methods!(delegate_every_method);
