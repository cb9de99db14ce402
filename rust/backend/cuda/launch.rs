//! The plumbing every kernel launch shares: arguments as the C signatures take them, launch
//! shapes, and the backend hooks ([`KernelLauncher`]), through which every CUDA-kernel
//! backend is a [`CheckedMemory`] for the ops' shared validation.
//!
//! Invariants: a pointer reaches a kernel only as a [`DeviceRange`], which only an op's
//! `validate` makes (after the ledger check of its exact byte range); sizes reach kernels
//! only through [`LaunchArgs::int`], which refuses values that do not fit an `int`.

use crate::backend::kernels::check::invalid;
use crate::backend::kernels::CheckedMemory;
use crate::backend::{BackendError, DevicePtr, GpuBackend, HostView};

/// Names of every kernel entry point in the fatbin (`cuda/*.cu`).
pub const KERNEL_NAMES: [&str; 18] = [
    "sd_embedding",
    "sd_rms_norm",
    "sd_add",
    "sd_silu_mul",
    "sd_sigmoid_mul",
    "sd_linear_bf16",
    "sd_linear_nvfp4",
    "sd_linear_fp8",
    "sd_rope",
    "sd_kv_write",
    "sd_paged_attention",
    "sd_argmax",
    "sd_softmax",
    "sd_pick",
    "sd_top_k",
    "sd_copy_rows",
    "sd_kv_copy",
    "sd_mla_attention",
];

/// Threads per block of the row-per-block kernels (whole warps, as the reductions need).
pub(super) const ROW_THREADS: u32 = 256;
/// Threads per block of the element-wise kernels.
pub(super) const ELEMENT_THREADS: u32 = 256;
/// Warps per block of the linear kernels (one output feature per warp).
pub(super) const LINEAR_WARPS: u32 = 8;
/// Input rows per block of the linear kernels (`SD_LINEAR_ROWS` / `SD_NVFP4_ROWS` /
/// `SD_FP8_ROWS`).
pub(super) const LINEAR_ROWS: usize = 4;
/// Warps per block of paged attention (`SD_ATTN_WARPS`).
pub(super) const ATTN_WARPS: u32 = 4;
/// Largest head the attention kernel holds in registers (`SD_ATTN_MAX_DIM`).
pub(crate) const ATTN_MAX_HEAD_DIM: usize = 256;
/// Warps per block of latent attention (`SD_MLA_WARPS`).
pub(super) const MLA_WARPS: u32 = 4;
/// Largest `kv_lora_rank` the latent attention kernel holds (`SD_MLA_MAX_RANK`).
pub(crate) const MLA_MAX_RANK: usize = 512;
/// Largest latent row (`kv_lora_rank + rope_dim`) it holds in registers (`SD_MLA_MAX_LATENT`).
pub(crate) const MLA_MAX_LATENT: usize = 640;
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
    /// Checks that `nbytes` at `ptr` lie in one live allocation and returns the address the
    /// kernel dereferences.
    fn resolve(
        &self,
        ptr: DevicePtr,
        nbytes: usize,
        what: &str,
    ) -> Result<DeviceRange, BackendError>;
    /// Queues `kernel` on `stream`.
    fn launch(
        &self,
        kernel: &'static str,
        shape: Shape,
        args: &[Arg],
        stream: u64,
    ) -> Result<(), BackendError>;
}

impl<L: KernelLauncher> CheckedMemory for L {
    type Range = DeviceRange;

    fn checked_range(
        &self,
        ptr: DevicePtr,
        nbytes: usize,
        what: &str,
    ) -> Result<DeviceRange, BackendError> {
        self.resolve(ptr, nbytes, what)
    }

    /// Reads on the op's stream, so that earlier work on that stream (which may have
    /// written the array) is complete.
    fn read_u32(
        &self,
        _range: &DeviceRange,
        ptr: DevicePtr,
        n: usize,
        stream: u64,
    ) -> Result<Vec<u32>, BackendError> {
        let mut out = vec![0u32; n];
        if n > 0 {
            self.copy_dtoh(bytemuck::cast_slice_mut(&mut out), ptr, stream)?;
        }
        Ok(out)
    }
}

/// A ledger-checked range as a kernel sees it: its device address, and (on the emulator)
/// the host view that keeps the memory behind it alive until the launch returns.
pub struct DeviceRange {
    addr: u64,
    _view: Option<HostView>,
}

impl DeviceRange {
    pub(super) fn new(addr: u64, view: Option<HostView>) -> Self {
        DeviceRange { addr, _view: view }
    }

    /// The address the kernel dereferences.
    pub fn addr(&self) -> u64 {
        self.addr
    }
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

/// One launch's argument list, in the order of the kernel's C signature. The validated
/// ranges it points into outlive it (the caller holds them until the launch returns).
pub(super) struct LaunchArgs {
    op: &'static str,
    pub(super) args: Vec<Arg>,
}

impl LaunchArgs {
    pub(super) fn new(op: &'static str) -> Self {
        LaunchArgs {
            op,
            args: Vec::with_capacity(16),
        }
    }

    pub(super) fn ptr(&mut self, range: &DeviceRange) -> &mut Self {
        self.args.push(Arg::Ptr(range.addr));
        self
    }

    /// An optional input: the null pointer when absent.
    pub(super) fn opt_ptr(&mut self, range: Option<&DeviceRange>) -> &mut Self {
        self.args.push(Arg::Ptr(range.map_or(0, |r| r.addr)));
        self
    }

    /// A size, refused when it does not fit the kernel's `int`.
    pub(super) fn int(&mut self, name: &str, v: usize) -> Result<&mut Self, BackendError> {
        self.args.push(int(self.op, name, v)?);
        Ok(self)
    }

    pub(super) fn flag(&mut self, v: bool) -> &mut Self {
        self.args.push(Arg::I32(v as i32));
        self
    }

    pub(super) fn float(&mut self, v: f32) -> &mut Self {
        self.args.push(Arg::F32(v));
        self
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
