//! Members for the `Hybrid` tests: a recorder that logs every protocol call a proposer gets
//! (and the history of tokens it was told), scripted drafters that draft the true greedy
//! continuation with chosen errors, and members that fail on purpose.
#![allow(dead_code)]

use specdraft::backend::{DevicePtr, GpuBackend};
use specdraft::model::ForwardContext;
use specdraft::speculative::{DraftProposer, HybridMember, ProposerError, ProposerState};
use specdraft::Result;
use std::sync::{Arc, Mutex};

/// The recorder id of the hybrid itself (members are 0, 1, ...).
pub const HYBRID: usize = 99;

/// One protocol call, as a recorder saw it.
#[derive(Clone, Debug, PartialEq)]
pub enum Ev {
    Prefill {
        who: usize,
        len: usize,
    },
    Propose {
        who: usize,
        pos: usize,
        last: u32,
        asked: usize,
        drafts: Vec<u32>,
    },
    After {
        who: usize,
        accepted: usize,
    },
    /// At `free_state`: every token the proposer was told, in sequence order.
    Free {
        who: usize,
        history: Vec<u32>,
    },
    /// A `propose_batch` of `size` sequences (each also logged as a `Propose`), at
    /// `positions`, with the confidences it reported (`out_conf`, asked of it always).
    Batch {
        who: usize,
        size: usize,
        positions: Vec<usize>,
        confs: Vec<Vec<f32>>,
    },
}

impl Ev {
    pub fn who(&self) -> usize {
        match self {
            Ev::Prefill { who, .. }
            | Ev::Propose { who, .. }
            | Ev::After { who, .. }
            | Ev::Free { who, .. }
            | Ev::Batch { who, .. } => *who,
        }
    }
}

pub type Log = Arc<Mutex<Vec<Ev>>>;

/// Logs every call to `inner` and keeps the history of tokens `inner` was told, as a
/// retrieval drafter keeps it: the prompt at prefill, each `last_token` at its position, the
/// accepted drafts at `after_verify`. With `batch`, `inner`'s `propose_batch` is passed on,
/// always asked for its confidences, which are logged (else the recorder proposes one
/// sequence at a time).
pub struct Recorder {
    pub who: usize,
    pub inner: Arc<dyn DraftProposer>,
    pub log: Log,
    pub batch: bool,
}

pub struct RecState {
    inner: Box<dyn ProposerState>,
    history: Vec<u32>,
    pending: Vec<u32>,
}
specdraft::impl_proposer_state!(RecState);

fn rec(s: &mut dyn ProposerState) -> &mut RecState {
    s.as_any_mut()
        .downcast_mut::<RecState>()
        .expect("a recorder's state")
}

impl Recorder {
    pub fn member(
        who: usize,
        name: &str,
        inner: Arc<dyn DraftProposer>,
        log: &Log,
    ) -> HybridMember {
        Self::recording(who, name, inner, log, false)
    }

    /// [`Recorder::member`], passing `inner`'s `propose_batch` on.
    pub fn batching_member(
        who: usize,
        name: &str,
        inner: Arc<dyn DraftProposer>,
        log: &Log,
    ) -> HybridMember {
        Self::recording(who, name, inner, log, true)
    }

    fn recording(
        who: usize,
        name: &str,
        inner: Arc<dyn DraftProposer>,
        log: &Log,
        batch: bool,
    ) -> HybridMember {
        let log = log.clone();
        HybridMember::new(
            name,
            Arc::new(Recorder {
                who,
                inner,
                log,
                batch,
            }),
        )
    }

    /// What a propose at `pos` from `last` that returned `drafts` tells the history.
    fn record(&self, r: &mut RecState, last: u32, pos: usize, n: usize, drafts: &[u32]) {
        r.history.truncate(pos);
        r.history.push(last);
        r.pending = drafts.to_vec();
        self.push(Ev::Propose {
            who: self.who,
            pos,
            last,
            asked: n,
            drafts: drafts.to_vec(),
        });
    }

    fn push(&self, e: Ev) {
        self.log.lock().unwrap().push(e);
    }
}

