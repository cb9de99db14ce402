//! The DFlash draft head (block diffusion drafting; arXiv 2602.06036, z-lab's
//! `dflash/model.py`): a few Qwen3 decoder layers that draft a whole block of γ - 1 tokens
//! in one forward, conditioned on the target's hiddens captured at several layers.
//!
//! Per committed position `q` the head keeps a context row `x_q = hidden_norm(fc(c_q))`, `c_q`
//! the captured layers' hiddens computed at `q` side by side, as keys and values in every
//! draft layer. To draft after the token `t` at position `p`, it runs the block `[t, mask ×
//! (γ - 1)]` at positions `p ..`, every block row attending to the whole context and the
//! whole block (non-causal), and takes the target's LM head's argmax at rows `1 ..`.
//!
//! One file per job: [`config`] (`config.json`, the layer ids), `load` (the tensors), `state`
//! (per-sequence rows and blocks), `forward` (the context rows and the block), `deferred`
//! (context rows kept while the policy declines, written in one forward later), `storage`
//! (projections re-stored in a block format), `head` (construction, the memory the head
//! owns, what it reports) and `proposer` (the protocol).
//! What it shares with the MTP and EAGLE-3 heads is the model layer's decoder layer
//! (`decoder_layer_with_input` writes the context rows' keys and values from `x`), its
//! scratch slots, the paged attention (given every block row the same context length) and
//! the block allocator; its paging is its own, since one table serves all its layers.
//!
//! Capture layers: z-lab's `target_layer_ids` index `hidden_states[id + 1]`, the output of
//! layer `id`, which is specdraft's convention as it is: `target_layer_ids` returns them
//! unchanged.

pub mod config;
mod deferred;
mod forward;
mod head;
mod load;
mod proposer;
mod state;
mod storage;

pub use config::DFlashConfig;
pub use deferred::DEFERRED_ROWS;
pub use head::{DFlashHead, DFLASH_MAX_BATCH};
pub use state::{DFlashState, DFLASH_BLOCK_ROWS};
