//! Runs a loader call with its time and heap watched: the call runs on a fresh thread, this
//! test binary's allocator counts the bytes each thread's heap holds, and the call fails the
//! test if it takes longer than a limit (a hang) or its thread's heap grows by more than a
//! bound. Files are memory-mapped, so a file's own size is not on the heap.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

/// Counts the bytes each thread's allocations hold, and the peak.
struct CountingAllocator;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn track(delta: isize) {
    // try_with: a thread being torn down has no counters left, and needs none.
    let _ = LIVE.try_with(|live| {
        live.set(live.get() + delta);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(live.get())));
    });
}

unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        track(layout.size() as isize);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        track(-(layout.size() as isize));
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        track(new_size as isize - layout.size() as isize);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Runs `load` on a fresh thread and returns its result, failing the test if that takes
/// longer than `time_limit` or the thread's heap grew by more than `heap_bound` bytes.
pub fn bounded<T: Send + 'static>(
    heap_bound: isize,
    time_limit: Duration,
    load: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let start = LIVE.with(|l| l.get());
        PEAK.with(|p| p.set(start));
        let out = load();
        let grew = PEAK.with(|p| p.get()) - start;
        let _ = tx.send((out, grew));
    });
    let (out, grew) = match rx.recv_timeout(time_limit) {
        Ok(done) => done,
        Err(RecvTimeoutError::Timeout) => panic!("the load took longer than {time_limit:?}"),
        Err(RecvTimeoutError::Disconnected) => panic!("the load panicked (message above)"),
    };
    assert!(
        grew <= heap_bound,
        "the load's heap grew by {grew} bytes (bound {heap_bound})"
    );
    out
}
