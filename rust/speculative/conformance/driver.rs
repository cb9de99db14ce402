//! The lifecycle the checker drives: setup, twin sequences, grammar probe, trees, KV carry,
//! leaks (the synthetic sequences are `synthetic`'s, the guard around each call `guard`'s).

use super::batch::{batch_step, lone_step};
use super::guard::{guarded, guarded_value};
use super::kv_carry::check_kv_carry;
use super::synthetic::{options_problem, synthetic_config, synthetic_tokens, Sequence};
use super::tree::{check_tree_batch, check_trees};
use super::{CheckOptions, ConformanceReport};
use crate::backend::{DevicePtr, GpuBackend, GpuBackendExt};
use crate::memory::BufferArena;
use crate::model::{ForwardContext, ModelLevers};
use crate::speculative::{bitmask_allows, bitmask_words, DraftProposer};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::HashSet;
use std::sync::Arc;

pub(super) struct Checker<'p> {
    pub(super) proposer: &'p dyn DraftProposer,
    pub(super) gpu: Arc<dyn GpuBackend>,
    pub(super) ctx: ForwardContext<'static>,
    pub(super) options: CheckOptions,
    pub(super) report: ConformanceReport,
    /// How many target layers the proposer names (0: it is given no captured rows).
    pub(super) layers: usize,
}

