//! The row-wise cases: `embedding`, `rms_norm`, the elementwise `add_silu`, `rope` and
//! `softmax`, each on random rows against the reference.

use super::*;

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
