//! `BufferArena`: forward scratch, sized once from a list of named slots.
//!
//! The target model and (when `prefill_uses_shared_buffers` says so) the proposers use these
//! buffers for intermediate activations. They are allocated once for `max_rows` rows, so a
//! forward never allocates on the hot path; a forward that needs more rows must be split.
//! Which slots there are is the model layer's business: the arena knows only names, element
//! types and widths.

use super::MemoryError;
use crate::backend::{DevicePtr, Dtype, GpuBackend};

/// One slot to allocate: its name, element type and elements per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotSpec {
    /// Its name (`"hidden"`, `"logits"`, ...); names are unique within an arena.
    pub name: &'static str,
    /// Element type.
    pub dtype: Dtype,
    /// Elements per row.
    pub row_elems: usize,
}

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
    /// Bytes an arena of `slots` for `max_rows` rows takes (saturating).
    pub fn bytes_for(slots: &[SlotSpec], max_rows: usize) -> usize {
        slots.iter().fold(0usize, |total, s| {
            total.saturating_add(
                s.dtype
                    .size()
                    .saturating_mul(s.row_elems.max(1))
                    .saturating_mul(max_rows),
            )
        })
    }

    /// Allocates `slots` for forwards of at most `max_rows` rows, each recorded in the
    /// ledger as `{tag}:{name}`. A slot of zero width still gets one element, so every slot
    /// has an address. A repeated name is an error; on failure nothing stays allocated.
    pub fn new(
        gpu: &dyn GpuBackend,
        tag: &str,
        slots: &[SlotSpec],
        max_rows: usize,
    ) -> Result<Self, MemoryError> {
        if max_rows == 0 {
            return Err(MemoryError::InvalidSize(
                "a buffer arena needs at least one row".into(),
            ));
        }
        if let Some(dup) = slots
            .iter()
            .enumerate()
            .find(|(i, s)| slots[..*i].iter().any(|t| t.name == s.name))
        {
            return Err(MemoryError::InvalidSize(format!(
                "arena slot {:?} is listed twice",
                dup.1.name
            )));
        }
        let mut arena = BufferArena {
            max_rows,
            slots: Vec::with_capacity(slots.len()),
        };
        for &SlotSpec {
            name,
            dtype,
            row_elems,
        } in slots
        {
            let nbytes = dtype
                .size()
                .checked_mul(row_elems.max(1))
                .and_then(|b| b.checked_mul(max_rows))
                .ok_or_else(|| MemoryError::InvalidSize(format!("arena slot {name} overflows")));
            let nbytes = match nbytes {
                Ok(n) => n,
                Err(e) => {
                    arena.free(gpu)?;
                    return Err(e);
                }
            };
            match gpu.alloc(nbytes, &format!("{tag}:{name}")) {
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

    const SLOTS: [SlotSpec; 3] = [
        SlotSpec {
            name: "hidden",
            dtype: Dtype::Bf16,
            row_elems: 64,
        },
        SlotSpec {
            name: "logits",
            dtype: Dtype::F32,
            row_elems: 100,
        },
        SlotSpec {
            name: "ids",
            dtype: Dtype::U32,
            row_elems: 1,
        },
    ];

    #[test]
    fn sized_once_and_freed_completely() {
        let gpu = CpuBackend::new();
        let mut arena = BufferArena::new(&gpu, "test", &SLOTS, 8).unwrap();
        assert_eq!(gpu.ledger().live_bytes(), (64 * 2 + 100 * 4 + 4) * 8);
        assert_eq!(gpu.ledger().live_bytes(), BufferArena::bytes_for(&SLOTS, 8));
        let logits = arena.slot("logits").unwrap();
        assert_eq!((logits.row_elems, logits.dtype), (100, Dtype::F32));
        let tags: Vec<String> = gpu
            .ledger()
            .live_report()
            .into_iter()
            .map(|a| a.tag)
            .collect();
        assert_eq!(tags, ["test:hidden", "test:logits", "test:ids"]);
        assert!(arena.slot("nope").is_err());
        arena.free(&gpu).unwrap();
        arena.free(&gpu).unwrap();
        assert_eq!(gpu.ledger().live_count(), 0);
    }

    #[test]
    fn failed_allocation_leaves_nothing_live() {
        let gpu = CpuBackend::with_memory_limit(BufferArena::bytes_for(&SLOTS, 8) - 1);
        let err = BufferArena::new(&gpu, "test", &SLOTS, 8).unwrap_err();
        assert!(matches!(err, MemoryError::Backend(_)), "{err}");
        assert_eq!(gpu.ledger().live_count(), 0);
    }

    #[test]
    fn repeated_names_and_overflowing_sizes_are_refused() {
        let gpu = CpuBackend::new();
        let twice = [SLOTS[0], SLOTS[1], SLOTS[0]];
        let err = BufferArena::new(&gpu, "test", &twice, 8).unwrap_err();
        assert!(
            err.to_string().contains("\"hidden\" is listed twice"),
            "{err}"
        );
        let huge = [
            SLOTS[0],
            SlotSpec {
                name: "huge",
                dtype: Dtype::F32,
                row_elems: usize::MAX / 2,
            },
        ];
        let err = BufferArena::new(&gpu, "test", &huge, 8).unwrap_err();
        assert!(err.to_string().contains("huge overflows"), "{err}");
        assert_eq!(gpu.ledger().live_count(), 0);
    }
}
