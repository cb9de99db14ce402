//! The CPU reference of every op in [`Kernels`].
//!
//! These are the definitions the CUDA kernels are tested against, so they favour being
//! obviously right: each op first runs its arguments' shared `validate`, which checks every
//! range through the ledger and the op's aliasing rule, and then touches only the views it
//! returned; all arithmetic accumulates in f32. An op whose output may be an input itself
//! computes into a fresh buffer and writes it at the end; every other op writes its output
//! directly, which the aliasing check makes sound. `linear` is the hot op of a CPU forward,
//! so its kernel lives in `linear`, written to be fast and to give each row bitwise the
//! same result whatever else is in the batch; so does `paged_attention`, in `attention`.

use super::attention::{paged_attention, AttentionInputs, AttentionShape};
use super::fp8::Fp8Rows;
use super::linear::{Nvfp4Rows, WeightRows};
use super::CpuBackend;
use crate::backend::kernels::{
    ArgmaxArgs, ElementwiseArgs, ElementwiseOp, EmbeddingArgs, GroupedLinearArgs, Kernels,
    KvWriteArgs, LinearArgs, LinearWeight, PagedAttentionArgs, RmsNormArgs, RopeArgs, RopeStyle,
    SoftmaxArgs,
};
use crate::backend::quant::{PackedView, QuantError};
use crate::backend::BackendError;
use half::bf16;

fn quant_err(op: &'static str) -> impl Fn(QuantError) -> BackendError {
    move |source| BackendError::Quant { op, source }
}

fn bf16_to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

impl Kernels for CpuBackend {
    fn embedding(&self, args: EmbeddingArgs) -> Result<(), BackendError> {
        let c = args.validate(self)?;
        let (hidden, vocab) = (c.args.hidden, c.args.vocab);
        // SAFETY: validated ranges; `out` is apart from the table.
        let out = unsafe { c.args.out.typed_mut::<bf16>() };
        let rows = out.chunks_mut(hidden.max(1)).zip(&c.ids);
        let mut buf = Vec::new();
        let round = |row: &mut [bf16], values: &[f32]| {
            row.iter_mut()
                .zip(values)
                .for_each(|(o, &v)| *o = bf16::from_f32(v));
        };
        match &c.args.table {
            LinearWeight::Bf16 { weight } => {
                // SAFETY: a validated range, only read.
                let table = unsafe { weight.typed::<bf16>() };
                for (row, &t) in rows {
                    let t = t as usize;
                    row.copy_from_slice(&table[t * hidden..(t + 1) * hidden]);
                }
            }
            LinearWeight::Packed { blocks, format, .. } => {
                // SAFETY: a validated range, only read.
                let bytes = unsafe { blocks.bytes() };
                let w = PackedView::from_packed(*format, vocab, hidden, bytes)
                    .map_err(quant_err("embedding"))?;
                buf.resize(hidden, 0.0);
                for (row, &t) in rows {
                    w.dequantize_row(t as usize, &mut buf)
                        .map_err(quant_err("embedding"))?;
                    round(row, &buf);
                }
            }
            LinearWeight::Nvfp4 {
                codes,
                block_scales,
                global_scale,
            } => {
                let src = Nvfp4Rows {
                    // SAFETY: validated ranges, only read.
                    codes: unsafe { codes.bytes() },
                    scales: unsafe { block_scales.bytes() },
                    global_scale: *global_scale,
                    in_features: hidden,
                };
                for (row, &t) in rows {
                    round(row, src.row(t as usize, &mut buf));
                }
            }
            LinearWeight::Fp8 {
                weight,
                block_scales,
            } => {
                let src = Fp8Rows {
                    // SAFETY: validated ranges, only read.
                    weight: unsafe { weight.bytes() },
                    block_scales: unsafe { block_scales.typed::<f32>() },
                    in_features: hidden,
                };
                for (row, &t) in rows {
                    round(row, src.row(t as usize, &mut buf));
                }
            }
        }
        Ok(())
    }

    fn rms_norm(&self, args: RmsNormArgs) -> Result<(), BackendError> {
        let a = args.validate(self)?;
        let (dim, eps) = (a.dim, a.eps);
        let result = {
            // SAFETY: validated ranges, only read here; `out` (maybe `x`) is written below.
            let (xs, w) = unsafe { (a.x.typed::<bf16>(), a.weight.typed::<bf16>()) };
            let w = bf16_to_f32(w);
            let mut result = Vec::with_capacity(xs.len());
            for row in xs.chunks(dim.max(1)) {
                let row = bf16_to_f32(row);
                let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
                let inv = 1.0 / (mean_sq + eps).sqrt();
                result.extend(row.iter().zip(&w).map(|(v, w)| bf16::from_f32(v * inv * w)));
            }
            result
        };
        // SAFETY: validated range; no other view of it is alive.
        unsafe { a.out.typed_mut::<bf16>() }.copy_from_slice(&result);
        Ok(())
    }

    fn elementwise(&self, args: ElementwiseArgs) -> Result<(), BackendError> {
        let a = args.validate(self)?;
        let result: Vec<bf16> = {
            // SAFETY: validated ranges, only read here; `out` (maybe an input) is written below.
            let (x, y) = unsafe { (a.a.typed::<bf16>(), a.b.typed::<bf16>()) };
            let pairs = x.iter().zip(y);
            match a.op {
                ElementwiseOp::Add => pairs
                    .map(|(x, y)| bf16::from_f32(x.to_f32() + y.to_f32()))
                    .collect(),
                ElementwiseOp::SiluMul => pairs
                    .map(|(g, u)| {
                        let g = g.to_f32();
                        bf16::from_f32(g / (1.0 + (-g).exp()) * u.to_f32())
                    })
                    .collect(),
                ElementwiseOp::SigmoidMul => pairs
                    .map(|(g, v)| bf16::from_f32(v.to_f32() / (1.0 + (-g.to_f32()).exp())))
                    .collect(),
            }
        };
        // SAFETY: validated range; no other view of it is alive.
        unsafe { a.out.typed_mut::<bf16>() }.copy_from_slice(&result);
        Ok(())
    }

