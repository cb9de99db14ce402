//! The adaptive draft policy: it turns a drafter that is never right down to (nearly) no
//! drafts, keeps asking a drafter that is always right for all it may (for trees as for
//! chains), asks for none when verify rows cost more than they can win, recovers a
//! sequence whose text turns predictable, is reproducible under a fixed cost model, and
//! never changes greedy output.

mod engine_common;

use engine_common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{DevicePtr, GpuBackend};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{
    CostCurve, CostCurves, DraftPolicyKind, FixedCost, GenerateRequest, Generation, SpecEngine,
};
use specdraft::model::ForwardContext;
use specdraft::speculative::{DraftProposer, DraftTree, PromptLookup, ProposerState};
use specdraft::Result;
use std::sync::{Arc, Mutex};

const VOCAB: u32 = 48;
const NUM_DRAFTS: usize = 4;

/// Verify costs `intercept + per_row * rows` seconds; drafting costs `draft` a sequence.
fn linear_cost(intercept: f64, per_row: f64, draft: f64) -> Arc<FixedCost> {
    Arc::new(FixedCost(CostCurves {
        verify: CostCurve::from_points([(1, intercept + per_row), (2, intercept + 2.0 * per_row)]),
        draft: CostCurve::from_points([(0, draft)]),
    }))
}

/// Drafts the target's greedy continuation (always accepted) where `oracle(first prompt
/// token, position)` holds and random ids elsewhere, and logs every ask as
/// `(first prompt token, position, num_drafts)`.
struct Mixed {
    oracle: Oracle,
    is_oracle: fn(u32, usize) -> bool,
    asks: Mutex<Vec<(u32, usize, usize)>>,
}

impl Mixed {
    fn new(target: &Arc<TableTarget>, is_oracle: fn(u32, usize) -> bool) -> Arc<Self> {
        Arc::new(Mixed {
            oracle: Oracle {
                target: target.clone(),
                fail: None,
            },
            is_oracle,
            asks: Mutex::new(Vec::new()),
        })
    }

    fn asks_of(&self, first: u32) -> Vec<(usize, usize)> {
        let asks = self.asks.lock().unwrap();
        asks.iter()
            .filter(|a| a.0 == first)
            .map(|&(_, pos, n)| (pos, n))
            .collect()
    }
}

impl DraftProposer for Mixed {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        self.oracle.alloc_state(gpu)
    }
    fn prefill_drafter(
        &self,
        prompt: &[u32],
        h: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<usize> {
        self.oracle.prefill_drafter(prompt, h, state, ctx, stream)
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
        // The oracle keeps the history in step either way; an accepted random draft equals
        // the target's pick, which is what the oracle drafted at that place.
        let first = state
            .as_any_mut()
            .downcast_mut::<History>()
            .and_then(|s| s.tokens.first().copied())
            .unwrap_or(0);
        let drafts = self
            .oracle
            .propose(last, h, position, n, state, ctx, stream, d, mask, stack)?;
        self.asks.lock().unwrap().push((first, position, n));
        if (self.is_oracle)(first, position) {
            return Ok(drafts);
        }
        let mut rng = SmallRng::seed_from_u64(position as u64 * 7919 + u64::from(first));
        Ok(drafts.iter().map(|_| rng.random_range(0..VOCAB)).collect())
    }
    fn after_verify(&self, a: usize, state: &mut dyn ProposerState, stream: u64) -> Result<()> {
        self.oracle.after_verify(a, state, stream)
    }
}

fn request(first: u32, max_tokens: usize) -> GenerateRequest {
    GenerateRequest::new(vec![first, 3, 1, 4, 1, 5], max_tokens)
}

fn engine(
    target: &Arc<TableTarget>,
    proposer: Arc<dyn DraftProposer>,
    cost: Arc<FixedCost>,
) -> SpecEngine<TableTarget> {
    SpecEngine::new(target.clone(), Some(proposer), NUM_DRAFTS)
        .unwrap()
        .with_cost_model(cost)
}

/// One prompt's asks: `(position, count)`.
type Asks = Vec<(usize, usize)>;

