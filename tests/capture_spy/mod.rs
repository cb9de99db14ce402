//! The capturing proposer of `engine_capture.rs` ([`StackSpy`]): it drafts from a known
//! continuation and records every captured row the engine hands it, with the position the
//! row was computed at; [`check_rows`] compares those rows with a teacher-forced capture of
//! the same tokens.

use crate::model_util::propose_each;
use crate::tiny;
use half::bf16;
use specdraft::backend::{DevicePtr, GpuBackend, GpuBackendExt};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, LogitRows, ModelConfig, TargetModel};
use specdraft::speculative::{DraftProposer, ProposerError, ProposerState};
use specdraft::Result;
use std::sync::Mutex;

/// The capture of `layers` over `tokens` by a teacher-forced forward on a fresh sequence,
/// one row of bits per position.
pub fn teacher_forced(model: &TargetModel, tokens: &[u32], layers: &[usize]) -> Vec<Vec<u16>> {
    let width = layers.len() * model.config().hidden_size;
    let mut seq = model.new_sequence();
    let mut rows = Vec::new();
    for c in tokens.chunks(model.max_rows()) {
        let out = model
            .forward_capturing(&mut [&mut seq], &[c], LogitRows::LastPerSequence, layers)
            .unwrap();
        let v: Vec<bf16> = model
            .gpu()
            .download(out.hidden_stack.unwrap(), out.rows * width)
            .unwrap();
        rows.extend(
            v.chunks(width)
                .map(|r| r.iter().map(|x| x.to_bits()).collect()),
        );
    }
    model.free_sequence(&mut seq).unwrap();
    rows
}

/// What a capturing proposer was given: for request `full`, the rows it received, each with
/// the position it was computed at.
#[derive(Debug)]
pub struct Seen {
    pub full: usize,
    pub what: &'static str,
    pub rows: Vec<(usize, Vec<u16>)>,
}

#[derive(Default)]
pub struct Log {
    pub seen: Vec<Seen>,
    /// Rows counts `k` given to `propose`, in order.
    pub ks: Vec<usize>,
    /// What the proposer's own calls owed each propose: `1 + num_accepted` of the
    /// `after_verify` before it (1 after a prefill), beside its `k`.
    pub owed: Vec<(usize, usize)>,
    /// `num_drafts` of every `propose`.
    pub asked: Vec<usize>,
    /// Contract breaks seen from inside the proposer.
    pub broken: Vec<String>,
    /// The size of every `propose_batch` group.
    pub batches: Vec<usize>,
}

/// Drafts from a known continuation (`right`: the target's own greedy continuation, so
/// every draft is accepted; otherwise always one token off, so none is), and records the
/// stack rows it is given; with `batch`, also through `propose_batch` (groups of up to 4),
/// each sequence from its entry of `ctx.target_hidden_stacks`.
pub struct StackSpy {
    pub layers: Vec<usize>,
    pub fulls: Vec<Vec<u32>>,
    pub right: bool,
    pub batch: bool,
    pub gamma: Option<usize>,
    pub hidden: usize,
    pub vocab: u32,
    pub log: Mutex<Log>,
}

impl StackSpy {
    pub fn new(layers: &[usize], fulls: Vec<Vec<u32>>, right: bool) -> Self {
        let t = tiny();
        StackSpy {
            layers: layers.to_vec(),
            fulls,
            right,
            batch: false,
            gamma: None,
            hidden: t.hidden,
            vocab: t.vocab as u32,
            log: Mutex::new(Log::default()),
        }
    }

    fn width(&self) -> usize {
        self.layers.len() * self.hidden
    }

    fn rows(&self, ctx: &ForwardContext<'_>, p: DevicePtr, n: usize) -> Result<Vec<Vec<u16>>> {
        let v: Vec<bf16> = ctx.gpu.download(p, n * self.width())?;
        Ok(v.chunks(self.width())
            .map(|r| r.iter().map(|x| x.to_bits()).collect())
            .collect())
    }

