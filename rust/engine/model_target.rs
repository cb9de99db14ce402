//! The [`Target`] adapter for the real [`TargetModel`]: every method forwards to the model.

use super::{KvPoolStatus, Target, TargetOutput};
use crate::backend::GpuBackend;
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
        convert(TargetModel::forward_tree(
            self, seqs, tokens, trees, layers,
        )?)
    }

    fn compact(&self, seq: &mut KvSequence, start: usize, rows: &[usize]) -> Result<()> {
        TargetModel::compact(self, seq, start, rows)
    }

    fn trim(&self, seq: &mut KvSequence, new_len: usize) -> Result<()> {
        TargetModel::trim(self, seq, new_len)
    }

    fn free_sequence(&self, seq: &mut KvSequence) -> Result<()> {
        TargetModel::free_sequence(self, seq)
    }

    fn buffers(&self) -> &Arc<BufferArena> {
        TargetModel::buffers(self)
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
    })
}