#[allow(clippy::too_many_arguments)]
impl DraftProposer for Recorder {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        self.alloc_state_for(gpu, usize::MAX)
    }
    fn alloc_state_for(
        &self,
        gpu: &dyn GpuBackend,
        budget: usize,
    ) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(RecState {
            inner: self.inner.alloc_state_for(gpu, budget)?,
            history: Vec::new(),
            pending: Vec::new(),
        }))
    }
    fn propose(
        &self,
        last: u32,
        h: DevicePtr,
        pos: usize,
        n: usize,
        s: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        st: u64,
        d: Option<DevicePtr>,
        m: Option<&[i32]>,
        k: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        let r = rec(s);
        let drafts = self
            .inner
            .propose(last, h, pos, n, r.inner.as_mut(), ctx, st, d, m, k)?;
        self.record(r, last, pos, n, &drafts);
        Ok(drafts)
    }
    fn propose_batch(
        &self,
        last: &[u32],
        h: &[DevicePtr],
        pos: &[usize],
        n: usize,
        s: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        st: u64,
        conf: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<Vec<Vec<u32>>>> {
        if !self.batch {
            return Ok(None);
        }
        let mut confs = Vec::new();
        let got = {
            let mut inner: Vec<&mut dyn ProposerState> = Vec::with_capacity(s.len());
            for x in s.iter_mut() {
                let r: &mut RecState = rec(&mut **x);
                inner.push(&mut *r.inner);
            }
            self.inner
                .propose_batch(last, h, pos, n, &mut inner, ctx, st, Some(&mut confs))?
        };
        if let Some(drafts) = &got {
            self.push(Ev::Batch {
                who: self.who,
                size: last.len(),
                positions: pos.to_vec(),
                confs: confs.clone(),
            });
            if let Some(out) = conf {
                *out = confs;
            }
            for (i, x) in s.iter_mut().enumerate() {
                self.record(rec(&mut **x), last[i], pos[i], n, &drafts[i]);
            }
        }
        Ok(got)
    }
    fn propose_batch_max(
        &self,
        buffers: &specdraft::memory::BufferArena,
        config: &specdraft::model::ModelConfig,
    ) -> usize {
        match self.batch {
            true => self.inner.propose_batch_max(buffers, config),
            false => 1,
        }
    }
    fn after_verify(&self, a: usize, s: &mut dyn ProposerState, st: u64) -> Result<()> {
        let r = rec(s);
        self.push(Ev::After {
            who: self.who,
            accepted: a,
        });
        self.inner.after_verify(a, r.inner.as_mut(), st)?;
        let pending = std::mem::take(&mut r.pending);
        r.history
            .extend_from_slice(&pending[..a.min(pending.len())]);
        Ok(())
    }
    fn target_layer_ids(&self) -> Vec<usize> {
        self.inner.target_layer_ids()
    }
    fn block_gamma(&self) -> Option<usize> {
        self.inner.block_gamma()
    }
    fn prefill_hidden_rows(&self, max_seq_len: usize) -> usize {
        self.inner.prefill_hidden_rows(max_seq_len)
    }
    fn drafter_rows(&self, s: &mut dyn ProposerState) -> usize {
        self.inner.drafter_rows(rec(s).inner.as_mut())
    }
    fn catchup_batch(
        &self,
        t: &[Vec<u32>],
        h: &[Vec<DevicePtr>],
        fp: &[usize],
        s: &mut [&mut dyn ProposerState],
        ctx: &ForwardContext<'_>,
        st: u64,
    ) -> Result<usize> {
        let mut inner: Vec<&mut dyn ProposerState> = Vec::with_capacity(s.len());
        for x in s.iter_mut() {
            let r: &mut RecState = rec(&mut **x);
            inner.push(&mut *r.inner);
        }
        self.inner.catchup_batch(t, h, fp, &mut inner, ctx, st)
    }
    fn prefill_drafter(
        &self,
        p: &[u32],
        h: DevicePtr,
        s: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        st: u64,
    ) -> Result<usize> {
        let r = rec(s);
        r.history = p.to_vec();
        self.push(Ev::Prefill {
            who: self.who,
            len: p.len(),
        });
        self.inner.prefill_drafter(p, h, r.inner.as_mut(), ctx, st)
    }
    fn free_state(&self, gpu: &dyn GpuBackend, s: &mut dyn ProposerState) -> Result<()> {
        let r = rec(s);
        self.push(Ev::Free {
            who: self.who,
            history: r.history.clone(),
        });
        self.inner.free_state(gpu, r.inner.as_mut())
    }
}

