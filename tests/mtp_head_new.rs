//! `MtpHead::new` with the caller's own weights: a trimmed LM head (`lm_head_nvfp4_t`) is the
//! one drafts come from, `mtp_vocab_size` limits the draft vocabulary and is checked,
//! `main_kv_blocks` caps the drafter pool (and the cap is real: a full pool is a clear
//! error), `release` frees what `new` allocated and nothing of the caller's, and
//! `propose_batch` takes at most `MTP_MAX_BATCH` sequences.

mod mtp_common;

use mtp_common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend, GpuBackendExt};
use specdraft::memory::BufferArena;
use specdraft::model::{
    DenseWeight, DeviceAllocations, ForwardContext, ModelConfig, ModelLevers,
    SafetensorsCheckpoint, TensorSource,
};
use specdraft::speculative::mtp::{find_layout, quantize_nvfp4, MtpWeights, MTP_MAX_BATCH};
use specdraft::speculative::{DraftProposer, MtpHead, MtpQuantization, ProposerState};
use std::sync::Arc;

const MAX_SEQ: usize = 512;

/// The caller's side of `MtpHead::new`: weights from a tiny checkpoint, and the LM head rows
/// as f32 (to quantize whichever rows a test wants).
struct Parts {
    gpu: Arc<dyn GpuBackend>,
    allocs: DeviceAllocations,
    config: ModelConfig,
    src: SafetensorsCheckpoint,
    lm_rows: Vec<f32>,
}

impl Parts {
    fn new(name: &str) -> Parts {
        let dir = scratch_dir(&format!("mtp_head_new_{name}"));
        write_checkpoint(&dir, "deepseek_v3", 5);
        let (config, src) = SafetensorsCheckpoint::open_with_config(&dir).unwrap();
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
        let name = format!("model.layers.{MAIN_LAYERS}.shared_head.head.weight");
        let lm_rows = src
            .read_bf16(&name, &[VOCAB, HIDDEN])
            .unwrap()
            .into_iter()
            .map(f32::from)
            .collect();
        Parts {
            allocs: DeviceAllocations::new(gpu.clone()),
            gpu,
            config,
            src,
            lm_rows,
        }
    }

    /// The NVFP4 LM head made of `rows` of the checkpoint's head, in that order.
    fn lm_head(&self, rows: &[usize], tag: &str) -> specdraft::model::QuantizedWeight {
        let w: Vec<f32> = rows
            .iter()
            .flat_map(|&r| self.lm_rows[r * HIDDEN..(r + 1) * HIDDEN].iter().copied())
            .collect();
        quantize_nvfp4(&w, rows.len(), HIDDEN)
            .unwrap()
            .upload(&self.allocs, tag)
            .unwrap()
    }

    fn dense(&self, name: &str, shape: &[usize]) -> DenseWeight {
        let v = self.src.read_bf16(name, shape).unwrap();
        DenseWeight::upload(&self.allocs, name, shape, &v).unwrap()
    }

    /// `MtpHead::new` over the full LM head, with `trimmed` and the two sizes given.
    fn head(
        &self,
        trimmed: Option<(&[usize], u32)>,
        mtp_vocab_size: u32,
        main_kv_blocks: usize,
    ) -> specdraft::Result<MtpHead> {
        let layout = find_layout(&self.src, &self.config).unwrap();
        let weights =
            MtpWeights::load(&self.allocs, &self.src, &self.config, layout, 0, None).unwrap();
        let all: Vec<usize> = (0..VOCAB).collect();
        let t = trimmed.map(|(rows, n)| (self.lm_head(rows, "lm_head_t"), n));
        MtpHead::new(
            weights,
            self.dense("model.embed_tokens.weight", &[VOCAB, HIDDEN]),
            self.dense("model.norm.weight", &[HIDDEN]),
            self.lm_head(&all, "lm_head"),
            t,
            &self.config,
            self.gpu.as_ref(),
            MtpQuantization::Bf16,
            mtp_vocab_size,
            MAX_SEQ,
            main_kv_blocks,
            &ModelLevers::default(),
        )
    }

    fn ctx(&self) -> ForwardContext<'static> {
        ForwardContext::new(
            self.gpu.clone(),
            Arc::new(BufferArena::empty(16)),
            Arc::new(self.config.clone()),
            ModelLevers::default(),
        )
    }

    fn finish(self, heads: Vec<MtpHead>) {
        for h in heads {
            let (total, free) = h.kv_blocks();
            assert_eq!(total, free, "drafter KV blocks still held");
            h.release(self.gpu.as_ref()).unwrap();
        }
        self.allocs.free_all().unwrap();
        assert_eq!(
            self.gpu.ledger().live_count(),
            0,
            "{:?}",
            self.gpu.ledger().live_report()
        );
    }
}

/// Target hiddens and tokens for `rows` positions.
fn inputs(gpu: &dyn GpuBackend, rows: usize, seed: u64) -> (DevicePtr, Vec<u32>) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let h: Vec<f32> = (0..rows * HIDDEN)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let tokens = (0..rows)
        .map(|_| rng.random_range(0..VOCAB as u32))
        .collect();
    (gpu.upload_bf16(&h, "test:hiddens").unwrap(), tokens)
}

