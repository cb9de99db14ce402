//! Where libnccl comes from, and the error that says how to get it when it is missing.
//!
//! cudarc loads NCCL at run time (`dlopen`) under a fixed list of names (`libnccl.so`,
//! `libnccl.so.13`, `libnccl.so.12`, ...) through the dynamic loader's search path. The
//! `nvidia-nccl-cu12` wheel ships the library as `site-packages/nvidia/nccl/lib/libnccl.so.2`,
//! a name outside that list, and the loader reads `LD_LIBRARY_PATH` only when a process
//! starts; so the wheel's library is reached through a folder that holds a `libnccl.so`
//! link to it, put on `LD_LIBRARY_PATH` before the process starts
//! (`specdraft.distributed.nccl_library_dir()` makes that folder; `tests/gpu/run.sh` does the
//! same in shell).
//!
//! Invariant: [`require_nccl`] is called before any other NCCL symbol is used, since
//! cudarc panics when the library is missing.

use super::DistributedError;
use cudarc::nccl::sys;

/// The wheel that carries libnccl for CUDA 12 and later drivers.
pub const NCCL_WHEEL: &str = "nvidia-nccl-cu12";

/// `Ok` when cudarc can load libnccl; else [`DistributedError::Unavailable`] naming the
/// library, the names tried, and how to install and expose the wheel's copy.
pub(crate) fn require_nccl(rank: usize) -> Result<(), DistributedError> {
    // SAFETY: only tries to open the library; no symbol of it is used.
    if unsafe { sys::is_culib_present() } {
        return Ok(());
    }
    Err(DistributedError::Unavailable {
        rank,
        message: missing_message(),
    })
}

fn missing_message() -> String {
    let mut names: Vec<String> = Vec::new();
    for name in cudarc::get_lib_name_candidates("nccl") {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    format!(
        "NCCL library (libnccl) not found: cudarc loads it from the dynamic loader's path \
         (LD_LIBRARY_PATH) under the names {}. Install it with `pip install {NCCL_WHEEL}` \
         (or `pip install 'specdraft[nccl]'`); that wheel's library is \
         site-packages/nvidia/nccl/lib/libnccl.so.2, so start the process with \
         LD_LIBRARY_PATH naming a folder with a libnccl.so link to it \
         (`python3 -c 'import specdraft.distributed as d; print(d.nccl_library_dir())'` \
         makes one and prints it)",
        names.join(", ")
    )
}
