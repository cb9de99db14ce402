//! The scheduler's block arithmetic, kept apart from the sequences so it can be checked on
//! its own: what a step's rows cost in blocks, and how the blocks left over are shared out
//! as room for drafts.
//!
//! Invariant: the grants never take more blocks than the pool has free, and every sequence
//! gets at least the rows it needs (the caller has preempted until those fit).

use super::super::KvPoolStatus;

/// What one running sequence asks of the pool this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Demand {
    /// Rows its KV holds now.
    pub kv_len: usize,
    /// Rows it must append (a prefill chunk, or the one row of a decode step).
    pub need: usize,
    /// Rows it would like to append on top (drafts).
    pub extra: usize,
}

/// Blocks `d`'s needed rows take beyond those it holds.
pub(crate) fn new_blocks(pool: &KvPoolStatus, d: &Demand) -> usize {
    pool.blocks_for(d.kv_len + d.need) - pool.blocks_for(d.kv_len)
}

/// Blocks every demand's needed rows take beyond those held.
pub(crate) fn total_new_blocks(pool: &KvPoolStatus, demands: &[Demand]) -> usize {
    demands.iter().map(|d| new_blocks(pool, d)).sum()
}

/// Rows each demand may append: its need, plus as many of its extra rows as the free space
/// of its last block and the blocks left over allow, handed out in order (oldest first).
/// The caller guarantees the needs fit (`total_new_blocks <= pool.num_free`).
pub(crate) fn grants(pool: &KvPoolStatus, demands: &[Demand]) -> Vec<usize> {
    let mut left = pool
        .num_free
        .saturating_sub(total_new_blocks(pool, demands));
    demands
        .iter()
        .map(|d| {
            let base = d.kv_len + d.need;
            let held = pool.blocks_for(base);
            // Rows the blocks it will hold anyway still have room for, then whole blocks.
            let slack = held * pool.block_size - base;
            let room = slack.saturating_add(left.saturating_mul(pool.block_size));
            let extra = d.extra.min(room);
            left = left.saturating_sub(pool.blocks_for(base + extra) - held);
            d.need + extra
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(free: usize) -> KvPoolStatus {
        KvPoolStatus {
            block_size: 4,
            num_blocks: 10,
            num_free: free,
        }
    }

    #[test]
    fn a_step_costs_the_blocks_its_rows_cross_into() {
        let p = pool(10);
        let d = |kv_len, need| Demand {
            kv_len,
            need,
            extra: 0,
        };
        // 3 rows held in one block: the 4th row fits, the 5th takes a block.
        assert_eq!(new_blocks(&p, &d(3, 1)), 0);
        assert_eq!(new_blocks(&p, &d(3, 2)), 1);
        assert_eq!(new_blocks(&p, &d(0, 9)), 3);
        assert_eq!(total_new_blocks(&p, &[d(3, 2), d(0, 9), d(4, 0)]), 4);
    }

    #[test]
    fn grants_share_leftover_blocks_oldest_first_and_never_overdraw() {
        // Needs take 1 block (the second demand's row 9); 2 blocks are left over.
        let demands = [
            Demand {
                kv_len: 2,
                need: 1,
                extra: 10,
            },
            Demand {
                kv_len: 8,
                need: 1,
                extra: 10,
            },
        ];
        let g = grants(&pool(3), &demands);
        // The first: 3 rows -> slack 1 in its block, plus 2 whole blocks = 9 extra rows.
        // The second gets the 3 rows of slack in its new block and nothing more.
        assert_eq!(g, vec![1 + 9, 1 + 3]);
        let p = pool(3);
        let used: usize = demands
            .iter()
            .zip(&g)
            .map(|(d, &rows)| p.blocks_for(d.kv_len + rows) - p.blocks_for(d.kv_len))
            .sum();
        assert_eq!(used, 3);
        // Nothing free: only the slack of the blocks already held.
        assert_eq!(grants(&pool(0), &demands[..1]), vec![1 + 1]);
    }
}
