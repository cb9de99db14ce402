//! `Target`: what the engine needs from the model that verifies drafts.
//!
//! The trait mirrors the target model's own API one to one, so the adapter for the real
//! model is a thin forwarding impl and the engine can be tested against small deterministic
//! targets (see [`TableTarget`](super::testing::TableTarget)).
//!
//! Contract the engine relies on:
//! - `forward` appends `tokens[i]` to `seqs[i]` (positions continue from the sequence's
//!   length) and returns one logits row (f32 `[vocab]`) and one hidden row (BF16
//!   `[hidden]`, before the final norm) per input token, sequence after sequence;
//!   `row_offsets[i]` is the first row of sequence `i`.
//! - The output buffers stay valid until the next `forward` and belong to the target: the
//!   engine copies what it keeps past that point.
//! - `trim` shortens a sequence's KV to `new_len` tokens; `free_sequence` releases it.
//! - `forward_capturing` with capture layers also returns, in `hidden_stack`, the hidden
//!   after each of those decoder layers for every row (see [`crate::model::check_layer_ids`]
//!   for what an id names); with none it is the plain forward. A target that cannot
//!   capture says so in `check_capture`, which the engine asks once, when it is built.
//! - `forward_tree` is `forward_capturing` (every row's logits) where a sequence's rows
//!   may form a draft tree: row 0 the last verified token, each later row a child of an
//!   earlier one, attending to the prefix and its ancestors only, at its depth's position.
//!   Its rows still take the sequence's next KV rows in row order; `compact` then keeps one
//!   path (moved down after the prefix, the rest dropped), leaving the KV a plain forward of
//!   that path would. A target that cannot (`supports_trees` false, the default) only
//!   takes chains there.
//! - When `kv_pool` reports a paged pool, a sequence of `n` tokens holds exactly
//!   `ceil(n / block_size)` of its blocks, taken by `forward` and returned by `trim` and
//!   `free_sequence`; the scheduler plans every forward from these figures.

use crate::backend::{DevicePtr, GpuBackend};
use crate::memory::BufferArena;
use crate::model::ModelConfig;
use crate::Result;
use std::sync::Arc;

/// The output of one target forward over one or more sequences.
#[derive(Clone, Debug, PartialEq)]
pub struct TargetOutput {
    /// Rows in total (the sum of the token counts).
    pub rows: usize,
    /// First row of each sequence, in input order.
    pub row_offsets: Vec<usize>,
    /// f32 `[rows, vocab_size]`, or `[sequences, vocab_size]` (row `i` the last row of
    /// sequence `i`) when `last_logits_only`.
    pub logits: DevicePtr,
    /// Whether `logits` holds only each sequence's last row (see [`Target::forward_last`]).
    pub last_logits_only: bool,
    /// BF16 `[rows, hidden_size]`, each row the hidden state before the final norm.
    pub hiddens: DevicePtr,
    /// BF16 `[rows, n * hidden_size]`: the hidden after each of the `n` layers a
    /// [`Target::forward_capturing`] named, side by side in the order named; `None` when the
    /// forward named none.
    pub hidden_stack: Option<DevicePtr>,
    /// u32 `[rows]`: room for one token a logits row, where the engine's greedy verification
    /// writes each row's argmax on the device and then downloads only those picks; `None`
    /// when the target has no such room, and then the engine downloads the logits.
    pub picks: Option<DevicePtr>,
}

/// A paged KV pool's shape and how much of it is free at the moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvPoolStatus {
    /// Rows (tokens) a block holds.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Blocks free now.
    pub num_free: usize,
}

impl KvPoolStatus {
    /// Blocks a sequence of `rows` tokens holds.
    pub fn blocks_for(&self, rows: usize) -> usize {
        rows.div_ceil(self.block_size.max(1))
    }

    /// Rows the whole pool holds.
    pub fn capacity_rows(&self) -> usize {
        self.num_blocks.saturating_mul(self.block_size)
    }
}

/// The model that verifies drafts.
pub trait Target: Send + Sync {
    /// The KV state of one sequence.
    type KvSequence: Send;

