//! Chat turns: drafter KV carried from one turn into the next (take → install → catch-up)
//! gives exactly the drafter state, drafts and acceptance of a drafter rebuilt from
//! scratch over the whole history; declined or dropped entries are freed.

mod engine_common;

use engine_common::*;
use specdraft::backend::{DevicePtr, GpuBackend};
use specdraft::engine::testing::{decode_hidden, TableTarget};
use specdraft::engine::{
    DraftPolicyKind, EngineError, GenerateRequest, GrammarMatcher, SpecEngine,
};
use specdraft::memory::BlockAllocator;
use specdraft::model::ForwardContext;
use specdraft::speculative::{DraftProposer, ProposerError, ProposerState};
use specdraft::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

const BLOCK: usize = 4;

/// Drafter "KV" rows `(position, token)` kept in blocks of a `BlockAllocator` (the block
/// contents in `store`, standing in for device memory). It drafts by looking the last token
/// up in its own rows only, so missing or wrong rows change its drafts.
struct KvEcho {
    pool: BlockAllocator,
    store: Mutex<HashMap<u32, Vec<(usize, u32)>>>,
    install_ok: bool,
    shared: bool,
    snapshots: Mutex<Vec<Vec<(usize, u32)>>>,
    gpu: Arc<dyn GpuBackend>,
}

#[derive(Default)]
struct EchoState {
    blocks: Vec<u32>,
    rows: Vec<(usize, u32)>,
    propose_pos: usize,
}
specdraft::impl_proposer_state!(EchoState);

fn st(s: &mut dyn ProposerState) -> Result<&mut EchoState> {
    s.as_any_mut().downcast_mut::<EchoState>().ok_or_else(|| {
        ProposerError::WrongState {
            method: "echo",
            expected: "EchoState",
        }
        .into()
    })
}

impl KvEcho {
    fn new(gpu: Arc<dyn GpuBackend>, install_ok: bool, shared: bool) -> Self {
        KvEcho {
            pool: BlockAllocator::new(64, BLOCK).unwrap(),
            store: Mutex::new(HashMap::new()),
            install_ok,
            shared,
            snapshots: Mutex::new(Vec::new()),
            gpu,
        }
    }
    /// Writes the state's rows through to its blocks, growing or shrinking them.
    fn sync(&self, s: &mut EchoState) -> Result<()> {
        let need = s.rows.len().div_ceil(BLOCK);
        if s.blocks.len() < need {
            s.blocks.extend(self.pool.alloc(need - s.blocks.len())?);
        } else if s.blocks.len() > need {
            let extra = s.blocks.split_off(need);
            self.pool.free(&extra)?;
        }
        let mut store = self.store.lock().unwrap();
        for (k, &b) in s.blocks.iter().enumerate() {
            store.insert(
                b,
                s.rows[k * BLOCK..((k + 1) * BLOCK).min(s.rows.len())].to_vec(),
            );
        }
        Ok(())
    }
    fn hidden(&self, h: DevicePtr, k: usize) -> (u32, usize) {
        let hs = 64;
        let v = specdraft::backend::GpuBackendExt::download_bf16(
            self.gpu.as_ref(),
            h.offset(k * hs * 2),
            hs,
        )
        .unwrap();
        decode_hidden(&v)
    }
    /// Appends the row at `pos` for `token`, checking its paired hidden against the row before.
    fn append(&self, s: &mut EchoState, pos: usize, token: u32, pair: (u32, usize)) -> Result<()> {
        if pair.1 + 1 != pos
            || s.rows
                .last()
                .is_some_and(|&(p, t)| p + 1 == pos && t != pair.0)
        {
            return Err(ProposerError::Failed {
                method: "echo".into(),
                message: format!(
                    "row {pos} paired with {pair:?}, rows end {:?}",
                    s.rows.last()
                ),
            }
            .into());
        }
        s.rows.push((pos, token));
        Ok(())
    }
}

