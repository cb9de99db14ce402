//! `BlockAllocator`: fixed-size KV blocks with a free list and per-block reference counts.
//!
//! The allocator hands out block ids only; where a block's rows live (which device buffer,
//! which stride) is the owner's business. Two sequences can share a prefix block by
//! `retain`ing it; it returns to the pool when the last holder releases it.

use super::MemoryError;
use std::sync::Mutex;

struct Pool {
    free: Vec<u32>,
    refcount: Vec<u32>,
}

/// A pool of `num_blocks` KV blocks of `block_size` rows each.
pub struct BlockAllocator {
    block_size: usize,
    pool: Mutex<Pool>,
}

impl BlockAllocator {
    /// A pool of `num_blocks` blocks of `block_size` rows. Both must be non-zero.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self, MemoryError> {
        if num_blocks == 0 || block_size == 0 {
            return Err(MemoryError::InvalidSize(format!(
                "a block pool needs at least one block of at least one row (got {num_blocks} blocks of {block_size} rows)"
            )));
        }
        if num_blocks > u32::MAX as usize {
            return Err(MemoryError::InvalidSize(format!(
                "{num_blocks} blocks do not fit u32 block ids"
            )));
        }
        // Reversed so that `pop` hands out low ids first.
        let free = (0..num_blocks as u32).rev().collect();
        Ok(BlockAllocator {
            block_size,
            pool: Mutex::new(Pool {
                free,
                refcount: vec![0; num_blocks],
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        // Every mutation below validates first and then applies, so a poisoned lock still
        // guards a consistent pool.
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rows per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.lock().refcount.len()
    }

    /// Blocks currently free.
    pub fn num_free(&self) -> usize {
        self.lock().free.len()
    }

    /// Blocks needed to hold `rows` rows.
    pub fn blocks_for(&self, rows: usize) -> usize {
        rows.div_ceil(self.block_size)
    }

    /// The reference count of `block` (0 when free).
    pub fn refcount(&self, block: u32) -> Result<u32, MemoryError> {
        let pool = self.lock();
        pool.refcount
            .get(block as usize)
            .copied()
            .ok_or(MemoryError::InvalidBlock {
                block,
                total: pool.refcount.len(),
            })
    }

    /// Allocates `n` blocks, each with reference count 1; all or nothing.
    pub fn alloc(&self, n: usize) -> Result<Vec<u32>, MemoryError> {
        let mut pool = self.lock();
        if n > pool.free.len() {
            return Err(MemoryError::Exhausted {
                requested: n,
                free: pool.free.len(),
                total: pool.refcount.len(),
            });
        }
        let at = pool.free.len() - n;
        let mut blocks = pool.free.split_off(at);
        blocks.reverse();
        for &b in &blocks {
            pool.refcount[b as usize] = 1;
        }
        Ok(blocks)
    }

    fn check_held(pool: &Pool, blocks: &[u32]) -> Result<(), MemoryError> {
        for &b in blocks {
            match pool.refcount.get(b as usize) {
                None => {
                    return Err(MemoryError::InvalidBlock {
                        block: b,
                        total: pool.refcount.len(),
                    })
                }
                Some(0) => return Err(MemoryError::NotAllocated { block: b }),
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Adds a holder to each block (for sharing a prefix). Every block must be allocated;
    /// on error nothing changes.
    pub fn retain(&self, blocks: &[u32]) -> Result<(), MemoryError> {
        let mut pool = self.lock();
        Self::check_held(&pool, blocks)?;
        for &b in blocks {
            pool.refcount[b as usize] += 1;
        }
        Ok(())
    }

    /// Drops one holder of each block; a block whose count reaches zero returns to the pool.
    /// Every block must be held as often as it appears in `blocks`; on error nothing changes.
    pub fn release(&self, blocks: &[u32]) -> Result<(), MemoryError> {
        let mut pool = self.lock();
        Self::check_held(&pool, blocks)?;
        let mut wanted = std::collections::HashMap::<u32, u32>::new();
        for &b in blocks {
            *wanted.entry(b).or_default() += 1;
        }
        for (&b, &n) in &wanted {
            if pool.refcount[b as usize] < n {
                return Err(MemoryError::NotAllocated { block: b });
            }
        }
        for &b in blocks {
            let count = &mut pool.refcount[b as usize];
            *count -= 1;
            if *count == 0 {
                pool.free.push(b);
            }
        }
        Ok(())
    }

    /// Same as [`BlockAllocator::release`]: the holder gives its blocks back.
    pub fn free(&self, blocks: &[u32]) -> Result<(), MemoryError> {
        self.release(blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exhaustion_names_counts_and_leaves_pool_unchanged() {
        let a = BlockAllocator::new(4, 16).unwrap();
        let got = a.alloc(3).unwrap();
        let err = a.alloc(2).unwrap_err();
        assert_eq!(
            err,
            MemoryError::Exhausted {
                requested: 2,
                free: 1,
                total: 4
            }
        );
        assert!(err.to_string().contains("asked for 2 blocks, 1 of 4 free"));
        assert_eq!(a.num_free(), 1);
        a.free(&got).unwrap();
        assert_eq!(a.num_free(), 4);
    }

    #[test]
    fn release_errors_leave_pool_unchanged() {
        let a = BlockAllocator::new(4, 16).unwrap();
        let b = a.alloc(2).unwrap();
        assert!(matches!(
            a.release(&[b[0], b[0]]),
            Err(MemoryError::NotAllocated { .. })
        ));
        assert!(matches!(
            a.release(&[b[0], 9]),
            Err(MemoryError::InvalidBlock { .. })
        ));
        assert_eq!(a.refcount(b[0]).unwrap(), 1);
        assert_eq!(a.num_free(), 2);
        a.free(&b).unwrap();
        assert!(matches!(a.free(&b), Err(MemoryError::NotAllocated { .. })));
    }

    #[test]
    fn shared_block_returns_after_last_holder() {
        let a = BlockAllocator::new(2, 16).unwrap();
        let b = a.alloc(1).unwrap();
        a.retain(&b).unwrap();
        a.release(&b).unwrap();
        assert_eq!(a.num_free(), 1);
        a.release(&b).unwrap();
        assert_eq!(a.num_free(), 2);
        assert_eq!(a.blocks_for(17), 2);
        assert_eq!(a.blocks_for(0), 0);
    }
}