impl Checker<'_> {
    pub(super) fn budget(seq: &Sequence) -> usize {
        seq.truth.len()
    }

    pub(super) fn start(&mut self, seq: &mut Sequence) {
        let (p, gpu, budget) = (self.proposer, self.gpu.clone(), Self::budget(seq));
        let Some(mut state) = guarded(&mut self.report, "alloc_state_for", || {
            p.alloc_state_for(&*gpu, budget)
        }) else {
            return;
        };
        let prompt = &seq.truth[..seq.prompt_len];
        let mut ctx = self.ctx.clone();
        ctx.target_hidden_stack = seq.stack;
        let ctx = &ctx;
        let written = guarded(&mut self.report, "prefill_drafter", || {
            p.prefill_drafter(prompt, seq.hiddens, &mut *state, ctx, 0)
        });
        if let Some(written) = written {
            if written > seq.prompt_len {
                self.report.violate(
                    "prefill_drafter",
                    format!("reported {written} drafter rows for a prompt of {} tokens", seq.prompt_len),
                    "return the number of drafter rows actually written, at most one per prompt token",
                );
            }
            let rows = guarded_value(&mut self.report, "drafter_rows", || {
                p.drafter_rows(&mut *state)
            });
            if let Some(rows) = rows.filter(|&r| r != 0 && r != written) {
                self.report.violate(
                    "drafter_rows",
                    format!("prefill_drafter wrote {written} rows but drafter_rows says {rows}"),
                    "drafter_rows must count the rows the state holds (or return 0 when unknown)",
                );
            }
        }
        seq.pos = seq.prompt_len;
        seq.delivered = seq.prompt_len - 1;
        seq.state = Some(state);
    }

    pub(super) fn hidden_for(&self, seq: &Sequence) -> DevicePtr {
        // The hidden whose logits picked the token at `pos` is the one computed at `pos - 1`.
        seq.hiddens
            .offset((seq.pos - 1) * self.options.hidden_size * 2)
    }

    /// The `target_hidden_stack` of the next propose: the captured rows of the tokens after
    /// `delivered` up to `pos` (their rows `delivered .. pos - 1`), as the engine passes them.
    pub(super) fn stack_for(&self, seq: &Sequence) -> Option<DevicePtr> {
        let row_bytes = self.layers * self.options.hidden_size * 2;
        seq.stack.map(|s| s.offset(seq.delivered * row_bytes))
    }

    /// A one-row stack, the row paired with the token at `pos` (what a state that was never
    /// given rows is proposed with).
    pub(super) fn last_stack_row(&self, seq: &Sequence) -> Option<DevicePtr> {
        let row_bytes = self.layers * self.options.hidden_size * 2;
        seq.stack.map(|s| s.offset((seq.pos - 1) * row_bytes))
    }

    /// Checks one sequence's drafts and returns how many the simulated target accepts.
    pub(super) fn judge(
        &mut self,
        check: &str,
        seq: &Sequence,
        drafts: &[u32],
        mask: Option<&[i32]>,
    ) -> usize {
        let (n, vocab) = (self.options.num_drafts, self.options.vocab_size);
        if drafts.len() > n {
            self.report.violate(
                check,
                format!("returned {} drafts but num_drafts is {n}", drafts.len()),
                "never return more than num_drafts ids",
            );
        }
        if let Some(&bad) = drafts.iter().find(|&&t| t as usize >= vocab) {
            self.report.violate(
                check,
                format!("returned token id {bad}, outside the vocabulary of {vocab}"),
                "draft only ids below ctx.config.vocab_size",
            );
        }
        if let Some(mask) = mask {
            if let Some(&bad) = drafts.iter().find(|&&t| !bitmask_allows(mask, t)) {
                self.report.violate(
                    "grammar mask",
                    format!("drafted token {bad}, which the grammar_bitmask forbids"),
                    "stop drafting before the first token whose bit in grammar_bitmask is clear",
                );
            }
        }
        let future = &seq.truth[seq.pos + 1..];
        drafts
            .iter()
            .zip(future)
            .take_while(|(d, t)| d == t)
            .count()
    }

    pub(super) fn advance(&mut self, seq: &mut Sequence, accepted: usize) {
        let (p, Some(state)) = (self.proposer, seq.state.as_mut()) else {
            return;
        };
        if guarded(&mut self.report, "after_verify", || {
            p.after_verify(accepted, &mut **state, 0)
        })
        .is_none()
        {
            self.end(seq);
            return;
        }
        // Accepted drafts plus the bonus token.
        seq.delivered = seq.pos;
        seq.pos += accepted + 1;
    }

    /// [`Self::advance`] after a branching tree: `after_verify_tree` with the accepted path.
    pub(super) fn advance_tree(&mut self, seq: &mut Sequence, path: &[usize]) {
        let (p, Some(state)) = (self.proposer, seq.state.as_mut()) else {
            return;
        };
        if guarded(&mut self.report, "after_verify_tree", || {
            p.after_verify_tree(path, &mut **state, 0)
        })
        .is_none()
        {
            self.end(seq);
            return;
        }
        seq.delivered = seq.pos;
        seq.pos += path.len() + 1;
    }

    pub(super) fn propose_one(
        &mut self,
        seq: &mut Sequence,
        mask: Option<&[i32]>,
    ) -> Option<Vec<u32>> {
        let (p, ctx, n) = (self.proposer, &self.ctx, self.options.num_drafts);
        let (last, pos, hidden) = (seq.truth[seq.pos], seq.pos, self.hidden_for(seq));
        let stack = self.stack_for(seq);
        let state = seq.state.as_mut()?;
        let drafts = guarded(&mut self.report, "propose", || {
            p.propose(
                last,
                hidden,
                pos,
                n,
                &mut **state,
                ctx,
                0,
                None,
                mask,
                stack,
            )
        });
        if drafts.is_none() {
            self.end(seq);
        }
        drafts
    }

    pub(super) fn end(&mut self, seq: &mut Sequence) {
        if let Some(mut state) = seq.state.take() {
            let (p, gpu) = (self.proposer, self.gpu.clone());
            guarded(&mut self.report, "free_state", || {
                p.free_state(&*gpu, &mut *state)
            });
        }
    }

    /// A mask that forbids the token the continuation wants next, and about half the rest.
    pub(super) fn probe_mask(&self, seq: &Sequence, rng: &mut SmallRng) -> Vec<i32> {
        let vocab = self.options.vocab_size;
        let mut mask = vec![0i32; bitmask_words(vocab)];
        for t in 0..vocab {
            if rng.random_bool(0.5) {
                mask[t / 32] |= 1 << (t % 32);
            }
        }
        let forbidden = seq.truth[seq.pos + 1] as usize;
        mask[forbidden / 32] &= !(1 << (forbidden % 32));
        mask
    }
}

