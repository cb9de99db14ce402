//! Soak: many short requests through a KV pool that holds a few at a time, with faults
//! mixed in (allocation failures from the backend, one forward per batch whose KV blocks
//! the pool refuses, a proposer that errors or panics in one of its methods for some
//! requests). Every request that no fault hit gives its solo
//! output; at the end the pool, the target's sequences and the backend's ledger are back
//! where they started. `SPECDRAFT_SOAK_REQUESTS` sets the request count (default 3000);
//! the figures are printed as one JSON line.

mod engine_common;

use engine_common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{GenerateRequest, SpecEngine};
use specdraft::model::ForwardContext;
use specdraft::speculative::{DraftProposer, ProposerError, ProposerState};
use specdraft::Result;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Methods a planted fault can hit, and how (an error or a panic).
const FAULTS: [(&str, bool); 6] = [
    ("prefill_drafter", false),
    ("propose", false),
    ("after_verify", false),
    ("prefill_drafter", true),
    ("propose", true),
    ("after_verify", true),
];

/// A bigram drafter (accepted often on these repetitive prompts) that fails in one method
/// for sequences whose prompt starts with a fault marker (token 47 - fault index).
struct Saboteur {
    faults: AtomicU64,
}

fn fault_of(state: &mut dyn ProposerState) -> Option<(&'static str, bool)> {
    let h = state.as_any_mut().downcast_mut::<History>()?;
    let first = *h.tokens.first()? as usize;
    (first >= 47 - (FAULTS.len() - 1)).then(|| FAULTS[47 - first])
}

impl Saboteur {
    fn strike(&self, method: &str, state: &mut dyn ProposerState) -> Result<()> {
        match fault_of(state) {
            Some((m, panics)) if m == method => {
                self.faults.fetch_add(1, Ordering::Relaxed);
                if panics {
                    panic!("planted panic in {method}");
                }
                Err(ProposerError::Failed {
                    method: method.into(),
                    message: "planted error".into(),
                }
                .into())
            }
            _ => Ok(()),
        }
    }
}

impl DraftProposer for Saboteur {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(History::default()))
    }
    fn prefill_drafter(
        &self,
        prompt: &[u32],
        _h: DevicePtr,
        state: &mut dyn ProposerState,
        _c: &ForwardContext<'_>,
        _s: u64,
    ) -> Result<usize> {
        state.as_any_mut().downcast_mut::<History>().unwrap().tokens = prompt.to_vec();
        self.strike("prefill_drafter", state)?;
        Ok(0)
    }
    fn propose(
        &self,
        last: u32,
        _h: DevicePtr,
        position: usize,
        n: usize,
        state: &mut dyn ProposerState,
        _c: &ForwardContext<'_>,
        _s: u64,
        _d: Option<DevicePtr>,
        _m: Option<&[i32]>,
        _t: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        self.strike("propose", state)?;
        let h = state.as_any_mut().downcast_mut::<History>().unwrap();
        h.tokens.truncate(position);
        h.tokens.push(last);
        let body = &h.tokens[..h.tokens.len() - 1];
        let drafts: Vec<u32> = body
            .iter()
            .rposition(|&t| t == last)
            .map(|a| h.tokens[a + 1..].iter().take(n).copied().collect())
            .unwrap_or_default();
        h.pending = drafts.clone();
        Ok(drafts)
    }
    fn after_verify(&self, a: usize, state: &mut dyn ProposerState, _s: u64) -> Result<()> {
        self.strike("after_verify", state)?;
        let h = state.as_any_mut().downcast_mut::<History>().unwrap();
        let accepted: Vec<u32> = h.pending.drain(..).take(a).collect();
        h.tokens.extend(accepted);
        Ok(())
    }
}

fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

