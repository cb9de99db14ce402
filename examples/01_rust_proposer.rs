//! A Rust engine builder's proposer, using the crate without Python or a GPU toolkit.
//!
//! `Bigram` drafts by following, from the last token, the successor seen most often in the
//! prompt and the output so far. The example runs it through `check_proposer` (the same
//! lifecycle an engine drives) and through a few propose/verify rounds by hand.
//!
//! Run: `cargo run --example 01_rust_proposer`

use specdraft::backend::{CpuBackend, DevicePtr, GpuBackend};
use specdraft::memory::BufferArena;
use specdraft::model::{ForwardContext, ModelConfig, ModelLevers};
use specdraft::speculative::conformance::{check_proposer, CheckOptions};
use specdraft::speculative::{bitmask_allows, DraftProposer, ProposerError, ProposerState};
use std::collections::HashMap;
use std::sync::Arc;

/// Per-sequence state: the history and the drafts awaiting verification.
#[derive(Default)]
struct BigramState {
    history: Vec<u32>,
    pending: Vec<u32>,
}
specdraft::impl_proposer_state!(BigramState);

struct Bigram;

impl Bigram {
    fn state(state: &mut dyn ProposerState) -> specdraft::Result<&mut BigramState> {
        state
            .as_any_mut()
            .downcast_mut::<BigramState>()
            .ok_or_else(|| {
                ProposerError::WrongState {
                    method: "Bigram",
                    expected: "BigramState",
                }
                .into()
            })
    }

    /// The most frequent successor of `token` in `history` (ties: the most recent).
    fn successor(history: &[u32], token: u32) -> Option<u32> {
        let mut counts: HashMap<u32, (usize, usize)> = HashMap::new();
        for (i, pair) in history.windows(2).enumerate() {
            if pair[0] == token {
                let entry = counts.entry(pair[1]).or_default();
                *entry = (entry.0 + 1, i);
            }
        }
        counts.into_iter().max_by_key(|&(_, c)| c).map(|(t, _)| t)
    }
}

impl DraftProposer for Bigram {
    fn alloc_state(&self, _gpu: &dyn GpuBackend) -> specdraft::Result<Box<dyn ProposerState>> {
        Ok(Box::new(BigramState::default()))
    }

    fn propose(
        &self,
        last_token: u32,
        _target_hidden: DevicePtr,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        _stream: u64,
        _draft_embed_target: Option<DevicePtr>,
        grammar_bitmask: Option<&[i32]>,
        _target_hidden_stack: Option<DevicePtr>,
    ) -> specdraft::Result<Vec<u32>> {
        if last_token as usize >= ctx.config.vocab_size {
            return Err(ProposerError::TokenOutOfVocab {
                method: "propose",
                token: last_token as u64,
                vocab_size: ctx.config.vocab_size,
            }
            .into());
        }
        let st = Self::state(state)?;
        st.history.truncate(position);
        st.history.push(last_token);
        let mut drafts = Vec::new();
        let mut token = last_token;
        while drafts.len() < num_drafts {
            match Self::successor(&st.history, token) {
                Some(next) if grammar_bitmask.is_none_or(|m| bitmask_allows(m, next)) => {
                    drafts.push(next);
                    token = next;
                }
                _ => break,
            }
        }
        st.pending = drafts.clone();
        Ok(drafts)
    }

    fn after_verify(
        &self,
        num_accepted: usize,
        state: &mut dyn ProposerState,
        _stream: u64,
    ) -> specdraft::Result<()> {
        let st = Self::state(state)?;
        let accepted = st.pending.drain(..).take(num_accepted).collect::<Vec<_>>();
        st.history.extend(accepted);
        Ok(())
    }

    fn prefill_drafter(
        &self,
        prompt_tokens: &[u32],
        _hiddens: DevicePtr,
        state: &mut dyn ProposerState,
        _ctx: &ForwardContext<'_>,
        _stream: u64,
    ) -> specdraft::Result<usize> {
        let st = Self::state(state)?;
        st.history = prompt_tokens.to_vec();
        Ok(0)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let report = check_proposer(
        &Bigram,
        &CheckOptions {
            label: "Bigram".into(),
            ..CheckOptions::default()
        },
    );
    println!("{report}");
    if !report.is_ok() {
        return Err("the example proposer broke a contract".into());
    }

    // Driving it by hand, as an engine would: prefill, then propose and verify.
    let gpu = Arc::new(CpuBackend::new());
    let ctx = ForwardContext::new(
        gpu.clone(),
        Arc::new(BufferArena::empty(1)),
        Arc::new(ModelConfig::tiny(100)),
        ModelLevers::default(),
    );
    let mut state = Bigram.alloc_state_for(&*gpu, 64)?;
    let prompt = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2];
    Bigram.prefill_drafter(&prompt, DevicePtr::NULL, &mut *state, &ctx, 0)?;
    let drafts = Bigram.propose(
        3,
        DevicePtr::NULL,
        prompt.len(),
        3,
        &mut *state,
        &ctx,
        0,
        None,
        None,
        None,
    )?;
    println!("after {prompt:?} + [3] the bigram proposer drafts {drafts:?}");
    Bigram.after_verify(1, &mut *state, 0)?;
    Bigram.free_state(&*gpu, &mut *state)?;
    assert_eq!(gpu.ledger().live_count(), 0);
    Ok(())
}
