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

mod fp8;
mod top_k;
pub use fp8::linear_fp8;
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

pub fn embedding(
    dut: &dyn GpuBackend,
    rows: usize,
    hidden: usize,
    vocab: usize,
    seed: u64,
) -> Result<(), String> {
    let table = uniform(seed, vocab * hidden, -1.0, 1.0);
    let mut r = rng(seed + 1);
    let ids: Vec<u32> = (0..rows).map(|_| r.random_range(0..vocab as u32)).collect();
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let (t, i, o) = (
            s.bf16(&table)?,
            s.u32(&ids)?,
            s.out(Dtype::Bf16, rows * hidden)?,
        );
        b.embedding(EmbeddingArgs {
            out: o,
            table: LinearWeight::Bf16 { weight: t },
            ids: i,
            rows,
            hidden,
            vocab,
            stream: 0,
        })?;
        b.download::<bf16>(o, rows * hidden)
    })?;
    exact("embedding", &bits(&got), &bits(&want))
}

pub fn rms_norm(
    dut: &dyn GpuBackend,
    rows: usize,
    dim: usize,
    seed: u64,
    in_place: bool,
) -> Result<(), String> {
    let x = uniform(seed, rows * dim, -3.0, 3.0);
    let w = uniform(seed + 1, dim, 0.5, 1.5);
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let (px, pw) = (s.bf16(&x)?, s.bf16(&w)?);
        let o = if in_place {
            px
        } else {
            s.out(Dtype::Bf16, rows * dim)?
        };
        b.rms_norm(RmsNormArgs {
            out: o,
            x: px,
            weight: pw,
            rows,
            dim,
            eps: 1e-6,
            stream: 0,
        })?;
        b.download_bf16(o, rows * dim)
    })?;
    close("rms_norm", &got, &want, BF16_RTOL, 1e-6)
}

pub fn add_silu(dut: &dyn GpuBackend, n: usize, seed: u64) -> Result<(), String> {
    let a = uniform(seed, n, -4.0, 4.0);
    let c = uniform(seed + 1, n, -4.0, 4.0);
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let (pa, pc) = (s.bf16(&a)?, s.bf16(&c)?);
        let (o1, o2) = (s.out(Dtype::Bf16, n)?, s.out(Dtype::Bf16, n)?);
        let o3 = s.out(Dtype::Bf16, n)?;
        let op = |op, out, a, b| ElementwiseArgs {
            op,
            out,
            a,
            b,
            n,
            stream: 0,
        };
        b.elementwise(op(ElementwiseOp::Add, o1, pa, pc))?;
        b.elementwise(op(ElementwiseOp::SiluMul, o2, pa, pc))?;
        b.elementwise(op(ElementwiseOp::SigmoidMul, o3, pa, pc))?;
        // In place as well: out aliasing an input.
        b.elementwise(op(ElementwiseOp::Add, pa, pa, pc))?;
        let mut v = b.download_bf16(o1, n)?;
        v.extend(b.download_bf16(o2, n)?);
        v.extend(b.download_bf16(o3, n)?);
        v.extend(b.download_bf16(pa, n)?);
        Ok(v)
    })?;
    close("add/silu_mul/sigmoid_mul", &got, &want, BF16_RTOL, 1e-6)
}

/// The shape of one `linear` case; `x` is drawn from `seed`, the bias from `seed + 2`, and
/// the weight's own draws are the case's (from `seed + 1` on).
pub struct LinearCase {
    pub rows: usize,
    pub inf: usize,
    pub outf: usize,
    pub out_dtype: Dtype,
    pub with_bias: bool,
    pub seed: u64,
}

impl LinearCase {
    pub fn new(
        rows: usize,
        inf: usize,
        outf: usize,
        out_dtype: Dtype,
        with_bias: bool,
        seed: u64,
    ) -> Self {
        LinearCase {
            rows,
            inf,
            outf,
            out_dtype,
            with_bias,
            seed,
        }
    }

