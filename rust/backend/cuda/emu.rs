//! `EmuBackend`: the CUDA kernels of `cuda/`, compiled for the CPU against the emulation
//! of the device model in `cuda/emu/`, behind the `GpuBackend` trait (feature `cuda-emu`).
//!
//! It exists to test the kernels and their host side without a GPU: memory, copies and
//! streams are a [`CpuBackend`]'s (so every range is ledger-checked), and each kernel op goes
//! through the same host code as [`super::CudaBackend`] and then runs the real kernel
//! source with one host thread per CUDA thread. It is slow by design; use it only to check.
//!
//! Invariants: launches are synchronous (the work is done when the call returns), and the
//! host views of every buffer a kernel touches are held until then, so a concurrent `free`
//! cannot pull memory from under a running kernel.

use super::launch::{Arg, DeviceRange, KernelLauncher, Shape};
use crate::backend::{AllocationLedger, BackendError, CpuBackend, DevicePtr, GpuBackend};
use std::any::Any;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

extern "C" {
    fn sd_emu_launch(
        name: *const c_char,
        gx: c_uint,
        gy: c_uint,
        gz: c_uint,
        bx: c_uint,
        by: c_uint,
        bz: c_uint,
        params: *mut *mut c_void,
        signature: *const c_char,
        faults: c_uint,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
}

/// A bug the emulator injects into every launch, to prove that the kernel tests notice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EmuFault {
    /// `__syncthreads` and warp exchanges do nothing, and the threads of a block run one
    /// after another: every read of another thread's result sees stale or poisoned data.
    NoBarriers,
    /// The last thread of every block never runs (an off-by-one in the launch).
    DropLastThread,
}

impl EmuFault {
    fn bits(self) -> c_uint {
        match self {
            EmuFault::NoBarriers => 1,
            EmuFault::DropLastThread => 2,
        }
    }
}

/// The CUDA kernels on the CPU, through the emulated device model.
pub struct EmuBackend {
    memory: CpuBackend,
    fault: Option<EmuFault>,
}

impl Default for EmuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl EmuBackend {
    /// An emulated device with host memory.
    pub fn new() -> Self {
        EmuBackend {
            memory: CpuBackend::new(),
            fault: None,
        }
    }

    /// An emulated device whose every launch carries `fault`.
    pub fn with_fault(fault: EmuFault) -> Self {
        EmuBackend {
            memory: CpuBackend::new(),
            fault: Some(fault),
        }
    }
}

impl KernelLauncher for EmuBackend {
    fn resolve(
        &self,
        ptr: DevicePtr,
        nbytes: usize,
        what: &str,
    ) -> Result<DeviceRange, BackendError> {
        let view = self.memory.view(ptr, nbytes, what)?;
        Ok(DeviceRange::new(view.as_ptr() as u64, Some(view)))
    }

    fn launch(
        &self,
        kernel: &'static str,
        shape: Shape,
        args: &[Arg],
        stream: u64,
    ) -> Result<(), BackendError> {
        // An unknown stream is an error here as on the GPU.
        self.memory.synchronize(stream)?;
        let driver = |message: String| BackendError::Driver {
            op: kernel,
            message,
        };
        // Storage the parameter array points into, laid out as cuLaunchKernel expects.
        let mut values: Vec<[u8; 8]> = args
            .iter()
            .map(|a| {
                let mut v = [0u8; 8];
                match *a {
                    Arg::Ptr(p) => v.copy_from_slice(&p.to_ne_bytes()),
                    Arg::I32(i) => v[..4].copy_from_slice(&i.to_ne_bytes()),
                    Arg::F32(f) => v[..4].copy_from_slice(&f.to_ne_bytes()),
                }
                v
            })
            .collect();
        let mut params: Vec<*mut c_void> = values
            .iter_mut()
            .map(|v| v.as_mut_ptr() as *mut c_void)
            .collect();
        let signature: Vec<u8> = args.iter().map(|a| a.code()).collect();
        let signature = CString::new(signature).map_err(|e| driver(e.to_string()))?;
        let name = CString::new(kernel).map_err(|e| driver(e.to_string()))?;
        let mut error = vec![0 as c_char; 512];
        // SAFETY: every pointer argument was resolved to a live host range of the size the
        // kernel touches (the views are held by the caller until this returns); `params`
        // and `values` outlive the synchronous call; strings are NUL-terminated.
        let status = unsafe {
            sd_emu_launch(
                name.as_ptr(),
                shape.grid.0,
                shape.grid.1,
                shape.grid.2,
                shape.block.0,
                shape.block.1,
                shape.block.2,
                params.as_mut_ptr(),
                signature.as_ptr(),
                self.fault.map_or(0, EmuFault::bits),
                error.as_mut_ptr(),
                error.len(),
            )
        };
        if status != 0 {
            // SAFETY: the launcher NUL-terminates the message within the buffer.
            let message = unsafe { CStr::from_ptr(error.as_ptr()) };
            return Err(driver(message.to_string_lossy().into_owned()));
        }
        Ok(())
    }
}

