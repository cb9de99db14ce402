//! The types one forward of the target model takes and returns: a sequence's KV handle,
//! the choice of logit rows, and the output buffers.
//!
//! Invariant: a [`KvSequence`] holds exactly `ceil(len / BLOCK_SIZE)` blocks of the pool of
//! the model that created it (`model_id`), and is only ever changed by that model.

use crate::backend::DevicePtr;

/// One sequence's KV: block ids from the model's pool and the number of rows written.
#[derive(Debug, Default)]
pub struct KvSequence {
    pub(super) blocks: Vec<u32>,
    pub(super) len: usize,
    pub(super) model_id: u64,
    /// Unique among the model's sequences: rank 0 names the sequence by it to its workers.
    pub(super) id: u64,
}

impl KvSequence {
    /// Rows (tokens) in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no row is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sequence's id, unique among those of the model that created it.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The block ids, in row order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }
}

/// Which rows of a forward get logits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogitRows {
    /// Every row (verification reads all of them).
    #[default]
    All,
    /// Only the last row of each sequence (a prefill needs no more, and skips the LM head
    /// on every other row).
    LastPerSequence,
}

/// What a forward produced; the buffers belong to the model and stay valid until the next
/// forward.
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardOutput {
    /// Rows of all sequences together.
    pub rows: usize,
    /// Sequence `i`'s rows are `row_offsets[i]..row_offsets[i + 1]`.
    pub row_offsets: Vec<usize>,
    /// f32 `[logits_rows, vocab]`.
    pub logits: DevicePtr,
    /// Rows of `logits`: `rows` for [`LogitRows::All`]; the number of sequences for
    /// [`LogitRows::LastPerSequence`], row `i` being sequence `i`'s last row.
    pub logits_rows: usize,
    /// u32 `[logits_rows]`: room for one token a logits row, which the forward leaves
    /// unwritten, so that a caller can pick on the device (the `argmax` kernel) and download
    /// the picks instead of the logits. Overwritten by whatever writes it after the next
    /// forward, as `logits` is.
    pub picks: DevicePtr,
    /// BF16 `[rows, hidden]`: each row's hidden state before the final norm.
    pub hiddens: DevicePtr,
    /// BF16 `[rows, n * hidden]`: the hidden after each of the `n` capture layers the forward
    /// named, side by side in the order named; `None` when it named none.
    pub hidden_stack: Option<DevicePtr>,
}