    /// Runs `linear` with the weight `weight` uploads into the scope, on `dut` and on the
    /// reference, and compares with the output dtype's `rtol` and the case's `atol`.
    pub fn check(
        &self,
        dut: &dyn GpuBackend,
        what: &str,
        atol: f32,
        weight: impl Fn(&Scope) -> Result<LinearWeight, BackendError>,
    ) -> Result<(), String> {
        let (rows, outf, out_dtype) = (self.rows, self.outf, self.out_dtype);
        let x = uniform(self.seed, rows * self.inf, -1.0, 1.0);
        let bias = uniform(self.seed + 2, outf, -1.0, 1.0);
        let (got, want) = both(dut, |b| {
            let s = Scope::new(b);
            let px = s.bf16(&x)?;
            let weight = weight(&s)?;
            let pb = if self.with_bias {
                Some(s.bf16(&bias)?)
            } else {
                None
            };
            let o = s.out(out_dtype, rows * outf)?;
            b.linear(LinearArgs {
                out: o,
                out_dtype,
                x: px,
                weight,
                bias: pb,
                rows,
                in_features: self.inf,
                out_features: outf,
                stream: 0,
            })?;
            match out_dtype {
                Dtype::F32 => b.download::<f32>(o, rows * outf),
                _ => b.download_bf16(o, rows * outf),
            }
        })?;
        let rtol = if out_dtype == Dtype::F32 {
            F32_RTOL
        } else {
            BF16_RTOL
        };
        close(what, &got, &want, rtol, atol)
    }
}

pub fn linear(
    dut: &dyn GpuBackend,
    rows: usize,
    inf: usize,
    outf: usize,
    out_dtype: Dtype,
    with_bias: bool,
    seed: u64,
) -> Result<(), String> {
    let w = uniform(seed + 1, outf * inf, -1.0, 1.0);
    let case = LinearCase::new(rows, inf, outf, out_dtype, with_bias, seed);
    // f32 sums of `inf` products of size <= 1 in a different order.
    case.check(dut, "linear", 1e-5 * inf as f32, |s| {
        Ok(LinearWeight::Bf16 {
            weight: s.bf16(&w)?,
        })
    })
}

pub fn linear_nvfp4(
    dut: &dyn GpuBackend,
    rows: usize,
    inf: usize,
    outf: usize,
    out_dtype: Dtype,
    with_bias: bool,
    seed: u64,
) -> Result<(), String> {
    let mut r = rng(seed + 1);
    let codes: Vec<u8> = (0..outf * inf / 2).map(|_| r.random()).collect();
    // Scale bytes over the normal and subnormal E4M3 range, avoiding NaN (0x7f / 0xff).
    let scales: Vec<u8> = (0..outf * inf / 16)
        .map(|_| r.random_range(0u8..0x60) | if r.random() { 0x80 } else { 0 })
        .collect();
    let case = LinearCase::new(rows, inf, outf, out_dtype, with_bias, seed);
    case.check(dut, "linear_nvfp4", 1e-5 * inf as f32, |s| {
        Ok(LinearWeight::Nvfp4 {
            codes: s.u8(&codes)?,
            block_scales: s.u8(&scales)?,
            global_scale: 0.0123,
        })
    })
}

pub fn rope(
    dut: &dyn GpuBackend,
    rows: usize,
    heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    style: RopeStyle,
    seed: u64,
) -> Result<(), String> {
    let x = uniform(seed, rows * heads * head_dim, -2.0, 2.0);
    let mut r = rng(seed + 1);
    let pos: Vec<u32> = (0..rows).map(|_| r.random_range(0..4096)).collect();
    let freq: Vec<f32> = (0..rotary_dim / 2)
        .map(|i| 10000f32.powf(-((2 * i) as f32) / rotary_dim as f32))
        .collect();
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let (px, pp, pf) = (s.bf16(&x)?, s.u32(&pos)?, s.f32(&freq)?);
        b.rope(RopeArgs {
            x: px,
            positions: pp,
            inv_freq: pf,
            rows,
            heads,
            head_dim,
            rotary_dim,
            style,
            stream: 0,
        })?;
        b.download_bf16(px, rows * heads * head_dim)
    })?;
    // sin/cos of angles up to 4096 rad differ between libraries by a few f32 ulps.
    close("rope", &got, &want, BF16_RTOL, 1e-3)
}

