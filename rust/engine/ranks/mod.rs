//! Multi-rank serving: rank 0 runs the engine and announces each collective step to the
//! workers; every other rank runs [`run_worker`], which replays those steps on its own
//! shard of the model until rank 0 sends [`Command::Shutdown`] ([`shutdown_workers`]).
//!
//! Invariants:
//! - On rank 0 of a model that spans several ranks, every target call that runs a forward
//!   (prefill, verify, tree verify) or changes a sequence's KV (trim, compact, free) sends
//!   its command before it runs, in call order (see `model_target.rs`). A model on one rank
//!   sends nothing and pays nothing.
//! - A worker keeps one sequence per id rank 0 names, created when first named and dropped
//!   when freed, so its KV holds exactly the rows rank 0's does: the same forwards over the
//!   same tokens, the same trims and compactions.
//! - A command whose call fails on a worker failed the same way on rank 0 (the model
//!   checks its arguments before any collective, and a forward is all-or-nothing), so the
//!   worker counts it and serves on; a failure of the communicator itself ends the loop
//!   with its error, which names the ranks.

pub(super) mod proposer;

use super::Target;
use crate::backend::GpuBackend;
use crate::distributed::{Command, Communicator, SeqTokens};
use crate::model::{ForwardContext, KvSequence, ModelLevers, TargetModel};
use crate::speculative::{DraftProposer, ProposerState};
use crate::Result;
use std::collections::{BTreeMap, HashMap};

/// The communicator `model` announces on: `Some` on rank 0 of a model that spans several
/// ranks.
fn leader(model: &TargetModel) -> Option<&dyn Communicator> {
    let comm = model.expert_shard()?.comm();
    (comm.rank() == 0).then_some(comm)
}

/// Sends the workers the command `make` builds, when `model` is rank 0 of several.
pub(super) fn announce(model: &TargetModel, make: impl FnOnce() -> Command) -> Result<()> {
    if let Some(comm) = leader(model) {
        comm.send_command(&make())?;
    }
    Ok(())
}

/// The command form of a batch: each sequence's id and new tokens.
pub(super) fn batch_of(seqs: &[&mut KvSequence], tokens: &[&[u32]]) -> Vec<SeqTokens> {
    seqs.iter()
        .zip(tokens)
        .map(|(s, t)| SeqTokens {
            seq: s.id(),
            tokens: t.to_vec(),
        })
        .collect()
}

/// Tells `model`'s workers to leave [`run_worker`]. Rank 0 calls it once, when it is done
/// with the model; on one rank, or on a worker, it does nothing.
pub fn shutdown_workers(model: &TargetModel) -> Result<()> {
    announce(model, || Command::Shutdown)
}

/// What a worker did, returned when rank 0 shuts it down.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerReport {
    /// Commands served, the shutdown included.
    pub commands: usize,
    /// Commands served by kind ([`Command::kind`]).
    pub by_kind: BTreeMap<&'static str, usize>,
    /// Commands whose call failed (as it failed on rank 0).
    pub failed: usize,
    /// The last failure's message.
    pub last_error: Option<String>,
    /// Sequences still held at the shutdown (rank 0 had not freed them); their KV is freed.
    pub leftover_sequences: usize,
}

/// Serves rank 0 on a worker: receives each command and runs the same call on `model`,
/// until [`Command::Shutdown`]. Refused on rank 0 and on a model loaded on one rank. A
/// worker that must also run a sharded proposer uses [`run_worker_with`].
pub fn run_worker(model: &TargetModel) -> Result<WorkerReport> {
    run_worker_with(model, None, ModelLevers::default())
}

