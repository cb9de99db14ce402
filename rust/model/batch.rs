//! The metadata of one batched forward, staged on the host in the layout the kernels read,
//! so that a forward needs a single host-to-device copy.
//!
//! Layout (u32): token ids `[rows]` | positions `[rows]` | KV slots `[rows]` | sequence of
//! each row `[rows]` | context length of each row `[rows]` | block table `[seqs, max_blocks]`.
//! Invariant: row `r` of sequence `i` at position `p` writes slot `block(p / B) * B + p % B`
//! and attends to `p + 1` rows, so causality within a multi-token step is in the lengths.

use super::sequence::KvSequence;
use super::target::BLOCK_SIZE;

/// What the forward needs besides the staged words.
pub(super) struct Plan {
    /// Sequence `i`'s rows are `row_offsets[i]..row_offsets[i + 1]`.
    pub row_offsets: Vec<usize>,
    /// Columns of the staged block table.
    pub max_blocks_per_seq: usize,
}

/// Fills `staging` for appending `tokens[i]` to `seqs[i]`, where sequence `i` gets `need[i]`
/// blocks from `fresh` (in order) on top of the ones it holds.
pub(super) fn stage(
    staging: &mut Vec<u32>,
    seqs: &[&mut KvSequence],
    tokens: &[&[u32]],
    need: &[usize],
    fresh: &[u32],
) -> Plan {
    let block_of = |i: usize, b: usize, base: usize| -> u32 {
        let s = &seqs[i];
        if b < s.blocks.len() {
            s.blocks[b]
        } else {
            fresh[base + b - s.blocks.len()]
        }
    };
    let mbps = seqs
        .iter()
        .zip(need)
        .map(|(s, n)| s.blocks.len() + n)
        .max()
        .unwrap_or(1)
        .max(1);
    // One staging buffer, one upload: ids | positions | slots | row_seq | ctx_len | table.
    staging.clear();
    for t in tokens {
        staging.extend_from_slice(t);
    }
    let mut row_offsets = Vec::with_capacity(seqs.len() + 1);
    row_offsets.push(0);
    for (s, t) in seqs.iter().zip(tokens) {
        staging.extend((s.len..s.len + t.len()).map(|p| p as u32));
        row_offsets.push(row_offsets.last().copied().unwrap_or(0) + t.len());
    }
    let mut base = 0;
    let mut bases = Vec::with_capacity(seqs.len());
    for n in need {
        bases.push(base);
        base += n;
    }
    for (i, (s, t)) in seqs.iter().zip(tokens).enumerate() {
        for p in s.len..s.len + t.len() {
            staging.push(
                block_of(i, p / BLOCK_SIZE, bases[i]) * BLOCK_SIZE as u32 + (p % BLOCK_SIZE) as u32,
            );
        }
    }
    for (i, t) in tokens.iter().enumerate() {
        staging.extend(std::iter::repeat_n(i as u32, t.len()));
    }
    for (s, t) in seqs.iter().zip(tokens) {
        staging.extend((s.len + 1..=s.len + t.len()).map(|p| p as u32));
    }
    for (i, (s, n)) in seqs.iter().zip(need).enumerate() {
        let have = s.blocks.len() + n;
        staging.extend((0..mbps).map(|b| {
            if b < have {
                block_of(i, b, bases[i])
            } else {
                0
            }
        }));
    }
    Plan {
        row_offsets,
        max_blocks_per_seq: mbps,
    }
}