    /// The model's configuration (vocabulary, hidden size, EOS ids).
    fn config(&self) -> &Arc<ModelConfig>;
    /// The backend every buffer lives on.
    fn gpu(&self) -> &Arc<dyn GpuBackend>;
    /// The longest sequence (prompt plus output) the model holds.
    fn max_seq_len(&self) -> usize;
    /// A new, empty sequence.
    fn new_sequence(&self) -> Self::KvSequence;
    /// Tokens held in `seq`'s KV.
    fn seq_len(&self, seq: &Self::KvSequence) -> usize;
    /// Appends `tokens[i]` to `seqs[i]` and returns the logits and hiddens of every row.
    fn forward(
        &self,
        seqs: &mut [&mut Self::KvSequence],
        tokens: &[&[u32]],
    ) -> Result<TargetOutput>;
    /// [`Target::forward`] where only each sequence's last row needs logits (a prefill), so
    /// a target may skip the LM head on the other rows and set `last_logits_only`. Hiddens
    /// are still returned for every row. The default computes every row.
    fn forward_last(
        &self,
        seqs: &mut [&mut Self::KvSequence],
        tokens: &[&[u32]],
    ) -> Result<TargetOutput> {
        self.forward(seqs, tokens)
    }
    /// Whether this target can capture the hidden after each decoder layer in `layers`
    /// (empty: nothing to capture, always fine); the message says why not. The default
    /// captures nothing, so it refuses any layer.
    fn check_capture(&self, layers: &[usize]) -> std::result::Result<(), String> {
        match layers {
            [] => Ok(()),
            _ => Err("this target cannot capture layer hiddens".into()),
        }
    }
    /// [`Target::forward`] (or [`Target::forward_last`] when `last_logits_only`) that also
    /// captures the hidden after each decoder layer in `layers` for every row, into the
    /// output's `hidden_stack`. With no layers it is that forward; the default captures
    /// nothing, so it refuses any layer (see [`Target::check_capture`]).
    fn forward_capturing(
        &self,
        seqs: &mut [&mut Self::KvSequence],
        tokens: &[&[u32]],
        last_logits_only: bool,
        layers: &[usize],
    ) -> Result<TargetOutput> {
        if let Err(message) = self.check_capture(layers) {
            return Err(crate::engine::EngineError::InvalidArgument {
                what: "target_layer_ids",
                message,
            }
            .into());
        }
        if last_logits_only {
            self.forward_last(seqs, tokens)
        } else {
            self.forward(seqs, tokens)
        }
    }
    /// Whether [`Target::forward_tree`] and [`Target::compact`] take draft trees; the engine
    /// asks once, when it is built. The default takes none.
    fn supports_trees(&self) -> bool {
        false
    }
    /// A verify forward (every row's logits, capturing `layers`) where `trees[i] =
    /// Some(parents)` makes sequence `i`'s rows a draft tree: row `k + 1`'s parent is row
    /// `parents[k]` (`<= k`), row 0 the root. `None` is a chain. The default takes chains
    /// only.
    fn forward_tree(
        &self,
        seqs: &mut [&mut Self::KvSequence],
        tokens: &[&[u32]],
        trees: &[Option<&[usize]>],
        layers: &[usize],
    ) -> Result<TargetOutput> {
        if trees.iter().any(Option::is_some) {
            return Err(crate::engine::EngineError::InvalidArgument {
                what: "draft tree",
                message: "this target verifies chains only".into(),
            }
            .into());
        }
        self.forward_capturing(seqs, tokens, false, layers)
    }
    /// Moves `seq`'s KV rows `rows` (increasing, each at or after its destination) to rows
    /// `start..start + rows.len()` in order, and trims it to `start + rows.len()`: the
    /// accepted path of a draft tree after its verify forward. The default can only trim
    /// (rows already in place).
    fn compact(&self, seq: &mut Self::KvSequence, start: usize, rows: &[usize]) -> Result<()> {
        if let Some((k, &r)) = rows.iter().enumerate().find(|(k, &r)| r != start + k) {
            return Err(crate::engine::EngineError::InvalidArgument {
                what: "compact",
                message: format!("this target cannot move KV row {r} to row {}", start + k),
            }
            .into());
        }
        self.trim(seq, start + rows.len())
    }
    /// Shortens `seq` to its first `new_len` tokens.
    fn trim(&self, seq: &mut Self::KvSequence, new_len: usize) -> Result<()>;
    /// Releases `seq`'s KV; the sequence is empty afterwards.
    fn free_sequence(&self, seq: &mut Self::KvSequence) -> Result<()>;
    /// The shared forward scratch; its `max_rows` bounds the rows of one forward
    /// (0 or `usize::MAX`: unbounded).
    fn buffers(&self) -> &Arc<BufferArena>;
    /// On rank 0 of a target that spans several ranks, the communicator it announces its
    /// forwards on, which the engine also gives a proposer that `needs_comm` (see
    /// [`super::ranks`]); `None` elsewhere (the default).
    fn leader_comm(&self) -> Option<Arc<dyn crate::distributed::Communicator>> {
        None
    }
    /// The paged KV pool sequences take their blocks from, or `None` when the target's KV
    /// is not bounded by one (the default).
    fn kv_pool(&self) -> Option<KvPoolStatus> {
        None
    }
}
