//! The `DraftProposer` implementation of [`PyProposer`], written from the protocol's method
//! list: each method hands over to the inherent method of the same name in its group's
//! file, where the Rust path (the class does not override the method) and the call into
//! Python (it does) are written: `adapter_lifecycle` (state and carried drafter KV),
//! `adapter_drafting` (propose, batches, verify feedback), `adapter_prefill` (drafter KV
//! from target hiddens), `adapter_capabilities` (what the proposer is, the circuit binding).
//!
//! `PyProposer::name` resolves to the inherent method before the trait's, so each trait
//! method calls its group's; a group that lacked one would make the trait method call
//! itself, which `unconditional_recursion` (denied in CI) reports.

use super::adapter::PyProposer;
use crate::speculative::DraftProposer;

/// Writes `impl DraftProposer for PyProposer` from the protocol's method list.
macro_rules! adapt_every_method {
    ($($variant:ident => fn $name:ident ($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty,
        $answer:ident $(($default:expr))?;)+) => {
        #[allow(clippy::too_many_arguments, clippy::unused_unit)]
        impl DraftProposer for PyProposer {
            $(
                fn $name(&self, $($arg: $ty),*) -> $ret {
                    PyProposer::$name(self, $($arg),*)
                }
            )+
        }
    };
}

crate::speculative::with_protocol_methods!(adapt_every_method);
