//! Draft trees in batches through the engine: under the tree draft shape, sequences that
//! propose together are asked `propose_tree_batch` (the real `MtpHead`, growing trees, on a
//! table target); a sequence under a grammar, and a group the proposer does not batch,
//! are asked `propose_tree` alone; greedy output equals plain greedy output either way;
//! nothing leaks.

mod engine_common;
mod mtp_common;

use engine_common::counted::Counted;
use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{DraftPolicyKind, GenerateRequest, GrammarMatcher, SpecEngine};
use specdraft::model::ModelLevers;
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization};
use specdraft::Result;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A grammar that allows every token: greedy output stays plain greedy output.
struct AllowAll(usize);

impl GrammarMatcher for AllowAll {
    fn fill_mask(&mut self, mask: &mut [i32]) -> Result<()> {
        for t in 0..self.0 {
            mask[t / 32] |= 1 << (t % 32);
        }
        Ok(())
    }
    fn advance(&mut self, _token: u32) -> Result<()> {
        Ok(())
    }
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 2, 3, 4, 5, 1, 2, 3],
        vec![50, 60, 70, 80, 50, 60],
        vec![7; 9],
        vec![33, 34, 35, 36, 37],
    ]
}

fn tokens(g: specdraft::engine::Generation) -> Vec<Vec<u32>> {
    g.results
        .into_iter()
        .map(|r| {
            assert!(r.error.is_none(), "{:?}", r.error);
            r.tokens
        })
        .collect()
}

#[test]
fn sequences_that_propose_together_grow_their_trees_in_one_batch() {
    let dir = mtp_common::scratch_dir("engine_tree_batch");
    mtp_common::write_checkpoint(&dir, "deepseek_v3", 5);
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let levers = ModelLevers::default();
    let head = Arc::new(
        MtpHead::from_checkpoint(
            &dir,
            gpu.clone(),
            MtpQuantization::Bf16,
            0,
            512,
            256,
            &levers,
        )
        .unwrap(),
    );
    head.set_grow_trees(true);
    let target =
        Arc::new(TableTarget::new(gpu.clone(), mtp_common::VOCAB, 512, 64, 2, 0.1).unwrap());
    let plain = SpecEngine::new(target.clone(), None, 0).unwrap();
    let base = tokens(plain.generate(engine_common::requests(&prompts(), 24)));
    for batches in [true, false] {
        let counted = Arc::new(Counted::new(head.clone(), batches));
        let engine = SpecEngine::new(
            target.clone(),
            Some(counted.clone() as Arc<dyn DraftProposer>),
            5,
        )
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed);
        assert!(engine.drafts_trees());
        let g = engine.generate(engine_common::requests(&prompts(), 24));
        assert!(g.metrics.drafted > 0);
        assert_eq!(tokens(g), base, "batches {batches}");
        let (b, seqs, lone) = (
            counted.tree_batches.load(Ordering::Relaxed),
            counted.batched_sequences.load(Ordering::Relaxed),
            counted.lone_trees.load(Ordering::Relaxed),
        );
        if batches {
            // Four sequences step together, apart from the steps near their ends.
            assert!(
                b > 0 && seqs > 3 * b,
                "{b} tree batches of {seqs} sequences"
            );
            assert_eq!(lone, 0, "a batching proposer was asked for lone trees");
        } else {
            assert_eq!(b, 0);
            assert!(
                lone > 0,
                "a group the proposer did not batch was not asked alone"
            );
        }
        // A sequence under a grammar proposes its tree alone, beside a batch.
        counted.lone_trees.store(0, Ordering::Relaxed);
        let mut requests = engine_common::requests(&prompts(), 12);
        requests[0] = GenerateRequest::new(prompts()[0].clone(), 12)
            .with_grammar(Box::new(AllowAll(mtp_common::VOCAB)));
        let g = engine.generate(requests);
        let got = tokens(g);
        for (i, t) in got.iter().enumerate() {
            assert_eq!(t[..], base[i][..12], "grammar run, prompt {i}");
        }
        assert!(counted.lone_trees.load(Ordering::Relaxed) > 0);
        assert_eq!(target.live_sequences(), 0);
    }
    drop((plain, target));
    let (total, free) = head.kv_blocks();
    assert_eq!(total, free, "drafter KV blocks still held");
    drop(head);
    assert_eq!(gpu.ledger().live_count(), 0);
}
