//! Broken checkpoints for the loaders' refusal tests: a safetensors header or a
//! `config.json` edited in place, and the check that a load refuses the result by name and
//! leaves nothing allocated.

use specdraft::backend::{CpuBackend, GpuBackend};
use specdraft::model::{LoadOptions, TargetModel};
use std::path::Path;
use std::sync::Arc;

/// Rewrites the safetensors header of `dir/model.safetensors` (the data stays in place, so
/// an edit must keep every tensor's byte length).
pub fn edit_header(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let text = serde_json::to_vec(&header).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(&bytes[8 + n..]);
    std::fs::write(&path, out).unwrap();
}

pub fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
}

/// Loads `dir` with `opts`; `Err` unless it is refused with every one of `needles` in the message and
/// nothing left allocated.
pub fn check_refusal(
    dir: &Path,
    what: &str,
    needles: &[&str],
    opts: LoadOptions,
) -> Result<(), String> {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::new());
    let err = match TargetModel::load(dir, gpu.clone(), opts) {
        Ok(_) => return Err(format!("{what}: {} loaded", dir.display())),
        Err(e) => e.to_string(),
    };
    if gpu.ledger().live_count() != 0 {
        return Err(format!("{what}: allocations left after refusing ({err})"));
    }
    match needles.iter().find(|n| !err.contains(*n)) {
        Some(n) => Err(format!("{what}: {err:?} does not name {n:?}")),
        None => Ok(()),
    }
}
