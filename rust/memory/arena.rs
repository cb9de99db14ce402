//! `BufferArena`: the shared forward scratch, sized once from a `ModelConfig`.
//!
//! The target model and (when `prefill_uses_shared_buffers` says so) the proposers use these
//! buffers for intermediate activations. They are allocated once for `max_rows` rows, so a
//! forward never allocates on the hot path; a forward that needs more rows must be split.

use super::MemoryError;
use crate::backend::{DevicePtr, Dtype, GpuBackend};
use crate::model::ModelConfig;

/// One named scratch buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct ArenaSlot {
    /// Its name (`"hidden"`, `"logits"`, ...).
    pub name: &'static str,
    /// Where it lives.
    pub ptr: DevicePtr,
    /// Element type.
    pub dtype: Dtype,
    /// Elements per row.
    pub row_elems: usize,
}

/// The shared forward scratch.
#[derive(Debug)]
pub struct BufferArena {
    max_rows: usize,
    slots: Vec<ArenaSlot>,
}

impl BufferArena {
    /// The slots and their per-row widths for `config`.
    fn layout(config: &ModelConfig) -> Vec<(&'static str, Dtype, usize)> {
        let ffn = config.moe.as_ref().map_or(config.intermediate_size, |m| {
            m.expert_intermediate_size.max(config.intermediate_size)
        });
        vec![
            ("hidden", Dtype::Bf16, config.hidden_size),
            ("residual", Dtype::Bf16, config.hidden_size),
            ("normed", Dtype::Bf16, config.hidden_size),
            ("q", Dtype::Bf16, config.q_size()),
            ("k", Dtype::Bf16, config.kv_size()),
            ("v", Dtype::Bf16, config.kv_size()),
            ("attn_out", Dtype::Bf16, config.q_size()),
            ("gate", Dtype::Bf16, ffn),
            ("up", Dtype::Bf16, ffn),
            ("logits", Dtype::F32, config.vocab_size),
            ("token_ids", Dtype::U32, 1),
            ("positions", Dtype::U32, 1),
        ]
    }

    /// Bytes an arena for `config` and `max_rows` rows takes.
    pub fn bytes_for(config: &ModelConfig, max_rows: usize) -> usize {
        Self::layout(config)
            .iter()
            .map(|(_, d, w)| d.size() * w * max_rows)
            .sum()
    }

    /// Allocates the scratch for forwards of at most `max_rows` rows. On failure nothing
    /// stays allocated.
    pub fn new(
        gpu: &dyn GpuBackend,
        config: &ModelConfig,
        max_rows: usize,
    ) -> Result<Self, MemoryError> {
        if max_rows == 0 {
            return Err(MemoryError::InvalidSize(
                "a buffer arena needs at least one row".into(),
            ));
        }
        let mut arena = BufferArena {
            max_rows,
            slots: Vec::new(),
        };
        for (name, dtype, row_elems) in Self::layout(config) {
            let nbytes = dtype
                .size()
                .checked_mul(row_elems)
                .and_then(|b| b.checked_mul(max_rows))
                .ok_or_else(|| MemoryError::InvalidSize(format!("arena slot {name} overflows")))?;
            match gpu.alloc(nbytes, &format!("arena:{name}")) {
                Ok(ptr) => arena.slots.push(ArenaSlot {
                    name,
                    ptr,
                    dtype,
                    row_elems,
                }),
                Err(e) => {
                    arena.free(gpu)?;
                    return Err(e.into());
                }
            }
        }
        Ok(arena)
    }

    /// An arena with no buffers, for proposers and tests that never touch the scratch.
    pub fn empty(max_rows: usize) -> Self {
        BufferArena {
            max_rows,
            slots: Vec::new(),
        }
    }

    /// Rows every slot holds.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// The slot called `name`.
    pub fn slot(&self, name: &str) -> Result<&ArenaSlot, MemoryError> {
        self.slots
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| MemoryError::UnknownSlot(name.to_string()))
    }

    /// Every slot.
    pub fn slots(&self) -> &[ArenaSlot] {
        &self.slots
    }

    /// Returns every buffer to `gpu`; calling it twice frees nothing the second time.
    pub fn free(&mut self, gpu: &dyn GpuBackend) -> Result<(), MemoryError> {
        let mut first_error = None;
        for slot in self.slots.drain(..) {
            if let Err(e) = gpu.free(slot.ptr) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), |e| Err(e.into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;

    #[test]
    fn sized_once_and_freed_completely() {
        let gpu = CpuBackend::new();
        let config = ModelConfig::tiny(100);
        let mut arena = BufferArena::new(&gpu, &config, 8).unwrap();
        assert_eq!(
            gpu.ledger().live_bytes(),
            BufferArena::bytes_for(&config, 8)
        );
        assert_eq!(arena.slot("logits").unwrap().row_elems, 100);
        assert!(arena.slot("nope").is_err());
        arena.free(&gpu).unwrap();
        arena.free(&gpu).unwrap();
        assert_eq!(gpu.ledger().live_count(), 0);
    }

    #[test]
    fn failed_allocation_leaves_nothing_live() {
        let config = ModelConfig::tiny(100);
        let gpu = CpuBackend::with_memory_limit(BufferArena::bytes_for(&config, 8) - 1);
        let err = BufferArena::new(&gpu, &config, 8).unwrap_err();
        assert!(matches!(err, MemoryError::Backend(_)), "{err}");
        assert_eq!(gpu.ledger().live_count(), 0);
    }
}