impl DraftProposer for KvEcho {
    fn alloc_state(&self, _g: &dyn GpuBackend) -> Result<Box<dyn ProposerState>> {
        Ok(Box::new(EchoState::default()))
    }
    fn prefill_uses_shared_buffers(&self) -> bool {
        self.shared
    }
    fn prefill_drafter(
        &self,
        prompt: &[u32],
        h: DevicePtr,
        state: &mut dyn ProposerState,
        _c: &ForwardContext<'_>,
        _s: u64,
    ) -> Result<usize> {
        let s = st(state)?;
        for (p, &t) in prompt.iter().enumerate().skip(1) {
            let pair = self.hidden(h, p - 1);
            self.append(s, p, t, pair)?;
        }
        self.sync(s)?;
        Ok(prompt.len().saturating_sub(1))
    }
    fn catchup_drafter(
        &self,
        tokens: &[u32],
        h: DevicePtr,
        row_base: usize,
        pos_base: usize,
        state: &mut dyn ProposerState,
        _c: &ForwardContext<'_>,
        _s: u64,
    ) -> Result<usize> {
        let s = st(state)?;
        assert_eq!(row_base, s.rows.len(), "row_base is the carried row count");
        for (k, &t) in tokens.iter().enumerate() {
            let pair = self.hidden(h, k);
            self.append(s, pos_base + k, t, pair)?;
        }
        self.sync(s)?;
        Ok(tokens.len())
    }
    fn propose(
        &self,
        last: u32,
        h: DevicePtr,
        position: usize,
        n: usize,
        state: &mut dyn ProposerState,
        _c: &ForwardContext<'_>,
        _s: u64,
        _d: Option<DevicePtr>,
        _m: Option<&[i32]>,
        _k: Option<DevicePtr>,
    ) -> Result<Vec<u32>> {
        let s = st(state)?;
        s.rows.retain(|&(p, _)| p < position);
        s.propose_pos = position;
        let pair = self.hidden(h, 0);
        self.append(s, position, last, pair)?;
        // Most recent earlier row with the same token; draft what followed it.
        let toks: Vec<u32> = s.rows.iter().map(|r| r.1).collect();
        let mut drafts = Vec::new();
        if let Some(i) = (0..toks.len() - 1).rev().find(|&i| toks[i] == last) {
            drafts = toks[i + 1..].iter().take(n).copied().collect();
        }
        for (k, &d) in drafts.iter().enumerate() {
            s.rows.push((position + 1 + k, d));
        }
        self.sync(s)?;
        Ok(drafts)
    }
    fn after_verify(&self, a: usize, state: &mut dyn ProposerState, _s: u64) -> Result<()> {
        let s = st(state)?;
        // Rows of rejected drafts go; the newest kept row is the last accepted draft.
        let keep = s.propose_pos + a;
        s.rows.retain(|&(p, _)| p <= keep);
        self.sync(s)
    }
    fn drafter_rows(&self, state: &mut dyn ProposerState) -> usize {
        st(state).map(|s| s.rows.len()).unwrap_or(0)
    }
    fn last_pair_key(&self, state: &mut dyn ProposerState) -> Option<usize> {
        st(state).ok()?.rows.last().map(|r| r.0 - 1)
    }
    fn take_drafter_kv(
        &self,
        state: &mut dyn ProposerState,
    ) -> Option<(Vec<u32>, usize, Option<usize>)> {
        let s = st(state).ok()?;
        if s.rows.is_empty() {
            return None;
        }
        self.snapshots.lock().unwrap().push(s.rows.clone());
        let key = s.rows.last().map(|r| r.0 - 1);
        let rows = s.rows.len();
        s.rows.clear();
        Some((std::mem::take(&mut s.blocks), rows, key))
    }
    fn install_drafter_kv(
        &self,
        state: &mut dyn ProposerState,
        blocks: Vec<u32>,
        rows: usize,
        _key: Option<usize>,
    ) -> bool {
        if !self.install_ok {
            return false;
        }
        let Ok(s) = st(state) else { return false };
        let store = self.store.lock().unwrap();
        s.rows = blocks
            .iter()
            .flat_map(|b| store.get(b).cloned().unwrap_or_default())
            .take(rows)
            .collect();
        s.blocks = blocks;
        true
    }
    fn free_drafter_kv(&self, blocks: &[u32]) {
        self.pool.free(blocks).unwrap();
    }
    fn free_state(&self, _g: &dyn GpuBackend, state: &mut dyn ProposerState) -> Result<()> {
        let s = st(state)?;
        if !s.rows.is_empty() {
            self.snapshots.lock().unwrap().push(s.rows.clone());
        }
        self.pool.free(&std::mem::take(&mut s.blocks))?;
        s.rows.clear();
        Ok(())
    }
}