/// How a [`Scripted`] drafter drafts from position `pos` (`None`: no drafts): `len` tokens of
/// the true continuation, the one at index `wrong` (if within `len`) changed.
pub type Plan = fn(pos: usize) -> Option<(usize, usize)>;

/// Drafts from the true greedy continuation of its sequence (found among `fulls` by the
/// prompt it was prefilled with), as `plan` says.
pub struct Scripted {
    pub fulls: Vec<Vec<u32>>,
    pub plan: Plan,
    pub vocab: u32,
}

#[derive(Default)]
pub struct Prompt(Vec<u32>);
specdraft::impl_proposer_state!(Prompt);

impl DraftProposer for Scripted {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(Prompt::default()))
    }
    fn propose(
        &self,
        _last: u32,
        _h: DevicePtr,
        pos: usize,
        n: usize,
        s: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _st: u64,
        _d: Option<DevicePtr>,
        _m: Option<&[i32]>,
        _k: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        let prompt = &s.as_any_mut().downcast_mut::<Prompt>().unwrap().0;
        let Some((len, wrong)) = (self.plan)(pos) else {
            return Ok(Vec::new());
        };
        let Some(full) = self.fulls.iter().find(|f| f.starts_with(prompt)) else {
            return Ok(Vec::new());
        };
        let end = (pos + 1 + len.min(n)).min(full.len());
        let mut d: Vec<u32> = full.get(pos + 1..end).unwrap_or(&[]).to_vec();
        if let Some(t) = d.get_mut(wrong) {
            *t = (*t + 1) % self.vocab;
        }
        Ok(d)
    }
    fn after_verify(&self, _a: usize, _s: &mut dyn ProposerState, _st: u64) -> Result<()> {
        Ok(())
    }
    fn prefill_drafter(
        &self,
        p: &[u32],
        _h: DevicePtr,
        s: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _st: u64,
    ) -> Result<usize> {
        s.as_any_mut().downcast_mut::<Prompt>().unwrap().0 = p.to_vec();
        Ok(0)
    }
}

/// Holds 64 bytes of device memory per state (freed by `free_state`), drafts nothing, and
/// fails `propose` from position `fail_from` on, or `alloc_state` when `fail_alloc`.
pub struct Faulty {
    pub fail_from: usize,
    pub fail_alloc: bool,
}

pub struct Held(DevicePtr);
specdraft::impl_proposer_state!(Held);

impl DraftProposer for Faulty {
    fn alloc_state(&self, gpu: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        if self.fail_alloc {
            return Err(ProposerError::Failed {
                method: "alloc_state".into(),
                message: "planted allocation failure".into(),
            }
            .into());
        }
        Ok(Box::new(Held(gpu.alloc(64, "test:faulty")?)))
    }
    fn propose(
        &self,
        _last: u32,
        _h: DevicePtr,
        pos: usize,
        _n: usize,
        _s: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _st: u64,
        _d: Option<DevicePtr>,
        _m: Option<&[i32]>,
        _k: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        if pos >= self.fail_from {
            return Err(ProposerError::Failed {
                method: "propose".into(),
                message: format!("planted failure at position {pos}"),
            }
            .into());
        }
        Ok(Vec::new())
    }
    fn after_verify(&self, _a: usize, _s: &mut dyn ProposerState, _st: u64) -> Result<()> {
        Ok(())
    }
    fn free_state(&self, gpu: &dyn GpuBackend, s: &mut dyn ProposerState) -> Result<()> {
        let held = s.as_any_mut().downcast_mut::<Held>().unwrap();
        gpu.free(std::mem::take(&mut held.0))?;
        Ok(())
    }
}