    fn broke(&self, what: String) {
        self.log.lock().unwrap().broken.push(what);
    }
}

pub struct SpyState {
    pub full: usize,
    /// Position of the last token the proposer has seen a row for.
    pub seen_pos: usize,
    /// `1 + num_accepted` of the last `after_verify`, owed by the next propose.
    pub owed: Option<usize>,
}
specdraft::impl_proposer_state!(SpyState);

fn spy(s: &mut dyn ProposerState) -> Result<&mut SpyState> {
    s.as_any_mut().downcast_mut::<SpyState>().ok_or_else(|| {
        ProposerError::WrongState {
            method: "spy",
            expected: "SpyState",
        }
        .into()
    })
}

impl DraftProposer for StackSpy {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(SpyState {
            full: usize::MAX,
            seen_pos: 0,
            owed: None,
        }))
    }

    fn target_layer_ids(&self) -> Vec<usize> {
        self.layers.clone()
    }

    fn block_gamma(&self) -> Option<usize> {
        self.gamma
    }

    fn prefill_drafter(
        &self,
        prompt: &[u32],
        hiddens: DevicePtr,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        _stream: u64,
    ) -> Result<usize> {
        let st = spy(state)?;
        // A recompute after preemption prefills every token but the last: still a prefix.
        st.full = self
            .fulls
            .iter()
            .position(|f| f.starts_with(prompt))
            .expect("a known prompt");
        st.seen_pos = prompt.len() - 1;
        st.owed = Some(1);
        let Some(stack) = ctx.target_hidden_stack else {
            if !self.layers.is_empty() {
                self.broke("prefill_drafter without a stack".into());
            }
            return Ok(0);
        };
        let rows = self.rows(ctx, stack, prompt.len())?;
        // The last layer's column is the final hidden the `hiddens` rows hold.
        let h: Vec<bf16> = ctx.gpu.download(hiddens, prompt.len() * self.hidden)?;
        for (i, r) in rows.iter().enumerate() {
            let want: Vec<u16> = h[i * self.hidden..(i + 1) * self.hidden]
                .iter()
                .map(|x| x.to_bits())
                .collect();
            if r[..self.hidden] != want[..] {
                self.broke(format!(
                    "prefill row {i}: last layer's column is not its hidden"
                ));
            }
        }
        self.log.lock().unwrap().seen.push(Seen {
            full: st.full,
            what: "prefill_drafter",
            // Row i is the hidden computed at prompt position i.
            rows: rows.into_iter().enumerate().collect(),
        });
        Ok(0)
    }

    fn propose(
        &self,
        last: u32,
        target_hidden: DevicePtr,
        position: usize,
        n: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        _stream: u64,
        _d: Option<DevicePtr>,
        _mask: Option<&[i32]>,
        stack: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        let st = spy(state)?;
        let full = &self.fulls[st.full];
        if full[position] != last {
            self.broke(format!(
                "propose: token {last} at {position}, not {}",
                full[position]
            ));
        }
        // The rows of every token since the last one seen, each computed one position before.
        let k = position - st.seen_pos;
        let Some(owed) = st.owed.take() else {
            self.broke(format!(
                "propose at {position} without a prefill or after_verify"
            ));
            return Ok(Vec::new());
        };
        st.seen_pos = position;
        {
            let mut log = self.log.lock().unwrap();
            log.ks.push(k);
            log.owed.push((k, owed));
            log.asked.push(n);
        }
        match stack {
            None if !self.layers.is_empty() => self.broke("propose without a stack".into()),
            Some(_) if self.layers.is_empty() => self.broke("a stack for no layers".into()),
            None => {}
            Some(p) => {
                let rows = self.rows(ctx, p, k)?;
                let h: Vec<bf16> = ctx.gpu.download(target_hidden, self.hidden)?;
                let last_row: Vec<u16> = h.iter().map(|x| x.to_bits()).collect();
                if rows[k - 1][..self.hidden] != last_row[..] {
                    self.broke(format!(
                        "propose at {position}: last row is not target_hidden"
                    ));
                }
                let first = position + 1 - k;
                self.log.lock().unwrap().seen.push(Seen {
                    full: st.full,
                    what: "propose",
                    rows: rows
                        .into_iter()
                        .enumerate()
                        .map(|(i, r)| (first + i - 1, r))
                        .collect(),
                });
            }
        }
        if ctx.target_hidden_stack.is_some() {
            self.broke("propose's context carries a stack".into());
        }
        if self.layers.is_empty() {
            let tags: Vec<String> = ctx
                .gpu
                .ledger()
                .live_report()
                .into_iter()
                .map(|a| a.tag)
                .filter(|t| t.contains("stack"))
                .collect();
            if !tags.is_empty() {
                self.broke(format!("capture buffers live without capture: {tags:?}"));
            }
        }
        let next = &full[(position + 1).min(full.len())..];
        Ok(next
            .iter()
            .take(n)
            .map(|&t| if self.right { t } else { (t + 1) % self.vocab })
            .collect())
    }

    fn after_verify(&self, a: usize, state: &mut dyn ProposerState, _stream: u64) -> Result<()> {
        spy(state)?.owed = Some(1 + a);
        Ok(())
    }

    fn propose_batch_max(&self, _buffers: &BufferArena, _config: &ModelConfig) -> usize {
        if self.batch {
            4
        } else {
            1
        }
    }

    fn propose_batch(
        &self,
        last: &[u32],
        hiddens: &[DevicePtr],
        positions: &[usize],
        n: usize,
        states: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        stream: u64,
        _conf: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        if !self.batch {
            return Ok(None);
        }
        self.log.lock().unwrap().batches.push(last.len());
        match ctx.target_hidden_stacks {
            Some(s) if s.len() != last.len() => {
                self.broke(format!("{} stacks for {} sequences", s.len(), last.len()));
                return Ok(None);
            }
            None if !self.layers.is_empty() => {
                self.broke("propose_batch without stacks".into());
                return Ok(None);
            }
            _ => {}
        }
        let stacks = ctx.target_hidden_stacks;
        let drafts = propose_each(
            self, last, hiddens, positions, n, states, ctx, stream, stacks,
        )?;
        Ok(Some(drafts))
    }
}