/// Runs an oracle prompt (10) and a random one (20) in one batch through `proposer`, which
/// logs its asks in `mixed`, and checks that the random drafts are turned down to
/// occasional one-draft probes, the oracle is asked for all it may once its first verdicts
/// are in, and greedy output is the target's own. Returns the generation and the asks.
fn random_off_and_oracle_on(
    target: &Arc<TableTarget>,
    mixed: &Mixed,
    proposer: Arc<dyn DraftProposer>,
) -> (Generation, Asks, Asks) {
    let engine = engine(target, proposer, linear_cost(0.75, 0.25, 0.01));
    assert_eq!(engine.draft_policy(), DraftPolicyKind::Adaptive);
    let g = engine.generate(vec![request(10, 80), request(20, 80)]);
    for r in &g.results {
        assert!(r.error.is_none(), "{:?}", r.error);
    }
    let random = mixed.asks_of(20);
    // A few steps to learn, then only occasional one-draft probes.
    let later = &random[6..];
    let drafting = later.iter().filter(|a| a.1 > 0).count();
    assert!(later.len() > 40, "{} steps", later.len());
    assert!(
        drafting * 8 <= later.len() && later.iter().all(|a| a.1 <= 1),
        "random drafter still asked after learning: {later:?}"
    );
    let oracle = mixed.asks_of(10);
    // Once its first verdicts are in, it is asked for all it may (the last step's budget
    // is cut by max_tokens).
    let settled = &oracle[2..oracle.len() - 1];
    assert!(
        settled.iter().all(|a| a.1 == NUM_DRAFTS),
        "oracle not asked for all: {oracle:?}"
    );
    let prompts: Vec<Vec<u32>> = vec![request(10, 1).prompt, request(20, 1).prompt];
    let want = baseline(target, &prompts, 80);
    assert_eq!(g.results[0].tokens, want[0]);
    assert_eq!(g.results[1].tokens, want[1]);
    (g, oracle, random)
}

#[test]
fn random_drafts_are_turned_down_and_oracle_drafts_kept_in_one_batch() {
    let gpu = cpu();
    let target = table(&gpu);
    // Prompts starting with 10 get the oracle, with 20 random drafts.
    let mixed = Mixed::new(&target, |first, _| first == 10);
    let (g, oracle, random) = random_off_and_oracle_on(&target, &mixed, mixed.clone());
    assert!(
        oracle.iter().all(|a| a.1 > 0),
        "oracle turned down: {oracle:?}"
    );
    let full = oracle.iter().filter(|a| a.1 == NUM_DRAFTS).count();
    // The histogram records every ask, per request.
    let hist = &g.results[1].metrics.draft_lengths;
    assert_eq!(hist.iter().sum::<u64>() as usize, random.len());
    assert_eq!(hist[0] as usize, random.iter().filter(|a| a.1 == 0).count());
    let hist = &g.results[0].metrics.draft_lengths;
    assert_eq!(hist[NUM_DRAFTS] as usize, full);
}

/// Grows trees from [`Mixed`]'s choice of prompts and logs every ask as `(first prompt
/// token, position, node budget)`: for an oracle prompt the target's continuation with a
/// wrong sibling beside its first token (nodes: the first token, the sibling, then the rest
/// of the continuation under the first, so the accepted path is every node but the
/// sibling), for the others random tokens, all children of the last verified token.
struct TreeMixed(Arc<Mixed>);

impl DraftProposer for TreeMixed {
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
    fn propose_tree(
        &self,
        last: u32,
        h: DevicePtr,
        position: usize,
        budget: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        d: Option<DevicePtr>,
        mask: Option<&[i32]>,
        stack: Option<DevicePtr>,
    ) -> Result<DraftTree> {
        let first = state
            .as_any_mut()
            .downcast_mut::<History>()
            .and_then(|s| s.tokens.first().copied())
            .unwrap_or(0);
        let chain_len = if budget >= 2 { budget - 1 } else { budget };
        let chain = self.0.oracle.propose(
            last, h, position, chain_len, state, ctx, stream, d, mask, stack,
        )?;
        self.0.asks.lock().unwrap().push((first, position, budget));
        if !(self.0.is_oracle)(first, position) {
            let mut rng = SmallRng::seed_from_u64(position as u64 * 7919 + u64::from(first));
            return Ok(DraftTree {
                tokens: (0..budget).map(|_| rng.random_range(0..VOCAB)).collect(),
                parents: vec![None; budget],
                probs: None,
            });
        }
        let mut tree = DraftTree::chain(chain);
        if budget >= 2 {
            let sibling = (tree.tokens[0] + 1) % VOCAB;
            tree.tokens.insert(1, sibling);
            tree.parents = (0..budget)
                .map(|i| match i {
                    0 | 1 => None,
                    2 => Some(0),
                    _ => Some(i - 1),
                })
                .collect();
        }
        Ok(tree)
    }
}

#[test]
fn random_trees_are_turned_down_and_oracle_trees_kept_in_one_batch() {
    let gpu = cpu();
    let target = table(&gpu);
    let mixed = Mixed::new(&target, |first, _| first == 10);
    let trees = Arc::new(TreeMixed(mixed.clone()));
    assert!(engine(&target, trees.clone(), linear_cost(1.0, 0.1, 0.0)).drafts_trees());
    // The oracle's trees (3 tokens for 4 nodes, 1 for 1) get the whole node budget.
    let (g, _, _) = random_off_and_oracle_on(&target, &mixed, trees);
    assert!(g.results[0].metrics.accepted > 0);
}

