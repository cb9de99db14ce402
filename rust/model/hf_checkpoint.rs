//! A Hugging Face checkpoint directory: `config.json` plus one or more `*.safetensors` files,
//! each memory-mapped (nothing is read until a tensor is converted).
//!
//! A checkpoint is untrusted input. The 8-byte header length is checked against the file and
//! against safetensors' own 100 MB limit before the JSON header is read; the `safetensors`
//! crate then checks every tensor's offsets (contiguous, inside the file, with checked
//! arithmetic) and that each holds exactly the bytes its shape and dtype need.
//!
//! Invariants: every tensor name maps to exactly one file (a name found twice is an error),
//! and every tensor's byte range lies inside its file; a cut-short file is reported with the
//! first tensor whose bytes are missing.

use super::file_bytes::FileBytes;
use super::tensors::{RawTensor, TensorSource, TensorType};
use super::{ModelConfig, ModelError};
use safetensors::tensor::{Dtype as StDtype, TensorInfo};
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The longest JSON header read (the `safetensors` crate's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

struct MappedFile {
    path: PathBuf,
    bytes: FileBytes,
    data_start: usize,
}

/// The safetensors files of one checkpoint directory, memory-mapped.
pub struct SafetensorsCheckpoint {
    dir: String,
    files: Vec<MappedFile>,
    index: HashMap<String, (usize, TensorInfo)>,
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

fn tensor_type(d: StDtype) -> TensorType {
    match d {
        StDtype::F32 => TensorType::F32,
        StDtype::F16 => TensorType::F16,
        StDtype::BF16 => TensorType::Bf16,
        StDtype::U8 => TensorType::U8,
        StDtype::F8_E4M3 => TensorType::F8E4M3,
        other => TensorType::Other(format!("{other:?}")),
    }
}

/// The length of the JSON header, checked: the file holds it, and it is within the limit.
fn header_length(path: &Path, bytes: &[u8]) -> Result<usize, ModelError> {
    let out_of_range = |n: u64, reason: String| ModelError::OutOfRange {
        path: path.display().to_string(),
        field: "the header length".into(),
        value: n.to_string(),
        reason,
    };
    let Some(field) = bytes.get(..8) else {
        return Err(ModelError::Format {
            path: path.display().to_string(),
            format: "safetensors",
            message: format!(
                "the file is {} bytes, too short for the header length",
                bytes.len()
            ),
        });
    };
    let n = u64::from_le_bytes(field.try_into().unwrap_or([0; 8]));
    if n > MAX_HEADER_BYTES {
        return Err(out_of_range(
            n,
            format!("headers are at most {MAX_HEADER_BYTES} bytes"),
        ));
    }
    let after = bytes.len() - 8;
    if n > after as u64 {
        return Err(out_of_range(
            n,
            format!("the file holds {after} bytes after it"),
        ));
    }
    Ok(n as usize)
}

/// Explains why `read_metadata` refused `bytes`, whose header is `n` bytes (checked by
/// [`header_length`]): when the header parses but the data is short, names the first tensor
/// that does not fit.
fn diagnose(path: &Path, bytes: &[u8], n: usize, err: safetensors::SafeTensorError) -> ModelError {
    let format_err = |message: String| ModelError::Format {
        path: path.display().to_string(),
        format: "safetensors",
        message,
    };
    let header = bytes
        .get(8..8 + n)
        .and_then(|h| serde_json::from_slice::<serde_json::Value>(h).ok());
    let Some(serde_json::Value::Object(map)) = header else {
        return format_err(format!("{err}"));
    };
    let available = bytes.len().saturating_sub(8 + n);
    let mut worst: Option<(usize, String, usize)> = None;
    for (name, info) in &map {
        let offs = info.get("data_offsets").and_then(|o| o.as_array());
        if let Some([a, b]) = offs.map(|v| v.as_slice()) {
            let (a, b) = (
                a.as_u64().unwrap_or(0) as usize,
                b.as_u64().unwrap_or(0) as usize,
            );
            if b > available && worst.as_ref().is_none_or(|w| a < w.0) {
                worst = Some((a, name.clone(), b));
            }
        }
    }
    match worst {
        Some((start, tensor, end)) => ModelError::Truncated {
            path: path.display().to_string(),
            tensor,
            start,
            end,
            file_len: available,
        },
        None => format_err(format!("{err}")),
    }
}

impl SafetensorsCheckpoint {
    /// Maps every `*.safetensors` file in `dir` (sorted by name).
    pub fn open_dir(dir: impl AsRef<Path>) -> Result<Self, ModelError> {
        let dir = dir.as_ref();
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| io_err(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        paths.sort();
        if paths.is_empty() {
            return Err(io_err(dir, "the folder holds no *.safetensors file"));
        }
        Self::open_files(&dir.display().to_string(), &paths)
    }

    /// Maps the given files as one checkpoint called `name` in messages.
    pub fn open_files(name: &str, paths: &[PathBuf]) -> Result<Self, ModelError> {
        let files = paths
            .iter()
            .map(|p| Ok((p.clone(), FileBytes::map(p)?)))
            .collect::<Result<Vec<_>, ModelError>>()?;
        Self::from_files(name, files)
    }

    /// A checkpoint of one safetensors file held in memory; `name` stands for its path.
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<Self, ModelError> {
        Self::from_files(name, vec![(PathBuf::from(name), FileBytes::Owned(bytes))])
    }

    fn from_files(name: &str, contents: Vec<(PathBuf, FileBytes)>) -> Result<Self, ModelError> {
        let mut files: Vec<MappedFile> = Vec::new();
        let mut index = HashMap::new();
        for (path, bytes) in contents {
            let n = header_length(&path, &bytes)?;
            let (_, meta) =
                SafeTensors::read_metadata(&bytes).map_err(|e| diagnose(&path, &bytes, n, e))?;
            let fi = files.len();
            for (tensor, info) in meta.tensors() {
                if let Some((other, _)) = index.insert(tensor.clone(), (fi, info.clone())) {
                    return Err(ModelError::Format {
                        path: path.display().to_string(),
                        format: "safetensors",
                        message: format!(
                            "tensor {tensor:?} is also in {}",
                            files[other].path.display()
                        ),
                    });
                }
            }
            files.push(MappedFile {
                path,
                bytes,
                data_start: 8 + n,
            });
        }
        Ok(SafetensorsCheckpoint {
            dir: name.to_string(),
            files,
            index,
        })
    }

    /// Reads `config.json` and maps the safetensors of a checkpoint directory.
    pub fn open_with_config(dir: impl AsRef<Path>) -> crate::Result<(ModelConfig, Self)> {
        let dir = dir.as_ref();
        let config = ModelConfig::from_file(dir.join("config.json"))?;
        Ok((config, Self::open_dir(dir)?))
    }
}

impl TensorSource for SafetensorsCheckpoint {
    fn path(&self) -> &str {
        &self.dir
    }

    fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.index.keys().cloned().collect();
        v.sort();
        v
    }

    fn tensor(&self, name: &str) -> Result<Option<RawTensor<'_>>, ModelError> {
        let Some((fi, info)) = self.index.get(name) else {
            return Ok(None);
        };
        let f = &self.files[*fi];
        let (a, b) = info.data_offsets;
        // read_metadata validated the offsets against the file length; the checked sums
        // keep that a fact here too.
        let range = f.data_start.checked_add(a).zip(f.data_start.checked_add(b));
        let data = range
            .and_then(|(start, end)| f.bytes.get(start..end))
            .ok_or_else(|| ModelError::Truncated {
                path: f.path.display().to_string(),
                tensor: name.to_string(),
                start: a,
                end: b,
                file_len: f.bytes.len().saturating_sub(f.data_start),
            })?;
        Ok(Some(RawTensor {
            dtype: tensor_type(info.dtype),
            shape: info.shape.clone(),
            data,
        }))
    }
}