impl GpuBackend for EmuBackend {
    fn name(&self) -> String {
        "cuda-emu".to_string()
    }
    fn ledger(&self) -> &AllocationLedger {
        self.memory.ledger()
    }
    fn alloc(&self, nbytes: usize, tag: &str) -> Result<DevicePtr, BackendError> {
        self.memory.alloc(nbytes, tag)
    }
    fn free(&self, ptr: DevicePtr) -> Result<(), BackendError> {
        self.memory.free(ptr)
    }
    fn copy_htod(&self, dst: DevicePtr, src: &[u8], stream: u64) -> Result<(), BackendError> {
        self.memory.copy_htod(dst, src, stream)
    }
    fn copy_dtoh(&self, dst: &mut [u8], src: DevicePtr, stream: u64) -> Result<(), BackendError> {
        self.memory.copy_dtoh(dst, src, stream)
    }
    fn copy_dtod(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        nbytes: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        self.memory.copy_dtod(dst, src, nbytes, stream)
    }
    fn memset(
        &self,
        dst: DevicePtr,
        value: u8,
        nbytes: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        self.memory.memset(dst, value, nbytes, stream)
    }
    fn create_stream(&self) -> Result<u64, BackendError> {
        self.memory.create_stream()
    }
    fn destroy_stream(&self, stream: u64) -> Result<(), BackendError> {
        self.memory.destroy_stream(stream)
    }
    fn synchronize(&self, stream: u64) -> Result<(), BackendError> {
        self.memory.synchronize(stream)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::KERNEL_NAMES;

    const ONE: Shape = Shape {
        grid: (1, 1, 1),
        block: (32, 1, 1),
    };

    #[test]
    fn every_kernel_name_is_a_registered_kernel() {
        let emu = EmuBackend::new();
        for name in KERNEL_NAMES {
            // A wrong argument list is refused by name, which proves the kernel exists.
            let err = emu.launch(name, ONE, &[Arg::F32(1.0)], 0).unwrap_err();
            assert!(
                err.to_string()
                    .contains("do not match the kernel's parameters"),
                "{err}"
            );
        }
        let err = emu.launch("sd_missing", ONE, &[], 0).unwrap_err();
        assert!(
            err.to_string()
                .contains("no emulated kernel named sd_missing"),
            "{err}"
        );
    }

    #[test]
    fn launch_shapes_and_streams_are_checked() {
        let emu = EmuBackend::new();
        let args = [Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), Arg::I32(0)];
        let too_big = Shape {
            grid: (1, 1, 1),
            block: (2048, 1, 1),
        };
        let err = emu.launch("sd_add", too_big, &args, 0).unwrap_err();
        assert!(err.to_string().contains("invalid launch shape"), "{err}");
        assert_eq!(
            emu.launch("sd_add", ONE, &args, 7).unwrap_err(),
            BackendError::UnknownStream(7)
        );
        // n = 0: the kernel touches nothing, so null pointers are fine.
        emu.launch("sd_add", ONE, &args, 0).unwrap();
    }
}
