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

use super::Target;
use crate::distributed::{Command, Communicator, SeqTokens};
use crate::model::{KvSequence, TargetModel};
use crate::Result;
use std::collections::HashMap;

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
    /// Commands whose call failed (as it failed on rank 0).
    pub failed: usize,
    /// The last failure's message.
    pub last_error: Option<String>,
    /// Sequences still held at the shutdown (rank 0 had not freed them); their KV is freed.
    pub leftover_sequences: usize,
}

/// Serves rank 0 on a worker: receives each command and runs the same call on `model`,
/// until [`Command::Shutdown`]. Refused on rank 0 and on a model loaded on one rank.
pub fn run_worker(model: &TargetModel) -> Result<WorkerReport> {
    let Some(shard) = model.expert_shard() else {
        return Err(crate::engine::EngineError::InvalidArgument {
            what: "run_worker",
            message: "the model was loaded on one rank; there is no rank 0 to serve".into(),
        }
        .into());
    };
    let comm = shard.comm();
    let mut seqs: HashMap<u64, KvSequence> = HashMap::new();
    let mut report = WorkerReport::default();
    loop {
        let command = comm.recv_command()?;
        report.commands += 1;
        if command == Command::Shutdown {
            report.leftover_sequences = seqs.len();
            for (_, mut seq) in seqs.drain() {
                model.free_sequence(&mut seq)?;
            }
            return Ok(report);
        }
        if let Err(e) = replay(model, &mut seqs, command) {
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
        // No proposer runs on the workers yet: a sharded proposer is refused on rank 0
        // before it can send this.
        Command::MtpPropose { .. } => Err(crate::engine::EngineError::InvalidArgument {
            what: "mtp_propose",
            message: "this worker runs no sharded proposer".into(),
        }
        .into()),
        Command::Shutdown => Ok(()),
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
