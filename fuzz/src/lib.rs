//! Fuzzing of specdraft's loaders: the targets (one per loader, in [`targets`]), the
//! harness every libFuzzer binary shares, and a structured mutator for runs without
//! libFuzzer ([`mutate`]).
//!
//! The harness adds two checks libFuzzer cannot make without a sanitizer: a heap cap (this
//! crate's global allocator aborts when the Rust heap would pass [`HEAP_CAP`], which
//! libFuzzer reports as a crash with the input saved), and the slowest input seen, saved for
//! the fuzz script to report.

pub mod mutate;
pub mod targets;

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// The most heap the loaders may hold while loading one input (inputs are at most a few
/// megabytes; a parsed GGUF header alone may take 256 MiB).
pub const HEAP_CAP: usize = 1 << 30;

static LIVE: AtomicUsize = AtomicUsize::new(0);

/// The system allocator with a cap on the bytes live at once.
pub struct CappedAllocator;

unsafe impl GlobalAlloc for CappedAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        reserve(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        reserve(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        reserve(new_size);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

fn reserve(size: usize) {
    let live = LIVE.fetch_add(size, Ordering::Relaxed).saturating_add(size);
    if live > HEAP_CAP {
        // No formatting here: it could allocate, inside the allocator.
        let _ = std::io::stderr().write_all(b"specdraft-fuzz: the heap passed its cap\n");
        std::process::abort();
    }
}

#[global_allocator]
static ALLOCATOR: CappedAllocator = CappedAllocator;

/// The slowest input's CPU time, and whether the first (warm-up) run is done.
static SLOWEST: Mutex<(Duration, bool)> = Mutex::new((Duration::ZERO, false));

/// CPU time the process has used (all threads): on a shared machine, wall time measures
/// the neighbours as much as the input.
fn cpu_time() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Runs `target` on `data`; when it is the slowest input so far (in CPU time, the first run
/// aside) and `SPECDRAFT_FUZZ_SLOWEST` names a folder, saves the input as `{name}.bin` and
/// its time and size as `{name}.txt`.
pub fn run(name: &str, data: &[u8], target: targets::Target) {
    let start = cpu_time();
    // Refusals are the loaders' answer to hostile bytes; only a crash, a hang or the heap cap
    // is a finding.
    let _ = target(data);
    let took = cpu_time().saturating_sub(start);
    let mut slowest = SLOWEST.lock().unwrap_or_else(|e| e.into_inner());
    // The first run also pays for one-time setup (thread pools, lazy statics).
    let warmed_up = std::mem::replace(&mut slowest.1, true);
    if !warmed_up || took <= slowest.0 {
        return;
    }
    slowest.0 = took;
    if let Ok(dir) = std::env::var("SPECDRAFT_FUZZ_SLOWEST") {
        let dir = std::path::Path::new(&dir);
        let _ = std::fs::write(dir.join(format!("{name}.bin")), data);
        let line = format!("{} us cpu, {} bytes\n", took.as_micros(), data.len());
        let _ = std::fs::write(dir.join(format!("{name}.txt")), line);
    }
}
