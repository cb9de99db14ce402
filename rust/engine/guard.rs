//! `PanicGuard`: the engine's boundary around a proposer. Every call the engine makes into
//! a proposer goes through it, and a panic inside the proposer becomes a
//! `ProposerError::Failed` naming the method and the panic's message, so it ends only the
//! sequence (or `catchup_batch` group) the call was for, as an error would; the process
//! goes on and what the sequence held is released as usual.
//!
//! Invariants:
//! - A call that does not panic returns exactly what the proposer returned.
//! - Methods without an error channel answer a panic with their protocol default: no
//!   drafter KV taken or installed (the engine then frees the blocks itself), the protocol's
//!   default widths and capacities, no circuit.
//!
//! The proposer's own data may be left half-updated by a panic; the engine never calls it
//! again for the failed sequence except to free its state, which is guarded the same way.

use crate::error::panic_message;
use crate::speculative::{DraftProposer, ProposerError};
use crate::Result;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// A proposer whose panics become errors (see the module documentation).
pub(super) struct PanicGuard(pub Arc<dyn DraftProposer>);

/// Runs `f`, turning a panic into the error of `method`.
fn guarded<R>(method: &'static str, f: impl FnOnce() -> Result<R>) -> Result<R> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => Err(ProposerError::Failed {
            method: method.to_string(),
            message: format!(
                "panicked: {}",
                panic_message(payload.as_ref()).unwrap_or("a panic without a message")
            ),
        }
        .into()),
    }
}

/// Runs `f`, answering a panic with `default`.
fn or_default<R>(default: R, f: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(default)
}

/// Writes `impl DraftProposer for PanicGuard` from the protocol's method list: a method
/// with an error channel is run under [`guarded`], one without under [`or_default`] with
/// the protocol's default.
macro_rules! guard_every_method {
    ($($variant:ident => fn $name:ident ($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty,
        $answer:ident $(($default:expr))?;)+) => {
        #[allow(clippy::too_many_arguments, clippy::unused_unit)]
        impl DraftProposer for PanicGuard {
            $(
                fn $name(&self, $($arg: $ty),*) -> $ret {
                    guard_every_method!(@call $answer $(($default))?, self.0.$name($($arg),*), $name)
                }
            )+
        }
    };
    (@call fallible, $call:expr, $name:ident) => {
        guarded(stringify!($name), || $call)
    };
    (@call default($default:expr), $call:expr, $name:ident) => {
        or_default($default, || $call)
    };
}

crate::speculative::with_protocol_methods!(guard_every_method);
