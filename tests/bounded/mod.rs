//! Runs a loader call with its time and heap watched: the call runs on a fresh thread, this
//! test binary's allocator counts the bytes the whole process's heap holds, and the call
//! fails the test if it takes longer than a limit (a hang) or the heap grows by more than a
//! bound. Files are memory-mapped, so a file's own size is not on the heap.
//!
//! The count is the process's, so that an allocation made on any thread the load starts (a
//! kernel pool's workers, a loader's helpers) is charged to it. Invariant: while a bounded
//! call runs, no other thread of the binary allocates beyond noise. Bounded calls hold one
//! global lock for their whole run, so they never overlap; a test that allocates much outside
//! them (writing a large hostile file, building seeds) holds the same lock through
//! [`serial`] for its whole run, and every test of a binary that includes this module does,
//! so that the binary's tests run one at a time. The growth is measured from the live bytes
//! when the lock was taken (the baseline) to the highest count reached before the call
//! returned (the peak).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// Counts the bytes the process's allocations hold, and the peak since the last reset.
struct CountingAllocator;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn track(delta: isize) {
    let live = LIVE.fetch_add(delta, Ordering::Relaxed) + delta;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        track(layout.size() as isize);
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        track(layout.size() as isize);
        System.alloc_zeroed(layout)
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

/// The lock every bounded call, and every test of a binary that measures, holds.
static SERIAL: Mutex<()> = Mutex::new(());

thread_local! {
    /// Whether this thread holds [`SERIAL`] (through a [`Serial`]).
    static HOLDS: Cell<bool> = const { Cell::new(false) };
}

/// [`SERIAL`], held: no bounded call runs elsewhere while it lives.
pub struct Serial {
    _guard: MutexGuard<'static, ()>,
}

impl Drop for Serial {
    fn drop(&mut self) {
        HOLDS.with(|h| h.set(false));
    }
}

/// Takes the lock that bounded calls hold; a test holds it for its whole run so that its
/// own allocations are never counted in another test's bound. Calls of [`bounded`] under it
/// use it rather than taking it again.
pub fn serial() -> Serial {
    assert!(
        !HOLDS.with(Cell::get),
        "this thread already holds bounded::serial()"
    );
    // A test that failed while holding it poisoned it; the next test may still measure.
    let guard = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    HOLDS.with(|h| h.set(true));
    Serial { _guard: guard }
}

/// Runs `load` on a fresh thread and returns its result and how far the process's heap grew
/// above its live bytes at the start, at its highest, before the result came back; fails the
/// test if that takes longer than `time_limit`.
pub fn measure<T: Send + 'static>(
    time_limit: Duration,
    load: impl FnOnce() -> T + Send + 'static,
) -> (T, isize) {
    let _serial = (!HOLDS.with(Cell::get)).then(serial);
    let (tx, rx) = std::sync::mpsc::channel();
    let baseline = LIVE.load(Ordering::Relaxed);
    PEAK.store(baseline, Ordering::Relaxed);
    std::thread::spawn(move || {
        let _ = tx.send(load());
    });
    let out = match rx.recv_timeout(time_limit) {
        Ok(out) => out,
        Err(RecvTimeoutError::Timeout) => panic!("the load took longer than {time_limit:?}"),
        Err(RecvTimeoutError::Disconnected) => panic!("the load panicked (message above)"),
    };
    (out, PEAK.load(Ordering::Relaxed) - baseline)
}

/// [`measure`], failing the test if the process's heap grew by more than `heap_bound` bytes.
pub fn bounded<T: Send + 'static>(
    heap_bound: isize,
    time_limit: Duration,
    load: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (out, grew) = measure(time_limit, load);
    assert!(
        grew <= heap_bound,
        "the load's heap grew by {grew} bytes (bound {heap_bound})"
    );
    out
}