/// Checks every row a spy was given against the teacher-forced capture of its request's
/// whole sequence, and that its rows (prefill and propose together) cover every position
/// from the first on without a gap. Returns how many rows were checked.
pub fn check_rows(
    model: &TargetModel,
    spy: &StackSpy,
    fulls: &[Vec<u32>],
    prompts: &[Vec<u32>],
) -> usize {
    let log = spy.log.lock().unwrap();
    assert!(log.broken.is_empty(), "{:#?}", log.broken);
    let refs: Vec<Vec<Vec<u16>>> = fulls
        .iter()
        .map(|f| teacher_forced(model, &f[..f.len() - 1], &spy.layers))
        .collect();
    let mut checked = 0;
    for s in &log.seen {
        for (pos, row) in &s.rows {
            assert!(
                *row == refs[s.full][*pos],
                "request {} {}: the row computed at {pos} differs from the teacher-forced one",
                s.full,
                s.what
            );
            checked += 1;
        }
    }
    for (i, p) in prompts.iter().enumerate() {
        let mut at: Vec<usize> = log
            .seen
            .iter()
            .filter(|s| s.full == i)
            .flat_map(|s| s.rows.iter().map(|r| r.0))
            .collect();
        at.sort_unstable();
        at.dedup();
        assert!(
            at.len() > p.len(),
            "request {i}: no propose rows past the prompt"
        );
        let want: Vec<usize> = (0..at.len()).collect();
        assert_eq!(at, want, "request {i}: rows with a gap");
    }
    checked
}
