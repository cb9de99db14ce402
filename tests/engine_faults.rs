//! Faults during generation, against a KV pool small enough to queue and preempt: an
//! allocation failure at each allocation point of a run, and a Rust proposer panicking in
//! each of its methods. Each ends only the sequence it hit (with an error saying what
//! failed), every other output is its solo output, and the KV pool and the backend's
//! ledger return to where they started.

mod engine_common;

use engine_common::*;
use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend};
use specdraft::engine::testing::TableTarget;
use specdraft::engine::{FinishReason, GenerateRequest, SpecEngine};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig};
use specdraft::speculative::{DraftProposer, PromptLookup, ProposerState};
use specdraft::Result;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const MAX: usize = 12;

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 2, 3, 4, 5, 1, 2, 3],
        vec![9, 9, 8, 7, 9, 9, 8, 7, 9],
        vec![40, 41, 42, 43, 40, 41],
        vec![5],
        vec![20, 21, 20, 21, 20, 21, 20],
    ]
}

fn reqs() -> Vec<GenerateRequest> {
    prompts()
        .into_iter()
        .map(|p| GenerateRequest::new(p, MAX).ignore_eos())
        .collect()
}

fn solo() -> Vec<Vec<u32>> {
    let gpu = cpu();
    let target = table(&gpu);
    let engine = SpecEngine::new(target, None, 0).unwrap();
    prompts()
        .into_iter()
        .map(|p| {
            engine
                .generate(vec![GenerateRequest::new(p, MAX).ignore_eos()])
                .results
                .remove(0)
                .tokens
        })
        .collect()
}

/// `table`'s target with its KV in 12 blocks of 4 rows: a request needs up to 5 blocks.
fn pooled(gpu: &Arc<dyn GpuBackend>) -> Arc<TableTarget> {
    Arc::new(
        TableTarget::new(gpu.clone(), 48, 256, 64, 11, 0.2)
            .unwrap()
            .with_kv_blocks(12, 4)
            .unwrap(),
    )
}

fn assert_clean(gpu: &Arc<dyn GpuBackend>, target: &TableTarget, before: usize, what: &str) {
    let (total, free) = target.kv_blocks().unwrap();
    assert_eq!(free, total, "{what}: KV blocks held");
    assert_eq!(target.live_sequences(), 0, "{what}");
    assert_eq!(
        gpu.ledger().live_count(),
        before,
        "{what}: {:?}",
        gpu.ledger().live_report()
    );
}

#[test]
fn an_allocation_failure_at_each_point_ends_only_its_sequence() {
    let expect = solo();
    let cpu_backend = Arc::new(CpuBackend::new());
    let gpu: Arc<dyn GpuBackend> = cpu_backend.clone();
    let target = pooled(&gpu);
    let before = gpu.ledger().live_count();
    let proposers: [Arc<dyn DraftProposer>; 2] = [
        Arc::new(PromptLookup::default()),
        Arc::new(RandomDrafter { seed: 1, vocab: 48 }),
    ];
    for proposer in proposers {
        let engine = SpecEngine::new(target.clone(), Some(proposer), 3)
            .unwrap()
            .with_max_batch_tokens(6);
        // A clean run counts the allocation points (admissions after preemptions included).
        let start = cpu_backend.alloc_attempts();
        let g = engine.generate(reqs());
        let points = cpu_backend.alloc_attempts() - start;
        assert!(g.metrics.preemptions > 0, "the pool must preempt");
        assert!(points >= 2 * prompts().len() as u64, "{points} allocations");
        for (i, r) in g.results.iter().enumerate() {
            assert_eq!(r.tokens, expect[i]);
        }
        for k in 0..points {
            cpu_backend.inject_alloc_failures(cpu_backend.alloc_attempts() + k, 0);
            let injected = cpu_backend.injected_alloc_failures();
            let g = engine.generate(reqs());
            cpu_backend.clear_alloc_failures();
            assert_eq!(
                cpu_backend.injected_alloc_failures(),
                injected + 1,
                "point {k}"
            );
            let failed: Vec<usize> = (0..g.results.len())
                .filter(|&i| g.results[i].error.is_some())
                .collect();
            assert_eq!(failed.len(), 1, "point {k}: failed {failed:?}");
            let r = &g.results[failed[0]];
            assert_eq!(r.finish, FinishReason::Error);
            let msg = r.error.as_ref().unwrap().to_string();
            assert!(msg.contains("out of device memory"), "point {k}: {msg}");
            for (i, r) in g.results.iter().enumerate() {
                if i != failed[0] {
                    assert_eq!(r.tokens, expect[i], "point {k}: request {i}");
                }
            }
            assert_clean(&gpu, &target, before, &format!("point {k}"));
        }
    }
}

/// Drafts the greedy continuation the history suggests (a bigram lookup) and panics in
/// `method` for the sequence whose prompt starts with 9 (for `alloc_state_for`, on its
/// second call).
struct Panicky {
    method: &'static str,
    allocs: AtomicUsize,
}

impl Panicky {
    fn check(&self, method: &str, state: &mut dyn ProposerState) {
        let h = state.as_any_mut().downcast_mut::<History>().unwrap();
        if method == self.method && h.tokens.first() == Some(&9) {
            panic!("injected panic in {method}");
        }
    }
}

