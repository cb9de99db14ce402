//! [`KernelPool`]: a small persistent thread pool for kernels whose work is tens of microseconds.
//!
//! `threads - 1` workers plus the calling thread, which always takes a share, so the pool never
//! runs more threads than it was given (the number of cores by default). A call publishes one
//! job (a closure over task indices); every participant claims tasks from one atomic counter
//! until none are left. Idle workers spin for [`KernelPool::spin`] before sleeping on a
//! condition variable, so back-to-back calls (the linears of one forward pass) find them awake.
//! For the last three quarters of that spin a worker yields the core between checks: on a
//! machine whose other cores are busy, a worker woken onto the caller's core would otherwise
//! hold the caller off until it fell asleep (a 200 µs stall measured on 2 shared cores).
//!
//! A forward pass makes hundreds of calls of tens of microseconds each, so the round trip is
//! kept to a few cache-line transfers: no lock is taken on the hot path (the pool is claimed
//! with one atomic swap, a panic is flagged by an atomic before its message is locked), the
//! job's state word shares its cache line with the job it publishes (a joining worker reads
//! both in one transfer), and the task counter, which every participant hammers, and the
//! read-mostly settings each sit on a line of their own.
//!
//! Invariants:
//! - The caller never waits for a worker that has not started: a job is *closed* when the
//!   caller runs out of tasks, a worker joins only an open job, and the caller waits only for
//!   workers that joined. A descheduled worker costs nothing but its share of the tasks.
//! - A job's closure outlives every use: the caller returns only after every joined worker
//!   has left, even when a task panicked (the panic becomes an error) and even when the caller
//!   unwinds (a guard's `Drop` waits for them), and recording a panic never unwinds a worker
//!   out of its job.
//! - A call made while the pool is busy (another thread, or a task calling back into the pool)
//!   runs inline on the calling thread: no deadlock, no extra threads.

use super::{Isa, QuantError, SupportedIsa};
use std::any::Any;
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The state word: epoch (high 32 bits), closed flag (bit 31), joined workers (low 31 bits).
const CLOSED: u64 = 1 << 31;
const ACTIVE: u64 = CLOSED - 1;

fn epoch(s: u64) -> u64 {
    s >> 32
}

