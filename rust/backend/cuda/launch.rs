//! The plumbing every kernel launch shares: arguments as the C signatures take them, launch
//! shapes, the backend hooks ([`KernelLauncher`]) and the checks made before a launch.
//!
//! Invariants: a pointer reaches a kernel only through [`Args::ptr`], which checks the
//! exact byte range against the ledger first; sizes reach kernels only through
//! [`Args::int`], which refuses values that do not fit an `int`.

use crate::backend::{BackendError, DevicePtr, Dtype, GpuBackend};

/// Names of every kernel entry point in the fatbin (`cuda/*.cu`).
pub const KERNEL_NAMES: [&str; 12] = [
    "sd_embedding",
    "sd_rms_norm",
    "sd_add",
    "sd_silu_mul",
    "sd_sigmoid_mul",
    "sd_linear_bf16",
    "sd_linear_nvfp4",
    "sd_rope",
    "sd_kv_write",
    "sd_paged_attention",
    "sd_argmax",
    "sd_softmax",
];

/// Threads per block of the row-per-block kernels (whole warps, as the reductions need).
pub(super) const ROW_THREADS: u32 = 256;
/// Threads per block of the element-wise kernels.
pub(super) const ELEMENT_THREADS: u32 = 256;
/// Warps per block of the linear kernels (one output feature per warp).
pub(super) const LINEAR_WARPS: u32 = 8;
/// Input rows per block of the linear kernels (`SD_LINEAR_ROWS` / `SD_NVFP4_ROWS`).
pub(super) const LINEAR_ROWS: usize = 4;
/// Warps per block of paged attention (`SD_ATTN_WARPS`).
pub(super) const ATTN_WARPS: u32 = 4;
/// Largest head the attention kernel holds in registers (`SD_ATTN_MAX_DIM`).
pub(crate) const ATTN_MAX_HEAD_DIM: usize = 256;
/// Most blocks of one element-wise launch; the kernels stride over the rest.
pub(super) const MAX_ELEMENT_BLOCKS: usize = 65_535;

/// One kernel argument, as the C signature takes it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    /// A device address (`T*`); 0 is the null pointer.
    Ptr(u64),
    /// An `int`.
    I32(i32),
    /// A `float`.
    F32(f32),
}

impl Arg {
    /// The emulator's type code of this argument.
    #[cfg_attr(not(feature = "cuda-emu"), allow(dead_code))]
    pub(crate) fn code(self) -> u8 {
        match self {
            Arg::Ptr(_) => b'p',
            Arg::I32(_) => b'i',
            Arg::F32(_) => b'f',
        }
    }
}

/// Grid and block of one launch, `(x, y, z)`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
}

/// What a backend supplies to run the kernels: address resolution and launching.
pub(crate) trait KernelLauncher: GpuBackend {
    /// Keeps a resolved address valid until the launch returns (the emulator's host view).
    type Hold;
    /// Checks that `nbytes` at `ptr` lie in one live allocation and returns the address the
    /// kernel dereferences.
    fn resolve(
        &self,
        ptr: DevicePtr,
        nbytes: usize,
        what: &str,
    ) -> Result<(u64, Self::Hold), BackendError>;
    /// Queues `kernel` on `stream`.
    fn launch(
        &self,
        kernel: &'static str,
        shape: Shape,
        args: &[Arg],
        stream: u64,
    ) -> Result<(), BackendError>;
}

pub(super) fn invalid(op: &'static str, message: String) -> BackendError {
    BackendError::InvalidArgument { op, message }
}

pub(super) fn int(op: &'static str, name: &str, v: usize) -> Result<Arg, BackendError> {
    i32::try_from(v).map(Arg::I32).map_err(|_| {
        invalid(
            op,
            format!("{name} = {v} is too large for the CUDA kernels"),
        )
    })
}

pub(super) fn grid_dim(op: &'static str, name: &str, v: usize) -> Result<u32, BackendError> {
    // The y and z grid dimensions stop at 65535; x is larger, but no op needs more.
    if v > 65_535 {
        return Err(invalid(
            op,
            format!("{name} = {v} exceeds a launch's 65535 blocks"),
        ));
    }
    Ok(v.max(1) as u32)
}

/// The product of `dims`, or an error naming the op if it overflows.
pub(super) fn count(op: &'static str, dims: &[usize]) -> Result<usize, BackendError> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| invalid(op, format!("sizes {dims:?} overflow")))
}

pub(super) fn bytes(
    op: &'static str,
    n: usize,
    dtype: Dtype,
    what: &str,
) -> Result<usize, BackendError> {
    n.checked_mul(dtype.size())
        .ok_or_else(|| invalid(op, format!("{what}: {n} elements overflow")))
}

