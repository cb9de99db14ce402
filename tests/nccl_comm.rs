//! `NcclCommunicator` (feature `cuda`). Without libnccl, a CUDA driver or a device, making
//! one (or its unique id) must return the documented error and never panic (plain tests, run
//! everywhere). With a GPU and libnccl, every collective must give the sums that numpy
//! computes from every rank's inputs (tests/python/nccl_reference.py), and a rank that never
//! joins must end the start-up with a timeout naming it; these tests are ignored in a plain
//! `cargo test` and `tests/gpu/run.sh` runs them with `--ignored`.
//!
//! A communicator of one rank runs every collective through NCCL and the staging copies
//! (its sums are each rank's own values). The two-rank sums start the test binary twice,
//! one process a rank: on two GPUs a GPU each; on one GPU both on it, as two hosts to NCCL
//! (which otherwise refuses two ranks on one GPU, "Duplicate GPU detected").
#![cfg(feature = "cuda")]

use specdraft::distributed::{
    Command, Communicator, DistributedError, NcclCommunicator, NCCL_UNIQUE_ID_BYTES,
};
use std::io::Write;
use std::path::Path;
use std::process::{Command as Process, Stdio};
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(20);

/// Whether the loader finds libnccl under cudarc's names (decides which error is due).
fn libnccl_loads() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// `result` is the error that names what is missing: libnccl (with the wheel to install
/// and the name it ships under) when the loader cannot find it, else the driver or GPU.
fn expect_unavailable(result: Result<(), DistributedError>, what: &str) {
    match result {
        Err(DistributedError::Unavailable { rank: 0, message }) => {
            if libnccl_loads() {
                assert!(
                    message.contains("no CUDA driver (libcuda) found")
                        || message.contains("no CUDA device"),
                    "{what}: libnccl loads, so the driver or GPU is missing: {message}"
                );
            } else {
                for part in ["libnccl", "pip install nvidia-nccl-cu12", "libnccl.so.2"] {
                    assert!(message.contains(part), "{what}: no {part:?} in: {message}");
                }
            }
        }
        Err(other) => panic!("{what}: expected Unavailable, got {other}"),
        Ok(()) => eprintln!("{what}: NCCL and a GPU are present; the GPU tests cover this"),
    }
}

#[test]
fn without_libnccl_or_a_gpu_the_start_up_is_a_clear_error() {
    let made = std::panic::catch_unwind(|| {
        NcclCommunicator::new(0, 1, &[0u8; NCCL_UNIQUE_ID_BYTES], 0, TIMEOUT, None).map(|_| ())
    })
    .expect("NcclCommunicator::new panicked");
    expect_unavailable(made, "new");
    let id = std::panic::catch_unwind(|| NcclCommunicator::unique_id().map(|_| ()))
        .expect("NcclCommunicator::unique_id panicked");
    // A unique id needs libnccl only (no GPU): it is made wherever libnccl loads.
    assert_eq!(id.is_ok(), libnccl_loads(), "unique_id: {id:?}");
    if id.is_err() {
        expect_unavailable(id, "unique_id");
    }
}

#[test]
fn arguments_are_checked_before_any_library_is_looked_for() {
    let id = [0u8; NCCL_UNIQUE_ID_BYTES];
    match NcclCommunicator::new(0, 1, &id[..16], 0, TIMEOUT, None) {
        Err(DistributedError::InvalidArgument { message, .. }) => {
            assert!(message.contains("128 bytes, got 16"), "{message}")
        }
        other => panic!("expected InvalidArgument, got {:?}", other.err()),
    }
    match NcclCommunicator::new(2, 2, &id, 0, TIMEOUT, None) {
        Err(DistributedError::InvalidArgument { message, .. }) => {
            assert!(message.contains("rank 2 is not a rank of 2"), "{message}")
        }
        other => panic!("expected InvalidArgument, got {:?}", other.err()),
    }
}

