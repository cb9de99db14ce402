//! Sampling over draft trees is lossless: over many seeded walks of hand-made trees (a
//! branching root, siblings repeating a token, node probabilities given and not), the
//! tokens `verify_tree_sampled` emits follow the target's sampling distribution at every
//! depth, and under a grammar the masked one.
//!
//! The target is a fixed function of the context (its logits after the path to a node), so
//! siblings repeating a token get equal rows as on a real model. The expected
//! distributions come from `stats::reference` (the definitions of temperature, top-k and
//! top-p, pinned in `engine_verify.rs`), never from the code under test; the acceptance
//! rate of the first level is `sum p(x)` over the root's distinct children, from the
//! definition of one-hot rejection sampling. Chi-square at significance 0.001 with fixed
//! seeds, so the outcome is deterministic.

mod stats;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::engine::{verify_tree_sampled, EngineError, GrammarMatcher, SamplingParams};
use specdraft::speculative::DraftTree;
use specdraft::Result;
use stats::paths::{check, fit, Table};
use stats::reference;

const VOCAB: usize = 5;
const TRIALS: u64 = 60_000;

/// The target's logits after `context` (the tokens after the last verified one).
fn logits_for(context: &[u32]) -> Vec<f32> {
    let key = context.iter().fold(0x9e37_79b9_u64, |h, &t| {
        h.wrapping_mul(31).wrapping_add(t as u64 + 1)
    });
    let mut r = SmallRng::seed_from_u64(key);
    (0..VOCAB).map(|_| r.random_range(-1.5f32..1.5)).collect()
}

/// The tokens from the root down to node `i`.
fn path_tokens(tree: &DraftTree, mut i: usize) -> Vec<u32> {
    let mut path = vec![tree.tokens[i]];
    while let Some(p) = tree.parents[i] {
        path.push(tree.tokens[p]);
        i = p;
    }
    path.reverse();
    path
}

/// Row 0 (the last verified token's), then each node's row.
fn rows(tree: &DraftTree) -> Vec<Vec<f32>> {
    std::iter::once(logits_for(&[]))
        .chain((0..tree.len()).map(|i| logits_for(&path_tokens(tree, i))))
        .collect()
}

fn tree(tokens: &[u32], parents: &[Option<usize>], probs: Option<&[f32]>) -> DraftTree {
    DraftTree {
        tokens: tokens.to_vec(),
        parents: parents.to_vec(),
        probs: probs.map(<[f32]>::to_vec),
    }
}

/// A branching root (three children, two of them with children of their own), and a root
/// whose first two children repeat a token (with repeated grandchildren under the second),
/// each without and with node probabilities far from the target's.
fn trees() -> Vec<(&'static str, DraftTree)> {
    let branching = (
        [1, 3, 0, 2, 4, 1],
        [None, None, None, Some(0), Some(1), Some(1)],
    );
    let repeated = (
        [2, 2, 4, 1, 3, 3, 0],
        [None, None, None, Some(0), Some(1), Some(1), Some(3)],
    );
    vec![
        ("branching", tree(&branching.0, &branching.1, None)),
        (
            "branching with probs",
            tree(
                &branching.0,
                &branching.1,
                Some(&[0.9, 0.05, 0.05, 0.5, 0.3, 0.2]),
            ),
        ),
        ("repeated", tree(&repeated.0, &repeated.1, None)),
        (
            "repeated with probs",
            tree(
                &repeated.0,
                &repeated.1,
                Some(&[0.05, 0.05, 0.9, 1.0, 0.1, 0.1, 0.02]),
            ),
        ),
    ]
}

fn settings() -> Vec<SamplingParams> {
    let s = |temperature, top_k, top_p| SamplingParams {
        temperature,
        top_k,
        top_p,
        seed: 0,
    };
    vec![s(1.0, 0, 1.0), s(0.7, 3, 1.0), s(1.4, 0, 0.8)]
}

/// Draws from `p` by its cumulative sums (the next step's plain sample, for walks that
/// emitted one token).
fn draw(p: &[f64], r: &mut SmallRng) -> u32 {
    let u: f64 = r.random();
    let mut cum = 0.0;
    for (t, &x) in p.iter().enumerate() {
        cum += x;
        if u < cum {
            return t as u32;
        }
    }
    p.iter().rposition(|&x| x > 0.0).unwrap() as u32
}