struct Turns {
    replies: Vec<Vec<u32>>,
    accepted: Vec<(u64, u64)>,
}

fn converse(
    target: &Arc<TableTarget>,
    echo: &Arc<KvEcho>,
    turns: &[Vec<u32>],
) -> (Turns, Option<usize>) {
    let engine = SpecEngine::new(
        target.clone(),
        Some(echo.clone() as Arc<dyn DraftProposer>),
        3,
    )
    .unwrap()
    // Runs compared step by step must ask for the same drafts.
    .with_draft_policy(DraftPolicyKind::Fixed);
    let mut conv = engine.conversation();
    let mut out = Turns {
        replies: vec![],
        accepted: vec![],
    };
    for t in turns {
        let r = conv.send(GenerateRequest::new(t.clone(), 24)).unwrap();
        out.accepted.push((r.metrics.drafted, r.metrics.accepted));
        out.replies.push(r.tokens);
        conv.append(&CLOSE_TURN);
    }
    let carried = conv.carried().map(|c| c.rows);
    (out, carried)
}

/// Tokens appended after each reply without generating, as a chat template closes a turn.
const CLOSE_TURN: [u32; 2] = [46, 47];

fn turns() -> Vec<Vec<u32>> {
    vec![
        vec![1, 2, 3, 4, 1, 2, 3],
        vec![4, 1, 2, 30, 31],
        vec![7, 7, 1, 2],
    ]
}

fn carried_equals_rebuilt(shared: bool) {
    let gpu = cpu();
    let target = table(&gpu);
    let echo = Arc::new(KvEcho::new(gpu.clone(), true, shared));
    let (conv, carried) = converse(&target, &echo, &turns());
    assert!(carried.is_some(), "the last turn's drafter KV is carried");
    let carried_rows = echo.snapshots.lock().unwrap().clone();
    // Rebuild each turn from scratch: one request over the whole history so far.
    let fresh = Arc::new(KvEcho::new(gpu.clone(), true, shared));
    let engine = SpecEngine::new(
        target.clone(),
        Some(fresh.clone() as Arc<dyn DraftProposer>),
        3,
    )
    .unwrap()
    // Runs compared step by step must ask for the same drafts.
    .with_draft_policy(DraftPolicyKind::Fixed);
    let mut history = Vec::new();
    for (i, t) in turns().iter().enumerate() {
        history.extend_from_slice(t);
        let g = engine.generate(vec![GenerateRequest::new(history.clone(), 24)]);
        let r = &g.results[0];
        assert!(r.error.is_none(), "{:?}", r.error);
        assert_eq!(r.tokens, conv.replies[i], "turn {i} reply");
        assert_eq!(
            (r.metrics.drafted, r.metrics.accepted),
            conv.accepted[i],
            "turn {i} drafts"
        );
        history.extend_from_slice(&r.tokens);
        history.extend_from_slice(&CLOSE_TURN);
    }
    // The drafter rows at the end of every turn are identical, and they are exactly the
    // sequence's tokens at positions 1.. (the pairing held on every row).
    let rebuilt_rows = fresh.snapshots.lock().unwrap().clone();
    assert_eq!(carried_rows, rebuilt_rows);
    for rows in &carried_rows {
        for &(p, t) in rows {
            assert_eq!(history[p], t, "row at position {p}");
        }
    }
    assert!(
        conv.accepted.iter().skip(1).any(|&(_, a)| a > 0),
        "carried rows are used for drafting"
    );
    // Dropping the conversation freed the carried blocks.
    assert_eq!(echo.pool.num_free(), echo.pool.num_blocks());
    assert_eq!(fresh.pool.num_free(), fresh.pool.num_blocks());
    assert_eq!(target.live_sequences(), 0);
}