#[test]
fn expensive_verify_rows_mean_no_drafts() {
    let gpu = cpu();
    let target = table(&gpu);
    let mixed = Mixed::new(&target, |_, _| true);
    // One row costs 1 s, each more row 10 s: even sure drafts lose.
    let engine = engine(&target, mixed.clone(), linear_cost(-9.0, 10.0, 0.0));
    let g = engine.generate(vec![request(10, 40)]);
    let r = &g.results[0];
    assert!(r.error.is_none(), "{:?}", r.error);
    assert_eq!(r.metrics.drafted, 0);
    assert_eq!(r.metrics.draft_lengths, vec![r.metrics.verify_steps - 1]);
    assert!(mixed.asks_of(10).iter().all(|a| a.1 == 0));
    // The same rows made cheap: the oracle is asked for everything.
    let cheap = engine_with(&target, &mixed, linear_cost(1.0, 0.01, 0.0));
    let r = &cheap.generate(vec![request(10, 40)]).results[0];
    assert!(r.metrics.drafted > 0 && r.metrics.accepted == r.metrics.drafted);
    assert_eq!(r.metrics.draft_lengths[0], 0);
}

fn engine_with(
    target: &Arc<TableTarget>,
    mixed: &Arc<Mixed>,
    cost: Arc<FixedCost>,
) -> SpecEngine<TableTarget> {
    engine(target, mixed.clone(), cost)
}

#[test]
fn a_sequence_turned_down_recovers_when_its_text_turns_predictable() {
    let gpu = cpu();
    let target = table(&gpu);
    // Random drafts up to position 40, the target's own after.
    let mixed = Mixed::new(&target, |_, pos| pos >= 40);
    let engine = engine(&target, mixed.clone(), linear_cost(0.75, 0.25, 0.01));
    let g = engine.generate(vec![request(10, 200)]);
    assert!(g.results[0].error.is_none());
    let asks = mixed.asks_of(10);
    let before: Vec<usize> = asks
        .iter()
        .filter(|a| (20..40).contains(&a.0))
        .map(|a| a.1)
        .collect();
    assert!(
        before.iter().filter(|&&n| n > 0).count() <= 2,
        "random phase: {before:?}"
    );
    // Within the longest probe wait and a few steps to learn, it drafts fully again.
    let recovered: Vec<usize> = asks
        .iter()
        .filter(|a| (40 + 64 + 8..190).contains(&a.0))
        .map(|a| a.1)
        .collect();
    assert!(!recovered.is_empty());
    assert!(
        recovered.iter().all(|&n| n == NUM_DRAFTS),
        "after recovery: {recovered:?}"
    );
}

#[test]
fn choices_are_reproducible_under_a_fixed_cost_model() {
    let gpu = cpu();
    let target = table(&gpu);
    let run = || {
        let mixed = Mixed::new(&target, |first, pos| first == 10 || pos % 23 > 11);
        let engine = engine(&target, mixed.clone(), linear_cost(0.5, 0.2, 0.02));
        let g = engine.generate(vec![request(10, 60), request(20, 60), request(30, 60)]);
        let hists: Vec<Vec<u64>> = g
            .results
            .iter()
            .map(|r| r.metrics.draft_lengths.clone())
            .collect();
        let asks = mixed.asks.lock().unwrap().clone();
        (asks, hists)
    };
    let (a, b) = (run(), run());
    assert_eq!(a, b);
    // Not a constant choice: several counts were asked for.
    let mut counts: Vec<usize> = a.0.iter().map(|x| x.2).collect();
    counts.sort_unstable();
    counts.dedup();
    assert!(counts.len() >= 3, "{counts:?}");
}

