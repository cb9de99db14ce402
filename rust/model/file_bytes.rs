//! The bytes of one checkpoint file: memory-mapped from disk, or owned (a checkpoint built in
//! memory, such as a test's or a fuzzer's input). Loaders parse either through the same code.
//!
//! Invariant: the bytes never change while a loader holds them (a mapped file modified on
//! disk during a load is unsupported, as with every mmap-based loader).

use super::ModelError;
use memmap2::Mmap;
use std::fs::File;
use std::ops::Deref;
use std::path::Path;

/// A checkpoint file's bytes.
pub enum FileBytes {
    /// Mapped read-only from a file.
    Mapped(Mmap),
    /// Held in memory.
    Owned(Vec<u8>),
}

impl FileBytes {
    /// Maps `path` read-only; an error names the file.
    pub fn map(path: &Path) -> Result<Self, ModelError> {
        let io = |e: std::io::Error| ModelError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: a read-only map; see the module invariant.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Ok(FileBytes::Mapped(map))
    }
}

impl Deref for FileBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(m) => m,
            FileBytes::Owned(v) => v,
        }
    }
}
