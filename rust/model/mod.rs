//! The model layer's shared types: the configuration, the levers, the forward context.
//!
//! Invariants:
//! - A [`ModelConfig`] that exists is consistent: heads divide the hidden size (or an
//!   explicit `head_dim` is given), KV heads divide the attention heads, sizes are non-zero.
//! - [`ModelLevers`] is resolved once (from `SPECDRAFT_*` variables or by hand) and then
//!   copied; nothing reads the environment on the hot path.

mod config;
mod context;
mod levers;

pub use config::{ConfigError, ModelConfig, ModelFamily, MoeConfig, RopeScaling};
pub use context::{Communicator, ForwardContext};
pub use levers::ModelLevers;
