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
use stats::paths::{check, fit, Path, Tables};
use std::sync::Arc;

const VOCAB: usize = 8;
const PROMPT: [u32; 8] = [1, 2, 3, 1, 2, 3, 1, 2];

fn generate(
    target: &Arc<TableTarget>,
    proposer: Option<Arc<dyn DraftProposer>>,
    s: SamplingParams,
    n: u64,
) -> (Tables, u64) {
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
    let mut t = Tables::new(VOCAB);
    let mut accepted = 0;
    for r in engine.generate(requests).results {
        assert!(r.error.is_none(), "{:?}", r.error);
        let x = &r.tokens;
        assert_eq!(x.len(), 3);
        // The oracle's first draft for the second token is the greedy pick there: the second
        // token equals it exactly when that draft was accepted (a rejected one-hot draft is
        // never the correction). The metrics must say the same.
        let mut ctx = PROMPT.to_vec();
        ctx.push(x[0]);
        let draft = argmax(&target.logits_for(&ctx), None).unwrap();
        let path = if x[1] == draft {
            Path::Accepted
        } else {
            Path::Rejected
        };
        if r.metrics.drafted > 0 {
            assert_eq!(Path::of(&r.metrics), path, "{x:?}");
        }
        t.add(x, path);
        accepted += r.metrics.accepted;
    }
    (t, accepted)
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
        let (t, accepted) = generate(&target, Some(Arc::new(oracle)), s, 6000);
        assert!(
            (2000..12000).contains(&accepted),
            "{s:?}: {accepted} drafts accepted"
        );
        let mut logits = |c: &[u32]| {
            let full: Vec<u32> = PROMPT.iter().chain(c).copied().collect();
            target.logits_for(&full)
        };
        check(&format!("{s:?} first"), &fit(&mut logits, &s, &t.first), 2);
        check(
            &format!("{s:?} second"),
            &fit(&mut logits, &s, &t.second),
            10,
        );
        let accept = fit(&mut logits, &s, &t.third_after_accept);
        let reject = fit(&mut logits, &s, &t.third_after_reject);
        check(&format!("{s:?} third, first draft accepted"), &accept, 10);
        check(&format!("{s:?} third, first draft rejected"), &reject, 10);
        // Without a proposer the same statistics pass as well (the reference is right).
        let (plain, _) = generate(&target, None, s, 2000);
        check(
            &format!("{s:?} plain second"),
            &fit(&mut logits, &s, &plain.second),
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