/// Collects resolved pointers and keeps their holds alive until the launch is done.
pub(super) struct Args<'a, L: KernelLauncher> {
    backend: &'a L,
    op: &'static str,
    pub(super) args: Vec<Arg>,
    holds: Vec<L::Hold>,
}

impl<'a, L: KernelLauncher> Args<'a, L> {
    pub(super) fn new(backend: &'a L, op: &'static str) -> Self {
        Args {
            backend,
            op,
            args: Vec::with_capacity(16),
            holds: Vec::new(),
        }
    }

    pub(super) fn ptr(
        &mut self,
        ptr: DevicePtr,
        n: usize,
        dtype: Dtype,
        what: &str,
    ) -> Result<(), BackendError> {
        let nbytes = bytes(self.op, n, dtype, what)?;
        let (addr, hold) = self.backend.resolve(ptr, nbytes, what)?;
        self.holds.push(hold);
        self.args.push(Arg::Ptr(addr));
        Ok(())
    }

    pub(super) fn opt_ptr(
        &mut self,
        ptr: Option<DevicePtr>,
        n: usize,
        dtype: Dtype,
        what: &str,
    ) -> Result<(), BackendError> {
        match ptr {
            Some(p) => self.ptr(p, n, dtype, what),
            None => {
                self.args.push(Arg::Ptr(0));
                Ok(())
            }
        }
    }

    pub(super) fn int(&mut self, name: &str, v: usize) -> Result<(), BackendError> {
        self.args.push(int(self.op, name, v)?);
        Ok(())
    }

    pub(super) fn float(&mut self, v: f32) {
        self.args.push(Arg::F32(v));
    }

    pub(super) fn launch(
        self,
        kernel: &'static str,
        shape: Shape,
        stream: u64,
    ) -> Result<(), BackendError> {
        let result = self.backend.launch(kernel, shape, &self.args, stream);
        drop(self.holds);
        result
    }
}

/// Checks ranges in the order the CPU reference does, so that with several bad arguments
/// both backends name the same one.
pub(super) fn check_in_order<L: KernelLauncher>(
    b: &L,
    op: &'static str,
    ranges: &[(DevicePtr, usize, Dtype, &str)],
) -> Result<(), BackendError> {
    for &(ptr, n, dtype, what) in ranges {
        b.ledger()
            .check_range(ptr, bytes(op, n, dtype, what)?, what)?;
    }
    Ok(())
}

/// Reads a small index array back to the host, on the op's stream so that earlier work on
/// that stream (which may have written it) is complete.
pub(super) fn read_u32<L: KernelLauncher>(
    b: &L,
    ptr: DevicePtr,
    n: usize,
    what: &str,
    stream: u64,
) -> Result<Vec<u32>, BackendError> {
    let nbytes = bytes("kernel", n, Dtype::U32, what)?;
    b.ledger().check_range(ptr, nbytes, what)?;
    let mut out = vec![0u32; n];
    if n == 0 {
        return Ok(out);
    }
    b.copy_dtoh(bytemuck::cast_slice_mut(&mut out), ptr, stream)?;
    Ok(out)
}

pub(super) fn out_dtype_ok(op: &'static str, dtype: Dtype) -> Result<i32, BackendError> {
    match dtype {
        Dtype::F32 => Ok(1),
        Dtype::Bf16 => Ok(0),
        other => Err(invalid(
            op,
            format!("out_dtype must be bf16 or f32, not {}", other.name()),
        )),
    }
}

pub(super) fn rows_shape(rows: usize, op: &'static str) -> Result<Shape, BackendError> {
    Ok(Shape {
        grid: (grid_dim(op, "rows", rows)?, 1, 1),
        block: (ROW_THREADS, 1, 1),
    })
}

pub(super) fn element_shape(n: usize) -> Shape {
    let blocks = n
        .div_ceil(ELEMENT_THREADS as usize)
        .clamp(1, MAX_ELEMENT_BLOCKS);
    Shape {
        grid: (blocks as u32, 1, 1),
        block: (ELEMENT_THREADS, 1, 1),
    }
}

pub(super) fn linear_shape(
    op: &'static str,
    rows: usize,
    out_features: usize,
) -> Result<Shape, BackendError> {
    let x_blocks = out_features.div_ceil(LINEAR_WARPS as usize).max(1);
    let x_blocks = u32::try_from(x_blocks)
        .map_err(|_| invalid(op, format!("out_features {out_features} is too large")))?;
    Ok(Shape {
        grid: (
            x_blocks,
            grid_dim(op, "rows / 4", rows.div_ceil(LINEAR_ROWS))?,
            1,
        ),
        block: (LINEAR_WARPS * 32, 1, 1),
    })
}
