//! The CPU reference of every op in [`Kernels`].
//!
//! These are the definitions the CUDA kernels are tested against, so they favour being
//! obviously right: each op first runs its arguments' shared `validate`, which checks every
//! range through the ledger and the op's aliasing rule, and then touches only the views it
//! returned; all arithmetic accumulates in f32. An op whose output may be an input itself
//! either reads each block of it before writing that block (the small ops) or computes into
//! a fresh buffer and writes it at the end; every other op writes its output directly, which
//! the aliasing check makes sound. The ops a forward runs per layer are written to be fast
//! and to give each row bitwise the same result whatever else is in the batch: `linear` in
//! `linear`, `paged_attention` in `attention`, RMSNorm, the element-wise ops and RoPE in
//! `elementwise`. The per-step picks over logits rows (`argmax`, `top_k`) take a pool task
//! a row, since a verify forward at batch 16 hands them dozens of vocabulary rows.

use super::attention::{paged_attention, AttentionInputs, AttentionShape};
use super::elementwise::{self, Input, RopeShape};
use super::fp8::Fp8Rows;
use super::linear::{Nvfp4Rows, WeightRows};
use super::shared_out::SharedOut;
use super::{CpuBackend, HostView};
use crate::backend::kernels::{
    ArgmaxArgs, CopyRowsArgs, ElementwiseArgs, EmbeddingArgs, GroupedLinearArgs, Kernels,
    KvCopyArgs, KvWriteArgs, LinearArgs, LinearWeight, MlaAttentionArgs, PagedAttentionArgs,
    PickArgs, RmsNormArgs, RopeArgs, SoftmaxArgs, TopKArgs,
};
use crate::backend::quant::{PackedView, QuantError};
use crate::backend::BackendError;
use half::bf16;

fn quant_err(op: &'static str) -> impl Fn(QuantError) -> BackendError {
    move |source| BackendError::Quant { op, source }
}

