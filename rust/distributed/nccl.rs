//! `NcclCommunicator`: the [`Communicator`] of ranks that each drive an NVIDIA GPU, through
//! NCCL (cudarc's bindings; libnccl loaded at run time, see `nccl_library`). Feature `cuda`.
//!
//! It sits in the distributed layer, beside the backend rather than in it: it needs a CUDA
//! context and a stream of its own, not the kernels, ledger or streams of `CudaBackend`, so
//! the layer still uses nothing else of the crate.
//!
//! The trait's collectives take host slices, because the model's all-reduce today sums rows
//! the forward has already brought to the host (the CPU and MPI ranks share that code path).
//! So each collective copies the slice to a device staging buffer, runs the NCCL collective
//! there and copies the result back. Collectives on device buffers would save both copies;
//! they need a trait method that takes a `DevicePtr`, which waits for a forward that keeps
//! its partial sums on the device.
//!
//! Invariants:
//! - construction never panics: libnccl and the CUDA driver are looked for before any other
//!   cudarc call (cudarc panics without them), and the start-up runs under `catch_unwind`;
//! - BF16 sums keep the trait's contract (widened, summed in f32, rounded once): the
//!   default `all_reduce_sum_bf16` runs an f32 all-reduce, because NCCL's own bf16 sum
//!   rounds every partial sum to bf16;
//! - no call waits forever. The communicator is non-blocking (`ncclConfig_t.blocking = 0`):
//!   the start-up and every collective are polled, the way PyTorch's NCCL watchdog does it,
//!   through `ncclCommGetAsyncError` and the stream's completion, until `timeout` passes;
//!   then the communicator is aborted (`ncclCommAbort`, which also makes NCCL's kernels
//!   return) and the call ends with [`DistributedError::Timeout`]. A worker's
//!   `recv_command` waits `command_timeout` instead (`None`: as long as rank 0 idles);
//! - after any failure the communicator is aborted and refuses every later call with
//!   [`DistributedError::Broken`]: the ranks are out of step for good;
//! - one collective runs at a time (a mutex), so two threads never interleave a broadcast's
//!   length with its bytes, and the host slice is read and written only while its call runs
//!   (the stream is drained before the call returns).

use super::nccl_library::require_nccl;
use super::{check_root, other_ranks, Command, Communicator, DistributedError};
use cudarc::driver::{result as cu, sys as cusys, CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys as ncclsys};
use std::ffi::CStr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Bytes of an NCCL unique id, which rank 0 makes and every rank passes to
/// [`NcclCommunicator::new`].
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// The NCCL version whose `ncclConfig_t` layout cudarc binds (2.28); older libraries read
/// only the prefix they know (the struct carries its size).
const CONFIG_VERSION: u32 = 22800;
const CONFIG_MAGIC: u32 = 0xcafe_beef;
const CONFIG_UNDEF_INT: i32 = i32::MIN;

/// The longest sleep between two polls of a pending call.
const MAX_POLL_SLEEP: Duration = Duration::from_millis(1);

/// Ranks on NVIDIA GPUs meeting in NCCL collectives.
pub struct NcclCommunicator {
    rank: usize,
    size: usize,
    device: usize,
    timeout: Duration,
    command_timeout: Option<Duration>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    state: Mutex<State>,
}

/// What one collective at a time may touch.
struct State {
    /// Null once aborted.
    comm: ncclsys::ncclComm_t,
    staging: cusys::CUdeviceptr,
    staging_bytes: usize,
    /// The message of the failure that broke the communicator.
    broken: Option<String>,
}

// SAFETY: the raw communicator and staging pointer are used only under the state's mutex,
// with the communicator's context bound to the calling thread; NCCL allows a communicator
// to be used from any thread as long as calls do not overlap.
unsafe impl Send for State {}

/// How a pending NCCL call ended.
enum Wait {
    Done,
    Failed(String),
    TimedOut,
}