fn tally(table: &mut Table, context: &[u32], next: u32) {
    table
        .entry(context.to_vec())
        .or_insert_with(|| vec![0; VOCAB])[next as usize] += 1;
}

/// Emitted tokens of many walks: the first, the first two (the second drawn plainly from
/// the target when the walk stopped after one), and every later token of a walk given the
/// ones before it in the same walk.
struct Tallies {
    first: Table,
    second: Table,
    within: Table,
    first_accepted: u64,
}

fn walk_many(
    t: &DraftTree,
    s: &SamplingParams,
    grammar: &mut dyn FnMut() -> Option<Box<dyn GrammarMatcher>>,
    logits: &dyn Fn(&[u32]) -> Vec<f32>,
) -> Tallies {
    let rows = rows(t);
    let refs: Vec<&[f32]> = rows.iter().map(|r| &r[..]).collect();
    let mut out = Tallies {
        first: Table::new(),
        second: Table::new(),
        within: Table::new(),
        first_accepted: 0,
    };
    for trial in 0..TRIALS {
        let mut rng = SmallRng::seed_from_u64(trial);
        let mut g = grammar();
        let g: Option<&mut dyn GrammarMatcher> = match &mut g {
            Some(g) => Some(g.as_mut()),
            None => None,
        };
        let v = verify_tree_sampled(&refs, t, s, &mut rng, g).unwrap();
        assert!(!v.grammar_exhausted);
        assert_eq!(v.tokens.len(), v.path.len() + 1, "{v:?}");
        for (k, &node) in v.path.iter().enumerate() {
            assert_eq!(path_tokens(t, node), v.tokens[..=k], "path {:?}", v.path);
        }
        tally(&mut out.first, &[], v.tokens[0]);
        let second = match v.tokens.get(1) {
            Some(&x) => x,
            None => {
                let mut r = SmallRng::seed_from_u64(u64::MAX - trial);
                draw(&reference(&logits(&v.tokens[..1]), s), &mut r)
            }
        };
        tally(&mut out.second, &v.tokens[..1], second);
        for k in 1..v.tokens.len() {
            tally(&mut out.within, &v.tokens[..k], v.tokens[k]);
        }
        out.first_accepted += u64::from(!v.path.is_empty());
    }
    out
}

/// Checks the walks' first tokens, first pairs and later tokens within a walk against
/// sampling from `logits`, each fit with at least the degrees of freedom in `min_df`.
fn check_tallies(
    what: &str,
    logits: &mut dyn FnMut(&[u32]) -> Vec<f32>,
    s: &SamplingParams,
    o: &Tallies,
    min_df: [usize; 3],
) {
    check(
        &format!("{what}: first"),
        &fit(logits, s, &o.first),
        min_df[0],
    );
    check(
        &format!("{what}: first two"),
        &fit(logits, s, &o.second),
        min_df[1],
    );
    check(
        &format!("{what}: later tokens within a walk"),
        &fit(logits, s, &o.within),
        min_df[2],
    );
}

fn no_grammar() -> Option<Box<dyn GrammarMatcher>> {
    None
}

#[test]
fn the_helpers_are_right() {
    stats::check_helpers();
}

#[test]
fn emitted_tokens_follow_the_target_at_every_depth_of_the_tree() {
    for (name, t) in trees() {
        for s in settings() {
            let o = walk_many(&t, &s, &mut no_grammar, &logits_for);
            let mut logits = |c: &[u32]| logits_for(c);
            let what = format!("{name}, {s:?}");
            check_tallies(&what, &mut logits, &s, &o, [2, 6, 2]);
            // One-hot rejection sampling accepts a child of the root with probability
            // p(x), each distinct token once.
            let p0 = reference(&logits_for(&[]), &s);
            let mut distinct: Vec<u32> = (0..t.len())
                .filter(|&i| t.parents[i].is_none())
                .map(|i| t.tokens[i])
                .collect();
            distinct.sort_unstable();
            distinct.dedup();
            let want: f64 = distinct.iter().map(|&x| p0[x as usize]).sum();
            let rate = o.first_accepted as f64 / TRIALS as f64;
            assert!(
                (rate - want).abs() < 0.01,
                "{what}: root acceptance {rate}, want {want}"
            );
        }
    }
}

