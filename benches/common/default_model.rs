//! The default model file a benchmark (or the real-model test) runs on: the first argument
//! that is not a flag, else `$SPECDRAFT_SMOLLM2_GGUF`, else the file `specdraft.models`
//! fetches (and caches).

use std::path::PathBuf;
use std::process::Command;

/// The path of the model file to load (see the module doc).
pub fn model_path() -> PathBuf {
    if let Some(p) = std::env::args().skip(1).find(|a| !a.starts_with('-')) {
        return PathBuf::from(p);
    }
    fetched_model_path()
}

/// The Python with specdraft's test dependencies (it runs `specdraft.models` and the numpy
/// references): `$PYTHON`, else `$PYO3_PYTHON`, else `python3`.
pub fn python() -> String {
    std::env::var("PYTHON")
        .or_else(|_| std::env::var("PYO3_PYTHON"))
        .unwrap_or_else(|_| "python3".into())
}

/// `$SPECDRAFT_SMOLLM2_GGUF`, else the file `specdraft.models` fetches (and caches).
pub fn fetched_model_path() -> PathBuf {
    if let Ok(p) = std::env::var("SPECDRAFT_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    let out = Command::new(python())
        .args([
            "-c",
            "from specdraft.models import fetch_default_model; print(fetch_default_model())",
        ])
        .env("PYTHONPATH", concat!(env!("CARGO_MANIFEST_DIR"), "/python"))
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "fetching the model failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}
