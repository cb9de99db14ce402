//! Tests of the kernel pool: every task runs exactly once; `run` returns only after every
//! task has finished; a panic on the caller or on a worker comes back as an error and leaves
//! the pool usable; nested and concurrent calls run inline.

use super::*;
use std::sync::atomic::AtomicU32;

#[test]
fn every_task_runs_exactly_once() {
    let pool = KernelPool::with_options(3, Isa::Portable, Duration::from_micros(50));
    for tasks in [0, 1, 2, 7, 100] {
        for round in 0..50 {
            let hits: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
            pool.run(tasks, &|t| {
                hits[t].fetch_add(1, Relaxed);
            })
            .unwrap();
            assert!(
                hits.iter().all(|h| h.load(Relaxed) == 1),
                "tasks={tasks} round={round}"
            );
            if round % 10 == 0 {
                // Let the workers fall asleep, so the wake-up path runs too.
                std::thread::sleep(Duration::from_micros(300));
            }
        }
    }
    // Many tiny tasks, all threads claiming at once: a claim that is not atomic shows up
    // as a task run twice or never.
    let hits: Vec<AtomicU32> = (0..200_000).map(|_| AtomicU32::new(0)).collect();
    pool.run(hits.len(), &|t| {
        hits[t].fetch_add(1, Relaxed);
    })
    .unwrap();
    let wrong = hits.iter().filter(|h| h.load(Relaxed) != 1).count();
    assert_eq!(wrong, 0, "tasks not run exactly once");
}

#[test]
fn a_panicking_task_is_an_error_and_the_pool_keeps_working() {
    let pool = KernelPool::with_options(2, Isa::Portable, Duration::from_micros(50));
    let err = pool
        .run(16, &|t| {
            if t == 5 {
                panic!("task five failed");
            }
        })
        .unwrap_err();
    assert_eq!(err, QuantError::TaskPanicked("task five failed".into()));
    let count = AtomicU32::new(0);
    pool.run(16, &|_| {
        count.fetch_add(1, Relaxed);
    })
    .unwrap();
    assert_eq!(count.load(Relaxed), 16);
}

#[test]
fn nested_and_concurrent_calls_run_inline() {
    let pool = Arc::new(KernelPool::with_options(2, Isa::Portable, Duration::ZERO));
    let total = AtomicU32::new(0);
    pool.run(4, &|_| {
        pool.run(3, &|_| {
            total.fetch_add(1, Relaxed);
        })
        .unwrap();
    })
    .unwrap();
    assert_eq!(total.load(Relaxed), 12);
    let handles: Vec<_> = (0..3)
        .map(|_| {
            let p = pool.clone();
            std::thread::spawn(move || {
                let n = AtomicU32::new(0);
                for _ in 0..200 {
                    p.run(5, &|_| {
                        n.fetch_add(1, Relaxed);
                    })
                    .unwrap();
                }
                n.load(Relaxed)
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), 1000);
    }
}

#[test]
fn workers_that_wake_late_never_join_a_finished_job() {
    // Workers that sleep at once wake long after the caller has run short jobs alone; if
    // one joined such a job after the caller returned, the state word would go wrong and
    // later calls would hang or lose tasks. A watchdog turns a hang into a failure.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let pool = KernelPool::with_options(3, Isa::Portable, Duration::ZERO);
        let count = AtomicU32::new(0);
        for _ in 0..20_000 {
            pool.run(2, &|_| {
                count.fetch_add(1, Relaxed);
            })
            .unwrap();
        }
        tx.send(count.load(Relaxed)).unwrap();
    });
    let count = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the pool hung");
    assert_eq!(count, 40_000);
}

#[test]
fn run_returns_only_after_every_task_has_finished() {
    let pool = KernelPool::with_options(2, Isa::Portable, Duration::from_millis(5));
    let caller = std::thread::current().id();
    let on_worker = AtomicU32::new(0);
    for round in 0..20 {
        let done = AtomicU32::new(0);
        pool.run(8, &|_| {
            if std::thread::current().id() != caller {
                on_worker.fetch_add(1, Relaxed);
            }
            std::thread::sleep(Duration::from_millis(1));
            done.fetch_add(1, Relaxed);
        })
        .unwrap();
        assert_eq!(
            done.load(Relaxed),
            8,
            "round {round}: returned before its tasks ended"
        );
    }
    // The check above means something only if the worker took part.
    assert!(on_worker.load(Relaxed) > 0, "the worker never ran a task");
}

/// A panic payload whose own `Drop` panics: what `panic_any` can throw at the pool.
struct DropPanics;

impl Drop for DropPanics {
    fn drop(&mut self) {
        panic!("the panic payload's drop panicked too");
    }
}

/// Runs `f` on a thread of its own and fails if it takes more than a minute: a pool that
/// waits forever for a worker fails the test instead of hanging it.
fn within_a_minute<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(f()).unwrap());
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the pool hung")
}

/// Spins until `flag` is set; false after a few seconds without it.
fn wait_for(flag: &AtomicBool) -> bool {
    let start = Instant::now();
    while !flag.load(SeqCst) {
        if start.elapsed() > Duration::from_secs(2) {
            return false;
        }
        std::thread::yield_now();
    }
    true
}