// ---- GPU checks (tests/gpu/run.sh) ----

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// numpy's f32 sum and its bf16 rounding (bit patterns) of every rank's `values`.
fn numpy_sums(ranks: &[Vec<f32>]) -> (Vec<f32>, Vec<u16>) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/nccl_reference.py");
    let mut child = Process::new(python())
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {} {}: {e}", python(), script.display()));
    let input = serde_json::json!({ "ranks": ranks }).to_string();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the numpy reference failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let f32s = v["f32"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    let bits = v["bf16_bits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u16)
        .collect();
    (f32s, bits)
}

/// Rank `rank`'s values: distinct per rank and element, with fractions bf16 must round.
fn values(rank: usize, n: usize) -> Vec<f32> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64 ^ (rank as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
        })
        .collect()
}

/// Runs every collective as rank `comm.rank()` of `comm.size()` and checks each against
/// numpy's sums of every rank's [`values`]; returns the first mismatch.
fn check_collectives(comm: &NcclCommunicator) -> Result<(), String> {
    let (rank, size) = (comm.rank(), comm.size());
    // 3 elements, then one past a power of two (the staging buffer grows), then 1.
    for n in [3usize, 4097, 1] {
        let all: Vec<Vec<f32>> = (0..size).map(|r| values(r, n)).collect();
        let (sum, sum_bf16) = numpy_sums(&all);
        let mut buf = all[rank].clone();
        comm.all_reduce_sum_f32(&mut buf)
            .map_err(|e| e.to_string())?;
        if buf != sum {
            return Err(format!(
                "rank {rank}: f32 all-reduce of {n}: {buf:?} != numpy's {sum:?}"
            ));
        }
        let mut half: Vec<half::bf16> =
            all[rank].iter().map(|&v| half::bf16::from_f32(v)).collect();
        comm.all_reduce_sum_bf16(&mut half)
            .map_err(|e| e.to_string())?;
        let bits: Vec<u16> = half.iter().map(|v| v.to_bits()).collect();
        if bits != sum_bf16 {
            return Err(format!(
                "rank {rank}: bf16 all-reduce of {n}: {bits:?} != numpy's {sum_bf16:?}"
            ));
        }
    }
    for root in 0..size {
        let sent: Vec<u8> = (0..300 + root).map(|i| (i * 7 + root) as u8).collect();
        let mut buf = if rank == root {
            sent.clone()
        } else {
            vec![0xAA; 5]
        };
        comm.broadcast_bytes(root, &mut buf)
            .map_err(|e| e.to_string())?;
        if buf != sent {
            return Err(format!(
                "rank {rank}: broadcast from {root}: {} bytes, not root's {}",
                buf.len(),
                sent.len()
            ));
        }
    }
    comm.barrier().map_err(|e| e.to_string())?;
    let cmd = Command::Trim { seq: 7, len: 300 };
    if rank == 0 {
        comm.send_command(&cmd).map_err(|e| e.to_string())?;
    } else {
        let got = comm.recv_command().map_err(|e| e.to_string())?;
        if got != cmd {
            return Err(format!("rank {rank}: received {got:?}, not {cmd:?}"));
        }
    }
    Ok(())
}

fn gpu_comm(rank: usize, size: usize, id: &[u8], device: usize) -> NcclCommunicator {
    NcclCommunicator::new(rank, size, id, device, TIMEOUT, None).unwrap_or_else(|e| {
        panic!("this test needs a CUDA GPU and libnccl (tests/gpu/run.sh runs it): {e}")
    })
}

