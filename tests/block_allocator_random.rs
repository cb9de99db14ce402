//! The KV block pool under thousands of random alloc / retain / release operations.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::memory::{BlockAllocator, MemoryError};
use std::collections::HashMap;

#[test]
fn never_hands_out_a_held_block_and_ends_empty() {
    let pool = BlockAllocator::new(64, 16).unwrap();
    let mut rng = SmallRng::seed_from_u64(11);
    // Our model of the pool: holders per block.
    let mut holders: HashMap<u32, u32> = HashMap::new();
    let mut sequences: Vec<Vec<u32>> = Vec::new();
    for _ in 0..20_000 {
        match rng.random_range(0..4) {
            0 => {
                let n = rng.random_range(1..8);
                let free_before = pool.num_free();
                match pool.alloc(n) {
                    Ok(blocks) => {
                        assert_eq!(blocks.len(), n);
                        for &b in &blocks {
                            assert!(!holders.contains_key(&b), "block {b} handed out while held");
                            holders.insert(b, 1);
                        }
                        sequences.push(blocks);
                    }
                    Err(MemoryError::Exhausted {
                        requested,
                        free,
                        total,
                    }) => {
                        assert_eq!((requested, free, total), (n, free_before, 64));
                        assert!(n > free_before);
                        assert_eq!(
                            pool.num_free(),
                            free_before,
                            "a failed alloc changed the pool"
                        );
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            1 if !sequences.is_empty() => {
                // Share a prefix of another sequence's blocks.
                let src = &sequences[rng.random_range(0..sequences.len())];
                let prefix: Vec<u32> = src[..rng.random_range(1..=src.len())].to_vec();
                pool.retain(&prefix).unwrap();
                for b in &prefix {
                    *holders.get_mut(b).unwrap() += 1;
                }
                sequences.push(prefix);
            }
            _ if !sequences.is_empty() => {
                let seq = sequences.swap_remove(rng.random_range(0..sequences.len()));
                pool.release(&seq).unwrap();
                for b in &seq {
                    let h = holders.get_mut(b).unwrap();
                    *h -= 1;
                    if *h == 0 {
                        holders.remove(b);
                    }
                }
            }
            _ => {}
        }
        assert_eq!(pool.num_free(), 64 - holders.len());
        for (&b, &h) in &holders {
            assert_eq!(pool.refcount(b).unwrap(), h);
        }
    }
    for seq in sequences {
        pool.release(&seq).unwrap();
    }
    assert_eq!(pool.num_free(), 64);
    for b in 0..64 {
        assert_eq!(pool.refcount(b).unwrap(), 0);
    }
}

#[test]
fn invalid_sizes_are_errors() {
    assert!(BlockAllocator::new(0, 16).is_err());
    assert!(BlockAllocator::new(4, 0).is_err());
    let pool = BlockAllocator::new(4, 16).unwrap();
    assert_eq!(pool.alloc(0).unwrap(), Vec::<u32>::new());
    assert!(matches!(
        pool.retain(&[7]),
        Err(MemoryError::InvalidBlock { block: 7, total: 4 })
    ));
    assert!(matches!(
        pool.retain(&[1]),
        Err(MemoryError::NotAllocated { block: 1 })
    ));
}
