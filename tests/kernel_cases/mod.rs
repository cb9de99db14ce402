//! Kernel cases shared by the emulated-kernel tests and the GPU tests: each case makes
//! random inputs from a seed, runs one op on the backend under test and on a fresh
//! `CpuBackend` (the reference), and compares the outputs.
//!
//! Outputs are poisoned (all bytes 0xFF, NaN in BF16 and F32) before an op runs, so an
//! element the kernel forgets to write always shows up as a mismatch. Every case frees all
//! it allocated, on both backends, whatever happens.
//!
//! Tolerances (stated once, used by every case):
//! - copies (embedding, kv_write, kv_copy, copy_rows, pick), argmax and `top_k`'s ids: exact;
//! - BF16 outputs: one BF16 rounding step, |got - want| <= 2^-7 * |want| + `atol`, where
//!   `atol` covers f32 accumulation done in a different order (given per op);
//! - F32 outputs: |got - want| <= 1e-5 * |want| + `atol`.
#![allow(dead_code)]

mod attention;
mod elementwise;
mod errors;
mod fp8;
mod kv;
mod linear;
mod picks;
mod top_k;
pub use attention::{mla_attention, paged_attention, paged_attention_tree};
pub use elementwise::{add_silu, embedding, rms_norm, rope, softmax};
pub use errors::same_errors;
pub use fp8::linear_fp8;
pub use kv::{copy_rows, kv_copy, kv_write};
pub use linear::{linear, linear_nvfp4, LinearCase};
pub use picks::{argmax, pick};
pub use top_k::top_k;

use half::bf16;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use specdraft::backend::{
    argmax as host_argmax, ArgmaxArgs, BackendError, CopyRowsArgs, CpuBackend, DevicePtr, Dtype,
    ElementwiseArgs, ElementwiseOp, EmbeddingArgs, GpuBackend, GpuBackendExt, KvCopyArgs,
    KvWriteArgs, LinearArgs, LinearWeight, MlaAttentionArgs, PagedAttentionArgs, PickArgs,
    RmsNormArgs, RopeArgs, RopeStyle, SoftmaxArgs,
};
use std::cell::RefCell;

/// One BF16 rounding step, relative.
pub const BF16_RTOL: f32 = 1.0 / 128.0;
/// F32 relative tolerance.
pub const F32_RTOL: f32 = 1e-5;

/// Buffers on one backend, freed when the scope ends.
pub struct Scope<'a> {
    b: &'a dyn GpuBackend,
    ptrs: RefCell<Vec<DevicePtr>>,
}

impl<'a> Scope<'a> {
    pub fn new(b: &'a dyn GpuBackend) -> Self {
        Scope {
            b,
            ptrs: RefCell::new(Vec::new()),
        }
    }

    fn keep(&self, p: DevicePtr) -> DevicePtr {
        self.ptrs.borrow_mut().push(p);
        p
    }

    pub fn bf16(&self, v: &[f32]) -> Result<DevicePtr, BackendError> {
        Ok(self.keep(self.b.upload_bf16(v, "test bf16")?))
    }

    pub fn f32(&self, v: &[f32]) -> Result<DevicePtr, BackendError> {
        Ok(self.keep(self.b.upload(v, "test f32")?))
    }

    pub fn u32(&self, v: &[u32]) -> Result<DevicePtr, BackendError> {
        Ok(self.keep(self.b.upload(v, "test u32")?))
    }

    pub fn i32(&self, v: &[i32]) -> Result<DevicePtr, BackendError> {
        Ok(self.keep(self.b.upload(v, "test i32")?))
    }

    pub fn u8(&self, v: &[u8]) -> Result<DevicePtr, BackendError> {
        Ok(self.keep(self.b.upload(v, "test u8")?))
    }

    /// An output of `len` elements of `dtype`, every byte 0xFF.
    pub fn out(&self, dtype: Dtype, len: usize) -> Result<DevicePtr, BackendError> {
        let p = self.keep(self.b.alloc_zeros(dtype, len, "test out")?);
        self.b.memset(p, 0xff, dtype.size() * len, 0)?;
        Ok(p)
    }
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        for p in self.ptrs.borrow_mut().drain(..) {
            // A failure here would show up as a leak in the ledger assertions.
            let _ = self.b.free(p);
        }
    }
}

pub fn rng(seed: u64) -> SmallRng {
    SmallRng::seed_from_u64(seed)
}

pub fn uniform(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    let mut r = rng(seed);
    (0..n).map(|_| r.random_range(lo..hi)).collect()
}

/// Runs `f` on the device under test and on the CPU reference.
pub fn both<T>(
    dut: &dyn GpuBackend,
    f: impl Fn(&dyn GpuBackend) -> Result<T, BackendError>,
) -> Result<(T, T), String> {
    let cpu = CpuBackend::new();
    let want = f(&cpu).map_err(|e| format!("reference failed: {e}"))?;
    let got = f(dut).map_err(|e| format!("{} failed: {e}", dut.name()))?;
    if cpu.ledger().live_count() != 0 {
        return Err("reference leaked".into());
    }
    Ok((got, want))
}

/// Element-wise comparison with `|got - want| <= rtol * |want| + atol`; NaN never matches.
pub fn close(what: &str, got: &[f32], want: &[f32], rtol: f32, atol: f32) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} values, expected {}",
            got.len(),
            want.len()
        ));
    }
    let mut bad = Vec::new();
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = (g - w).abs() <= rtol * w.abs() + atol;
        if !ok {
            bad.push((i, g, w));
        }
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{what}: {} of {} values differ; first {:?}",
            bad.len(),
            got.len(),
            &bad[..bad.len().min(5)]
        ))
    }
}

pub fn exact<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: &[T],
    want: &[T],
) -> Result<(), String> {
    if got == want {
        return Ok(());
    }
    let first = got.iter().zip(want).position(|(g, w)| g != w);
    Err(format!(
        "{what}: outputs differ (lengths {} and {}), first at {first:?}",
        got.len(),
        want.len()
    ))
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}
