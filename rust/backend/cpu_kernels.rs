//! The CPU reference of every kernel in [`Kernels`].
//!
//! These are the definitions the CUDA kernels are tested against, so they favour being
//! obviously right: every argument range is checked through the ledger first, outputs that
//! may alias inputs are computed from copies, and all arithmetic accumulates in f32.
//! `linear` is the hot op of a CPU forward, so its kernel lives in `cpu_linear`, written to
//! be fast and to give each row bitwise the same result whatever else is in the batch.

use super::cpu::{CpuBackend, HostView};
use super::cpu_linear::{linear_rows, Bf16Rows, Nvfp4Rows, WeightRows};
use super::kernels::{Kernels, RopeStyle};
use super::{BackendError, DevicePtr, Dtype};
use half::bf16;
use rayon::prelude::*;

/// FP8 E4M3 (`float8_e4m3fn`) to f32. Written here because no crate the field relies on
/// decodes it: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no infinities, and
/// `S.1111.111` is NaN.
pub fn fp8_e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((byte >> 3) & 0x0f) as i32;
    let man = (byte & 0x07) as f32;
    if exp == 0x0f && byte & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// The values of the eight E2M1 magnitudes (NVFP4's element codes, bit 3 is the sign).
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// An E2M1 code (low four bits of `code`) to f32.
pub fn e2m1_to_f32(code: u8) -> f32 {
    let v = E2M1_VALUES[(code & 0x07) as usize];
    if code & 0x08 != 0 {
        -v
    } else {
        v
    }
}

fn invalid(op: &'static str, message: String) -> BackendError {
    BackendError::InvalidArgument { op, message }
}

fn bf16_to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise the loop.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        sum += a[i] * b[i];
    }
    sum
}

impl CpuBackend {
    fn elems(
        &self,
        ptr: DevicePtr,
        n: usize,
        dtype: Dtype,
        what: &str,
    ) -> Result<HostView, BackendError> {
        let nbytes = n
            .checked_mul(dtype.size())
            .ok_or_else(|| invalid("kernel", format!("{what}: {n} elements overflow")))?;
        self.view(ptr, nbytes, what)
    }

    /// Copies `n` elements of `T` out of device memory (so an aliased output is safe).
    fn read<T: bytemuck::Pod>(
        &self,
        ptr: DevicePtr,
        n: usize,
        dtype: Dtype,
        what: &str,
    ) -> Result<Vec<T>, BackendError> {
        let view = self.elems(ptr, n, dtype, what)?;
        // SAFETY: a checked range; copied out before any write.
        Ok(unsafe { view.typed::<T>() }.to_vec())
    }

    fn write_out<T: bytemuck::Pod>(
        &self,
        ptr: DevicePtr,
        data: &[T],
        dtype: Dtype,
        what: &str,
    ) -> Result<(), BackendError> {
        let view = self.elems(ptr, data.len(), dtype, what)?;
        // SAFETY: a checked range; inputs were copied out already.
        unsafe { view.typed_mut::<T>() }.copy_from_slice(data);
        Ok(())
    }

    fn write_activations(
        &self,
        ptr: DevicePtr,
        out_dtype: Dtype,
        values: &[f32],
        op: &'static str,
    ) -> Result<(), BackendError> {
        match out_dtype {
            Dtype::F32 => self.write_out(ptr, values, Dtype::F32, op),
            Dtype::Bf16 => {
                let v: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
                self.write_out(ptr, &v, Dtype::Bf16, op)
            }
            other => Err(invalid(
                op,
                format!("out_dtype must be bf16 or f32, not {}", other.name()),
            )),
        }
    }