#[test]
fn soak_with_mixed_faults_leaves_nothing_behind() {
    let requests: usize = std::env::var("SPECDRAFT_SOAK_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    // Planted panics are expected; keep their messages out of the output.
    std::panic::set_hook(Box::new(|_| {}));
    let backend = Arc::new(CpuBackend::new());
    let gpu: Arc<dyn GpuBackend> = backend.clone();
    let target = Arc::new(
        TableTarget::new(gpu.clone(), 48, 256, 32, 11, 0.2)
            .unwrap()
            .with_kv_blocks(24, 4)
            .unwrap(),
    );
    let before = gpu.ledger().live_count();
    let saboteur = Arc::new(Saboteur {
        faults: AtomicU64::new(0),
    });
    let engine = SpecEngine::new(target.clone(), Some(saboteur.clone()), 3)
        .unwrap()
        .with_max_batch_tokens(12);
    // Solo outputs on a target without a pool, cached by (prompt, max_tokens).
    let plain = SpecEngine::new(table(&cpu()), None, 0).unwrap();
    let mut solo: HashMap<(Vec<u32>, usize), Vec<u32>> = HashMap::new();
    let mut rng = SmallRng::seed_from_u64(2026);
    // Every 53rd allocation from the start fails.
    backend.inject_alloc_failures(backend.alloc_attempts() + 7, 53);
    let (mut done, mut errors, mut preemptions, mut rss_after_warmup) = (0, 0, 0, 0);
    let mut kv_failures = 0u64;
    while done < requests {
        let n = (requests - done).min(250);
        let batch: Vec<(Vec<u32>, usize)> = (0..n)
            .map(|_| {
                let len = rng.random_range(1..8);
                let first = if rng.random_bool(0.05) {
                    47 - rng.random_range(0..FAULTS.len()) as u32
                } else {
                    rng.random_range(0..40)
                };
                let mut p = vec![first];
                p.extend((1..len).map(|k| (first + (k as u32 % 3)) % 40));
                (p, rng.random_range(1..10))
            })
            .collect();
        // One forward of each batch has its KV blocks refused.
        target.fail_kv_blocks_at(target.forward_count() + rng.random_range(0..40));
        let g = engine.generate(
            batch
                .iter()
                .map(|(p, m)| GenerateRequest::new(p.clone(), *m).ignore_eos())
                .collect(),
        );
        preemptions += g.metrics.preemptions;
        for ((p, m), r) in batch.iter().zip(&g.results) {
            match &r.error {
                Some(e) => {
                    errors += 1;
                    let msg = e.to_string();
                    let planted = p[0] >= 42;
                    let kv = msg.contains("KV block pool exhausted");
                    kv_failures += u64::from(kv);
                    assert!(
                        kv || msg.contains("out of device memory")
                            || (planted && msg.contains("planted")),
                        "an unplanted failure: {msg}"
                    );
                }
                None => {
                    let want = solo.entry((p.clone(), *m)).or_insert_with(|| {
                        let g =
                            plain.generate(vec![GenerateRequest::new(p.clone(), *m).ignore_eos()]);
                        g.results[0].tokens.clone()
                    });
                    assert_eq!(&r.tokens, want, "prompt {p:?}");
                }
            }
        }
        done += n;
        if done == n {
            rss_after_warmup = peak_rss_kib();
        }
        let (total, free) = target.kv_blocks().unwrap();
        assert_eq!(free, total, "KV blocks held after {done} requests");
        assert_eq!(
            gpu.ledger().live_count(),
            before,
            "allocations after {done}"
        );
    }
    backend.clear_alloc_failures();
    let _ = std::panic::take_hook();
    assert!(preemptions > 0, "the pool never ran dry");
    assert!(saboteur.faults.load(Ordering::Relaxed) > 0);
    assert!(backend.injected_alloc_failures() > 0);
    assert!(kv_failures > 0, "no KV refusal hit a sequence");
    assert_eq!(target.live_sequences(), 0);
    let live = gpu.ledger().live_count() - before;
    assert_eq!(live, 0);
    println!(
        "{{\"requests\": {requests}, \"errors\": {errors}, \"proposer_faults\": {}, \
         \"alloc_faults\": {}, \"sequences_failed_by_kv_refusals\": {kv_failures}, \"preemptions\": {preemptions}, \"live_allocations_at_end\": {live}, \
         \"peak_rss_kib_after_first_batch\": {rss_after_warmup}, \"peak_rss_kib\": {}}}",
        saboteur.faults.load(Ordering::Relaxed),
        backend.injected_alloc_failures(),
        peak_rss_kib()
    );
}
