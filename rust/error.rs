//! The crate-wide error: every layer's own error folded into one enum.
//!
//! Each layer has its own `thiserror` enum ([`BackendError`], [`DistributedError`], [`MemoryError`],
//! [`ConfigError`], [`ModelError`], [`ProposerError`], [`EngineError`]); `?` converts any
//! of them into [`Error`], which is the `Result` type the `DraftProposer` protocol uses.
//! Each variant is transparent: its message is the layer's own, and an error that wraps
//! another (an engine step that failed in the backend) keeps it as its `source`.

use thiserror::Error as ThisError;

pub use crate::backend::BackendError;
pub use crate::distributed::DistributedError;
pub use crate::engine::EngineError;
pub use crate::memory::MemoryError;
pub use crate::model::ConfigError;
pub use crate::model::ModelError;
pub use crate::speculative::ProposerError;

/// Any error specdraft returns.
///
/// `Clone` so one failure can be reported on every sequence it ended.
#[derive(Debug, ThisError, Clone, PartialEq)]
pub enum Error {
    /// Device memory, copies, streams or kernels failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A collective or the command channel between ranks failed.
    #[error(transparent)]
    Distributed(#[from] DistributedError),
    /// The KV block pool or the forward scratch failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A model configuration could not be read or is inconsistent.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A checkpoint could not be loaded, or a loaded model was misused.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A proposer broke its contract or failed.
    #[error(transparent)]
    Proposer(#[from] ProposerError),
    /// A generation request was invalid or the engine loop failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// `Result` with [`Error`], as the protocol's signatures use it.
pub type Result<T> = std::result::Result<T, Error>;

/// The message a caught panic carried: `panic!`'s text, whether a literal or formatted.
/// `None` for any other payload (`std::panic::panic_any` takes any type). Every place that
/// turns a caught panic into an error or a report reads the message here.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
}

#[cfg(test)]
mod tests {
    use super::panic_message;
    use std::panic::catch_unwind;

    #[test]
    fn a_panics_message_is_its_text_literal_or_formatted_and_none_otherwise() {
        let literal = catch_unwind(|| panic!("a literal")).unwrap_err();
        assert_eq!(panic_message(literal.as_ref()), Some("a literal"));
        let n = 7;
        let formatted = catch_unwind(|| panic!("formatted {n}")).unwrap_err();
        assert_eq!(panic_message(formatted.as_ref()), Some("formatted 7"));
        let other = catch_unwind(|| std::panic::panic_any(5u32)).unwrap_err();
        assert_eq!(panic_message(other.as_ref()), None);
    }
}