/// Length of the common prefix of `a` and `b`.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Checks one sequence's log against the hybrid's rules, given the members' `min_drafts`
/// and the sequence's prompt and output. Returns, per member, the steps it won, the steps
/// its drafts lost, and the tokens it was given to catch up on.
pub fn check_rules(log: &[Ev], mins: &[usize], full: &[u32]) -> [Vec<usize>; 3] {
    let m = mins.len();
    let stream =
        |who: usize| -> Vec<Ev> { log.iter().filter(|e| e.who() == who).cloned().collect() };
    let hybrid = stream(HYBRID);
    let mut members: Vec<std::vec::IntoIter<Ev>> = (0..m).map(|i| stream(i).into_iter()).collect();
    let mut wins = vec![0; m];
    let mut lost = vec![0; m];
    let mut replayed = vec![0; m];
    let mut missed: Vec<(Vec<u32>, usize)> = vec![(Vec::new(), 0); m];
    let mut h = hybrid.iter();
    let Some(Ev::Prefill { len, .. }) = h.next() else {
        panic!("the hybrid's log starts with its prefill: {hybrid:?}");
    };
    for (i, s) in members.iter_mut().enumerate() {
        assert_eq!(s.next(), Some(Ev::Prefill { who: i, len: *len }));
    }
    let mut last_step = (0, 0);
    loop {
        let (pos, last, asked, out) = match h.next() {
            Some(Ev::Propose {
                pos,
                last,
                asked,
                drafts,
                ..
            }) => (*pos, *last, *asked, drafts.clone()),
            Some(Ev::Free { history, .. }) => {
                let (pos, a) = last_step;
                assert_eq!(
                    history.as_slice(),
                    &full[..pos + 1 + a],
                    "the hybrid's history"
                );
                break;
            }
            other => panic!("expected a propose or the free, got {other:?}"),
        };
        let Some(Ev::After { accepted: a, .. }) = h.next() else {
            panic!("the hybrid's propose at {pos} is followed by its after_verify");
        };
        let a = *a;
        // Catch-up: each missed token as a propose of 0 drafts and after_verify(0).
        for (i, s) in members.iter_mut().enumerate() {
            let (tokens, from) = std::mem::take(&mut missed[i]);
            for (j, &t) in tokens.iter().enumerate() {
                assert_eq!(
                    s.next(),
                    Some(Ev::Propose {
                        who: i,
                        pos: from + j,
                        last: t,
                        asked: 0,
                        drafts: vec![]
                    }),
                    "member {i}'s catch-up before the step at {pos}"
                );
                assert_eq!(
                    s.next(),
                    Some(Ev::After {
                        who: i,
                        accepted: 0
                    })
                );
                replayed[i] += 1;
            }
        }
        // The round: asked in order until the first confident member, the rest asked for 0.
        let mut winner = None;
        let mut drafts = vec![Vec::new(); m];
        for (i, s) in members.iter_mut().enumerate() {
            let Some(Ev::Propose {
                pos: p,
                last: l,
                asked: n,
                drafts: d,
                ..
            }) = s.next()
            else {
                panic!("member {i} proposes at {pos}");
            };
            assert_eq!(
                (p, l),
                (pos, last),
                "member {i} drafts from the hybrid's token"
            );
            let want = if winner.is_none() { asked } else { 0 };
            assert_eq!(n, want, "member {i} at {pos}: asked {n}, want {want}");
            if winner.is_none() && n > 0 && d.len() >= mins[i] {
                winner = Some(i);
            }
            drafts[i] = d;
        }
        let won = winner.map(|w| drafts[w].clone()).unwrap_or_default();
        assert_eq!(
            out, won,
            "the hybrid returns the first confident member's drafts at {pos}"
        );
        if let Some(w) = winner {
            wins[w] += 1;
        }
        for (i, d) in drafts.iter().enumerate() {
            lost[i] += usize::from(winner != Some(i) && !d.is_empty());
        }
        let committed = &won[..a];
        for (i, s) in members.iter_mut().enumerate() {
            let acc = if winner == Some(i) {
                a
            } else {
                common_prefix(&drafts[i], committed)
            };
            assert_eq!(
                s.next(),
                Some(Ev::After {
                    who: i,
                    accepted: acc
                }),
                "member {i}'s after_verify at {pos} (winner {winner:?}, drafts {:?}, committed {committed:?})",
                drafts[i]
            );
            missed[i] = (committed[acc..].to_vec(), pos + 1 + acc);
        }
        last_step = (pos, a);
    }
    for (i, s) in members.iter_mut().enumerate() {
        let Some(Ev::Free { history, .. }) = s.next() else {
            panic!("member {i}'s state is freed last");
        };
        let (pos, a) = last_step;
        // The last step's accepted drafts a member did not draft itself are never replayed.
        let seen = pos + 1 + (a - missed[i].0.len());
        assert_eq!(history.as_slice(), &full[..seen], "member {i}'s history");
        assert_eq!(s.next(), None, "member {i} got nothing after free_state");
    }
    [wins, lost, replayed]
}