/// Frees a test buffer at the end of its scope.
struct FreeOnDrop<'a>(&'a dyn GpuBackend, DevicePtr);
impl Drop for FreeOnDrop<'_> {
    fn drop(&mut self) {
        // A failure shows up in the ledger check at the end of the test.
        let _ = self.0.free(self.1);
    }
}

/// Prefills a fresh state over `prompt` positions and proposes `n` drafts after them.
fn draft(
    head: &MtpHead,
    ctx: &ForwardContext<'_>,
    (hid, tokens): &(DevicePtr, Vec<u32>),
    prompt: usize,
    n: usize,
) -> Vec<u32> {
    let gpu = ctx.gpu.as_ref();
    let mut st = head.alloc_state_for(gpu, 256).unwrap();
    head.prefill_drafter(&tokens[..prompt], *hid, &mut *st, ctx, 0)
        .unwrap();
    let last = hid.offset((prompt - 1) * HIDDEN * 2);
    let d = head
        .propose(
            tokens[prompt],
            last,
            prompt,
            n,
            &mut *st,
            ctx,
            0,
            None,
            None,
            None,
        )
        .unwrap();
    head.free_state(gpu, &mut *st).unwrap();
    d
}

#[test]
fn the_trimmed_lm_head_is_the_one_drafts_come_from() {
    let parts = Parts::new("trimmed");
    let ctx = parts.ctx();
    let n = 40u32;
    let prefix: Vec<usize> = (0..n as usize).collect();
    // The same n rows reversed: the head's pick i must then be row n-1-i of the full head.
    let reversed: Vec<usize> = prefix.iter().rev().copied().collect();
    let by_size = parts.head(None, n, 64).unwrap();
    let by_copy = parts.head(Some((&prefix, n)), 0, 64).unwrap();
    let by_reversed = parts.head(Some((&reversed, n)), 0, 64).unwrap();
    let full = parts.head(None, 0, 64).unwrap();
    assert_eq!(by_size.draft_vocab_size(), n as usize);
    assert_eq!(by_reversed.draft_vocab_size(), n as usize);
    assert_eq!(full.draft_vocab_size(), VOCAB);
    let mut differs_from_full = false;
    for seed in 0..12 {
        let input = inputs(parts.gpu.as_ref(), 24, seed);
        let _free = FreeOnDrop(parts.gpu.as_ref(), input.0);
        let a = draft(&by_size, &ctx, &input, 20, 3);
        assert!(a.iter().all(|&t| t < n), "{a:?} outside the first {n} rows");
        assert_eq!(draft(&by_copy, &ctx, &input, 20, 3), a, "seed {seed}");
        let r = draft(&by_reversed, &ctx, &input, 20, 1);
        assert_eq!(r, vec![n - 1 - a[0]], "seed {seed}: the reversed rows");
        differs_from_full |= draft(&full, &ctx, &input, 20, 1)[0] != a[0];
    }
    assert!(
        differs_from_full,
        "the full vocabulary never drafted outside the prefix"
    );
    parts.finish(vec![by_size, by_copy, by_reversed, full]);
}

#[test]
fn sizes_that_do_not_fit_are_errors_that_leak_nothing() {
    let parts = Parts::new("sizes");
    // Every failed `new` frees what it allocated: only the caller's weights stay live.
    let only_the_callers = |r: specdraft::Result<MtpHead>, want: &str| {
        let err = r.err().expect("an error").to_string();
        assert!(err.contains(want), "{err}");
        assert_eq!(
            parts.gpu.ledger().live_count(),
            parts.allocs.len(),
            "{want}"
        );
    };
    only_the_callers(
        parts.head(None, VOCAB as u32 + 1, 64),
        &format!(
            "mtp_vocab_size {} exceeds the LM head's {VOCAB} rows",
            VOCAB + 1
        ),
    );
    let prefix: Vec<usize> = (0..30).collect();
    only_the_callers(
        parts.head(Some((&prefix, 31)), 0, 64),
        "lm_head_nvfp4_t is [30, 64] with 31 rows declared",
    );
    only_the_callers(parts.head(None, 0, 0), "main_kv_blocks (0)");
    // The largest mtp_vocab_size that fits is the LM head's row count.
    let head = parts.head(None, VOCAB as u32, 64).unwrap();
    assert_eq!(head.draft_vocab_size(), VOCAB);
    parts.finish(vec![head]);
}

#[test]
fn release_frees_what_new_allocated_and_nothing_of_the_callers() {
    let parts = Parts::new("release");
    let head = parts.head(None, 0, 64).unwrap();
    let callers = parts.allocs.len();
    let live = parts.gpu.ledger().live_count();
    assert!(live > callers, "new allocated caches and scratch");
    head.release(parts.gpu.as_ref()).unwrap();
    assert_eq!(parts.gpu.ledger().live_count(), callers);
    // A second call frees nothing and is not an error.
    head.release(parts.gpu.as_ref()).unwrap();
    assert_eq!(parts.gpu.ledger().live_count(), callers);
    drop(head);
    assert_eq!(
        parts.gpu.ledger().live_count(),
        callers,
        "drop after release"
    );
    parts.finish(vec![]);
}