fn nccl_message(r: ncclsys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static C string for every result code.
    let text = unsafe {
        let p = ncclsys::ncclGetErrorString(r);
        (!p.is_null()).then(|| CStr::from_ptr(p).to_string_lossy().into_owned())
    };
    format!("{r:?}: {}", text.unwrap_or_else(|| "no description".into()))
}

fn panic_text(panic: Box<dyn std::any::Any + Send>) -> String {
    crate::error::panic_message(panic.as_ref())
        .unwrap_or("unknown reason")
        .to_string()
}

impl NcclCommunicator {
    /// A new NCCL unique id (made on rank 0, then sent to every rank, e.g. over MPI).
    /// Without libnccl this is [`DistributedError::Unavailable`] saying how to install it.
    pub fn unique_id() -> Result<[u8; NCCL_UNIQUE_ID_BYTES], DistributedError> {
        require_nccl(0)?;
        let id = catch_unwind(nccl::get_uniqueid)
            .map_err(|p| DistributedError::Unavailable {
                rank: 0,
                message: format!("libnccl failed to start: {}", panic_text(p)),
            })?
            .map_err(|e| DistributedError::Nccl {
                rank: 0,
                op: "unique id",
                message: nccl_message(e.0),
            })?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// Rank `rank` of `size` on GPU `device` (0-based), joining the ranks that pass the same
    /// `unique_id`. Waits up to `timeout` for the other ranks to join (and in every later
    /// collective); a worker's `recv_command` waits `command_timeout` (`None`: forever).
    ///
    /// Without libnccl, a CUDA driver or that device this is
    /// [`DistributedError::Unavailable`] saying which; it never panics.
    pub fn new(
        rank: usize,
        size: usize,
        unique_id: &[u8],
        device: usize,
        timeout: Duration,
        command_timeout: Option<Duration>,
    ) -> Result<NcclCommunicator, DistributedError> {
        let invalid = |message: String| DistributedError::InvalidArgument {
            rank,
            size,
            op: "NCCL start-up",
            message,
        };
        if size == 0 || rank >= size || size > i32::MAX as usize {
            return Err(invalid(format!("rank {rank} is not a rank of {size}")));
        }
        if unique_id.len() != NCCL_UNIQUE_ID_BYTES {
            return Err(invalid(format!(
                "the NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {}",
                unique_id.len()
            )));
        }
        if timeout.is_zero() {
            return Err(invalid("timeout must be positive".into()));
        }
        require_nccl(rank)?;
        // SAFETY: only tries to open the library; no symbol of it is used.
        if !unsafe { cusys::is_culib_present() } {
            return Err(DistributedError::Unavailable {
                rank,
                message: "no CUDA driver (libcuda) found: NCCL needs an NVIDIA GPU".into(),
            });
        }
        let mut id = [0 as std::ffi::c_char; NCCL_UNIQUE_ID_BYTES];
        for (dst, &b) in id.iter_mut().zip(unique_id) {
            *dst = b as std::ffi::c_char;
        }
        let open = || Self::open(rank, size, id, device, timeout, command_timeout);
        catch_unwind(AssertUnwindSafe(open)).unwrap_or_else(|p| {
            Err(DistributedError::Unavailable {
                rank,
                message: format!("CUDA or NCCL failed to start: {}", panic_text(p)),
            })
        })
    }

    fn open(
        rank: usize,
        size: usize,
        id: [std::ffi::c_char; NCCL_UNIQUE_ID_BYTES],
        device: usize,
        timeout: Duration,
        command_timeout: Option<Duration>,
    ) -> Result<NcclCommunicator, DistributedError> {
        let unavailable = |message: String| DistributedError::Unavailable { rank, message };
        cu::init().map_err(|e| unavailable(format!("no CUDA device {device} (found 0): {e}")))?;
        let count = CudaContext::device_count()
            .map_err(|e| unavailable(format!("cannot count CUDA devices: {e}")))?;
        if device >= count.max(0) as usize {
            return Err(unavailable(format!(
                "no CUDA device {device} (found {count})"
            )));
        }
        let ctx = CudaContext::new(device)
            .map_err(|e| unavailable(format!("cannot open CUDA device {device}: {e}")))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| unavailable(format!("cannot make a stream on device {device}: {e}")))?;
        ctx.bind_to_thread()
            .map_err(|e| unavailable(format!("cannot bind CUDA device {device}: {e}")))?;
        let mut config = ncclsys::ncclConfig_t {
            size: std::mem::size_of::<ncclsys::ncclConfig_t>(),
            magic: CONFIG_MAGIC,
            version: CONFIG_VERSION,
            blocking: 0,
            cgaClusterSize: CONFIG_UNDEF_INT,
            minCTAs: CONFIG_UNDEF_INT,
            maxCTAs: CONFIG_UNDEF_INT,
            netName: std::ptr::null(),
            splitShare: CONFIG_UNDEF_INT,
            trafficClass: CONFIG_UNDEF_INT,
            commName: std::ptr::null(),
            collnetEnable: CONFIG_UNDEF_INT,
            CTAPolicy: CONFIG_UNDEF_INT,
            shrinkShare: CONFIG_UNDEF_INT,
            nvlsCTAs: CONFIG_UNDEF_INT,
            nChannelsPerNetPeer: CONFIG_UNDEF_INT,
            nvlinkCentricSched: CONFIG_UNDEF_INT,
            graphUsageMode: CONFIG_UNDEF_INT,
            numRmaCtx: CONFIG_UNDEF_INT,
            maxP2pPeers: CONFIG_UNDEF_INT,
        };
        let mut comm: ncclsys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` outlive the call; the device's context is bound.
        let started = unsafe {
            nccl::comm_init_rank_config(
                &mut comm,
                size as i32,
                ncclsys::ncclUniqueId { internal: id },
                rank as i32,
                &mut config,
            )
        };
        let this = NcclCommunicator {
            rank,
            size,
            device,
            timeout,
            command_timeout,
            ctx,
            stream,
            state: Mutex::new(State {
                comm,
                staging: 0,
                staging_bytes: 0,
                broken: None,
            }),
        };
        let mut state = this.lock();
        if let Err(e) = started {
            // A communicator that failed to start is aborted with the rest of the state.
            return Err(this.fail(&mut state, "NCCL start-up", nccl_message(e.0)));
        }
        this.finish(&mut state, "NCCL start-up", false, Some(timeout))?;
        drop(state);
        Ok(this)
    }

    /// The GPU this rank runs its collectives on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Seconds a collective waits for the other ranks.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Aborts the communicator, records why, and returns the error for `op`.
    fn fail(&self, state: &mut State, op: &'static str, message: String) -> DistributedError {
        self.abort(state);
        state.broken = Some(message.clone());
        DistributedError::Nccl {
            rank: self.rank,
            op,
            message,
        }
    }

    fn abort(&self, state: &mut State) {
        if !state.comm.is_null() {
            // SAFETY: a live communicator of this object, not used again (set null below).
            let _ = unsafe { nccl::comm_abort(state.comm) };
            state.comm = std::ptr::null_mut();
        }
    }

    /// Polls the last call until NCCL has finished it (and, with `stream`, the stream has
    /// drained), an asynchronous error shows, or `deadline` passes (`None`: never).
    fn poll(&self, state: &State, stream: bool, deadline: Option<Instant>) -> Wait {
        let mut sleep = Duration::from_micros(20);
        loop {
            let mut status = ncclsys::ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator; `status` outlives the call.
            let got = unsafe { ncclsys::ncclCommGetAsyncError(state.comm, &mut status) };
            if got != ncclsys::ncclResult_t::ncclSuccess {
                return Wait::Failed(nccl_message(got));
            }
            match status {
                ncclsys::ncclResult_t::ncclSuccess => {
                    if !stream {
                        return Wait::Done;
                    }
                    // SAFETY: the communicator's own live stream.
                    match unsafe { cusys::cuStreamQuery(self.stream.cu_stream()) } {
                        cusys::CUresult::CUDA_SUCCESS => return Wait::Done,
                        cusys::CUresult::CUDA_ERROR_NOT_READY => {}
                        e => return Wait::Failed(format!("the CUDA stream failed: {e:?}")),
                    }
                }
                ncclsys::ncclResult_t::ncclInProgress => {}
                e => return Wait::Failed(nccl_message(e)),
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Wait::TimedOut;
            }
            std::thread::sleep(sleep);
            sleep = (sleep * 2).min(MAX_POLL_SLEEP);
        }
    }

    /// [`Self::poll`] under a deadline `wait` from now (`None`: none), turning a failure or
    /// a timeout into the aborted communicator's error.
    fn finish(
        &self,
        state: &mut State,
        op: &'static str,
        stream: bool,
        wait: Option<Duration>,
    ) -> Result<(), DistributedError> {
        match self.poll(state, stream, wait.map(|w| Instant::now() + w)) {
            Wait::Done => Ok(()),
            Wait::Failed(message) => Err(self.fail(state, op, message)),
            Wait::TimedOut => {
                self.abort(state);
                let err = DistributedError::Timeout {
                    rank: self.rank,
                    size: self.size,
                    op,
                    timeout_s: wait.unwrap_or_default().as_secs_f64(),
                    missing: other_ranks(self.rank, self.size),
                };
                state.broken = Some(err.to_string());
                Err(err)
            }
        }
    }

    /// Runs one collective on `host` (in place): copies it to the staging buffer, enqueues
    /// `enqueue(device pointer, comm, stream)`, waits for it under the deadline, copies back.
    fn collective(
        &self,
        op: &'static str,
        host: &mut [u8],
        wait: Option<Duration>,
        enqueue: impl FnOnce(
            cusys::CUdeviceptr,
            ncclsys::ncclComm_t,
            ncclsys::cudaStream_t,
        ) -> ncclsys::ncclResult_t,
    ) -> Result<(), DistributedError> {
        let mut state = self.lock();
        if let Some(first) = &state.broken {
            return Err(DistributedError::Broken {
                rank: self.rank,
                op,
                first: first.clone(),
            });
        }
        if host.is_empty() {
            return Ok(());
        }
        let driver = |what: &str, e: cu::DriverError| format!("{what}: {e}");
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.fail(&mut state, op, driver("bind the CUDA context", e)))?;
        if state.staging_bytes < host.len() {
            if state.staging != 0 {
                // SAFETY: the previous staging buffer; no work is pending on it.
                let _ = unsafe { cu::free_sync(state.staging) };
                state.staging = 0;
                state.staging_bytes = 0;
            }
            let bytes = host.len().next_power_of_two();
            // SAFETY: a plain allocation in the bound context.
            let ptr = unsafe { cu::malloc_sync(bytes) }
                .map_err(|e| self.fail(&mut state, op, driver("allocate the staging buffer", e)))?;
            state.staging = ptr;
            state.staging_bytes = bytes;
        }
        let cu_stream = self.stream.cu_stream();
        // SAFETY: `host.len()` bytes fit the staging buffer. A copy from pageable memory is
        // staged before the call returns, so `host` is not read later.
        unsafe { cu::memcpy_htod_async(state.staging, &*host, cu_stream) }
            .map_err(|e| self.fail(&mut state, op, driver("copy to the device", e)))?;
        let staged = state.staging;
        let r = enqueue(staged, state.comm, cu_stream as ncclsys::cudaStream_t);
        if !matches!(
            r,
            ncclsys::ncclResult_t::ncclSuccess | ncclsys::ncclResult_t::ncclInProgress
        ) {
            return Err(self.fail(&mut state, op, nccl_message(r)));
        }
        self.finish(&mut state, op, true, wait)?;
        // The collective has completed, so the copy back does not wait on the other ranks.
        // SAFETY: `host.len()` bytes of the staging buffer; the stream is synchronised
        // before `host` is released.
        unsafe { cu::memcpy_dtoh_async(host, staged, cu_stream) }
            .map_err(|e| self.fail(&mut state, op, driver("copy to the host", e)))?;
        self.stream
            .synchronize()
            .map_err(|e| self.fail(&mut state, op, driver("copy to the host", e)))
    }

    /// `broadcast_bytes` with the wait for the length given apart (a worker waiting for its
    /// next command waits longer than a collective).
    fn broadcast_with(
        &self,
        op: &'static str,
        root: usize,
        buf: &mut Vec<u8>,
        first_wait: Option<Duration>,
    ) -> Result<(), DistributedError> {
        check_root(self, root, op)?;
        let mut len = (buf.len() as u64).to_le_bytes();
        self.bytes_broadcast(op, root, &mut len, first_wait)?;
        let n = u64::from_le_bytes(len) as usize;
        if self.rank != root {
            buf.clear();
            buf.resize(n, 0);
        }
        self.bytes_broadcast(op, root, buf, Some(self.timeout))
    }

    fn bytes_broadcast(
        &self,
        op: &'static str,
        root: usize,
        bytes: &mut [u8],
        wait: Option<Duration>,
    ) -> Result<(), DistributedError> {
        let n = bytes.len();
        self.collective(op, bytes, wait, |ptr, comm, stream| {
            // SAFETY: `n` bytes of the staging buffer, in place; a live communicator.
            unsafe {
                ncclsys::ncclBroadcast(
                    ptr as *const std::ffi::c_void,
                    ptr as *mut std::ffi::c_void,
                    n,
                    ncclsys::ncclDataType_t::ncclUint8,
                    root as i32,
                    comm,
                    stream,
                )
            }
        })
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), DistributedError> {
        let n = buf.len();
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        self.collective(
            "all_reduce_sum_f32",
            bytes,
            Some(self.timeout),
            |ptr, comm, stream| {
                // SAFETY: `n` f32 of the staging buffer, in place; a live communicator.
                unsafe {
                    ncclsys::ncclAllReduce(
                        ptr as *const std::ffi::c_void,
                        ptr as *mut std::ffi::c_void,
                        n,
                        ncclsys::ncclDataType_t::ncclFloat32,
                        ncclsys::ncclRedOp_t::ncclSum,
                        comm,
                        stream,
                    )
                }
            },
        )
    }

    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) -> Result<(), DistributedError> {
        self.broadcast_with("broadcast_bytes", root, buf, Some(self.timeout))
    }

    fn barrier(&self) -> Result<(), DistributedError> {
        let mut one = [0f32];
        self.all_reduce_sum_f32(&mut one)
    }

    fn recv_command(&self) -> Result<Command, DistributedError> {
        if self.rank == 0 {
            return Err(DistributedError::InvalidArgument {
                rank: 0,
                size: self.size,
                op: "recv_command",
                message: "rank 0 sends commands; only workers (ranks > 0) receive them".into(),
            });
        }
        let mut bytes = Vec::new();
        self.broadcast_with("recv_command", 0, &mut bytes, self.command_timeout)?;
        Command::decode(&bytes, self.rank)
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        let mut state = self.lock();
        // Abort rather than finalize: every collective has completed before its call
        // returned, and abort never waits on a rank that is already gone.
        self.abort(&mut state);
        if state.staging != 0 && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the staging buffer; the communicator that used it is gone.
            let _ = unsafe { cu::free_sync(state.staging) };
            state.staging = 0;
        }
    }
}