pub fn kv_write(
    dut: &dyn GpuBackend,
    rows: usize,
    kv_heads: usize,
    head_dim: usize,
    num_slots: usize,
    seed: u64,
) -> Result<(), String> {
    let width = kv_heads * head_dim;
    let k = uniform(seed, rows * width, -1.0, 1.0);
    let v = uniform(seed + 1, rows * width, -1.0, 1.0);
    // Distinct slots, so the result does not depend on write order.
    let mut r = rng(seed + 2);
    let mut slots: Vec<u32> = (0..num_slots as u32).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, r.random_range(0..=i));
    }
    slots.truncate(rows);
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let (pk, pv, ps) = (s.bf16(&k)?, s.bf16(&v)?, s.u32(&slots)?);
        let (kc, vc) = (
            s.out(Dtype::Bf16, num_slots * width)?,
            s.out(Dtype::Bf16, num_slots * width)?,
        );
        b.kv_write(KvWriteArgs {
            k_cache: kc,
            v_cache: vc,
            k: pk,
            v: pv,
            slots: ps,
            rows,
            kv_heads,
            head_dim,
            num_slots,
            stream: 0,
        })?;
        let mut out = b.download::<bf16>(kc, num_slots * width)?;
        out.extend(b.download::<bf16>(vc, num_slots * width)?);
        Ok(out)
    })?;
    exact("kv_write", &bits(&got), &bits(&want))
}

/// A compaction of a draft tree's accepted path in a paged cache of random rows: `path`
/// (increasing node indices) moves from the rows after `prefix` to the rows right after it,
/// through a scattered block table, as the target model compacts a sequence. The result
/// must be the copies done one at a time on the host (a later copy writes the row an
/// earlier one read whenever the path takes a node's first child).
pub fn kv_copy(
    dut: &dyn GpuBackend,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    prefix: usize,
    path: &[usize],
    seed: u64,
) -> Result<(), String> {
    let width = kv_heads * head_dim;
    let rows_used = prefix + 1 + path.last().map_or(0, |&p| p + 1);
    let blocks = rows_used.div_ceil(block_size) + 3;
    let num_slots = blocks * block_size;
    let mut r = rng(seed);
    let mut table: Vec<u32> = (0..blocks as u32).collect();
    for i in (1..table.len()).rev() {
        table.swap(i, r.random_range(0..=i));
    }
    let slot = |row: usize| table[row / block_size] * block_size as u32 + (row % block_size) as u32;
    let (src, dst): (Vec<u32>, Vec<u32>) = path
        .iter()
        .enumerate()
        .map(|(k, &node)| (slot(prefix + 1 + node), slot(prefix + 1 + k)))
        .unzip();
    let k0 = uniform(seed + 1, num_slots * width, -1.0, 1.0);
    let v0 = uniform(seed + 2, num_slots * width, -1.0, 1.0);
    let mut want: Vec<bf16> = k0.iter().chain(&v0).map(|&x| bf16::from_f32(x)).collect();
    for (&s, &d) in src.iter().zip(&dst) {
        for base in [0, num_slots * width] {
            let (s, d) = (base + s as usize * width, base + d as usize * width);
            want.copy_within(s..s + width, d);
        }
    }
    let (got, reference) = both(dut, |b| {
        let sc = Scope::new(b);
        let (kc, vc) = (sc.bf16(&k0)?, sc.bf16(&v0)?);
        let (ps, pd) = (sc.u32(&src)?, sc.u32(&dst)?);
        b.kv_copy(KvCopyArgs {
            k_cache: kc,
            v_cache: vc,
            src: ps,
            dst: pd,
            copies: src.len(),
            kv_heads,
            head_dim,
            num_slots,
            stream: 0,
        })?;
        let mut out = b.download::<bf16>(kc, num_slots * width)?;
        out.extend(b.download::<bf16>(vc, num_slots * width)?);
        Ok(out)
    })?;
    exact("kv_copy reference", &bits(&reference), &bits(&want))?;
    exact("kv_copy", &bits(&got), &bits(&want))
}