    fn linear(&self, args: LinearArgs) -> Result<(), BackendError> {
        let a = args.validate_group(self)?;
        super::grouped::run(self.kernel_pool(), "linear", &a)
    }

    fn grouped_linear(&self, args: GroupedLinearArgs) -> Result<(), BackendError> {
        let a = args.validate(self)?;
        super::grouped::run(self.kernel_pool(), "grouped_linear", &a)
    }

    fn rope(&self, args: RopeArgs) -> Result<(), BackendError> {
        let a = args.validate(self)?;
        let (heads, head_dim, half) = (a.heads, a.head_dim, a.rotary_dim / 2);
        // SAFETY: validated ranges; `x` is apart from the positions and frequencies.
        let (pos, freq, xs) = unsafe {
            (
                a.positions.typed::<u32>(),
                a.inv_freq.typed::<f32>(),
                a.x.typed_mut::<bf16>(),
            )
        };
        // A row's angles are the same for every head: computed once per row.
        let mut angles = Vec::with_capacity(freq.len());
        for (r, &p) in pos.iter().enumerate() {
            angles.clear();
            angles.extend(freq.iter().map(|f| (p as f32 * f).sin_cos()));
            for h in 0..heads {
                let head = &mut xs[(r * heads + h) * head_dim..(r * heads + h + 1) * head_dim];
                for (i, &(sin, cos)) in angles.iter().enumerate() {
                    let (i, j) = match a.style {
                        RopeStyle::Half => (i, i + half),
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (xi, xj) = (head[i].to_f32(), head[j].to_f32());
                    head[i] = bf16::from_f32(xi * cos - xj * sin);
                    head[j] = bf16::from_f32(xj * cos + xi * sin);
                }
            }
        }
        Ok(())
    }

    fn kv_write(&self, args: KvWriteArgs) -> Result<(), BackendError> {
        let c = args.validate(self)?;
        let width = c.args.kv_heads * c.args.head_dim;
        for (rows, cache) in [(&c.args.k, &c.args.k_cache), (&c.args.v, &c.args.v_cache)] {
            // SAFETY: validated ranges; each cache is apart from the rows and the other cache.
            let (rows, cache) = unsafe { (rows.typed::<bf16>(), cache.typed_mut::<bf16>()) };
            for (r, &s) in c.slots.iter().enumerate() {
                let s = s as usize;
                cache[s * width..(s + 1) * width]
                    .copy_from_slice(&rows[r * width..(r + 1) * width]);
            }
        }
        Ok(())
    }

    fn paged_attention(&self, args: PagedAttentionArgs) -> Result<(), BackendError> {
        let c = args.validate(self)?;
        let a = &c.args;
        let shape = AttentionShape {
            heads: a.heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            block_size: a.block_size,
            max_blocks_per_seq: a.max_blocks_per_seq,
            scale: a.scale,
        };
        // SAFETY: validated ranges covering every slot the table names; `out` is apart from
        // every input.
        let (inputs, out) = unsafe {
            (
                AttentionInputs {
                    q: a.q.typed::<bf16>(),
                    k_cache: a.k_cache.typed::<bf16>(),
                    v_cache: a.v_cache.typed::<bf16>(),
                    block_table: &c.block_table,
                    row_seq: &c.row_seq,
                    row_ctx_len: &c.row_ctx_len,
                },
                a.out.typed_mut::<bf16>(),
            )
        };
        paged_attention(self.kernel_pool(), &shape, &inputs, out)
            .map_err(quant_err("paged_attention"))
    }

    fn argmax(&self, args: ArgmaxArgs) -> Result<(), BackendError> {
        let a = args.validate(self)?;
        let (vocab, words) = (a.vocab, a.vocab.div_ceil(32));
        // SAFETY: validated ranges; `out` is apart from the logits and the mask.
        let (ls, mask, out) = unsafe {
            (
                a.logits.typed::<f32>(),
                a.bitmask.as_ref().map(|m| m.typed::<i32>()),
                a.out.typed_mut::<u32>(),
            )
        };
        for (r, pick) in out.iter_mut().enumerate() {
            *pick = u32::MAX;
            let mut best = f32::NEG_INFINITY;
            for t in 0..vocab {
                if let Some(m) = mask {
                    if (m[r * words + t / 32] as u32 >> (t % 32)) & 1 == 0 {
                        continue;
                    }
                }
                let v = ls[r * vocab + t];
                if *pick == u32::MAX || v > best {
                    best = v;
                    *pick = t as u32;
                }
            }
        }
        Ok(())
    }

    fn softmax(&self, args: SoftmaxArgs) -> Result<(), BackendError> {
        let a = args.validate(self)?;
        let temperature = a.temperature;
        // SAFETY: a validated range, copied out before `out` (maybe the same) is written.
        let mut ls = unsafe { a.logits.typed::<f32>() }.to_vec();
        for row in ls.chunks_mut(a.vocab.max(1)) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0.0;
            for v in row.iter_mut() {
                *v = ((*v - max) / temperature).exp();
                total += *v;
            }
            for v in row.iter_mut() {
                *v /= total;
            }
        }
        // SAFETY: validated range; no other view of it is alive.
        unsafe { a.out.typed_mut::<f32>() }.copy_from_slice(&ls);
        Ok(())
    }
}
