//! Draft trees under sampling and grammars, through the engine: sampled generations whose
//! steps verify random trees (with and without node probabilities) follow the table
//! target's conditional distributions token by token; a grammar's every emitted token is
//! one it allowed, sampled or greedy, and greedy output under a grammar equals plain
//! masked greedy decoding; a tree that is a chain samples bit for bit as the chain does;
//! nothing leaks.
//!
//! Expected distributions come from the table target's logits and `stats::reference` (the
//! definitions, pinned in `engine_verify.rs`), never from the engine's sampler.

mod engine_common;
mod stats;

use engine_common::{cpu, prompts, table, Oracle};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{DevicePtr, GpuBackend};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{
    DraftPolicyKind, DraftShape, EngineError, GenerateRequest, GrammarMatcher, SamplingParams,
    SpecEngine,
};
use specdraft::model::ForwardContext;
use specdraft::speculative::{
    bitmask_allows, DraftProposer, DraftTree, PromptLookup, ProposerState,
};
use specdraft::Result;
use stats::paths::{check, fit, Table};
use std::sync::{Arc, Mutex};

const VOCAB: usize = 8;
const PROMPT: [u32; 8] = [1, 2, 3, 1, 2, 3, 1, 2];

/// Grows a random tree from the last token and position alone (never the sequence's random
/// stream): three children of the last token, then each further node under a random
/// earlier one. With `probs`, every node carries a probability unrelated to the target's.
/// Given a grammar mask, the last token's children are tokens it allows.
struct RandomTrees {
    vocab: u32,
    probs: bool,
    /// Every path `after_verify_tree` was told.
    paths: Mutex<Vec<Vec<usize>>>,
}

#[derive(Default)]
struct NoState;
specdraft::impl_proposer_state!(NoState);

impl RandomTrees {
    fn new(vocab: u32, probs: bool) -> Self {
        RandomTrees {
            vocab,
            probs,
            paths: Mutex::new(Vec::new()),
        }
    }

    fn tree(&self, last: u32, position: usize, budget: usize, mask: Option<&[i32]>) -> DraftTree {
        let mut r = SmallRng::seed_from_u64((last as u64) << 32 | position as u64);
        let parents: Vec<Option<usize>> = (0..budget)
            .map(|i| (i >= 3).then(|| r.random_range(0..i)))
            .collect();
        let tokens = parents
            .iter()
            .map(|p| loop {
                let t = r.random_range(0..self.vocab);
                if p.is_some() || mask.is_none_or(|m| bitmask_allows(m, t)) {
                    break t;
                }
            })
            .collect();
        let probs = self
            .probs
            .then(|| (0..budget).map(|_| r.random_range(0.0..1.0)).collect());
        DraftTree {
            tokens,
            parents,
            probs,
        }
    }
}

impl DraftProposer for RandomTrees {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(NoState))
    }
    fn propose(
        &self,
        last: u32,
        _h: DevicePtr,
        position: usize,
        n: usize,
        _state: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _stream: u64,
        _d: Option<DevicePtr>,
        _mask: Option<&[i32]>,
        _stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        Ok(self.tree(last, position, n, None).tokens)
    }
    fn after_verify(&self, _a: usize, _s: &mut dyn ProposerState, _stream: u64) -> Result<()> {
        Ok(())
    }
    fn grows_trees(&self) -> bool {
        true
    }
    fn propose_tree(
        &self,
        last: u32,
        _h: DevicePtr,
        position: usize,
        budget: usize,
        _state: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _stream: u64,
        _d: Option<DevicePtr>,
        mask: Option<&[i32]>,
        _stack: Option<DevicePtr>,
    ) -> Result<DraftTree> {
        Ok(self.tree(last, position, budget, mask))
    }
    fn after_verify_tree(
        &self,
        path: &[usize],
        _state: &mut dyn ProposerState,
        _stream: u64,
    ) -> Result<()> {
        self.paths.lock().unwrap().push(path.to_vec());
        Ok(())
    }
}

fn tally(table: &mut Table, context: &[u32], next: u32) {
    table
        .entry(context.to_vec())
        .or_insert_with(|| vec![0; VOCAB])[next as usize] += 1;
}