/// A paged attention batch: `ctx[s]` cached rows for sequence s, blocks scattered through
/// the cache, and the last `queries` positions of each sequence as query rows (causal).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    dut: &dyn GpuBackend,
    ctx: &[usize],
    queries: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    seed: u64,
) -> Result<(), String> {
    let max_blocks = ctx
        .iter()
        .map(|c| c.div_ceil(block_size))
        .max()
        .unwrap_or(1)
        .max(1);
    let num_blocks = ctx.len() * max_blocks + 3;
    let mut r = rng(seed);
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, r.random_range(0..=i));
    }
    let table: Vec<u32> = ids[..ctx.len() * max_blocks].to_vec();
    let (mut row_seq, mut row_len) = (Vec::new(), Vec::new());
    for (s, &c) in ctx.iter().enumerate() {
        for q in 0..queries.min(c) {
            row_seq.push(s as u32);
            row_len.push((c - queries.min(c) + q + 1) as u32);
        }
    }
    let rows = row_seq.len();
    let width = kv_heads * head_dim;
    let q = uniform(seed + 1, rows * heads * head_dim, -1.0, 1.0);
    let kc = uniform(seed + 2, num_blocks * block_size * width, -1.0, 1.0);
    let vc = uniform(seed + 3, num_blocks * block_size * width, -1.0, 1.0);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let (pq, pk, pv) = (s.bf16(&q)?, s.bf16(&kc)?, s.bf16(&vc)?);
        let (pt, ps, pl) = (s.u32(&table)?, s.u32(&row_seq)?, s.u32(&row_len)?);
        let o = s.out(Dtype::Bf16, rows * heads * head_dim)?;
        b.paged_attention(PagedAttentionArgs {
            out: o,
            q: pq,
            k_cache: pk,
            v_cache: pv,
            block_table: pt,
            row_seq: ps,
            row_ctx_len: pl,
            row_parent: None,
            rows,
            heads,
            kv_heads,
            head_dim,
            block_size,
            max_blocks_per_seq: max_blocks,
            scale,
            stream: 0,
        })?;
        b.download_bf16(o, rows * heads * head_dim)
    })?;
    close("paged_attention", &got, &want, BF16_RTOL, 2e-3)
}

/// The sizes of one latent attention case: `(heads, kv_lora_rank, nope_dim, rope_dim,
/// v_dim, block_size)`.
pub type MlaShape = (usize, usize, usize, usize, usize, usize);

/// A latent attention batch: causal rows of sequences with `ctx` cached rows (the last
/// `queries` positions of each), then a draft tree's verify rows (a prefix of 9, the root
/// and five nodes: two children of the root, a grandchild, a great-grandchild), blocks
/// scattered through the cache, under the tree mask.
pub fn mla_attention(
    dut: &dyn GpuBackend,
    ctx: &[usize],
    queries: usize,
    shape: MlaShape,
    seed: u64,
) -> Result<(), String> {
    let (heads, rank, nope, rope, v_dim, block_size) = shape;
    let none = PagedAttentionArgs::NO_PARENT;
    let (mut row_seq, mut row_len, mut row_parent) = (Vec::new(), Vec::new(), Vec::new());
    for (s, &c) in ctx.iter().enumerate() {
        for q in 0..queries.min(c) {
            row_seq.push(s as u32);
            row_len.push((c - queries.min(c) + q + 1) as u32);
            row_parent.push(none);
        }
    }
    let tree_seq = ctx.len() as u32;
    let root = row_seq.len() as u32;
    for (i, parent) in [none, 0, 0, 1, 3, 4].into_iter().enumerate() {
        row_seq.push(tree_seq);
        row_len.push(10 + i as u32);
        row_parent.push(if parent == none { none } else { root + parent });
    }
    let all_ctx: Vec<usize> = ctx.iter().copied().chain([15]).collect();
    let max_blocks = all_ctx
        .iter()
        .map(|c| c.div_ceil(block_size))
        .max()
        .unwrap_or(1)
        .max(1);
    let num_blocks = all_ctx.len() * max_blocks + 3;
    let mut r = rng(seed);
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, r.random_range(0..=i));
    }
    let table: Vec<u32> = ids[..all_ctx.len() * max_blocks].to_vec();
    let rows = row_seq.len();
    let half = (rank + rope) / 2;
    let w = 1.0 / (rank as f32).sqrt();
    let q = uniform(seed + 1, rows * heads * (nope + rope), -1.0, 1.0);
    let kv_b = uniform(seed + 2, heads * (nope + v_dim) * rank, -w, w);
    let lo = uniform(seed + 3, num_blocks * block_size * half, -2.0, 2.0);
    let hi = uniform(seed + 4, num_blocks * block_size * half, -2.0, 2.0);
    let n_out = rows * heads * v_dim;
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let o = s.out(Dtype::Bf16, n_out)?;
        b.mla_attention(MlaAttentionArgs {
            out: o,
            q: s.bf16(&q)?,
            kv_b: s.bf16(&kv_b)?,
            lo_cache: s.bf16(&lo)?,
            hi_cache: s.bf16(&hi)?,
            block_table: s.u32(&table)?,
            row_seq: s.u32(&row_seq)?,
            row_ctx_len: s.u32(&row_len)?,
            row_parent: Some(s.u32(&row_parent)?),
            rows,
            heads,
            kv_lora_rank: rank,
            nope_dim: nope,
            rope_dim: rope,
            v_dim,
            block_size,
            max_blocks_per_seq: max_blocks,
            scale: 1.0 / ((nope + rope) as f32).sqrt(),
            stream: 0,
        })?;
        b.download_bf16(o, n_out)
    })?;
    close("mla_attention", &got, &want, BF16_RTOL, 2e-3)
}

