//! A test double of the `Communicator`: `n` ranks as threads of one process, meeting in
//! collectives through a mutex and a condition variable. It lets the expert-parallel
//! model and the engine's rank-0/worker protocol run in `cargo test` without MPI (the MPI
//! path runs the same code under `mpiexec` in `tests/python/test_distributed.py`).
//!
//! Every collective is a round: each rank deposits its input, the last to arrive combines
//! them, and each rank takes the result. A rank that waits longer than the timeout gets
//! `DistributedError::Timeout`, so a test whose ranks fall out of step fails instead of
//! hanging.

use specdraft::distributed::{Communicator, DistributedError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

#[derive(Default)]
struct Round {
    /// Rounds completed so far.
    done: u64,
    /// Inputs deposited for the current round, by rank.
    inputs: Vec<Option<Vec<u8>>>,
    /// The last completed round's result.
    result: Vec<u8>,
    /// Ranks that have taken the last result.
    taken: usize,
}

struct Group {
    size: usize,
    state: Mutex<Round>,
    cv: Condvar,
    timeout: Duration,
}

/// One rank of a [`thread_group`].
pub struct ThreadComm {
    rank: usize,
    group: Arc<Group>,
}

/// `size` communicators, one per rank, that time out after `timeout`.
pub fn thread_group(size: usize, timeout: Duration) -> Vec<Arc<dyn Communicator>> {
    let group = Arc::new(Group {
        size,
        state: Mutex::new(Round {
            inputs: vec![None; size],
            taken: size,
            ..Round::default()
        }),
        cv: Condvar::new(),
        timeout,
    });
    (0..size)
        .map(|rank| {
            Arc::new(ThreadComm {
                rank,
                group: group.clone(),
            }) as Arc<dyn Communicator>
        })
        .collect()
}

impl ThreadComm {
    /// Runs one collective round: deposits `input`, and once every rank has, `combine`
    /// (run by the last to arrive) makes the result every rank gets.
    fn round(
        &self,
        op: &'static str,
        input: Vec<u8>,
        combine: impl FnOnce(Vec<Vec<u8>>) -> Vec<u8>,
    ) -> Result<Vec<u8>, DistributedError> {
        let g = &self.group;
        let timeout = |_| DistributedError::Timeout {
            rank: self.rank,
            size: g.size,
            op,
            timeout_s: g.timeout.as_secs_f64(),
            missing: "another rank".into(),
        };
        let mut s = g.state.lock().unwrap();
        // Wait until every rank has taken the previous round's result.
        while s.taken < g.size {
            let (next, t) = g.cv.wait_timeout(s, g.timeout).unwrap();
            s = next;
            if t.timed_out() {
                return Err(timeout(()));
            }
        }
        let round = s.done;
        s.inputs[self.rank] = Some(input);
        if s.inputs.iter().all(Option::is_some) {
            let inputs = s.inputs.iter_mut().map(|i| i.take().unwrap()).collect();
            s.result = combine(inputs);
            s.done += 1;
            s.taken = 0;
            g.cv.notify_all();
        }
        while s.done == round {
            let (next, t) = g.cv.wait_timeout(s, g.timeout).unwrap();
            s = next;
            if t.timed_out() && s.done == round {
                return Err(timeout(()));
            }
        }
        let out = s.result.clone();
        s.taken += 1;
        g.cv.notify_all();
        Ok(out)
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.size
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), DistributedError> {
        let bytes = buf.iter().flat_map(|v| v.to_le_bytes()).collect();
        let out = self.round("all_reduce", bytes, |inputs| {
            let n = inputs[0].len() / 4;
            let mut sum = vec![0f32; n];
            // In rank order, as MPI's reduction of a fixed communicator is.
            for input in &inputs {
                for (s, c) in sum.iter_mut().zip(input.chunks_exact(4)) {
                    *s += f32::from_le_bytes(c.try_into().unwrap());
                }
            }
            sum.iter().flat_map(|v| v.to_le_bytes()).collect()
        })?;
        for (b, c) in buf.iter_mut().zip(out.chunks_exact(4)) {
            *b = f32::from_le_bytes(c.try_into().unwrap());
        }
        Ok(())
    }

    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<(), DistributedError> {
        let out = self.round("broadcast", buf.clone(), |mut inputs| {
            std::mem::take(&mut inputs[root])
        })?;
        *buf = out;
        Ok(())
    }

    fn barrier(&self) -> Result<(), DistributedError> {
        self.round("barrier", Vec::new(), |_| Vec::new())
            .map(|_| ())
    }
}