/// [`run_worker`] that also runs `proposer`'s announced calls (a proposer whose experts are
/// split across the ranks, loaded here with this rank's share) under `levers`, which must
/// be rank 0's engine's.
pub fn run_worker_with(
    model: &TargetModel,
    proposer: Option<&dyn DraftProposer>,
    levers: ModelLevers,
) -> Result<WorkerReport> {
    let Some(shard) = model.expert_shard() else {
        return Err(crate::engine::EngineError::InvalidArgument {
            what: "run_worker",
            message: "the model was loaded on one rank; there is no rank 0 to serve".into(),
        }
        .into());
    };
    let comm = shard.comm();
    let mut seqs: HashMap<u64, KvSequence> = HashMap::new();
    let mut drafter = WorkerDrafter {
        proposer,
        states: HashMap::new(),
        ctx: ForwardContext::new(
            model.gpu().clone(),
            model.buffers().clone(),
            model.config().clone(),
            levers,
        ),
    };
    let mut report = WorkerReport::default();
    loop {
        let command = comm.recv_command()?;
        report.commands += 1;
        *report.by_kind.entry(command.kind()).or_default() += 1;
        if command == Command::Shutdown {
            report.leftover_sequences = seqs.len() + drafter.states.len();
            for (_, mut seq) in seqs.drain() {
                model.free_sequence(&mut seq)?;
            }
            drafter.free_all()?;
            return Ok(report);
        }
        let result = match drafter.handles(&command) {
            true => drafter.replay(command),
            false => replay(model, &mut seqs, command),
        };
        if let Err(e) = result {
            if let crate::Error::Distributed(_) = e {
                return Err(e);
            }
            report.failed += 1;
            report.last_error = Some(e.to_string());
        }
    }
}

/// Runs one command on the worker's `model`.
fn replay(
    model: &TargetModel,
    seqs: &mut HashMap<u64, KvSequence>,
    command: Command,
) -> Result<()> {
    match command {
        Command::Prefill { batch, layers } => forward_batch(model, seqs, &batch, |m, s, t| {
            Target::forward_capturing(m, s, t, true, &widen(&layers))
        }),
        Command::Verify {
            batch,
            layers,
            trees,
        } => {
            let layers = widen(&layers);
            if trees.iter().all(Option::is_none) {
                return forward_batch(model, seqs, &batch, |m, s, t| {
                    Target::forward_capturing(m, s, t, false, &layers)
                });
            }
            let parents: Vec<Option<Vec<usize>>> =
                trees.iter().map(|t| t.as_deref().map(widen)).collect();
            let trees: Vec<Option<&[usize]>> = parents.iter().map(Option::as_deref).collect();
            forward_batch(model, seqs, &batch, |m, s, t| {
                Target::forward_tree(m, s, t, &trees, &layers)
            })
        }
        Command::Trim { seq, len } => {
            let s = seqs.entry(seq).or_insert_with(|| model.new_sequence());
            Target::trim(model, s, len as usize)
        }
        Command::Compact { seq, start, rows } => {
            let s = seqs.entry(seq).or_insert_with(|| model.new_sequence());
            Target::compact(model, s, start as usize, &widen(&rows))
        }
        Command::Free { seq } => match seqs.remove(&seq) {
            Some(mut s) => Target::free_sequence(model, &mut s),
            None => Ok(()),
        },
        // The proposer's calls are the drafter's (`WorkerDrafter::handles`).
        _ => Ok(()),
    }
}

/// Runs `call` over `batch`'s sequences (taken out of `seqs` for the call, then put back).
fn forward_batch(
    model: &TargetModel,
    seqs: &mut HashMap<u64, KvSequence>,
    batch: &[SeqTokens],
    call: impl FnOnce(&TargetModel, &mut [&mut KvSequence], &[&[u32]]) -> Result<super::TargetOutput>,
) -> Result<()> {
    let mut taken: Vec<(u64, KvSequence)> = Vec::with_capacity(batch.len());
    for entry in batch {
        if taken.iter().any(|(id, _)| *id == entry.seq) {
            // Put back what was taken before refusing.
            seqs.extend(taken);
            return Err(crate::engine::EngineError::InvalidArgument {
                what: "command",
                message: format!("sequence {} appears twice in one forward", entry.seq),
            }
            .into());
        }
        let s = seqs
            .remove(&entry.seq)
            .unwrap_or_else(|| model.new_sequence());
        taken.push((entry.seq, s));
    }
    let tokens: Vec<&[u32]> = batch.iter().map(|b| b.tokens.as_slice()).collect();
    let result = {
        let mut refs: Vec<&mut KvSequence> = taken.iter_mut().map(|(_, s)| s).collect();
        call(model, &mut refs, &tokens)
    };
    seqs.extend(taken);
    result.map(|_| ())
}