pub(super) fn run(
    proposer: &dyn DraftProposer,
    gpu: Arc<dyn GpuBackend>,
    options: &CheckOptions,
) -> ConformanceReport {
    let mut report = ConformanceReport {
        proposer: options.label.clone(),
        ..Default::default()
    };
    if let Some(problem) = options_problem(options) {
        report.violate(
            "options",
            problem,
            "pass options inside the documented ranges",
        );
        return report;
    }
    let config = synthetic_config(options);
    let rows = (options.num_sequences * (options.num_drafts + 1)).max(16);
    let slots = crate::model::layers::arena_slots(&config);
    let arena = match BufferArena::new(&*gpu, "arena", &slots, rows) {
        Ok(a) => a,
        Err(e) => {
            report.violate(
                "setup",
                format!("could not allocate the synthetic scratch: {e}"),
                "free memory on the backend",
            );
            return report;
        }
    };
    let ctx = ForwardContext::new(
        gpu.clone(),
        Arc::new(arena),
        Arc::new(config),
        ModelLevers::default(),
    );
    let layers = guarded_value(&mut report, "target_layer_ids", || {
        proposer.target_layer_ids()
    })
    .map_or(0, |ids| ids.len());
    let mut checker = Checker {
        proposer,
        gpu: gpu.clone(),
        ctx,
        options: options.clone(),
        report,
        layers,
    };
    let mut rng = SmallRng::seed_from_u64(options.seed);
    let mut twins: Vec<(Sequence, Sequence)> = Vec::new();
    let mut setup_failed = false;
    for _ in 0..options.num_sequences {
        let prompt_len = rng.random_range(12..=24);
        let total = prompt_len + (options.steps + 2) * (options.num_drafts + 1) + 2;
        let truth = synthetic_tokens(&mut rng, options.vocab_size, prompt_len, total);
        let values: Vec<f32> = (0..total * options.hidden_size)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let Ok(hiddens) = gpu.upload_bf16(&values, "check_proposer:hiddens") else {
            setup_failed = true;
            break;
        };
        let stack = match layers {
            0 => None,
            n => {
                let values: Vec<f32> = (0..total * n * options.hidden_size)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                match gpu.upload_bf16(&values, "check_proposer:target_hidden_stack") {
                    Ok(s) => Some(s),
                    Err(_) => {
                        let _ = gpu.free(hiddens);
                        setup_failed = true;
                        break;
                    }
                }
            }
        };
        let make = || Sequence {
            truth: truth.clone(),
            prompt_len,
            hiddens,
            stack,
            state: None,
            pos: prompt_len,
            delivered: prompt_len - 1,
        };
        twins.push((make(), make()));
    }
    let baseline: HashSet<DevicePtr> = gpu
        .ledger()
        .live_report()
        .into_iter()
        .map(|a| a.ptr)
        .collect();
    if setup_failed {
        checker.report.violate(
            "setup",
            "could not allocate the synthetic hiddens",
            "free memory on the backend",
        );
    } else {
        drive(&mut checker, &mut twins, &mut rng);
    }
    for (a, b) in twins.iter_mut() {
        checker.end(a);
        checker.end(b);
    }
    checker.report.ran("free_state: leaks");
    let leaks: Vec<String> = gpu
        .ledger()
        .live_report()
        .into_iter()
        .filter(|a| !baseline.contains(&a.ptr))
        .map(|a| format!("{} bytes tagged {:?} at {}", a.nbytes, a.tag, a.ptr))
        .collect();
    if !leaks.is_empty() {
        checker.report.violate(
            "free_state: leaks",
            format!("{} allocation(s) still live after free_state: {}", leaks.len(), leaks.join("; ")),
            "free in free_state every DevicePtr that alloc_state (or later calls) allocated; DevicePtr has no Drop",
        );
    }
    let mut report = std::mem::take(&mut checker.report);
    for (a, _) in &twins {
        // Both twins share one hidden buffer (and one stack).
        let _ = gpu.free(a.hiddens);
        if let Some(s) = a.stack {
            let _ = gpu.free(s);
        }
    }
    if let Ok(mut arena) = Arc::try_unwrap(checker.ctx.buffers) {
        if let Err(e) = arena.free(&*gpu) {
            report.violate(
                "setup",
                format!("scratch could not be freed: {e}"),
                "do not free ctx.buffers",
            );
        }
    }
    report
}

