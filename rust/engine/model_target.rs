//! The [`Target`] adapter for the real [`TargetModel`]: every method forwards to the model.
//! On rank 0 of a multi-rank model, each call that runs a collective forward or changes a
//! sequence's KV first sends the workers its command ([`super::ranks`]), so every rank runs
//! the same forwards and keeps the same KV.

use super::ranks::{announce, batch_of};
use super::{KvPoolStatus, Target, TargetOutput};
use crate::backend::GpuBackend;
use crate::distributed::Command;
use crate::memory::BufferArena;
use crate::model::{
    check_layer_ids, ForwardOutput, KvSequence, LogitRows, ModelConfig, TargetModel,
};
use crate::Result;
use std::sync::Arc;

impl Target for TargetModel {
    type KvSequence = KvSequence;

    fn config(&self) -> &Arc<ModelConfig> {
        TargetModel::config(self)
    }

    fn gpu(&self) -> &Arc<dyn GpuBackend> {
        TargetModel::gpu(self)
    }

    fn max_seq_len(&self) -> usize {
        TargetModel::max_seq_len(self)
    }

    fn new_sequence(&self) -> KvSequence {
        TargetModel::new_sequence(self)
    }

    fn seq_len(&self, seq: &KvSequence) -> usize {
        seq.len()
    }

    fn forward(&self, seqs: &mut [&mut KvSequence], tokens: &[&[u32]]) -> Result<TargetOutput> {
        announce(self, || Command::Verify {
            batch: batch_of(seqs, tokens),
            layers: Vec::new(),
            trees: Vec::new(),
        })?;
        convert(TargetModel::forward_with(
            self,
            seqs,
            tokens,
            LogitRows::All,
        )?)
    }

    fn forward_last(
        &self,
        seqs: &mut [&mut KvSequence],
        tokens: &[&[u32]],
    ) -> Result<TargetOutput> {
        announce(self, || Command::Prefill {
            batch: batch_of(seqs, tokens),
            layers: Vec::new(),
        })?;
        // A prefill reads one logits row per sequence: skip the LM head on the others.
        convert(TargetModel::forward_with(
            self,
            seqs,
            tokens,
            LogitRows::LastPerSequence,
        )?)
    }

    fn check_capture(&self, layers: &[usize]) -> std::result::Result<(), String> {
        check_layer_ids(layers, self.config().num_hidden_layers)
    }

    fn forward_capturing(
        &self,
        seqs: &mut [&mut KvSequence],
        tokens: &[&[u32]],
        last_logits_only: bool,
        layers: &[usize],
    ) -> Result<TargetOutput> {
        let layer_ids = || layers.iter().map(|&l| l as u32).collect();
        announce(self, || match last_logits_only {
            true => Command::Prefill {
                batch: batch_of(seqs, tokens),
                layers: layer_ids(),
            },
            false => Command::Verify {
                batch: batch_of(seqs, tokens),
                layers: layer_ids(),
                trees: Vec::new(),
            },
        })?;
        let rows = if last_logits_only {
            LogitRows::LastPerSequence
        } else {
            LogitRows::All
        };
        convert(TargetModel::forward_capturing(
            self, seqs, tokens, rows, layers,
        )?)
    }

    fn supports_trees(&self) -> bool {
        true
    }

    fn forward_tree(
        &self,
        seqs: &mut [&mut KvSequence],
        tokens: &[&[u32]],
        trees: &[Option<&[usize]>],
        layers: &[usize],
    ) -> Result<TargetOutput> {
        announce(self, || Command::Verify {
            batch: batch_of(seqs, tokens),
            layers: layers.iter().map(|&l| l as u32).collect(),
            trees: trees
                .iter()
                .map(|t| t.map(|parents| parents.iter().map(|&p| p as u32).collect()))
                .collect(),
        })?;
        convert(TargetModel::forward_tree(
            self, seqs, tokens, trees, layers,
        )?)
    }

    fn compact(&self, seq: &mut KvSequence, start: usize, rows: &[usize]) -> Result<()> {
        announce(self, || Command::Compact {
            seq: seq.id(),
            start: start as u64,
            rows: rows.iter().map(|&r| r as u32).collect(),
        })?;
        TargetModel::compact(self, seq, start, rows)
    }

    fn trim(&self, seq: &mut KvSequence, new_len: usize) -> Result<()> {
        announce(self, || Command::Trim {
            seq: seq.id(),
            len: new_len as u64,
        })?;
        TargetModel::trim(self, seq, new_len)
    }

    fn free_sequence(&self, seq: &mut KvSequence) -> Result<()> {
        announce(self, || Command::Free { seq: seq.id() })?;
        TargetModel::free_sequence(self, seq)
    }

    fn buffers(&self) -> &Arc<BufferArena> {
        TargetModel::buffers(self)
    }

    fn leader_comm(&self) -> Option<Arc<dyn crate::distributed::Communicator>> {
        let comm = self.expert_shard()?.comm_arc();
        (comm.rank() == 0).then(|| comm.clone())
    }

    fn kv_pool(&self) -> Option<KvPoolStatus> {
        let pool = TargetModel::kv_pool(self);
        Some(KvPoolStatus {
            block_size: pool.block_size(),
            num_blocks: pool.num_blocks(),
            num_free: pool.num_free(),
        })
    }
}

fn convert(out: ForwardOutput) -> Result<TargetOutput> {
    let last_logits_only = out.logits_rows != out.rows;
    Ok(TargetOutput {
        rows: out.rows,
        row_offsets: out.row_offsets,
        logits: out.logits,
        last_logits_only,
        hiddens: out.hiddens,
        hidden_stack: out.hidden_stack,
        picks: Some(out.picks),
    })
}