fn widen(ids: &[u32]) -> Vec<usize> {
    ids.iter().map(|&i| i as usize).collect()
}

fn widen64(ids: &[u64]) -> Vec<usize> {
    ids.iter().map(|&i| i as usize).collect()
}

/// A worker's side of a sharded proposer: its states by rank 0's names, and the context its
/// calls run in.
struct WorkerDrafter<'a> {
    proposer: Option<&'a dyn DraftProposer>,
    states: HashMap<u64, Box<dyn ProposerState>>,
    ctx: ForwardContext<'static>,
}

impl<'a> WorkerDrafter<'a> {
    /// Whether `command` is a proposer call.
    fn handles(&self, command: &Command) -> bool {
        matches!(
            command,
            Command::MtpPropose { .. }
                | Command::MtpProposeBatch { .. }
                | Command::ProposerAlloc { .. }
                | Command::ProposerPrefill { .. }
                | Command::ProposerAfterVerify { .. }
                | Command::ProposerCatchup { .. }
                | Command::ProposerFree { .. }
        )
    }

    fn proposer(&self, call: &'static str) -> Result<&'a dyn DraftProposer> {
        self.proposer.ok_or_else(|| {
            crate::engine::EngineError::InvalidArgument {
                what: call,
                message: "rank 0 runs a sharded proposer, and this worker was given none".into(),
            }
            .into()
        })
    }

    fn state<'s>(
        states: &'s mut HashMap<u64, Box<dyn ProposerState>>,
        name: u64,
        call: &'static str,
    ) -> Result<&'s mut Box<dyn ProposerState>> {
        states.get_mut(&name).ok_or_else(|| {
            crate::engine::EngineError::InvalidArgument {
                what: call,
                message: format!("no proposer state {name:#x} was allocated"),
            }
            .into()
        })
    }

    /// Runs `f` with `bytes` in a device buffer of their own, freed after.
    fn with_rows<R>(
        gpu: &dyn GpuBackend,
        bytes: &[u8],
        f: impl FnOnce(crate::backend::DevicePtr) -> Result<R>,
    ) -> Result<R> {
        use crate::backend::GpuBackendExt;
        let rows = gpu.upload(bytes.max(&[0u8][..]), "worker:hidden_rows")?;
        let out = f(rows);
        gpu.free(rows)?;
        out
    }

    fn replay(&mut self, command: Command) -> Result<()> {
        let gpu = self.ctx.gpu.clone();
        match command {
            Command::ProposerAlloc { state, budget } => {
                let p = self.proposer("proposer_alloc")?;
                let s = match budget {
                    u64::MAX => p.alloc_state(gpu.as_ref())?,
                    b => p.alloc_state_for(gpu.as_ref(), b as usize)?,
                };
                if let Some(mut old) = self.states.insert(state, s) {
                    // A name is reused only after its free reached us; free it anyway.
                    p.free_state(gpu.as_ref(), old.as_mut())?;
                }
                Ok(())
            }
            Command::ProposerFree { state } => {
                let p = self.proposer("proposer_free")?;
                match self.states.remove(&state) {
                    Some(mut s) => p.free_state(gpu.as_ref(), s.as_mut()),
                    None => Ok(()),
                }
            }
            Command::ProposerAfterVerify { state, accepted } => {
                let p = self.proposer("proposer_after_verify")?;
                let s = Self::state(&mut self.states, state, "proposer_after_verify")?;
                p.after_verify(accepted as usize, s.as_mut(), 0)
            }
            Command::ProposerPrefill {
                state,
                tokens,
                hidden,
            } => {
                let p = self.proposer("proposer_prefill")?;
                let ctx = self.ctx.clone();
                let s = Self::state(&mut self.states, state, "proposer_prefill")?;
                Self::with_rows(gpu.as_ref(), &hidden, |rows| {
                    p.prefill_drafter(&tokens, rows, s.as_mut(), &ctx, 0)
                })
                .map(|_| ())
            }
            Command::ProposerCatchup {
                state,
                tokens,
                hidden,
                row_base,
                pos_base,
            } => {
                let p = self.proposer("proposer_catchup")?;
                let ctx = self.ctx.clone();
                let s = Self::state(&mut self.states, state, "proposer_catchup")?;
                Self::with_rows(gpu.as_ref(), &hidden, |rows| {
                    p.catchup_drafter(
                        &tokens,
                        rows,
                        row_base as usize,
                        pos_base as usize,
                        s.as_mut(),
                        &ctx,
                        0,
                    )
                })
                .map(|_| ())
            }
            Command::MtpPropose {
                state,
                last_token,
                position,
                num_drafts,
                hidden,
                grammar,
            } => {
                let p = self.proposer("mtp_propose")?;
                let ctx = self.ctx.clone();
                let s = Self::state(&mut self.states, state, "mtp_propose")?;
                Self::with_rows(gpu.as_ref(), &hidden, |row| {
                    p.propose(
                        last_token,
                        row,
                        position as usize,
                        num_drafts as usize,
                        s.as_mut(),
                        &ctx,
                        0,
                        None,
                        grammar.as_deref(),
                        None,
                    )
                })
                .map(|_| ())
            }
            Command::MtpProposeBatch {
                states,
                last_tokens,
                positions,
                num_drafts,
                hidden,
                confidences,
            } => {
                let p = self.proposer("mtp_propose_batch")?;
                let ctx = self.ctx.clone();
                let row = ctx.config.hidden_size * 2;
                if hidden.len() != states.len() * row {
                    return Err(crate::engine::EngineError::InvalidArgument {
                        what: "mtp_propose_batch",
                        message: format!(
                            "{} hidden bytes for {} sequences of {row} bytes a row",
                            hidden.len(),
                            states.len()
                        ),
                    }
                    .into());
                }
                // The call's states leave the map for the call (each once) and come back.
                let mut taken = Vec::with_capacity(states.len());
                let mut missing = None;
                for &name in &states {
                    match self.states.remove(&name) {
                        Some(s) => taken.push((name, s)),
                        None => missing = missing.or(Some(name)),
                    }
                }
                let result = match missing {
                    Some(name) => {
                        Self::state(&mut self.states, name, "mtp_propose_batch").map(|_| ())
                    }
                    None => Self::with_rows(gpu.as_ref(), &hidden, |rows| {
                        let hiddens: Vec<_> =
                            (0..states.len()).map(|i| rows.offset(i * row)).collect();
                        let mut refs: Vec<&mut dyn ProposerState> = taken
                            .iter_mut()
                            .map(|(_, s)| -> &mut dyn ProposerState { s.as_mut() })
                            .collect();
                        let mut conf = Vec::new();
                        p.propose_batch(
                            &last_tokens,
                            &hiddens,
                            &widen64(&positions),
                            num_drafts as usize,
                            &mut refs,
                            &ctx,
                            0,
                            confidences.then_some(&mut conf),
                        )
                        .map(|_| ())
                    }),
                };
                self.states.extend(taken);
                result
            }
            _ => Ok(()),
        }
    }

    /// Frees every state rank 0 left allocated.
    fn free_all(&mut self) -> Result<()> {
        if let Some(p) = self.proposer {
            for (_, mut s) in self.states.drain() {
                p.free_state(self.ctx.gpu.as_ref(), s.as_mut())?;
            }
        }
        Ok(())
    }
}
