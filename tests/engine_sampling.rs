//! The engine's sampled generations with drafts follow the target's conditional
//! distributions: the first token given the prompt, the second given the first, and the
//! third given the first two, separately for the two paths a draft can take (its first
//! draft accepted, so the third token comes out of the same verification; or rejected, so
//! it comes out of the next step). The expected distributions are computed here from the
//! table target's logits and the definitions of temperature, top-k and top-p
//! (`engine_verify.rs` pins that reference); chi-square as in `stats/mod.rs`.

mod engine_common;
mod stats;

use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{argmax, DraftPolicyKind, GenerateRequest, SamplingParams, SpecEngine};
use specdraft::speculative::DraftProposer;
use stats::{chi_square, reference, Fit};
use std::collections::BTreeMap;
use std::sync::Arc;

const VOCAB: usize = 8;
const PROMPT: [u32; 8] = [1, 2, 3, 1, 2, 3, 1, 2];

/// Counts of the next token, per context.
type Table = BTreeMap<Vec<u32>, Vec<u64>>;

fn tally(table: &mut Table, context: &[u32], next: u32) {
    table
        .entry(context.to_vec())
        .or_insert_with(|| vec![0; VOCAB])[next as usize] += 1;
}

/// The summed chi-square of every context's counts against the target's distribution there.
fn fit(target: &TableTarget, s: &SamplingParams, table: &Table) -> Fit {
    let mut total = Fit::empty();
    for (context, counts) in table {
        let mut full = PROMPT.to_vec();
        full.extend_from_slice(context);
        let p = reference(&target.logits_for(&full), s);
        let f = chi_square(counts, &p).unwrap_or_else(|e| panic!("after {context:?}: {e}"));
        total.add(&f);
    }
    total
}

struct Tables {
    first: Table,
    second: Table,
    third_after_accept: Table,
    third_after_reject: Table,
    accepted: u64,
}

fn generate(
    target: &Arc<TableTarget>,
    proposer: Option<Arc<dyn DraftProposer>>,
    s: SamplingParams,
    n: u64,
) -> Tables {
    // Every step drafts the full count, so both draft paths are sampled often.
    let engine = SpecEngine::new(target.clone(), proposer, 3)
        .unwrap()
        .with_draft_policy(DraftPolicyKind::Fixed);
    let requests = (0..n)
        .map(|seed| {
            GenerateRequest::new(PROMPT.to_vec(), 3)
                .ignore_eos()
                .with_sampling(SamplingParams { seed, ..s })
        })
        .collect();
    let mut t = Tables {
        first: Table::new(),
        second: Table::new(),
        third_after_accept: Table::new(),
        third_after_reject: Table::new(),
        accepted: 0,
    };
    for r in engine.generate(requests).results {
        assert!(r.error.is_none(), "{:?}", r.error);
        let x = &r.tokens;
        assert_eq!(x.len(), 3);
        tally(&mut t.first, &[], x[0]);
        tally(&mut t.second, &x[..1], x[1]);
        // The oracle's first draft for the second token is the greedy pick there: the second
        // token equals it exactly when that draft was accepted (a rejected one-hot draft is
        // never the correction).
        let mut ctx = PROMPT.to_vec();
        ctx.push(x[0]);
        let draft = argmax(&target.logits_for(&ctx), None).unwrap();
        let path = if x[1] == draft {
            &mut t.third_after_accept
        } else {
            &mut t.third_after_reject
        };
        tally(path, &x[..2], x[2]);
        t.accepted += r.metrics.accepted;
    }
    t
}

fn check(what: &str, f: &Fit, min_df: usize) {
    assert!(
        f.df >= min_df && f.passes(),
        "{what}: chi2 {} on {} df (critical {})",
        f.statistic,
        f.df,
        stats::critical_value(f.df.max(1), stats::ALPHA)
    );
}

#[test]
fn sampled_generations_with_drafts_follow_the_conditional_distributions() {
    stats::check_helpers();
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let target = Arc::new(TableTarget::new(gpu.clone(), VOCAB, 64, 64, 21, 0.3).unwrap());
    let settings = [
        SamplingParams {
            temperature: 0.7,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        },
        SamplingParams {
            temperature: 1.3,
            top_k: 5,
            top_p: 0.9,
            seed: 0,
        },
    ];
    for s in settings {
        // The oracle drafts the target's argmax continuation: accepted often, not always.
        let oracle = engine_common::Oracle {
            target: target.clone(),
            fail: None,
        };
        let t = generate(&target, Some(Arc::new(oracle)), s, 6000);
        assert!(
            (2000..12000).contains(&t.accepted),
            "{s:?}: {} drafts accepted",
            t.accepted
        );
        check(&format!("{s:?} first"), &fit(&target, &s, &t.first), 2);
        check(&format!("{s:?} second"), &fit(&target, &s, &t.second), 10);
        let accept = fit(&target, &s, &t.third_after_accept);
        let reject = fit(&target, &s, &t.third_after_reject);
        check(&format!("{s:?} third, first draft accepted"), &accept, 10);
        check(&format!("{s:?} third, first draft rejected"), &reject, 10);
        // Without a proposer the same statistics pass as well (the reference is right).
        let plain = generate(&target, None, s, 2000);
        check(
            &format!("{s:?} plain second"),
            &fit(&target, &s, &plain.second),
            4,
        );
    }
    drop(target);
    assert_eq!(
        gpu.ledger().live_count(),
        0,
        "{:?}",
        gpu.ledger().live_report()
    );
}
