//! Grammar-constrained generation: the target's pick is masked, the mask reaches
//! `propose`, and every emitted token is one the grammar allowed at its position.

mod engine_common;

use engine_common::*;
use specdraft::engine::{
    FinishReason, GenerateRequest, GrammarMatcher, SamplingParams, SpecEngine,
};
use specdraft::speculative::{bitmask_allows, DraftProposer, PromptLookup};
use specdraft::Result;
use std::sync::{Arc, Mutex};

/// Allows, at step k, the tokens t with (t + k) % 3 == 0, for `limit` steps; then nothing.
/// It records what it consumed and fails on a token it did not allow.
struct Cyclic {
    step: usize,
    limit: usize,
    vocab: u32,
    seen: Arc<Mutex<Vec<u32>>>,
}

impl Cyclic {
    fn allows(&self, t: u32) -> bool {
        self.step < self.limit && (t as usize + self.step).is_multiple_of(3)
    }
}

impl GrammarMatcher for Cyclic {
    fn fill_mask(&mut self, mask: &mut [i32]) -> Result<()> {
        for t in 0..self.vocab {
            if self.allows(t) {
                mask[t as usize / 32] |= 1 << (t % 32);
            }
        }
        Ok(())
    }
    fn advance(&mut self, token: u32) -> Result<()> {
        if !self.allows(token) {
            return Err(specdraft::engine::EngineError::Grammar(format!(
                "token {token} not allowed at step {}",
                self.step
            ))
            .into());
        }
        self.seen.lock().unwrap().push(token);
        self.step += 1;
        Ok(())
    }
}

fn req(
    prompt: &[u32],
    limit: usize,
    sampling: SamplingParams,
) -> (GenerateRequest, Arc<Mutex<Vec<u32>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let g = Cyclic {
        step: 0,
        limit,
        vocab: 48,
        seen: seen.clone(),
    };
    (
        GenerateRequest::new(prompt.to_vec(), 30)
            .with_sampling(sampling)
            .with_grammar(Box::new(g)),
        seen,
    )
}

#[test]
fn every_emitted_token_is_allowed_and_greedy_matches_plain_masked_greedy() {
    let gpu = cpu();
    let target = table(&gpu);
    let plain = SpecEngine::new(target.clone(), None, 0).unwrap();
    let proposers: Vec<Arc<dyn DraftProposer>> = vec![
        Arc::new(PromptLookup::default()),
        Arc::new(RandomDrafter { seed: 5, vocab: 48 }),
        Arc::new(Oracle {
            target: target.clone(),
            fail: None,
        }),
    ];
    for sampling in [SamplingParams::greedy(), SamplingParams::sampled(1.0, 9)] {
        for prompt in prompts() {
            let (r, _) = req(&prompt, 1000, sampling);
            let base = plain.generate(vec![r]).results.remove(0);
            assert!(base.error.is_none(), "{:?}", base.error);
            for p in &proposers {
                let engine = SpecEngine::new(target.clone(), Some(p.clone()), 4).unwrap();
                let (r, seen) = req(&prompt, 1000, sampling);
                let out = engine.generate(vec![r]).results.remove(0);
                assert!(out.error.is_none(), "{:?}", out.error);
                assert_eq!(out.tokens.len(), 30);
                // The matcher consumed exactly the emitted tokens, each allowed at its step.
                assert_eq!(*seen.lock().unwrap(), out.tokens);
                for (k, &t) in out.tokens.iter().enumerate() {
                    assert_eq!((t as usize + k) % 3, 0);
                }
                if sampling.is_greedy() {
                    assert_eq!(out.tokens, base.tokens);
                }
            }
        }
    }
}

#[test]
fn propose_receives_the_mask_of_the_next_position() {
    let gpu = cpu();
    let target = table(&gpu);
    let masks = Arc::new(Mutex::new(Vec::new()));
    type Seen = Arc<Mutex<Vec<(usize, Vec<u32>)>>>;
    struct Spy(Seen);
    impl DraftProposer for Spy {
        fn alloc_state(
            &self,
            _g: &dyn specdraft::backend::GpuBackend,
        ) -> Result<Box<dyn specdraft::speculative::ProposerState>> {
            Ok(Box::new(History::default()))
        }
        fn propose(
            &self,
            _l: u32,
            _h: specdraft::backend::DevicePtr,
            pos: usize,
            _n: usize,
            _s: &mut dyn specdraft::speculative::ProposerState,
            _c: &specdraft::model::ForwardContext<'_>,
            _st: u64,
            _d: Option<specdraft::backend::DevicePtr>,
            m: Option<&[i32]>,
            _k: Option<specdraft::backend::DevicePtr>,
        ) -> Result<Vec<u32>> {
            let allowed = (0..48)
                .filter(|&t| m.is_some_and(|m| bitmask_allows(m, t)))
                .collect();
            self.0.lock().unwrap().push((pos, allowed));
            Ok(vec![])
        }
        fn after_verify(
            &self,
            _a: usize,
            _s: &mut dyn specdraft::speculative::ProposerState,
            _st: u64,
        ) -> Result<()> {
            Ok(())
        }
    }
    let engine = SpecEngine::new(target.clone(), Some(Arc::new(Spy(masks.clone()))), 2).unwrap();
    let prompt = vec![1, 2, 3];
    let (r, _) = req(&prompt, 1000, SamplingParams::greedy());
    engine.generate(vec![r]);
    let masks = masks.lock().unwrap();
    assert!(!masks.is_empty());
    for (pos, allowed) in masks.iter() {
        // `pos` holds the last emitted token, generated step pos - 3; drafts start a step later.
        let step = pos - prompt.len() + 1;
        let expect: Vec<u32> = (0..48)
            .filter(|&t| (t as usize + step).is_multiple_of(3))
            .collect();
        assert_eq!(allowed, &expect, "position {pos}");
    }
}

#[test]
fn a_grammar_that_allows_nothing_ends_the_sequence() {
    let gpu = cpu();
    let target = table(&gpu);
    let engine =
        SpecEngine::new(target.clone(), Some(Arc::new(PromptLookup::default())), 4).unwrap();
    let (r, seen) = req(&prompts()[0], 5, SamplingParams::greedy());
    let out = engine.generate(vec![r]).results.remove(0);
    assert_eq!(out.finish, FinishReason::Grammar);
    assert_eq!(out.tokens.len(), 5);
    assert_eq!(*seen.lock().unwrap(), out.tokens);
    assert_eq!(target.live_sequences(), 0);
}