impl DraftProposer for Panicky {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(History::default()))
    }
    fn alloc_state_for(&self, gpu: &dyn GpuBackend, _b: usize) -> Result<Box<dyn ProposerState>> {
        if self.allocs.fetch_add(1, Ordering::Relaxed) == 1 && self.method == "alloc_state_for" {
            panic!("injected panic in alloc_state_for");
        }
        self.alloc_state(gpu)
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
        self.check("prefill_drafter", state);
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
        self.check("propose", state);
        let h = state.as_any_mut().downcast_mut::<History>().unwrap();
        h.tokens.truncate(position);
        h.tokens.push(last);
        let at = h.tokens[..h.tokens.len() - 1]
            .iter()
            .rposition(|&t| t == last);
        let drafts: Vec<u32> = at
            .map(|a| h.tokens[a + 1..].iter().take(n).copied().collect())
            .unwrap_or_default();
        h.pending = drafts.clone();
        Ok(drafts)
    }
    fn after_verify(&self, a: usize, state: &mut dyn ProposerState, _s: u64) -> Result<()> {
        self.check("after_verify", state);
        let h = state.as_any_mut().downcast_mut::<History>().unwrap();
        let accepted: Vec<u32> = h.pending.drain(..).take(a).collect();
        h.tokens.extend(accepted);
        Ok(())
    }
    fn propose_batch(
        &self,
        _l: &[u32],
        _h: &[DevicePtr],
        _p: &[usize],
        _n: usize,
        states: &mut [&mut dyn ProposerState],
        _c: &ForwardContext<'_>,
        _s: u64,
        _o: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        for s in states.iter_mut() {
            self.check("propose_batch", &mut **s);
        }
        Ok(None)
    }
    fn propose_batch_max(&self, _b: &BufferArena, _c: &ModelConfig) -> usize {
        4
    }
    fn free_state(&self, _gpu: &dyn GpuBackend, state: &mut dyn ProposerState) -> Result<()> {
        self.check("free_state", state);
        Ok(())
    }
}

#[test]
fn a_panicking_rust_proposer_ends_only_its_sequence() {
    let expect = solo();
    let gpu = cpu();
    let target = pooled(&gpu);
    let before = gpu.ledger().live_count();
    for method in [
        "alloc_state_for",
        "prefill_drafter",
        "propose",
        "after_verify",
        "propose_batch",
        "free_state",
    ] {
        let proposer = Arc::new(Panicky {
            method,
            allocs: AtomicUsize::new(0),
        });
        let engine = SpecEngine::new(target.clone(), Some(proposer), 3)
            .unwrap()
            .with_max_batch_tokens(6);
        let g = engine.generate(reqs());
        let failed: Vec<usize> = (0..g.results.len())
            .filter(|&i| g.results[i].error.is_some())
            .collect();
        // A failed batched call falls back to one propose per sequence: nothing ends.
        let expect_failed: Vec<usize> = match method {
            "propose_batch" => vec![],
            _ => vec![1],
        };
        assert_eq!(failed, expect_failed, "{method}");
        for &i in &failed {
            let msg = g.results[i].error.as_ref().unwrap().to_string();
            assert!(
                msg.contains(method) && msg.contains("panicked: injected panic"),
                "{msg}"
            );
        }
        for (i, r) in g.results.iter().enumerate() {
            if !failed.contains(&i) {
                assert_eq!(r.tokens, expect[i], "{method}: request {i}");
            }
        }
        drop(engine);
        assert_clean(&gpu, &target, before, method);
    }
}

#[test]
fn a_kv_block_refusal_at_each_forward_ends_only_that_forwards_sequences() {
    let expect = solo();
    let gpu = cpu();
    let target = pooled(&gpu);
    let before = gpu.ledger().live_count();
    let engine = SpecEngine::new(target.clone(), Some(Arc::new(PromptLookup::default())), 3)
        .unwrap()
        .with_max_batch_tokens(6);
    let start = target.forward_count();
    engine.generate(reqs());
    let forwards = target.forward_count() - start;
    assert!(forwards > 5, "{forwards} forwards");
    for k in 0..forwards {
        target.fail_kv_blocks_at(target.forward_count() + k);
        let g = engine.generate(reqs());
        target.fail_kv_blocks_at(usize::MAX);
        let failed: Vec<usize> = (0..g.results.len())
            .filter(|&i| g.results[i].error.is_some())
            .collect();
        // Which forward it was decides how many sequences it carried; one at least.
        assert!(!failed.is_empty(), "forward {k}: nothing failed");
        for (i, r) in g.results.iter().enumerate() {
            match &r.error {
                Some(e) => {
                    let msg = e.to_string();
                    assert!(
                        msg.contains("KV block pool exhausted"),
                        "forward {k}: {msg}"
                    );
                    assert_eq!(r.tokens, expect[i][..r.tokens.len()], "forward {k}: {i}");
                }
                None => assert_eq!(r.tokens, expect[i], "forward {k}: request {i}"),
            }
        }
        assert_clean(&gpu, &target, before, &format!("forward {k}"));
    }
}