#[test]
fn main_kv_blocks_caps_the_drafter_pool() {
    let parts = Parts::new("kv_cap");
    let ctx = parts.ctx();
    let roomy = parts.head(None, 0, 1 << 20).unwrap();
    let (uncapped, _) = roomy.kv_blocks();
    // Enough 16-row blocks for MTP_MAX_BATCH sequences of MAX_SEQ rows, and not absurdly more.
    let need = MTP_MAX_BATCH * MAX_SEQ.div_ceil(16);
    assert!(
        (need..2 * need).contains(&uncapped),
        "{uncapped} blocks for {need}"
    );
    let tight = parts.head(None, 0, 3).unwrap();
    assert_eq!(tight.kv_blocks(), (3, 3));
    // Three blocks hold 48 drafter rows: a 40-token prompt (39 rows) fits, a second one
    // finds the pool empty and gets no rows (a full pool costs drafts, not the sequence).
    let (hid, tokens) = inputs(parts.gpu.as_ref(), 48, 3);
    let gpu = parts.gpu.as_ref();
    let prefill = |head: &MtpHead, s: &mut dyn ProposerState| {
        head.prefill_drafter(&tokens[..40], hid, s, &ctx, 0)
            .unwrap()
    };
    let (mut a, mut b) = (
        tight.alloc_state_for(gpu, 64).unwrap(),
        tight.alloc_state_for(gpu, 64).unwrap(),
    );
    assert_eq!(prefill(&tight, &mut *a), 39);
    assert_eq!(tight.kv_blocks(), (3, 0));
    assert_eq!(prefill(&tight, &mut *b), 0);
    // Without the cap both fit.
    let (mut c, mut d) = (
        roomy.alloc_state_for(gpu, 64).unwrap(),
        roomy.alloc_state_for(gpu, 64).unwrap(),
    );
    assert_eq!(
        (prefill(&roomy, &mut *c), prefill(&roomy, &mut *d)),
        (39, 39)
    );
    // Once the first state is freed, the second fits in the capped pool too.
    tight.free_state(gpu, &mut *a).unwrap();
    assert_eq!(prefill(&tight, &mut *b), 39);
    tight.free_state(gpu, &mut *b).unwrap();
    roomy.free_state(gpu, &mut *c).unwrap();
    roomy.free_state(gpu, &mut *d).unwrap();
    gpu.free(hid).unwrap();
    parts.finish(vec![roomy, tight]);
}

/// One `propose_batch` of 2 drafts for `states`, all at position 6.
fn propose_batch(
    head: &MtpHead,
    ctx: &ForwardContext<'_>,
    states: &mut [Box<dyn ProposerState>],
    token: u32,
    hidden: DevicePtr,
) -> specdraft::Result<Option<Vec<Vec<u32>>>> {
    let k = states.len();
    let mut refs: Vec<&mut dyn ProposerState> = states
        .iter_mut()
        .map(|s| &mut **s as &mut dyn ProposerState)
        .collect();
    head.propose_batch(
        &vec![token; k],
        &vec![hidden; k],
        &vec![6; k],
        2,
        &mut refs,
        ctx,
        0,
        None,
    )
}

#[test]
fn propose_batch_takes_at_most_mtp_max_batch_sequences() {
    let parts = Parts::new("batch");
    let ctx = parts.ctx();
    let head = parts.head(None, 0, 4096).unwrap();
    let gpu = parts.gpu.as_ref();
    assert_eq!(
        head.propose_batch_max(&BufferArena::empty(16), &parts.config),
        MTP_MAX_BATCH
    );
    let n = MTP_MAX_BATCH + 1;
    let (hid, tokens) = inputs(gpu, 8, 4);
    let mut states: Vec<Box<dyn ProposerState>> = (0..n)
        .map(|_| {
            let mut s = head.alloc_state_for(gpu, 64).unwrap();
            head.prefill_drafter(&tokens[..6], hid, &mut *s, &ctx, 0)
                .unwrap();
            s
        })
        .collect();
    let last = hid.offset(5 * HIDDEN * 2);
    let batch = |k: usize, states: &mut Vec<Box<dyn ProposerState>>| {
        propose_batch(&head, &ctx, &mut states[..k], tokens[6], last)
    };
    let err = batch(n, &mut states).unwrap_err().to_string();
    assert!(
        err.contains(&format!(
            "{n} sequences; propose_batch_max is {MTP_MAX_BATCH}"
        )),
        "{err}"
    );
    // The refused call touched no state: the full batch runs, every sequence drafts the same.
    let drafts = batch(MTP_MAX_BATCH, &mut states).unwrap().expect("batched");
    assert_eq!(drafts.len(), MTP_MAX_BATCH);
    assert!(drafts.iter().all(|d| d == &drafts[0] && d.len() == 2));
    for s in states.iter_mut() {
        head.free_state(gpu, &mut **s).unwrap();
    }
    gpu.free(hid).unwrap();
    parts.finish(vec![head]);
}
