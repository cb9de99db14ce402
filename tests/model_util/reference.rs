//! Runs one of the independent numpy references in `tests/python/` and reads the
//! `reference.json` it writes: the one way the model tests call a reference script.

use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// Runs `python tests/python/{script} {mode} {dir} {seed} {tokens,...} {extra...}` and returns
/// the `reference.json` the script wrote into `dir` (it also writes its checkpoint there).
/// Panics with the script's stderr when it fails.
pub fn run_reference(
    python: &str,
    script: &str,
    mode: &str,
    dir: &Path,
    seed: u64,
    tokens: &[u32],
    extra: &[&str],
) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(script);
    let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let out = Command::new(python)
        .arg(&path)
        .args([
            mode,
            dir.to_str().unwrap(),
            &seed.to_string(),
            &ids.join(","),
        ])
        .args(extra)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python} {}: {e}", path.display()));
    assert!(
        out.status.success(),
        "the reference failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A JSON array of numbers as f32.
pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// A JSON array of arrays of numbers as rows of f32.
pub fn rows(v: &Value) -> Vec<Vec<f32>> {
    v.as_array().unwrap().iter().map(floats).collect()
}