    /// Shared body of the two linear ops: reads `x` and `bias`, runs the kernel, writes `out`.
    #[allow(clippy::too_many_arguments)]
    fn linear_with(
        &self,
        op: &'static str,
        out: DevicePtr,
        out_dtype: Dtype,
        x: DevicePtr,
        bias: Option<DevicePtr>,
        rows: usize,
        in_features: usize,
        out_features: usize,
        src: &impl WeightRows,
    ) -> Result<(), BackendError> {
        let xs = self.elems(x, rows * in_features, Dtype::Bf16, "linear x")?;
        // SAFETY: checked range; `out` must not alias `x` (the op's contract), and `x` is
        // widened into a copy before anything is written.
        let xs = bf16_to_f32(unsafe { xs.typed::<bf16>() });
        let bias = match bias {
            Some(b) => Some(bf16_to_f32(&self.read::<bf16>(
                b,
                out_features,
                Dtype::Bf16,
                "linear bias",
            )?)),
            None => None,
        };
        let result = linear_rows(src, &xs, bias.as_deref(), rows, in_features, out_features);
        self.write_activations(out, out_dtype, &result, op)
    }
}

impl Kernels for CpuBackend {
    fn embedding(
        &self,
        out: DevicePtr,
        table: DevicePtr,
        ids: DevicePtr,
        rows: usize,
        hidden: usize,
        vocab: usize,
        _stream: u64,
    ) -> Result<(), BackendError> {
        let ids = self.read::<u32>(ids, rows, Dtype::U32, "embedding ids")?;
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid(
                "embedding",
                format!("token id {bad} is outside the vocabulary of {vocab}"),
            ));
        }
        let table = self.elems(table, vocab * hidden, Dtype::Bf16, "embedding table")?;
        // SAFETY: checked range, read-only.
        let table = unsafe { table.typed::<bf16>() };
        let mut result = Vec::with_capacity(rows * hidden);
        for &t in &ids {
            result.extend_from_slice(&table[t as usize * hidden..(t as usize + 1) * hidden]);
        }
        self.write_out(out, &result, Dtype::Bf16, "embedding out")
    }

    fn rms_norm(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        weight: DevicePtr,
        rows: usize,
        dim: usize,
        eps: f32,
        _stream: u64,
    ) -> Result<(), BackendError> {
        let xs = self.read::<bf16>(x, rows * dim, Dtype::Bf16, "rms_norm x")?;
        let w = bf16_to_f32(&self.read::<bf16>(weight, dim, Dtype::Bf16, "rms_norm weight")?);
        let mut result = Vec::with_capacity(rows * dim);
        for row in xs.chunks(dim.max(1)) {
            let row = bf16_to_f32(row);
            let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
            let inv = 1.0 / (mean_sq + eps).sqrt();
            result.extend(row.iter().zip(&w).map(|(v, w)| bf16::from_f32(v * inv * w)));
        }
        self.write_out(out, &result, Dtype::Bf16, "rms_norm out")
    }

    fn add(
        &self,
        out: DevicePtr,
        a: DevicePtr,
        b: DevicePtr,
        n: usize,
        _stream: u64,
    ) -> Result<(), BackendError> {
        let a = self.read::<bf16>(a, n, Dtype::Bf16, "add a")?;
        let b = self.read::<bf16>(b, n, Dtype::Bf16, "add b")?;
        let result: Vec<bf16> = a
            .iter()
            .zip(&b)
            .map(|(x, y)| bf16::from_f32(x.to_f32() + y.to_f32()))
            .collect();
        self.write_out(out, &result, Dtype::Bf16, "add out")
    }

    fn silu_mul(
        &self,
        out: DevicePtr,
        gate: DevicePtr,
        up: DevicePtr,
        n: usize,
        _stream: u64,
    ) -> Result<(), BackendError> {
        let g = self.read::<bf16>(gate, n, Dtype::Bf16, "silu_mul gate")?;
        let u = self.read::<bf16>(up, n, Dtype::Bf16, "silu_mul up")?;
        let result: Vec<bf16> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| {
                let g = g.to_f32();
                bf16::from_f32(g / (1.0 + (-g).exp()) * u.to_f32())
            })
            .collect();
        self.write_out(out, &result, Dtype::Bf16, "silu_mul out")
    }

    fn sigmoid_mul(
        &self,
        out: DevicePtr,
        gate: DevicePtr,
        x: DevicePtr,
        n: usize,
        _stream: u64,
    ) -> Result<(), BackendError> {
        let g = self.read::<bf16>(gate, n, Dtype::Bf16, "sigmoid_mul gate")?;
        let v = self.read::<bf16>(x, n, Dtype::Bf16, "sigmoid_mul x")?;
        let result: Vec<bf16> = g
            .iter()
            .zip(&v)
            .map(|(g, v)| bf16::from_f32(v.to_f32() / (1.0 + (-g.to_f32()).exp())))
            .collect();
        self.write_out(out, &result, Dtype::Bf16, "sigmoid_mul out")
    }

    fn linear(
        &self,
        out: DevicePtr,
        out_dtype: Dtype,
        x: DevicePtr,
        weight: DevicePtr,
        bias: Option<DevicePtr>,
        rows: usize,
        in_features: usize,
        out_features: usize,
        _stream: u64,
    ) -> Result<(), BackendError> {
        let w = self.elems(
            weight,
            out_features * in_features,
            Dtype::Bf16,
            "linear weight",
        )?;
        // SAFETY: checked range; weights are never an output of this op.
        let weight: &[u16] = unsafe { w.typed::<u16>() };
        self.linear_with(
            "linear",
            out,
            out_dtype,
            x,
            bias,
            rows,
            in_features,
            out_features,
            &Bf16Rows {
                weight,
                in_features,
            },
        )
    }

    fn linear_nvfp4(
        &self,
        out: DevicePtr,
        out_dtype: Dtype,
        x: DevicePtr,
        weight: DevicePtr,
        weight_scale: DevicePtr,
        global_scale: f32,
        rows: usize,
        in_features: usize,
        out_features: usize,
        _stream: u64,
    ) -> Result<(), BackendError> {
        if in_features % 16 != 0 {
            return Err(invalid(
                "linear_nvfp4",
                format!("in_features {in_features} is not a multiple of 16"),
            ));
        }
        let w = self.elems(
            weight,
            out_features * in_features / 2,
            Dtype::U8,
            "linear_nvfp4 weight",
        )?;
        let s = self.elems(
            weight_scale,
            out_features * in_features / 16,
            Dtype::U8,
            "linear_nvfp4 weight_scale",
        )?;
        // SAFETY: checked ranges, read-only.
        let (codes, scales) = unsafe { (w.bytes(), s.bytes()) };
        self.linear_with(
            "linear_nvfp4",
            out,
            out_dtype,
            x,
            None,
            rows,
            in_features,
            out_features,
            &Nvfp4Rows {
                codes,
                scales,
                global_scale,
                in_features,
            },
        )
    }

    fn rope(
        &self,
        x: DevicePtr,
        positions: DevicePtr,
        inv_freq: DevicePtr,
        rows: usize,
        heads: usize,
        head_dim: usize,
        rotary_dim: usize,
        style: RopeStyle,
        _stream: u64,
    ) -> Result<(), BackendError> {
        if rotary_dim > head_dim || rotary_dim % 2 != 0 {
            return Err(invalid(
                "rope",
                format!("rotary_dim {rotary_dim} must be even and at most head_dim {head_dim}"),
            ));
        }
        let pos = self.read::<u32>(positions, rows, Dtype::U32, "rope positions")?;
        let freq = self.read::<f32>(inv_freq, rotary_dim / 2, Dtype::F32, "rope inv_freq")?;
        let mut xs = self.read::<bf16>(x, rows * heads * head_dim, Dtype::Bf16, "rope x")?;
        let half = rotary_dim / 2;
        for r in 0..rows {
            for h in 0..heads {
                let head = &mut xs[(r * heads + h) * head_dim..(r * heads + h + 1) * head_dim];
                for (i, f) in freq.iter().enumerate() {
                    let (sin, cos) = (pos[r] as f32 * f).sin_cos();
                    let (a, b) = match style {
                        RopeStyle::Half => (i, i + half),
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (xa, xb) = (head[a].to_f32(), head[b].to_f32());
                    head[a] = bf16::from_f32(xa * cos - xb * sin);
                    head[b] = bf16::from_f32(xb * cos + xa * sin);
                }
            }
        }
        self.write_out(x, &xs, Dtype::Bf16, "rope x")
    }

    fn kv_write(
        &self,
        k_cache: DevicePtr,
        v_cache: DevicePtr,
        k: DevicePtr,
        v: DevicePtr,
        slots: DevicePtr,
        rows: usize,
        kv_heads: usize,
        head_dim: usize,
        num_slots: usize,
        _stream: u64,
    ) -> Result<(), BackendError> {
        let width = kv_heads * head_dim;
        let slots = self.read::<u32>(slots, rows, Dtype::U32, "kv_write slots")?;
        if let Some(&bad) = slots.iter().find(|&&s| s as usize >= num_slots) {
            return Err(invalid(
                "kv_write",
                format!("slot {bad} is outside the cache of {num_slots} slots"),
            ));
        }
        for (src, cache, what) in [(k, k_cache, "kv_write k"), (v, v_cache, "kv_write v")] {
            let rows_data = self.read::<bf16>(src, rows * width, Dtype::Bf16, what)?;
            let cache = self.elems(cache, num_slots * width, Dtype::Bf16, "kv_write cache")?;
            // SAFETY: checked range; the source was copied out.
            let cache = unsafe { cache.typed_mut::<bf16>() };
            for (r, &s) in slots.iter().enumerate() {
                cache[s as usize * width..(s as usize + 1) * width]
                    .copy_from_slice(&rows_data[r * width..(r + 1) * width]);
            }
        }
        Ok(())
    }

    fn paged_attention(
        &self,
        out: DevicePtr,
        q: DevicePtr,
        k_cache: DevicePtr,
        v_cache: DevicePtr,
        block_table: DevicePtr,
        row_seq: DevicePtr,
        row_ctx_len: DevicePtr,
        rows: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        max_blocks_per_seq: usize,
        scale: f32,
        _stream: u64,
    ) -> Result<(), BackendError> {
        if kv_heads == 0 || heads % kv_heads != 0 || block_size == 0 {
            return Err(invalid(
                "paged_attention",
                format!(
                    "heads {heads} must be a multiple of kv_heads {kv_heads}, block_size non-zero"
                ),
            ));
        }
        let seqs = self.read::<u32>(row_seq, rows, Dtype::U32, "paged_attention row_seq")?;
        let lens =
            self.read::<u32>(row_ctx_len, rows, Dtype::U32, "paged_attention row_ctx_len")?;
        let num_seqs = seqs.iter().map(|&s| s as usize + 1).max().unwrap_or(0);
        let table = self.read::<u32>(
            block_table,
            num_seqs * max_blocks_per_seq,
            Dtype::U32,
            "paged_attention block_table",
        )?;
        let qs = bf16_to_f32(&self.read::<bf16>(
            q,
            rows * heads * head_dim,
            Dtype::Bf16,
            "paged_attention q",
        )?);
        let width = kv_heads * head_dim;
        let max_block = table.iter().copied().max().unwrap_or(0) as usize;
        let cache_rows = (max_block + 1) * block_size;
        let kc = self.elems(
            k_cache,
            cache_rows * width,
            Dtype::Bf16,
            "paged_attention k_cache",
        )?;
        let vc = self.elems(
            v_cache,
            cache_rows * width,
            Dtype::Bf16,
            "paged_attention v_cache",
        )?;
        // SAFETY: checked ranges covering every slot the table can name; read-only.
        let (kc, vc) = unsafe { (kc.typed::<bf16>(), vc.typed::<bf16>()) };
        if let Some((r, len)) = lens
            .iter()
            .enumerate()
            .find(|(_, &l)| l as usize > max_blocks_per_seq * block_size)
        {
            return Err(invalid(
                "paged_attention",
                format!("row {r} attends to {len} rows, more than its block table holds"),
            ));
        }
        let group = heads / kv_heads;
        let mut result = vec![0f32; rows * heads * head_dim];
        result
            .par_chunks_mut(head_dim)
            .enumerate()
            .for_each(|(rh, o)| {
                let (r, h) = (rh / heads, rh % heads);
                let s = seqs[r] as usize;
                let kvh = h / group;
                let qv = &qs[rh * head_dim..(rh + 1) * head_dim];
                let n = lens[r] as usize;
                let slot = |j: usize| {
                    table[s * max_blocks_per_seq + j / block_size] as usize * block_size
                        + j % block_size
                };
                let mut scores = Vec::with_capacity(n);
                let mut kbuf = vec![0f32; head_dim];
                for j in 0..n {
                    let base = slot(j) * width + kvh * head_dim;
                    for (d, k) in kbuf.iter_mut().zip(&kc[base..base + head_dim]) {
                        *d = k.to_f32();
                    }
                    scores.push(dot(qv, &kbuf) * scale);
                }
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut total = 0.0;
                for sc in scores.iter_mut() {
                    *sc = (*sc - max).exp();
                    total += *sc;
                }
                for (j, p) in scores.iter().enumerate() {
                    let base = slot(j) * width + kvh * head_dim;
                    for (d, v) in o.iter_mut().zip(&vc[base..base + head_dim]) {
                        *d += p / total * v.to_f32();
                    }
                }
            });
        self.write_activations(out, Dtype::Bf16, &result, "paged_attention out")
    }

    fn argmax(
        &self,
        out: DevicePtr,
        logits: DevicePtr,
        bitmask: Option<DevicePtr>,
        rows: usize,
        vocab: usize,
        _stream: u64,
    ) -> Result<(), BackendError> {
        let words = vocab.div_ceil(32);
        let ls = self.elems(logits, rows * vocab, Dtype::F32, "argmax logits")?;
        // SAFETY: checked range, read-only (out is u32 and separate).
        let ls = unsafe { ls.typed::<f32>() }.to_vec();
        let mask = match bitmask {
            Some(m) => Some(self.read::<i32>(m, rows * words, Dtype::I32, "argmax bitmask")?),
            None => None,
        };
        let mut result = vec![u32::MAX; rows];
        for r in 0..rows {
            let mut best = f32::NEG_INFINITY;
            for t in 0..vocab {
                if let Some(m) = &mask {
                    if (m[r * words + t / 32] as u32 >> (t % 32)) & 1 == 0 {
                        continue;
                    }
                }
                let v = ls[r * vocab + t];
                if result[r] == u32::MAX || v > best {
                    best = v;
                    result[r] = t as u32;
                }
            }
        }
        self.write_out(out, &result, Dtype::U32, "argmax out")
    }

    fn softmax(
        &self,
        out: DevicePtr,
        logits: DevicePtr,
        rows: usize,
        vocab: usize,
        temperature: f32,
        _stream: u64,
    ) -> Result<(), BackendError> {
        if temperature.is_nan() || temperature <= 0.0 {
            return Err(invalid(
                "softmax",
                format!("temperature must be positive, got {temperature}"),
            ));
        }
        let mut ls = self.read::<f32>(logits, rows * vocab, Dtype::F32, "softmax logits")?;
        for row in ls.chunks_mut(vocab.max(1)) {
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
        self.write_out(out, &ls, Dtype::F32, "softmax out")
    }
}