#[test]
#[ignore = "needs a CUDA GPU and libnccl; tests/gpu/run.sh runs it"]
fn gpu_one_rank_runs_every_collective_through_nccl() {
    let id = NcclCommunicator::unique_id().expect("libnccl");
    let comm = gpu_comm(0, 1, &id, 0);
    check_collectives(&comm).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU and libnccl; tests/gpu/run.sh runs it"]
fn gpu_a_rank_that_never_joins_times_out_naming_it() {
    let id = NcclCommunicator::unique_id().expect("libnccl");
    let wait = Duration::from_secs(3);
    let start = Instant::now();
    let made = NcclCommunicator::new(0, 2, &id, 0, wait, None).map(|_| ());
    let took = start.elapsed();
    match made {
        Err(DistributedError::Timeout {
            rank: 0,
            missing,
            timeout_s,
            ..
        }) => {
            assert_eq!(missing, "rank 1");
            assert_eq!(timeout_s, 3.0);
        }
        other => panic!("expected a timeout naming rank 1, got {:?}", other.err()),
    }
    assert!(took < Duration::from_secs(20), "the timeout took {took:?}");
}

const CHILD_RANK: &str = "SPECDRAFT_NCCL_TEST_RANK";
const CHILD_ID: &str = "SPECDRAFT_NCCL_TEST_ID";
const CHILD_DEVICE: &str = "SPECDRAFT_NCCL_TEST_DEVICE";

/// One rank of [`gpu_two_ranks_sum_like_numpy`], which starts it twice (tests/gpu/run.sh
/// skips it).
#[test]
#[ignore = "started by gpu_two_ranks_sum_like_numpy as each of its ranks"]
fn gpu_two_ranks_child() {
    let var = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| {
            panic!("gpu_two_ranks_sum_like_numpy starts this test, with {name} set")
        })
    };
    let hex = var(CHILD_ID);
    let id: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let rank: usize = var(CHILD_RANK).parse().unwrap();
    let device: usize = var(CHILD_DEVICE).parse().unwrap();
    let comm = gpu_comm(rank, 2, &id, device);
    check_collectives(&comm).unwrap();
}

/// Two ranks, each a process of its own, sum like numpy. On two GPUs each rank has one. On
/// one GPU both share it: NCCL refuses two ranks of one host on one GPU ("Duplicate GPU
/// detected"), so each rank names a host of its own (`NCCL_HOSTID`) and the ranks talk over
/// sockets on the loopback interface, with NCCL's peer-to-peer and shared-memory transports
/// off.
#[test]
#[ignore = "needs a CUDA GPU and libnccl; tests/gpu/run.sh runs it"]
fn gpu_two_ranks_sum_like_numpy() {
    // SAFETY: only tries to open the library (cudarc panics on any call without it).
    assert!(
        unsafe { cudarc::driver::sys::is_culib_present() },
        "this test needs a CUDA GPU (tests/gpu/run.sh runs it on one): no libcuda"
    );
    let devices = cudarc::driver::CudaContext::device_count().expect("a CUDA driver");
    assert!(devices >= 1, "no CUDA device");
    let id = NcclCommunicator::unique_id().expect("libnccl");
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    let mut children: Vec<_> = (0..2usize)
        .map(|rank| {
            let device = if devices >= 2 { rank } else { 0 };
            let mut cmd = Process::new(std::env::current_exe().unwrap());
            cmd.args(["--ignored", "--exact", "gpu_two_ranks_child", "--nocapture"])
                .env(CHILD_RANK, rank.to_string())
                .env(CHILD_ID, &hex)
                .env(CHILD_DEVICE, device.to_string());
            if devices < 2 {
                cmd.env("NCCL_HOSTID", format!("specdraft-test-rank-{rank}"))
                    .env("NCCL_P2P_DISABLE", "1")
                    .env("NCCL_SHM_DISABLE", "1")
                    .env("NCCL_SOCKET_IFNAME", "lo");
            }
            cmd.spawn().unwrap()
        })
        .collect();
    // Each rank's collectives time out after TIMEOUT; this bounds the whole run past that.
    let deadline = Instant::now() + TIMEOUT * 3;
    let mut status = [None, None];
    while status.iter().any(Option::is_none) && Instant::now() < deadline {
        for (rank, child) in children.iter_mut().enumerate() {
            if status[rank].is_none() {
                status[rank] = child.try_wait().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for (rank, child) in children.iter_mut().enumerate() {
        if status[rank].is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
    for (rank, s) in status.iter().enumerate() {
        match s {
            Some(s) => assert!(s.success(), "rank {rank} failed: {s}"),
            None => panic!("rank {rank} did not finish within {:?}", TIMEOUT * 3),
        }
    }
}