/// A verify forward of draft trees under the tree mask: sequence `s` of `trees` has
/// `trees[s].0` cached prefix rows, then the last verified token's row (no parent) and one
/// row per node, node `i` the child of node `trees[s].1[i]` (`None`: of the last verified
/// token), in consecutive cache rows; a last sequence of causal rows without a parent runs
/// in the same call. Random trees (seeded) of up to 20 nodes, with a chain and a star.
pub fn paged_attention_tree(dut: &dyn GpuBackend, seed: u64) -> Result<(), String> {
    let (heads, kv_heads, head_dim, block_size) = (9, 3, 64, 16);
    let mut r = rng(seed);
    let mut trees: Vec<(usize, Vec<Option<usize>>)> = [(37, 20), (0, 6), (130, 9)]
        .iter()
        .map(|&(prefix, n)| {
            let tree = (0..n)
                .map(|i| {
                    let p = r.random_range(0..=i);
                    (p < i).then_some(p)
                })
                .collect();
            (prefix, tree)
        })
        .collect();
    trees.push((20, (0..7).map(|i: usize| i.checked_sub(1)).collect()));
    trees.push((5, vec![None; 5]));
    let none = PagedAttentionArgs::NO_PARENT;
    let (mut row_seq, mut row_len, mut row_parent) = (Vec::new(), Vec::new(), Vec::new());
    let mut ctx = Vec::new();
    for (s, (prefix, tree)) in trees.iter().enumerate() {
        let root = row_seq.len();
        row_seq.push(s as u32);
        row_len.push(*prefix as u32 + 1);
        row_parent.push(none);
        for (i, parent) in tree.iter().enumerate() {
            row_seq.push(s as u32);
            row_len.push((prefix + 2 + i) as u32);
            row_parent.push(parent.map_or(root, |p| root + 1 + p) as u32);
        }
        ctx.push(prefix + 1 + tree.len());
    }
    let plain = trees.len() as u32;
    for len in 10..15 {
        row_seq.push(plain);
        row_len.push(len);
        row_parent.push(none);
    }
    ctx.push(14);
    let max_blocks = ctx
        .iter()
        .map(|c| c.div_ceil(block_size))
        .max()
        .unwrap_or(1);
    let num_blocks = ctx.len() * max_blocks + 3;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, r.random_range(0..=i));
    }
    let table: Vec<u32> = ids[..ctx.len() * max_blocks].to_vec();
    let rows = row_seq.len();
    let width = kv_heads * head_dim;
    let q = uniform(seed + 1, rows * heads * head_dim, -1.0, 1.0);
    let kc = uniform(seed + 2, num_blocks * block_size * width, -2.0, 2.0);
    let vc = uniform(seed + 3, num_blocks * block_size * width, -1.0, 1.0);
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let o = s.out(Dtype::Bf16, rows * heads * head_dim)?;
        b.paged_attention(PagedAttentionArgs {
            out: o,
            q: s.bf16(&q)?,
            k_cache: s.bf16(&kc)?,
            v_cache: s.bf16(&vc)?,
            block_table: s.u32(&table)?,
            row_seq: s.u32(&row_seq)?,
            row_ctx_len: s.u32(&row_len)?,
            row_parent: Some(s.u32(&row_parent)?),
            rows,
            heads,
            kv_heads,
            head_dim,
            block_size,
            max_blocks_per_seq: max_blocks,
            scale: 1.0 / (head_dim as f32).sqrt(),
            stream: 0,
        })?;
        b.download_bf16(o, rows * heads * head_dim)
    })?;
    close(
        "paged_attention under a tree mask",
        &got,
        &want,
        BF16_RTOL,
        2e-3,
    )
}

