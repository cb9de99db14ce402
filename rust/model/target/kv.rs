//! A sequence's rows in the model's paged KV cache: trimming rejected rows, keeping a draft
//! tree's accepted path, and reading the cache back for tests.
//!
//! Invariants: each call first checks that the sequence belongs to this model; a refused
//! call changes nothing; after any call the sequence holds exactly
//! `ceil(len / BLOCK_SIZE)` blocks.

use super::{TargetModel, BLOCK_SIZE};
use crate::backend::{Dtype, KvCopyArgs, DEFAULT_STREAM};
use crate::model::sequence::KvSequence;
use crate::model::ModelError;

impl TargetModel {
    /// Keeps one path of a draft tree's verify forward: cache rows `rows` (increasing, each
    /// at or after its destination, below the sequence's length) move, in order, to the
    /// rows from `start` on, and the sequence is trimmed to `start + rows.len()`. The keys
    /// and values move unchanged; a node's position was its depth's, which is the row it
    /// lands on.
    pub fn compact(&self, seq: &mut KvSequence, start: usize, rows: &[usize]) -> crate::Result<()> {
        const OP: &str = "TargetModel::compact";
        self.check_owner(seq, OP)?;
        let end = start + rows.len();
        let fault = rows.iter().enumerate().find_map(|(k, &r)| {
            if r < start + k {
                Some(format!("row {r} would move up, to row {}", start + k))
            } else if k > 0 && r <= rows[k - 1] {
                Some(format!("rows {} and {r} are not increasing", rows[k - 1]))
            } else if r >= seq.len {
                Some(format!("row {r} is past the sequence's {} rows", seq.len))
            } else {
                None
            }
        });
        if let Some(message) = fault {
            return Err(ModelError::invalid(OP, message).into());
        }
        let slot =
            |j: usize| seq.blocks[j / BLOCK_SIZE] * BLOCK_SIZE as u32 + (j % BLOCK_SIZE) as u32;
        let (src, dst): (Vec<u32>, Vec<u32>) = rows
            .iter()
            .enumerate()
            .filter(|&(k, &r)| r != start + k)
            .map(|(k, &r)| (slot(r), slot(start + k)))
            .unzip();
        if !src.is_empty() {
            // The forward's metadata buffer is free between forwards, which the lock serialises.
            let _scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            let n = src.len();
            let words: Vec<u32> = src.into_iter().chain(dst).collect();
            self.gpu
                .copy_htod(self.meta, bytemuck::cast_slice(&words), DEFAULT_STREAM)?;
            let (kv_heads, head_dim) = self.config.kv_cache_row();
            for cache in &self.caches {
                self.gpu.kv_copy(KvCopyArgs {
                    k_cache: cache.k,
                    v_cache: cache.v,
                    src: self.meta,
                    dst: self.meta.offset(n * 4),
                    copies: n,
                    kv_heads,
                    head_dim,
                    num_slots: cache.num_slots,
                    stream: DEFAULT_STREAM,
                })?;
            }
        }
        self.trim(seq, end)
    }

    /// The keys and values `seq` holds at decoder layer `layer`: BF16 bits `[len, kv_heads *
    /// head_dim]` each, cache row `j` at row `j` (read through the block table), for tests
    /// and debugging. Under MLA, the two halves of each token's latent row `[c_kv | k_rope]`
    /// (see [`ModelConfig::kv_cache_row`](crate::model::ModelConfig::kv_cache_row)).
    pub fn read_kv(&self, seq: &KvSequence, layer: usize) -> crate::Result<(Vec<u16>, Vec<u16>)> {
        const OP: &str = "TargetModel::read_kv";
        self.check_owner(seq, OP)?;
        let Some(cache) = self.caches.get(layer) else {
            return Err(
                ModelError::invalid(OP, format!("layer {layer} of {}", self.caches.len())).into(),
            );
        };
        let width = self.config.kv_cache_width();
        let row_bytes = width * Dtype::Bf16.size();
        let mut out = (
            Vec::with_capacity(seq.len * width),
            Vec::with_capacity(seq.len * width),
        );
        for j in 0..seq.len {
            let slot = seq.blocks[j / BLOCK_SIZE] as usize * BLOCK_SIZE + j % BLOCK_SIZE;
            for (ptr, dst) in [(cache.k, &mut out.0), (cache.v, &mut out.1)] {
                let mut row = vec![0u8; row_bytes];
                self.gpu
                    .copy_dtoh(&mut row, ptr.offset(slot * row_bytes), DEFAULT_STREAM)?;
                dst.extend(row.chunks(2).map(|b| u16::from_le_bytes([b[0], b[1]])));
            }
        }
        Ok(out)
    }

    /// Drops rows `new_len..` of `seq` (rejected drafts), returning emptied blocks.
    pub fn trim(&self, seq: &mut KvSequence, new_len: usize) -> crate::Result<()> {
        self.check_owner(seq, "TargetModel::trim")?;
        if new_len > seq.len {
            return Err(ModelError::invalid(
                "TargetModel::trim",
                format!("cannot trim a sequence of {} rows to {new_len}", seq.len),
            )
            .into());
        }
        let keep = new_len.div_ceil(BLOCK_SIZE);
        self.pool.free(&seq.blocks[keep..])?;
        seq.blocks.truncate(keep);
        seq.len = new_len;
        Ok(())
    }

    /// Returns every block of `seq`; it becomes empty (and reusable).
    pub fn free_sequence(&self, seq: &mut KvSequence) -> crate::Result<()> {
        self.trim(seq, 0)
    }
}