type Job = *const (dyn Fn(usize) + Sync + 'static);

/// Aligns its contents to a cache line of its own (two 64-byte lines: adjacent-line prefetch
/// pulls pairs on x86), so that writes to one field do not evict readers of another.
#[repr(align(128))]
struct Line<T>(T);

impl<T> std::ops::Deref for Line<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// What a call publishes, on one line: workers spin reading `state`, and one that joins reads
/// `job` and `tasks` next, so they travel together.
struct Published {
    state: AtomicU64,
    /// Written by the publisher before it opens a job; read by workers that joined it.
    job: UnsafeCell<Job>,
    tasks: AtomicUsize,
}

struct Shared {
    published: Line<Published>,
    /// The next task to claim: every participant increments it, so it sits apart.
    next: Line<AtomicUsize>,
    /// Set when a task panicked; the message is in `panic_message`.
    panicked: Line<AtomicBool>,
    panic_message: Mutex<Option<String>>,
    sleepers: Line<AtomicUsize>,
    sleep: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
    spin: Duration,
}

// SAFETY: `job` is written only by the thread that claimed `KernelPool::busy`, before the
// Release store that opens the job, and read only by workers that joined that job (Acquire),
// while the publisher waits for them; every other field is an atomic or a lock.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// A task's panic as text, its payload dropped without unwinding: a payload's own `Drop` may
/// panic (`std::panic::panic_any` takes any type), and that panic is caught and its payload
/// dropped the same way (a chain of them is cut after a few, its last payload leaked).
/// Recording a panic therefore never unwinds: a worker that unwound here would never leave its
/// job, and its caller would wait for it forever.
fn panic_message(p: Box<dyn Any + Send>) -> String {
    let message = crate::error::panic_message(p.as_ref())
        .unwrap_or("unknown panic")
        .to_string();
    let mut p = p;
    for _ in 0..4 {
        match catch_unwind(AssertUnwindSafe(move || drop(p))) {
            Ok(()) => return message,
            Err(again) => p = again,
        }
    }
    std::mem::forget(p);
    message
}

impl Shared {
    /// Claims and runs tasks until none are left; a panic is recorded, not propagated.
    fn run_tasks(&self, job: &(dyn Fn(usize) + Sync)) {
        let n = self.published.tasks.load(Relaxed);
        let result = catch_unwind(AssertUnwindSafe(|| loop {
            let t = self.next.fetch_add(1, Relaxed);
            if t >= n {
                break;
            }
            job(t);
        }));
        if let Err(p) = result {
            // Let the others stop early.
            self.next.store(usize::MAX / 2, Relaxed);
            *self.panic_message.lock().unwrap_or_else(|e| e.into_inner()) = Some(panic_message(p));
            self.panicked.store(true, Release);
        }
    }

    fn worker(&self) {
        let state = &self.published.state;
        let mut seen = epoch(state.load(Acquire));
        loop {
            if !self.wait_for_job(seen) {
                return;
            }
            let mut s = state.load(Acquire);
            seen = epoch(s);
            // Join the job unless the caller has already closed it.
            while epoch(s) == seen && s & CLOSED == 0 {
                match state.compare_exchange_weak(s, s + 1, Acquire, Acquire) {
                    Ok(_) => {
                        // SAFETY: joined an open job: the publisher wrote `job` before opening
                        // it and keeps the closure alive until this worker leaves below.
                        let job = unsafe { &**self.published.job.get() };
                        self.run_tasks(job);
                        state.fetch_sub(1, Release);
                        break;
                    }
                    Err(now) => s = now,
                }
            }
        }
    }

    /// Spins, then sleeps, until the epoch moves past `seen`; false on shutdown.
    fn wait_for_job(&self, seen: u64) -> bool {
        let state = &self.published.state;
        let start = Instant::now();
        let mut spins = 0u32;
        while epoch(state.load(Acquire)) == seen {
            if self.shutdown.load(Relaxed) {
                return false;
            }
            std::hint::spin_loop();
            spins += 1;
            if !spins.is_multiple_of(256) {
                continue;
            }
            let waited = start.elapsed();
            if waited < self.spin {
                // Past the first stretch, a worker that shares its core with the caller (the
                // other cores busy elsewhere) would hold the caller off until it slept:
                // yielding hands the core back, and costs one system call when it is free.
                if waited >= self.spin / 4 {
                    std::thread::yield_now();
                }
            } else {
                let mut guard = self.sleep.lock().unwrap_or_else(|e| e.into_inner());
                self.sleepers.fetch_add(1, SeqCst);
                while epoch(state.load(SeqCst)) == seen && !self.shutdown.load(SeqCst) {
                    guard = self.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
                self.sleepers.fetch_sub(1, SeqCst);
            }
        }
        !self.shutdown.load(Relaxed)
    }
}

/// A persistent pool of `threads - 1` workers plus the calling thread (see the module doc).
pub struct KernelPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Held by the call that has the workers; a call that finds it held runs inline.
    busy: Line<AtomicBool>,
    level: SupportedIsa,
}

impl KernelPool {
    /// How long an idle worker spins before it sleeps.
    pub const DEFAULT_SPIN: Duration = Duration::from_micros(200);

    /// A pool of `threads` participants (at least 1) using the fastest instruction set here
    /// ([`Isa::preferred`]).
    pub fn new(threads: usize) -> Self {
        Self::with_options(threads, Isa::preferred(), Self::DEFAULT_SPIN)
    }

    /// A pool of `threads` participants, kernels limited to `isa` (clamped to what the CPU
    /// has), idle workers spinning for `spin` before they sleep.
    pub fn with_options(threads: usize, isa: Isa, spin: Duration) -> Self {
        let level = SupportedIsa::at_most(isa);
        let shared = Arc::new(Shared {
            published: Line(Published {
                state: AtomicU64::new(0),
                job: UnsafeCell::new(std::ptr::null::<fn(usize)>() as Job),
                tasks: AtomicUsize::new(0),
            }),
            next: Line(AtomicUsize::new(0)),
            panicked: Line(AtomicBool::new(false)),
            panic_message: Mutex::new(None),
            sleepers: Line(AtomicUsize::new(0)),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            spin,
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("specdraft-kernel-{i}"))
                    .spawn(move || s.worker())
                    .expect("spawning a kernel worker thread")
            })
            .collect();
        KernelPool {
            shared,
            workers,
            busy: Line(AtomicBool::new(false)),
            level,
        }
    }

    /// A pool with one participant per available core.
    pub fn per_core() -> Self {
        Self::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// Participants, the calling thread included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// The instruction set the kernels use.
    pub fn isa(&self) -> Isa {
        self.level.isa()
    }

    /// The instruction set the kernels use, as the proof that this CPU runs it which the
    /// kernels take.
    pub fn level(&self) -> SupportedIsa {
        self.level
    }

    /// How long idle workers spin before sleeping.
    pub fn spin(&self) -> Duration {
        self.shared.spin
    }

    /// Runs `f(0) .. f(tasks - 1)`, each exactly once, spread over the pool; returns when all
    /// are done. A panicking task becomes [`QuantError::TaskPanicked`].
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) -> Result<(), QuantError> {
        let inline = || {
            catch_unwind(AssertUnwindSafe(|| (0..tasks).for_each(f)))
                .map_err(|p| QuantError::TaskPanicked(panic_message(p)))
        };
        if self.workers.is_empty() || tasks <= 1 {
            return inline();
        }
        if self
            .busy
            .compare_exchange(false, true, Acquire, Relaxed)
            .is_err()
        {
            return inline();
        }
        // Released however this call ends, after `open` below (declared later, dropped
        // first): a job stays claimed until its workers have left.
        let _claim = ClaimGuard(&self.busy);
        let sh = &*self.shared;
        {
            // SAFETY: this call holds the claim, and `open` is dropped at the end of this
            // block (on an unwind too), never leaked.
            let open = unsafe { OpenJob::publish(sh, tasks, f) };
            sh.run_tasks(f);
            // Closes the job and waits for every worker that joined it.
            drop(open);
        }
        if !sh.panicked.load(Acquire) {
            return Ok(());
        }
        sh.panicked.store(false, Relaxed);
        let msg = sh
            .panic_message
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        Err(QuantError::TaskPanicked(
            msg.unwrap_or_else(|| "unknown panic".into()),
        ))
    }
}