#[test]
fn a_panic_on_the_caller_returns_only_after_the_workers_and_leaves_the_pool_usable() {
    let (returned, busy_worker_done, total) = within_a_minute(|| {
        // Declared before the pool, so they outlive its workers whatever `run` does.
        let (started, done) = (AtomicBool::new(false), AtomicBool::new(false));
        let caller = std::thread::current().id();
        let job = |_| {
            if std::thread::current().id() != caller {
                started.store(true, SeqCst);
                std::thread::sleep(Duration::from_millis(50));
                done.store(true, SeqCst);
            } else if wait_for(&started) {
                // While the worker is inside the job.
                std::panic::panic_any(DropPanics);
            }
        };
        let pool = KernelPool::with_options(2, Isa::Portable, Duration::from_millis(20));
        for _ in 0..20 {
            started.store(false, SeqCst);
            done.store(false, SeqCst);
            let result = catch_unwind(AssertUnwindSafe(|| pool.run(2, &job)));
            if !started.load(SeqCst) {
                continue; // The worker never joined: try again.
            }
            let done = done.load(SeqCst);
            let count = AtomicU32::new(0);
            pool.run(16, &|_| {
                count.fetch_add(1, Relaxed);
            })
            .unwrap();
            return (result, done, count.load(Relaxed));
        }
        panic!("the worker never joined a job");
    });
    let returned = returned.expect("run unwound instead of returning the task's panic");
    assert_eq!(
        returned,
        Err(QuantError::TaskPanicked("unknown panic".into()))
    );
    assert!(
        busy_worker_done,
        "run returned while a worker was still running its job"
    );
    assert_eq!(total, 16, "the next job after the panic");
}

#[test]
fn a_panic_on_a_worker_is_the_callers_error_and_the_worker_keeps_working() {
    let (returned, worker_ran_later) = within_a_minute(|| {
        let (thrown, on_worker) = (AtomicBool::new(false), AtomicBool::new(false));
        let caller = std::thread::current().id();
        let job = |_| {
            if std::thread::current().id() != caller {
                thrown.store(true, SeqCst);
                std::panic::panic_any(DropPanics);
            }
            // The caller leaves the worker time to join and take a task.
            wait_for(&thrown);
        };
        let pool = KernelPool::with_options(2, Isa::Portable, Duration::from_millis(20));
        for _ in 0..20 {
            let result = pool.run(2, &job);
            if !thrown.load(SeqCst) {
                continue; // The worker never joined: try again.
            }
            // The worker is alive: it takes tasks of later jobs.
            for _ in 0..200 {
                pool.run(2, &|_| {
                    if std::thread::current().id() != caller {
                        on_worker.store(true, SeqCst);
                    }
                    std::thread::sleep(Duration::from_micros(200));
                })
                .unwrap();
                if on_worker.load(SeqCst) {
                    break;
                }
            }
            return (result, on_worker.load(SeqCst));
        }
        panic!("the worker never joined a job");
    });
    assert_eq!(
        returned,
        Err(QuantError::TaskPanicked("unknown panic".into()))
    );
    assert!(worker_ran_later, "the worker ran no task after its panic");
}

#[test]
fn an_unwinding_caller_waits_for_the_workers_inside_its_job() {
    // Nothing in `run` unwinds between publishing and waiting today; the guard is what
    // keeps that sound if something ever does. Here the caller unwinds by hand, its job
    // published and a worker inside it.
    let (started, done) = (AtomicBool::new(false), AtomicBool::new(false));
    let job = |_| {
        started.store(true, SeqCst);
        std::thread::sleep(Duration::from_millis(50));
        done.store(true, SeqCst);
    };
    // Declared after what the job borrows, so its workers are joined before that goes.
    let pool = KernelPool::with_options(2, Isa::Portable, Duration::from_millis(20));
    // A worker joins jobs published after it started: wait until it has taken a task.
    let caller = std::thread::current().id();
    let worker_ran = AtomicBool::new(false);
    for _ in 0..1000 {
        pool.run(2, &|_| {
            if std::thread::current().id() != caller {
                worker_ran.store(true, SeqCst);
            }
            std::thread::sleep(Duration::from_micros(100));
        })
        .unwrap();
        if worker_ran.load(SeqCst) {
            break;
        }
    }
    assert!(pool
        .busy
        .compare_exchange(false, true, Acquire, Relaxed)
        .is_ok());
    let _claim = ClaimGuard(&pool.busy);
    let unwound = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the claim is held; the guard is dropped by this closure's unwind.
        let _open = unsafe { OpenJob::publish(&pool.shared, 1, &job) };
        assert!(wait_for(&started), "no worker joined the job");
        panic!("the caller fails while a worker runs its job");
    }));
    let message = panic_message(unwound.expect_err("the caller unwinds"));
    assert_eq!(message, "the caller fails while a worker runs its job");
    assert!(
        done.load(SeqCst),
        "the caller unwound past a worker still running its job"
    );
}