pub fn argmax(
    dut: &dyn GpuBackend,
    rows: usize,
    vocab: usize,
    masked: bool,
    seed: u64,
) -> Result<(), String> {
    let mut logits = uniform(seed, rows * vocab, -10.0, 10.0);
    // Ties: row 0 gets its maximum twice, and the lower index must win.
    if vocab > 3 {
        let (i, _) = logits[..vocab]
            .iter()
            .enumerate()
            .fold((0, f32::MIN), |a, (i, &v)| if v > a.1 { (i, v) } else { a });
        logits[vocab - 1] = logits[i];
        logits[1.min(i)] = logits[i];
    }
    // NaN never counts: row 0 starts with one (the first id a thread scans), and with
    // three rows or more, row 2 is NaN but for its last id.
    logits[0] = f32::NAN;
    if rows > 2 {
        logits[2 * vocab..3 * vocab - 1].fill(f32::NAN);
    }
    let words = vocab.div_ceil(32);
    let mut r = rng(seed + 1);
    let mut mask: Vec<i32> = (0..rows * words).map(|_| r.random::<i32>()).collect();
    if masked && rows > 1 {
        // Nothing allowed in row 1: the answer is u32::MAX.
        mask[words..2 * words].fill(0);
    }
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let pl = s.f32(&logits)?;
        let pm = if masked { Some(s.i32(&mask)?) } else { None };
        let o = s.out(Dtype::U32, rows)?;
        b.argmax(ArgmaxArgs {
            out: o,
            logits: pl,
            bitmask: pm,
            rows,
            vocab,
            stream: 0,
        })?;
        b.download::<u32>(o, rows)
    })?;
    // The reference row by row: the host's greedy pick, NaN and mask rules included.
    let expected: Vec<u32> = (0..rows)
        .map(|r| {
            let row_mask = masked.then(|| &mask[r * words..(r + 1) * words]);
            host_argmax(&logits[r * vocab..(r + 1) * vocab], row_mask).unwrap_or(u32::MAX)
        })
        .collect();
    exact("argmax (reference)", &want, &expected)?;
    exact("argmax", &got, &want)
}

/// `pick` of one value a row, against the values indexed here; every fourth row's index is
/// past the row (`u32::MAX`, or `width` itself), which gives 0.
pub fn pick(dut: &dyn GpuBackend, rows: usize, width: usize, seed: u64) -> Result<(), String> {
    let values = uniform(seed, rows * width, -3.0, 3.0);
    let mut r = rng(seed + 1);
    let index: Vec<u32> = (0..rows)
        .map(|i| match i % 4 {
            3 if i % 8 == 3 => u32::MAX,
            3 => width as u32,
            _ => r.random_range(0..width.max(1)) as u32,
        })
        .collect();
    let expected: Vec<f32> = (0..rows)
        .map(|i| match index[i] as usize {
            j if j < width => values[i * width + j],
            _ => 0.0,
        })
        .collect();
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let (pv, pi) = (s.f32(&values)?, s.u32(&index)?);
        let o = s.out(Dtype::F32, rows)?;
        b.pick(PickArgs {
            out: o,
            values: pv,
            index: pi,
            rows,
            width,
            stream: 0,
        })?;
        b.download::<f32>(o, rows)
    })?;
    exact("pick (reference)", &want, &expected)?;
    exact("pick", &got, &expected)
}

