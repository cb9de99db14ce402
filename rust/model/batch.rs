//! The metadata of one batched forward, staged on the host in the layout the kernels read,
//! so that a forward needs a single host-to-device copy.
//!
//! Layout (u32): token ids `[rows]` | positions `[rows]` | KV slots `[rows]` | sequence of
//! each row `[rows]` | context length of each row `[rows]` | block table `[seqs, max_blocks]`
//! | with draft trees, each row's parent row `[rows]`.
//! Invariant: row `r` of a sequence holding `n` rows writes cache row `j = n + r`, slot
//! `block(j / B) * B + j % B`, and attends to `j + 1` rows, so causality within a
//! multi-token step is in the lengths. Its position is `j` too, except in a draft tree,
//! where it is `n + depth` (row 0 at depth 0, a row one deeper than its parent row): a node
//! sits where it would on its own path, and the tree mask hides every row off that path.

use super::sequence::KvSequence;
use super::target::BLOCK_SIZE;

/// What the forward needs besides the staged words.
pub(super) struct Plan {
    /// Sequence `i`'s rows are `row_offsets[i]..row_offsets[i + 1]`.
    pub row_offsets: Vec<usize>,
    /// Columns of the staged block table.
    pub max_blocks_per_seq: usize,
    /// Where the row parents start (in u32 words), when a sequence's rows form a tree.
    pub row_parent_at: Option<usize>,
}

/// Each sequence's draft tree, if any: `Some(parents)` gives the parent row (within the
/// sequence's rows) of each row after the first, `parents[k] <= k` for row `k + 1`; the
/// first row has none. `None` (the whole list, or a sequence's entry) is a chain.
pub(super) type RowTrees<'a> = Option<&'a [Option<&'a [usize]>]>;

/// Depth of each row of a tree (row 0 at depth 0) from its rows' parents.
fn depths(parents: &[usize]) -> Vec<usize> {
    let mut depth = Vec::with_capacity(parents.len() + 1);
    depth.push(0);
    for &p in parents {
        depth.push(depth[p] + 1);
    }
    depth
}

/// Fills `staging` for appending `tokens[i]` to `seqs[i]`, where sequence `i` gets `need[i]`
/// blocks from `fresh` (in order) on top of the ones it holds.
pub(super) fn stage(
    staging: &mut Vec<u32>,
    seqs: &[&mut KvSequence],
    tokens: &[&[u32]],
    need: &[usize],
    fresh: &[u32],
    trees: RowTrees<'_>,
) -> Plan {
    let tree_of = |i: usize| trees.and_then(|t| t[i]);
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
    for (i, (s, t)) in seqs.iter().zip(tokens).enumerate() {
        match tree_of(i) {
            Some(parents) => staging.extend(depths(parents).iter().map(|d| (s.len + d) as u32)),
            None => staging.extend((s.len..s.len + t.len()).map(|p| p as u32)),
        }
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
    let mut row_parent_at = None;
    if trees.is_some() {
        row_parent_at = Some(staging.len());
        let none = crate::backend::PagedAttentionArgs::NO_PARENT;
        for (i, t) in tokens.iter().enumerate() {
            let first = row_offsets[i] as u32;
            staging.extend((0..t.len()).map(|r| match (tree_of(i), r) {
                (Some(parents), 1..) => first + parents[r - 1] as u32,
                _ => none,
            }));
        }
    }
    Plan {
        row_offsets,
        max_blocks_per_seq: mbps,
        row_parent_at,
    }
}