#[test]
fn sampled_generations_with_random_trees_follow_the_conditional_distributions() {
    stats::check_helpers();
    let gpu: Arc<dyn GpuBackend> = Arc::new(specdraft::backend::CpuBackend::new());
    let target = Arc::new(TableTarget::new(gpu.clone(), VOCAB, 64, 64, 21, 0.3).unwrap());
    let settings = [
        SamplingParams::sampled(0.8, 0),
        SamplingParams {
            temperature: 1.3,
            top_k: 5,
            top_p: 0.9,
            seed: 0,
        },
    ];
    for probs in [false, true] {
        for s in settings {
            let proposer = Arc::new(RandomTrees::new(VOCAB as u32, probs));
            let engine = SpecEngine::new(target.clone(), Some(proposer.clone()), 5)
                .unwrap()
                .with_draft_policy(DraftPolicyKind::Fixed)
                .with_draft_shape(DraftShape::Tree);
            assert!(engine.drafts_trees());
            let requests = (0..5000)
                .map(|seed| {
                    GenerateRequest::new(PROMPT.to_vec(), 6)
                        .ignore_eos()
                        .with_sampling(SamplingParams { seed, ..s })
                })
                .collect();
            // The first token comes from the prefill; the tree step after it (a budget of
            // four nodes: three children of the first token, one below) emits the next.
            let mut next: Vec<Table> = (0..4).map(|_| Table::new()).collect();
            let mut accepted = 0;
            for r in engine.generate(requests).results {
                assert!(r.error.is_none(), "{:?}", r.error);
                let x = &r.tokens;
                assert_eq!(x.len(), 6);
                for (k, t) in next.iter_mut().enumerate() {
                    tally(t, &x[..k], x[k]);
                }
                accepted += r.metrics.accepted;
            }
            let mut logits = |c: &[u32]| {
                let full: Vec<u32> = PROMPT.iter().chain(c).copied().collect();
                target.logits_for(&full)
            };
            let what = format!("probs {probs}, {s:?}");
            for (k, t) in next.iter().enumerate() {
                check(&format!("{what}: token {k}"), &fit(&mut logits, &s, t), 3);
            }
            // Trees were verified, and branches other than the first were accepted.
            let paths = proposer.paths.lock().unwrap();
            let off_first = paths.iter().filter(|p| p.first() > Some(&0)).count();
            assert!(
                accepted > 1000 && off_first > 500,
                "{what}: {accepted} accepted, {off_first} paths off the first branch"
            );
        }
    }
    drop(target);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

/// The oracle's drafts, from a proposer that says it grows trees but keeps the protocol's
/// default `propose_tree` (its chain).
struct ChainOnly(Oracle);

impl DraftProposer for ChainOnly {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        self.0.alloc_state(gpu)
    }
    fn prefill_drafter(
        &self,
        prompt: &[u32],
        h: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<usize> {
        self.0.prefill_drafter(prompt, h, state, ctx, stream)
    }
    fn propose(
        &self,
        last: u32,
        h: DevicePtr,
        position: usize,
        n: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        d: Option<DevicePtr>,
        mask: Option<&[i32]>,
        stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        self.0
            .propose(last, h, position, n, state, ctx, stream, d, mask, stack)
    }
    fn after_verify(&self, a: usize, state: &mut dyn ProposerState, stream: u64) -> Result<()> {
        self.0.after_verify(a, state, stream)
    }
    fn grows_trees(&self) -> bool {
        true
    }
}

#[test]
fn a_tree_that_is_a_chain_samples_exactly_as_the_chain_does() {
    let gpu = cpu();
    let target = table(&gpu);
    let proposer: Arc<dyn DraftProposer> = Arc::new(ChainOnly(Oracle {
        target: target.clone(),
        fail: None,
    }));
    let run = |shape: DraftShape| {
        let engine = SpecEngine::new(target.clone(), Some(proposer.clone()), 4)
            .unwrap()
            .with_draft_policy(DraftPolicyKind::Fixed)
            .with_draft_shape(shape);
        assert_eq!(engine.drafts_trees(), shape == DraftShape::Tree);
        let requests = prompts()
            .iter()
            .flat_map(|p| {
                (0..8).map(|seed| {
                    GenerateRequest::new(p.clone(), 24)
                        .ignore_eos()
                        .with_sampling(SamplingParams::sampled(0.5, seed))
                })
            })
            .collect();
        let g = engine.generate(requests);
        let accepted = g.metrics.accepted;
        let tokens: Vec<Vec<u32>> = g
            .results
            .into_iter()
            .map(|r| {
                assert!(r.error.is_none(), "{:?}", r.error);
                r.tokens
            })
            .collect();
        (tokens, accepted)
    };
    let (tree, accepted) = run(DraftShape::Tree);
    assert_eq!(tree, run(DraftShape::Chain).0, "seeded outputs differ");
    assert!(accepted > 100, "{accepted} drafts accepted");
    drop((proposer, target));
    assert_eq!(gpu.ledger().live_count(), 0);
}

/// Allows, at step k, the tokens t with (t + k) % 3 == 0; fails on a token it did not allow.
struct Cyclic {
    step: usize,
    vocab: u32,
    seen: Arc<Mutex<Vec<u32>>>,
}

impl Cyclic {
    fn allows(&self, t: u32) -> bool {
        (t as usize + self.step).is_multiple_of(3)
    }
}

impl GrammarMatcher for Cyclic {
    fn fill_mask(&mut self, mask: &mut [i32]) -> Result<()> {
        for t in (0..self.vocab).filter(|&t| self.allows(t)) {
            mask[t as usize / 32] |= 1 << (t % 32);
        }
        Ok(())
    }
    fn advance(&mut self, token: u32) -> Result<()> {
        if !self.allows(token) {
            let why = format!("token {token} not allowed at step {}", self.step);
            return Err(EngineError::Grammar(why).into());
        }
        self.seen.lock().unwrap().push(token);
        self.step += 1;
        Ok(())
    }
}

fn constrained(prompt: &[u32], s: SamplingParams) -> (GenerateRequest, Arc<Mutex<Vec<u32>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let g = Cyclic {
        step: 0,
        vocab: 48,
        seen: seen.clone(),
    };
    let r = GenerateRequest::new(prompt.to_vec(), 30)
        .ignore_eos()
        .with_sampling(s)
        .with_grammar(Box::new(g));
    (r, seen)
}

#[test]
fn under_a_grammar_trees_emit_only_allowed_tokens_and_greedy_stays_plain() {
    let gpu = cpu();
    let target = table(&gpu);
    let plain = SpecEngine::new(target.clone(), None, 0).unwrap();
    let random = Arc::new(RandomTrees::new(48, false));
    let proposers: Vec<Arc<dyn DraftProposer>> = vec![
        random.clone(),
        Arc::new(PromptLookup::default().with_trees(true)),
    ];
    for s in [SamplingParams::greedy(), SamplingParams::sampled(1.0, 9)] {
        for prompt in prompts() {
            let (r, _) = constrained(&prompt, s);
            let base = plain.generate(vec![r]).results.remove(0);
            assert!(base.error.is_none(), "{:?}", base.error);
            for p in &proposers {
                let engine = SpecEngine::new(target.clone(), Some(p.clone()), 6)
                    .unwrap()
                    .with_draft_policy(DraftPolicyKind::Fixed)
                    .with_draft_shape(DraftShape::Tree);
                let (r, seen) = constrained(&prompt, s);
                let out = engine.generate(vec![r]).results.remove(0);
                assert!(out.error.is_none(), "{:?}", out.error);
                assert_eq!(out.tokens.len(), 30);
                // The matcher consumed exactly the emitted tokens, each allowed at its step.
                assert_eq!(*seen.lock().unwrap(), out.tokens);
                for (k, &t) in out.tokens.iter().enumerate() {
                    assert_eq!((t as usize + k) % 3, 0, "{:?}", out.tokens);
                }
                if s.is_greedy() {
                    assert_eq!(out.tokens, base.tokens, "{s:?} {prompt:?}");
                }
            }
        }
    }
    // The random trees were verified under the grammar, and off their first branch too.
    let paths = random.paths.lock().unwrap();
    assert!(
        paths.iter().filter(|p| p.first() > Some(&0)).count() > 10,
        "{paths:?}"
    );
    drop((plain, target));
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}

/// Sampled sequences verified in one forward, their verdicts made side by side on the
/// host, emit exactly what each emits alone: a verdict reads only its own rows, drafts and
/// random stream. Trees and chains, three kinds of sampling parameters, all in one batch.
#[test]
fn sampled_sequences_stepping_together_emit_what_each_emits_alone() {
    let gpu = cpu();
    let base = gpu.ledger().live_count();
    let target = Arc::new(TableTarget::new(gpu.clone(), VOCAB, 256, 64, 5, 0.3).unwrap());
    let params = |i: usize| {
        let s = SamplingParams::sampled(0.7 + 0.1 * (i % 4) as f32, 100 + i as u64);
        match i % 3 {
            0 => s,
            1 => SamplingParams { top_p: 0.8, ..s },
            _ => SamplingParams { top_k: 3, ..s },
        }
    };
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| (0..5 + i).map(|t| ((t * 3 + i) % VOCAB) as u32).collect())
        .collect();
    let requests = |which: &[usize]| -> Vec<GenerateRequest> {
        which
            .iter()
            .map(|&i| {
                GenerateRequest::new(prompts[i].clone(), 40)
                    .ignore_eos()
                    .with_sampling(params(i))
            })
            .collect()
    };
    for shape in [DraftShape::Tree, DraftShape::Chain] {
        let engine = |batch: usize| {
            SpecEngine::new(
                target.clone(),
                Some(Arc::new(RandomTrees::new(VOCAB as u32, false))),
                4,
            )
            .unwrap()
            .with_draft_policy(DraftPolicyKind::Fixed)
            .with_draft_shape(shape)
            .with_max_batch(batch)
        };
        let all: Vec<usize> = (0..prompts.len()).collect();
        let g = engine(prompts.len()).generate(requests(&all));
        let (accepted, drafted) = (g.metrics.accepted, g.metrics.drafted);
        let together: Vec<Vec<u32>> = g.results.into_iter().map(|r| r.tokens).collect();
        let alone: Vec<Vec<u32>> = all
            .iter()
            .map(|&i| engine(1).generate(requests(&[i])).results[0].tokens.clone())
            .collect();
        assert_eq!(together, alone, "{shape:?}");
        // The verdicts decided something: drafts were both accepted and rejected.
        assert!(
            accepted > 10 && accepted < drafted,
            "{shape:?}: {accepted} of {drafted}"
        );
    }
    drop(target);
    assert_eq!(gpu.ledger().live_count(), base);
}