fn drive(checker: &mut Checker<'_>, twins: &mut [(Sequence, Sequence)], rng: &mut SmallRng) {
    let p = checker.proposer;
    check_static_contracts(checker);
    let width = p
        .propose_batch_max(&checker.ctx.buffers, &checker.ctx.config)
        .max(1);
    for (a, b) in twins.iter_mut() {
        checker.start(a);
        checker.start(b);
    }
    let mut batch_supported = true;
    let grammar_step = 1.min(checker.options.steps - 1);
    for step in 0..checker.options.steps {
        if step == grammar_step {
            // Both twins take the masked propose so they stay identical.
            checker.report.ran("grammar mask");
            for (a, b) in twins.iter_mut() {
                if a.state.is_none() {
                    continue;
                }
                let mask = checker.probe_mask(a, rng);
                for seq in [&mut *a, &mut *b] {
                    if let Some(drafts) = checker.propose_one(seq, Some(&mask)) {
                        let k = checker.judge("propose", seq, &drafts, Some(&mask));
                        checker.advance(seq, k);
                    }
                }
            }
            continue;
        }
        let mut per_seq: Vec<Option<Vec<u32>>> = Vec::new();
        for (a, _) in twins.iter_mut() {
            let drafts = checker.propose_one(a, None);
            if let Some(d) = &drafts {
                let k = checker.judge("propose", a, d, None);
                checker.advance(a, k);
            }
            per_seq.push(drafts);
        }
        if batch_supported {
            batch_supported = batch_step(checker, twins, &per_seq, width);
        } else {
            for (_, b) in twins.iter_mut() {
                lone_step(checker, b);
            }
        }
    }

    check_tree_batch(checker, twins, width);
    check_trees(checker, &mut twins[0].0, rng);
    check_kv_carry(checker, &mut twins[0].0);
}

fn check_static_contracts(checker: &mut Checker<'_>) {
    let p = checker.proposer;
    let (buffers, config) = (checker.ctx.buffers.clone(), checker.ctx.config.clone());
    if let Some(0) = guarded_value(&mut checker.report, "propose_batch_max", || {
        p.propose_batch_max(&buffers, config.as_ref())
    }) {
        checker.report.violate(
            "propose_batch_max",
            "returned 0",
            "return 1 for per-sequence only, or the widest batch",
        );
    }
    let max_seq_len = 4096;
    if let Some(rows) = guarded_value(&mut checker.report, "prefill_hidden_rows", || {
        p.prefill_hidden_rows(max_seq_len)
    }) {
        if rows > max_seq_len {
            checker.report.violate(
                "prefill_hidden_rows",
                format!("returned {rows} for max_seq_len {max_seq_len}"),
                "return at most max_seq_len (the default returns it unchanged)",
            );
        }
    }
    if let Some(Some(0)) = guarded_value(&mut checker.report, "block_gamma", || p.block_gamma()) {
        checker.report.violate(
            "block_gamma",
            "returned Some(0)",
            "a block drafter has γ >= 1; others return None",
        );
    }
}