pub fn softmax(
    dut: &dyn GpuBackend,
    rows: usize,
    vocab: usize,
    temperature: f32,
    in_place: bool,
    seed: u64,
) -> Result<(), String> {
    let logits = uniform(seed, rows * vocab, -20.0, 20.0);
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let pl = s.f32(&logits)?;
        let o = if in_place {
            pl
        } else {
            s.out(Dtype::F32, rows * vocab)?
        };
        b.softmax(SoftmaxArgs {
            out: o,
            logits: pl,
            rows,
            vocab,
            temperature,
            stream: 0,
        })?;
        b.download::<f32>(o, rows * vocab)
    })?;
    close("softmax", &got, &want, F32_RTOL, 1e-8)
}

/// `parts` source buffers of `rows` rows (`src_stride` elements apart, `width` used) copied
/// side by side into one poisoned `[rows, parts * width + pad]` buffer, part `j` at column
/// `j * width`, as the target's layer capture does. The reference's result is also checked
/// against the copy done here on the host (the pad columns stay poisoned).
pub fn copy_rows(
    dut: &dyn GpuBackend,
    rows: usize,
    width: usize,
    src_stride: usize,
    parts: usize,
    pad: usize,
    seed: u64,
) -> Result<(), String> {
    let dst_stride = parts * width + pad;
    let srcs: Vec<Vec<f32>> = (0..parts)
        .map(|j| uniform(seed + j as u64, rows * src_stride, -4.0, 4.0))
        .collect();
    let (got, want) = both(dut, |b| {
        let s = Scope::new(b);
        let dst = s.out(Dtype::Bf16, rows * dst_stride)?;
        for (j, src) in srcs.iter().enumerate() {
            b.copy_rows(CopyRowsArgs {
                dst,
                src: s.bf16(src)?,
                rows,
                width,
                col: j * width,
                dst_stride,
                src_stride,
                stream: 0,
            })?;
        }
        b.download::<bf16>(dst, rows * dst_stride)
    })?;
    let mut host = vec![bf16::from_bits(0xffff); rows * dst_stride];
    for (j, src) in srcs.iter().enumerate() {
        for r in 0..rows {
            for i in 0..width {
                host[r * dst_stride + j * width + i] = bf16::from_f32(src[r * src_stride + i]);
            }
        }
    }
    exact("copy_rows reference", &bits(&want), &bits(&host))?;
    exact("copy_rows", &bits(&got), &bits(&want))
}