#[test]
fn carried_drafter_kv_equals_rebuilt_from_scratch() {
    carried_equals_rebuilt(false);
}

#[test]
fn carried_drafter_kv_catches_up_at_the_first_propose_when_deferred() {
    carried_equals_rebuilt(true);
}

#[test]
fn declined_install_frees_the_blocks_and_prefills_instead() {
    let gpu = cpu();
    let target = table(&gpu);
    let accepting = Arc::new(KvEcho::new(gpu.clone(), true, false));
    let declining = Arc::new(KvEcho::new(gpu.clone(), false, false));
    let (a, _) = converse(&target, &accepting, &turns());
    let (b, _) = converse(&target, &declining, &turns());
    assert_eq!(a.replies, b.replies);
    assert_eq!(a.accepted, b.accepted);
    assert_eq!(declining.pool.num_free(), declining.pool.num_blocks());
    drop(target);
    assert_eq!(gpu.ledger().live_count(), 0);
}

/// A grammar that fails once it has seen `after` tokens: a failure in the middle of a run.
struct FailingGrammar {
    after: usize,
    seen: usize,
}

impl GrammarMatcher for FailingGrammar {
    fn fill_mask(&mut self, mask: &mut [i32]) -> Result<()> {
        if self.seen >= self.after {
            return Err(EngineError::Grammar("deliberate grammar failure".into()).into());
        }
        mask.fill(-1);
        Ok(())
    }
    fn advance(&mut self, _token: u32) -> Result<()> {
        self.seen += 1;
        Ok(())
    }
}

#[test]
fn a_bad_turn_changes_nothing_and_a_failed_turn_frees_the_carried_entry() {
    let gpu = cpu();
    let target = Arc::new(TableTarget::new(gpu.clone(), 48, 40, 64, 11, 0.2).unwrap());
    let echo = Arc::new(KvEcho::new(gpu.clone(), true, false));
    let engine = SpecEngine::new(
        target.clone(),
        Some(echo.clone() as Arc<dyn DraftProposer>),
        3,
    )
    .unwrap();
    let mut conv = engine.conversation();
    conv.send(GenerateRequest::new(vec![1, 2, 3, 1, 2], 10))
        .unwrap();
    let history = conv.history().to_vec();
    let carried = conv.carried().cloned();
    assert!(carried.is_some());
    // The next prompt would not fit the 40-token context: refused, nothing changes.
    let err = conv.send(GenerateRequest::new(vec![5; 30], 4)).unwrap_err();
    assert!(
        matches!(&err, Error::Engine(e) if e.is_request_error()),
        "{err:?}"
    );
    assert!(err.to_string().contains("context holds 40"), "{err}");
    assert_eq!(conv.history(), history.as_slice());
    assert_eq!(conv.carried(), carried.as_ref());
    // A failure while running keeps the history and frees the carried entry.
    let failing = GenerateRequest::new(vec![4, 5], 8)
        .with_grammar(Box::new(FailingGrammar { after: 3, seen: 0 }));
    let err = conv.send(failing).unwrap_err();
    assert!(
        err.to_string().contains("deliberate grammar failure"),
        "{err}"
    );
    assert_eq!(conv.history(), history.as_slice());
    assert!(conv.carried().is_none());
    assert_eq!(echo.pool.num_free(), echo.pool.num_blocks());
}
