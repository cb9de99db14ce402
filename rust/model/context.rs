//! `ForwardContext`: what a forward (the target's or a proposer's) runs with.
//!
//! It holds shared handles (`Arc`), so building one per step is cheap and a copy kept past
//! the call (as the Python view does) stays valid.

use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::{ModelConfig, ModelLevers};
use std::sync::Arc;

/// The communicator a forward is given when its block is sharded across ranks
/// (`needs_comm`).
pub use crate::distributed::Communicator;

/// The backend, shared scratch, configuration and levers of one forward.
#[derive(Clone)]
pub struct ForwardContext<'a> {
    /// The backend every buffer belongs to.
    pub gpu: Arc<dyn GpuBackend>,
    /// The shared forward scratch (owned by the target model while it runs).
    pub buffers: Arc<BufferArena>,
    /// The target model's configuration.
    pub config: Arc<ModelConfig>,
    /// The levers, resolved once.
    pub levers: ModelLevers,
    /// The communicator on a multi-rank serve; `None` on one rank.
    pub comm: Option<&'a dyn Communicator>,
    /// The captured rows paired row for row with the `hiddens` argument of the call it is
    /// passed to: BF16 `[rows, n * hidden_size]`, the hidden after each of the proposer's
    /// `target_layer_ids` side by side (`prefill_drafter`: `[P, n * hidden_size]`, row `i`
    /// paired with `hiddens` row `i`; `catchup_drafter` / `catchup_batch`: paired with their
    /// hiddens). `None` when the proposer names no layers or the call has no hiddens.
    pub target_hidden_stack: Option<DevicePtr>,
    /// For `propose_batch`, one entry per sequence of the batch, in order: the rows that
    /// sequence's `propose` would get as its `target_hidden_stack` (every token committed
    /// since its previous propose, oldest first, the last one paired with its last token).
    /// `None` when the proposer names no layers, and in every other call.
    pub target_hidden_stacks: Option<&'a [DevicePtr]>,
}

impl<'a> ForwardContext<'a> {
    /// A single-rank context.
    pub fn new(
        gpu: Arc<dyn GpuBackend>,
        buffers: Arc<BufferArena>,
        config: Arc<ModelConfig>,
        levers: ModelLevers,
    ) -> Self {
        ForwardContext {
            gpu,
            buffers,
            config,
            levers,
            comm: None,
            target_hidden_stack: None,
            target_hidden_stacks: None,
        }
    }
}