/// A BF16 input that validation found either to be `out` itself or apart from it.
///
/// # Safety
/// `x` is a validated range that no view writes while the result lives, unless it is `out`.
unsafe fn input<'a>(x: &'a HostView, out: &HostView) -> Input<'a> {
    if x.as_ptr() == out.as_ptr() {
        Input::Out
    } else {
        Input::Apart(x.typed::<bf16>())
    }
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
        // SAFETY: validated ranges; `x` is either `out` itself (then only `out` is viewed) or
        // apart from it, and the weight is apart from `out`.
        let (out, w) = unsafe { (a.out.typed_mut::<bf16>(), a.weight.typed::<bf16>()) };
        let x = unsafe { input(&a.x, &a.out) };
        elementwise::rms_norm(self.kernel_pool(), out, x, w, a.dim, a.eps)
            .map_err(quant_err("rms_norm"))
    }

    fn elementwise(&self, args: ElementwiseArgs) -> Result<(), BackendError> {
        let a = args.validate(self)?;
        // SAFETY: validated ranges; each input is either `out` itself (then only `out` is
        // viewed) or apart from it.
        let out = unsafe { a.out.typed_mut::<bf16>() };
        let (x, y) = unsafe { (input(&a.a, &a.out), input(&a.b, &a.out)) };
        elementwise::binary(self.kernel_pool(), a.op, out, x, y).map_err(quant_err(a.op.name()))
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
        // SAFETY: validated ranges; `x` is apart from the positions and frequencies.
        let (pos, freq, xs) = unsafe {
            (
                a.positions.typed::<u32>(),
                a.inv_freq.typed::<f32>(),
                a.x.typed_mut::<bf16>(),
            )
        };
        let shape = RopeShape {
            heads: a.heads,
            head_dim: a.head_dim,
            style: a.style,
        };
        elementwise::rope(self.kernel_pool(), &self.rope, xs, pos, freq, shape)
            .map_err(quant_err("rope"))
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
                    row_parent: c.row_parent.as_deref(),
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
        let picks = SharedOut::new(out);
        // A row a task: a verify forward's rows are independent, and each is a vocabulary's
        // scan (tens of microseconds), well above the pool's round trip.
        self.kernel_pool()
            .run(a.rows, &|r| {
                let row_mask = mask.map(|m| &m[r * words..(r + 1) * words]);
                // SAFETY: task `r` alone takes pick `r`.
                let pick = unsafe { picks.slice(r, 1) };
                pick[0] =
                    super::argmax(&ls[r * vocab..(r + 1) * vocab], row_mask).unwrap_or(u32::MAX);
            })
            .map_err(quant_err("argmax"))
    }

    fn pick(&self, args: PickArgs) -> Result<(), BackendError> {
        let a = args.validate(self)?;
        // SAFETY: validated ranges; `out` is apart from both inputs.
        let (values, index, out) = unsafe {
            (
                a.values.typed::<f32>(),
                a.index.typed::<u32>(),
                a.out.typed_mut::<f32>(),
            )
        };
        for (r, (o, &i)) in out.iter_mut().zip(index).enumerate() {
            let i = i as usize;
            *o = if i < a.width {
                values[r * a.width + i]
            } else {
                0.0
            };
        }
        Ok(())
    }

    fn top_k(&self, args: TopKArgs) -> Result<(), BackendError> {
        let a = args.validate(self)?;
        let (width, words, k) = (a.width, a.width.div_ceil(32), a.k);
        // SAFETY: validated ranges; both outputs are apart from the inputs and each other.
        let (ls, mask, ids, probs) = unsafe {
            (
                a.logits.typed::<f32>(),
                a.bitmask.as_ref().map(|m| m.typed::<i32>()),
                a.ids.typed_mut::<u32>(),
                a.probs.typed_mut::<f32>(),
            )
        };
        let (ids, probs) = (SharedOut::new(ids), SharedOut::new(probs));
        // A row a task, as in `argmax`.
        self.kernel_pool()
            .run(a.rows, &|r| {
                let row_mask = mask.map(|m| &m[r * words..(r + 1) * words]);
                let allowed =
                    |t: usize| row_mask.is_none_or(|m| (m[t / 32] as u32 >> (t % 32)) & 1 == 1);
                let kept = super::top_k::top_k_row(&ls[r * width..(r + 1) * width], k, allowed);
                // SAFETY: task `r` alone takes row `r` of each output.
                let (ids, probs) = unsafe { (ids.chunk(r, k), probs.chunk(r, k)) };
                for j in 0..k {
                    (ids[j], probs[j]) = kept.get(j).copied().unwrap_or((u32::MAX, 0.0));
                }
            })
            .map_err(quant_err("top_k"))
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

    fn copy_rows(&self, args: CopyRowsArgs) -> Result<(), BackendError> {
        let a = args.validate(self)?;
        if a.rows == 0 || a.width == 0 {
            return Ok(());
        }
        // SAFETY: validated spans, apart from each other.
        let (src, dst) = unsafe { (a.src.typed::<bf16>(), a.dst.typed_mut::<bf16>()) };
        for r in 0..a.rows {
            let (s, d) = (r * a.src_stride, r * a.dst_stride);
            dst[d..d + a.width].copy_from_slice(&src[s..s + a.width]);
        }
        Ok(())
    }

    fn kv_copy(&self, args: KvCopyArgs) -> Result<(), BackendError> {
        let c = args.validate(self)?;
        let width = c.args.kv_heads * c.args.head_dim;
        for cache in [&c.args.k_cache, &c.args.v_cache] {
            // SAFETY: a validated range, apart from the other cache and the slot lists.
            let cache = unsafe { cache.typed_mut::<bf16>() };
            for (&s, &d) in c.src.iter().zip(&c.dst) {
                let (s, d) = (s as usize * width, d as usize * width);
                cache.copy_within(s..s + width, d);
            }
        }
        Ok(())
    }

    fn mla_attention(&self, args: MlaAttentionArgs) -> Result<(), BackendError> {
        let c = args.validate(self)?;
        // SAFETY: validated for this call.
        unsafe { super::mla::mla_attention(&c) };
        Ok(())
    }
}