#[test]
fn greedy_output_is_the_same_with_the_policy_on_or_off() {
    let gpu = cpu();
    let target = table(&gpu);
    let prompts = prompts();
    let want = baseline(&target, &prompts, 48);
    let proposers: Vec<Arc<dyn DraftProposer>> = vec![
        Arc::new(RandomDrafter {
            seed: 5,
            vocab: VOCAB,
        }),
        Arc::new(Oracle {
            target: target.clone(),
            fail: None,
        }),
        Arc::new(PromptLookup::new(1, 3).unwrap()),
    ];
    for p in proposers {
        for kind in [DraftPolicyKind::Adaptive, DraftPolicyKind::Fixed] {
            for max_batch in [1, 4] {
                // The measured cost model (the real clock) under the adaptive policy.
                let engine = SpecEngine::new(target.clone(), Some(p.clone()), NUM_DRAFTS)
                    .unwrap()
                    .with_draft_policy(kind)
                    .with_max_batch(max_batch);
                // Twice, so the second run starts from measured costs.
                for _ in 0..2 {
                    let g = engine.generate(requests(&prompts, 48));
                    let got: Vec<Vec<u32>> = g.results.iter().map(|r| r.tokens.clone()).collect();
                    assert_eq!(got, want, "{kind} at max_batch {max_batch}");
                    if kind == DraftPolicyKind::Fixed {
                        // Fixed asks for the whole budget: never 0.
                        assert_eq!(g.metrics.draft_lengths[0], 0);
                    }
                }
            }
        }
    }
    drop(target);
    assert_eq!(gpu.ledger().live_count(), 0);
}

#[test]
fn the_policy_names_parse_and_a_bad_one_is_refused() {
    assert_eq!(
        "adaptive".parse::<DraftPolicyKind>().unwrap(),
        DraftPolicyKind::Adaptive
    );
    assert_eq!(
        " Fixed ".parse::<DraftPolicyKind>().unwrap(),
        DraftPolicyKind::Fixed
    );
    let e = "greedy".parse::<DraftPolicyKind>().unwrap_err().to_string();
    assert!(e.contains("draft_policy") && e.contains("greedy"), "{e}");
}

/// Drafts the target's greedy continuation for two positions, then wrong tokens, reporting
/// high confidence in the first two and almost none in the rest (through `propose_batch`).
struct Confident {
    oracle: Oracle,
}

impl DraftProposer for Confident {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        self.oracle.alloc_state(gpu)
    }
    fn prefill_drafter(
        &self,
        prompt: &[u32],
        h: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
    ) -> Result<usize> {
        self.oracle.prefill_drafter(prompt, h, state, ctx, stream)
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
        let mut drafts = self
            .oracle
            .propose(last, h, position, n, state, ctx, stream, d, mask, stack)?;
        for t in drafts.iter_mut().skip(2) {
            *t = (*t + 1) % VOCAB;
        }
        Ok(drafts)
    }
    fn propose_batch(
        &self,
        last: &[u32],
        h: &[DevicePtr],
        positions: &[usize],
        n: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
        conf: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        let mut all = Vec::new();
        for i in 0..last.len() {
            let d = self.propose(
                last[i],
                h[i],
                positions[i],
                n,
                &mut *states[i],
                ctx,
                stream,
                None,
                None,
                None,
            )?;
            all.push(d);
        }
        if let Some(conf) = conf {
            *conf = all
                .iter()
                .map(|d| {
                    (0..d.len())
                        .map(|j| if j < 2 { 0.95 } else { 0.02 })
                        .collect()
                })
                .collect();
        }
        Ok(Some(all))
    }
    fn propose_batch_max(
        &self,
        _b: &specdraft::memory::BufferArena,
        _c: &specdraft::model::ModelConfig,
    ) -> usize {
        8
    }
    fn after_verify(&self, a: usize, state: &mut dyn ProposerState, stream: u64) -> Result<()> {
        self.oracle.after_verify(a, state, stream)
    }
}

#[test]
fn drafts_the_proposer_doubts_are_not_verified() {
    let gpu = cpu();
    let target = table(&gpu);
    let confident: Arc<dyn DraftProposer> = Arc::new(Confident {
        oracle: Oracle {
            target: target.clone(),
            fail: None,
        },
    });
    let prompts = vec![request(10, 1).prompt, request(20, 1).prompt];
    let want = baseline(&target, &prompts, 40);
    let run = |kind| {
        let engine = SpecEngine::new(target.clone(), Some(confident.clone()), NUM_DRAFTS)
            .unwrap()
            .with_draft_policy(kind)
            .with_cost_model(linear_cost(0.75, 0.25, 0.01));
        let g = engine.generate(requests(&prompts, 40));
        let got: Vec<Vec<u32>> = g.results.iter().map(|r| r.tokens.clone()).collect();
        assert_eq!(got, want, "{kind}");
        g.metrics
    };
    // Fixed verifies the doubted drafts too, and they are rejected.
    let fixed = run(DraftPolicyKind::Fixed);
    assert!(fixed.accepted < fixed.drafted);
    // Adaptive cuts each step's drafts after the two the proposer is sure of.
    let adaptive = run(DraftPolicyKind::Adaptive);
    assert!(adaptive.drafted > 0);
    assert_eq!(adaptive.accepted, adaptive.drafted);
    assert_eq!(adaptive.drafted_at.len(), 2);
}