/// A published job, open to workers until dropped. Dropping it closes the job and waits
/// until every worker that joined has left, so the closure whose lifetime
/// [`OpenJob::publish`] erased is never read after the borrow it came from ends. Being a
/// `Drop`, the wait also happens when the caller unwinds between publishing and waiting:
/// without it, an unwind there would return while workers still ran a closure on the
/// caller's stack.
struct OpenJob<'a> {
    shared: &'a Shared,
    _job: std::marker::PhantomData<&'a (dyn Fn(usize) + Sync)>,
}

impl<'a> OpenJob<'a> {
    /// Publishes `f` over `tasks` tasks and wakes sleeping workers.
    ///
    /// # Safety
    /// The caller holds the pool's `busy` claim (so no other job is published meanwhile), and
    /// drops the guard, never leaks it (`std::mem::forget`): the lifetime `'a` ties `f` to
    /// the guard, but only the drop makes the workers stop reading it.
    unsafe fn publish(shared: &'a Shared, tasks: usize, f: &'a (dyn Fn(usize) + Sync)) -> Self {
        let published = &*shared.published;
        // SAFETY: workers read the closure only between joining this job and leaving it, and
        // the guard's drop waits until every joined worker has left, before `'a` ends.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        // SAFETY: no worker reads `job` now: the previous job is closed with no one joined.
        unsafe { *published.job.get() = job };
        published.tasks.store(tasks, Relaxed);
        shared.next.store(0, Relaxed);
        let s = published.state.load(Relaxed);
        published.state.store((epoch(s) + 1) << 32, SeqCst);
        if shared.sleepers.load(SeqCst) > 0 {
            let _g = shared.sleep.lock().unwrap_or_else(|e| e.into_inner());
            shared.wake.notify_all();
        }
        OpenJob {
            shared,
            _job: std::marker::PhantomData,
        }
    }
}

impl Drop for OpenJob<'_> {
    fn drop(&mut self) {
        let published = &*self.shared.published;
        published.state.fetch_or(CLOSED, AcqRel);
        let mut spins = 0u32;
        while published.state.load(Acquire) & ACTIVE != 0 {
            spins += 1;
            if spins < 1 << 12 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// Clears a claimed flag when dropped.
struct ClaimGuard<'a>(&'a AtomicBool);

impl Drop for ClaimGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Release);
    }
}

impl Default for KernelPool {
    fn default() -> Self {
        Self::per_core()
    }
}

impl Drop for KernelPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, SeqCst);
        {
            let _g = self.shared.sleep.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl std::fmt::Debug for KernelPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelPool")
            .field("threads", &self.threads())
            .field("isa", &self.level.isa())
            .field("spin", &self.shared.spin)
            .finish()
    }
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