/// Bad arguments: the backend under test must reject each exactly as the reference does.
pub fn same_errors(dut: &dyn GpuBackend) -> Result<(), String> {
    let run = |b: &dyn GpuBackend| -> Result<Vec<String>, BackendError> {
        let s = Scope::new(b);
        let table = s.bf16(&[0.5; 4 * 8])?;
        let ids = s.u32(&[1, 4])?;
        let out = s.out(Dtype::Bf16, 2 * 8)?;
        let slots = s.u32(&[0, 9])?;
        let lens = s.u32(&[5])?;
        let seqs = s.u32(&[0])?;
        let logits = s.f32(&[0.0; 10])?;
        let u = s.out(Dtype::U32, 4)?;
        let attention = |heads, kv_heads| PagedAttentionArgs {
            out,
            q: out,
            k_cache: table,
            v_cache: table,
            block_table: seqs,
            row_seq: seqs,
            row_ctx_len: lens,
            row_parent: None,
            rows: 1,
            heads,
            kv_heads,
            head_dim: 8,
            block_size: 4,
            max_blocks_per_seq: 1,
            scale: 1.0,
            stream: 0,
        };
        let linear = |out_dtype, weight, in_features, x| LinearArgs {
            out,
            out_dtype,
            x,
            weight,
            bias: None,
            rows: 1,
            in_features,
            out_features: 1,
            stream: 0,
        };
        let nvfp4 = LinearWeight::Nvfp4 {
            codes: out,
            block_scales: out,
            global_scale: 1.0,
        };
        let add = |out, a, b, n| ElementwiseArgs {
            op: ElementwiseOp::Add,
            out,
            a,
            b,
            n,
            stream: 0,
        };
        let errs = [
            b.embedding(EmbeddingArgs {
                out,
                table: LinearWeight::Bf16 { weight: table },
                ids,
                rows: 2,
                hidden: 8,
                vocab: 4,
                stream: 0,
            }),
            b.kv_write(KvWriteArgs {
                k_cache: table,
                v_cache: table,
                k: out,
                v: out,
                slots,
                rows: 2,
                kv_heads: 1,
                head_dim: 8,
                num_slots: 4,
                stream: 0,
            }),
            b.paged_attention(attention(2, 1)),
            b.paged_attention(attention(3, 2)),
            b.argmax(ArgmaxArgs {
                out: u,
                logits,
                bitmask: None,
                rows: 2,
                vocab: 10,
                stream: 0,
            }),
            b.softmax(SoftmaxArgs {
                out: logits,
                logits,
                rows: 1,
                vocab: 10,
                temperature: 0.0,
                stream: 0,
            }),
            b.rope(RopeArgs {
                x: out,
                positions: ids,
                inv_freq: logits,
                rows: 1,
                heads: 1,
                head_dim: 8,
                rotary_dim: 10,
                style: RopeStyle::Half,
                stream: 0,
            }),
            b.linear(linear(Dtype::Bf16, nvfp4, 8, out)),
            b.linear(linear(
                Dtype::U32,
                LinearWeight::Bf16 { weight: out },
                8,
                out,
            )),
            b.elementwise(add(out, out, table, 100)),
            // Aliasing: each refused after every range checked out.
            b.linear(linear(
                Dtype::Bf16,
                LinearWeight::Bf16 { weight: table },
                8,
                out,
            )),
            b.elementwise(add(out.offset(2), out, table, 8)),
            b.kv_write(KvWriteArgs {
                k_cache: table,
                v_cache: table.offset(16),
                k: out,
                v: out,
                slots: ids,
                rows: 1,
                kv_heads: 1,
                head_dim: 8,
                num_slots: 2,
                stream: 0,
            }),
            // A row wider than the source's stride, then columns past the destination's.
            // (Each span lies inside its buffer: only the shape check refuses it.)
            b.copy_rows(CopyRowsArgs {
                dst: out,
                src: table,
                rows: 1,
                width: 9,
                col: 0,
                dst_stride: 9,
                src_stride: 8,
                stream: 0,
            }),
            b.copy_rows(CopyRowsArgs {
                dst: out,
                src: table,
                rows: 1,
                width: 8,
                col: 1,
                dst_stride: 8,
                src_stride: 8,
                stream: 0,
            }),
            // The last destination row runs past its buffer (2 rows of 8 hold 16 elements).
            b.copy_rows(CopyRowsArgs {
                dst: out,
                src: table,
                rows: 2,
                width: 4,
                col: 6,
                dst_stride: 8,
                src_stride: 8,
                stream: 0,
            }),
            // A misaligned f32 pointer.
            b.softmax(SoftmaxArgs {
                out: u,
                logits: logits.offset(2),
                rows: 1,
                vocab: 4,
                temperature: 1.0,
                stream: 0,
            }),
        ];
        Ok(errs
            .into_iter()
            .map(|e| match e {
                Ok(()) => "ok".to_string(),
                // Addresses differ between backends; what was out of bounds must not.
                Err(BackendError::OutOfBounds { what, .. }) => format!("out of bounds: {what}"),
                Err(e) => e.to_string(),
            })
            .collect())
    };
    let (got, want) = both(dut, run)?;
    if want.iter().any(|e| e == "ok") {
        return Err(format!("the reference accepted a bad argument: {want:?}"));
    }
    exact("errors", &got, &want)
}