/// Allows after token `a` the tokens `t` with `(t + a) % 3 != 0`, starting from `a = 0`
/// (so 0 and 3 are forbidden first), and fails on a token it did not allow.
struct NotAfter {
    last: u32,
}

impl NotAfter {
    fn allows(&self, t: u32) -> bool {
        !(t + self.last).is_multiple_of(3)
    }
}

impl GrammarMatcher for NotAfter {
    fn fill_mask(&mut self, mask: &mut [i32]) -> Result<()> {
        for t in (0..VOCAB as u32).filter(|&t| self.allows(t)) {
            mask[t as usize / 32] |= 1 << (t % 32);
        }
        Ok(())
    }
    fn advance(&mut self, token: u32) -> Result<()> {
        if !self.allows(token) {
            let why = format!("token {token} after {}", self.last);
            return Err(EngineError::Grammar(why).into());
        }
        self.last = token;
        Ok(())
    }
}

/// The target's logits after `context` with the tokens the grammar forbids there removed.
fn masked_logits_for(context: &[u32]) -> Vec<f32> {
    let g = NotAfter {
        last: context.last().copied().unwrap_or(0),
    };
    let mut l = logits_for(context);
    for (t, x) in l.iter_mut().enumerate() {
        if !g.allows(t as u32) {
            *x = f32::NEG_INFINITY;
        }
    }
    l
}

#[test]
fn under_a_grammar_emitted_tokens_follow_the_masked_target() {
    // The root's children include tokens the grammar forbids first (0, 3), and nodes it
    // forbids only after their parent (2 after 1, 1 after 2, 0 after 3).
    let t = tree(
        &[1, 3, 2, 0, 2, 4, 1, 0],
        &[None, None, None, None, Some(0), Some(0), Some(2), Some(4)],
        None,
    );
    let mut grammar = || Some(Box::new(NotAfter { last: 0 }) as Box<dyn GrammarMatcher>);
    for s in settings() {
        let o = walk_many(&t, &s, &mut grammar, &masked_logits_for);
        let mut logits = |c: &[u32]| masked_logits_for(c);
        check_tallies(&format!("grammar, {s:?}"), &mut logits, &s, &o, [1, 3, 1]);
        assert!(o.within.values().flatten().sum::<u64>() > TRIALS / 4);
    }
}

/// Allows nothing once it has consumed `limit` tokens.
struct Ends {
    limit: usize,
    seen: usize,
}

impl GrammarMatcher for Ends {
    fn fill_mask(&mut self, mask: &mut [i32]) -> Result<()> {
        if self.seen < self.limit {
            mask[0] = (1 << VOCAB) - 1;
        }
        Ok(())
    }
    fn advance(&mut self, _token: u32) -> Result<()> {
        self.seen += 1;
        Ok(())
    }
}

#[test]
fn a_grammar_that_ends_inside_the_tree_stops_the_walk_without_a_bonus() {
    // Every node drafts the target's greedy pick, so greedy accepts the whole chain of the
    // second branch, until the grammar allows nothing after two tokens.
    let pick = |c: &[u32]| {
        let l = logits_for(c);
        (0..VOCAB).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap() as u32
    };
    let a = pick(&[]);
    let b = pick(&[a]);
    let c = pick(&[a, b]);
    let t = tree(
        &[(a + 1) % VOCAB as u32, a, b, c],
        &[None, None, Some(1), Some(2)],
        None,
    );
    let rows = rows(&t);
    let refs: Vec<&[f32]> = rows.iter().map(|r| &r[..]).collect();
    for s in [SamplingParams::greedy(), SamplingParams::sampled(0.01, 3)] {
        let mut g = Ends { limit: 2, seen: 0 };
        let mut rng = SmallRng::seed_from_u64(0);
        let v = verify_tree_sampled(&refs, &t, &s, &mut rng, Some(&mut g)).unwrap();
        assert_eq!((v.path, v.tokens), (vec![1, 2], vec![a, b]), "{s:?}");
        assert!(v.grammar_exhausted);
        let v = verify_tree_sampled(&refs, &t, &s, &mut rng, None).unwrap();
        assert_eq!(v.path, [1, 2, 3], "{s:?}");
        assert_eq!(v.tokens[..3], [a, b, c]);
        assert!(!v.grammar_exhausted);
    }
}
