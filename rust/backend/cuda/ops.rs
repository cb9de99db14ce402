//! The [`Kernels`] ops of the CUDA-kernel backends: for each op, the CPU reference's
//! checks, then one launch of the matching kernel in `cuda/`.
//!
//! Invariants:
//! - Every pointer is checked against the backend's ledger for the exact byte range the
//!   kernel touches before anything is launched; the checks, their order and their `what`
//!   strings are the CPU reference's, so both backends reject the same arguments with the
//!   same words.
//! - Data-dependent checks the reference makes (token ids, slots, block tables) are made
//!   here too, by reading those small index arrays back; a kernel never sees an index that
//!   would take it outside a buffer.
//! - The argument list of each launch matches the kernel's C signature; the emulator
//!   checks the type codes of every launch, so a drift is a test failure.
//! - An op with nothing to do checks its arguments and launches nothing.

use super::attention;
use super::launch::*;
use crate::backend::kernels::{Kernels, RopeStyle};
use crate::backend::{BackendError, DevicePtr, Dtype};

impl<L: KernelLauncher> Kernels for L {
    fn embedding(
        &self,
        out: DevicePtr,
        table: DevicePtr,
        ids: DevicePtr,
        rows: usize,
        hidden: usize,
        vocab: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        let op = "embedding";
        let id_values = read_u32(self, ids, rows, "embedding ids", stream)?;
        if let Some(&bad) = id_values.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid(
                op,
                format!("token id {bad} is outside the vocabulary of {vocab}"),
            ));
        }
        check_in_order(
            self,
            op,
            &[
                (
                    table,
                    count(op, &[vocab, hidden])?,
                    Dtype::Bf16,
                    "embedding table",
                ),
                (
                    out,
                    count(op, &[rows, hidden])?,
                    Dtype::Bf16,
                    "embedding out",
                ),
            ],
        )?;
        let mut a = Args::new(self, op);
        a.ptr(
            out,
            count(op, &[rows, hidden])?,
            Dtype::Bf16,
            "embedding out",
        )?;
        a.ptr(
            table,
            count(op, &[vocab, hidden])?,
            Dtype::Bf16,
            "embedding table",
        )?;
        a.ptr(ids, rows, Dtype::U32, "embedding ids")?;
        a.int("rows", rows)?;
        a.int("hidden", hidden)?;
        a.int("vocab", vocab)?;
        if rows == 0 {
            return Ok(());
        }
        a.launch("sd_embedding", rows_shape(rows, op)?, stream)
    }

    fn rms_norm(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        weight: DevicePtr,
        rows: usize,
        dim: usize,
        eps: f32,
        stream: u64,
    ) -> Result<(), BackendError> {
        let op = "rms_norm";
        check_in_order(
            self,
            op,
            &[
                (x, count(op, &[rows, dim])?, Dtype::Bf16, "rms_norm x"),
                (weight, dim, Dtype::Bf16, "rms_norm weight"),
                (out, count(op, &[rows, dim])?, Dtype::Bf16, "rms_norm out"),
            ],
        )?;
        let mut a = Args::new(self, op);
        a.ptr(out, count(op, &[rows, dim])?, Dtype::Bf16, "rms_norm out")?;
        a.ptr(x, count(op, &[rows, dim])?, Dtype::Bf16, "rms_norm x")?;
        a.ptr(weight, dim, Dtype::Bf16, "rms_norm weight")?;
        a.int("rows", rows)?;
        a.int("dim", dim)?;
        a.float(eps);
        if rows == 0 {
            return Ok(());
        }
        a.launch("sd_rms_norm", rows_shape(rows, op)?, stream)
    }

    fn add(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        y: DevicePtr,
        n: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        binary_elementwise(self, ("add", "sd_add"), out, (x, "a"), (y, "b"), n, stream)
    }

    fn silu_mul(
        &self,
        out: DevicePtr,
        gate: DevicePtr,
        up: DevicePtr,
        n: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        binary_elementwise(
            self,
            ("silu_mul", "sd_silu_mul"),
            out,
            (gate, "gate"),
            (up, "up"),
            n,
            stream,
        )
    }

    fn sigmoid_mul(
        &self,
        out: DevicePtr,
        gate: DevicePtr,
        x: DevicePtr,
        n: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        binary_elementwise(
            self,
            ("sigmoid_mul", "sd_sigmoid_mul"),
            out,
            (gate, "gate"),
            (x, "x"),
            n,
            stream,
        )
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
        stream: u64,
    ) -> Result<(), BackendError> {
        let op = "linear";
        let out_f32 = out_dtype_ok(op, out_dtype)?;
        check_in_order(
            self,
            op,
            &[
                (
                    weight,
                    count(op, &[out_features, in_features])?,
                    Dtype::Bf16,
                    "linear weight",
                ),
                (x, count(op, &[rows, in_features])?, Dtype::Bf16, "linear x"),
            ],
        )?;
        if let Some(bias) = bias {
            check_in_order(
                self,
                op,
                &[(bias, out_features, Dtype::Bf16, "linear bias")],
            )?;
        }
        let mut a = Args::new(self, op);
        a.ptr(
            out,
            count(op, &[rows, out_features])?,
            out_dtype,
            "linear out",
        )?;
        a.args.push(Arg::I32(out_f32));
        a.ptr(x, count(op, &[rows, in_features])?, Dtype::Bf16, "linear x")?;
        a.ptr(
            weight,
            count(op, &[out_features, in_features])?,
            Dtype::Bf16,
            "linear weight",
        )?;
        a.opt_ptr(bias, out_features, Dtype::Bf16, "linear bias")?;
        a.int("rows", rows)?;
        a.int("in_features", in_features)?;
        a.int("out_features", out_features)?;
        if rows == 0 || out_features == 0 {
            return Ok(());
        }
        a.launch(
            "sd_linear_bf16",
            linear_shape(op, rows, out_features)?,
            stream,
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
        stream: u64,
    ) -> Result<(), BackendError> {
        let op = "linear_nvfp4";
        if in_features % 16 != 0 {
            return Err(invalid(
                op,
                format!("in_features {in_features} is not a multiple of 16"),
            ));
        }
        let out_f32 = out_dtype_ok(op, out_dtype)?;
        check_in_order(
            self,
            op,
            &[
                (
                    weight,
                    count(op, &[out_features, in_features / 2])?,
                    Dtype::U8,
                    "linear_nvfp4 weight",
                ),
                (
                    weight_scale,
                    count(op, &[out_features, in_features / 16])?,
                    Dtype::U8,
                    "linear_nvfp4 weight_scale",
                ),
                (x, count(op, &[rows, in_features])?, Dtype::Bf16, "linear x"),
            ],
        )?;
        let mut a = Args::new(self, op);
        a.ptr(
            out,
            count(op, &[rows, out_features])?,
            out_dtype,
            "linear_nvfp4 out",
        )?;
        a.args.push(Arg::I32(out_f32));
        a.ptr(x, count(op, &[rows, in_features])?, Dtype::Bf16, "linear x")?;
        a.ptr(
            weight,
            count(op, &[out_features, in_features / 2])?,
            Dtype::U8,
            "linear_nvfp4 weight",
        )?;
        a.ptr(
            weight_scale,
            count(op, &[out_features, in_features / 16])?,
            Dtype::U8,
            "linear_nvfp4 weight_scale",
        )?;
        a.float(global_scale);
        a.int("rows", rows)?;
        a.int("in_features", in_features)?;
        a.int("out_features", out_features)?;
        if rows == 0 || out_features == 0 {
            return Ok(());
        }
        a.launch(
            "sd_linear_nvfp4",
            linear_shape(op, rows, out_features)?,
            stream,
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
        stream: u64,
    ) -> Result<(), BackendError> {
        attention::rope(
            self, x, positions, inv_freq, rows, heads, head_dim, rotary_dim, style, stream,
        )
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
        stream: u64,
    ) -> Result<(), BackendError> {
        attention::kv_write(
            self, k_cache, v_cache, k, v, slots, rows, kv_heads, head_dim, num_slots, stream,
        )
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
        stream: u64,
    ) -> Result<(), BackendError> {
        attention::paged_attention(
            self,
            out,
            q,
            k_cache,
            v_cache,
            block_table,
            row_seq,
            row_ctx_len,
            rows,
            heads,
            kv_heads,
            head_dim,
            block_size,
            max_blocks_per_seq,
            scale,
            stream,
        )
    }

    fn argmax(
        &self,
        out: DevicePtr,
        logits: DevicePtr,
        bitmask: Option<DevicePtr>,
        rows: usize,
        vocab: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        let op = "argmax";
        let words = vocab.div_ceil(32);
        check_in_order(
            self,
            op,
            &[(
                logits,
                count(op, &[rows, vocab])?,
                Dtype::F32,
                "argmax logits",
            )],
        )?;
        if let Some(mask) = bitmask {
            check_in_order(
                self,
                op,
                &[(
                    mask,
                    count(op, &[rows, words])?,
                    Dtype::I32,
                    "argmax bitmask",
                )],
            )?;
        }
        let mut a = Args::new(self, op);
        a.ptr(out, rows, Dtype::U32, "argmax out")?;
        a.ptr(
            logits,
            count(op, &[rows, vocab])?,
            Dtype::F32,
            "argmax logits",
        )?;
        a.opt_ptr(
            bitmask,
            count(op, &[rows, words])?,
            Dtype::I32,
            "argmax bitmask",
        )?;
        a.int("rows", rows)?;
        a.int("vocab", vocab)?;
        if rows == 0 {
            return Ok(());
        }
        a.launch("sd_argmax", rows_shape(rows, op)?, stream)
    }

    fn softmax(
        &self,
        out: DevicePtr,
        logits: DevicePtr,
        rows: usize,
        vocab: usize,
        temperature: f32,
        stream: u64,
    ) -> Result<(), BackendError> {
        let op = "softmax";
        if temperature.is_nan() || temperature <= 0.0 {
            return Err(invalid(
                op,
                format!("temperature must be positive, got {temperature}"),
            ));
        }
        check_in_order(
            self,
            op,
            &[(
                logits,
                count(op, &[rows, vocab])?,
                Dtype::F32,
                "softmax logits",
            )],
        )?;
        let mut a = Args::new(self, op);
        a.ptr(out, count(op, &[rows, vocab])?, Dtype::F32, "softmax out")?;
        a.ptr(
            logits,
            count(op, &[rows, vocab])?,
            Dtype::F32,
            "softmax logits",
        )?;
        a.int("rows", rows)?;
        a.int("vocab", vocab)?;
        a.float(temperature);
        if rows == 0 || vocab == 0 {
            return Ok(());
        }
        a.launch("sd_softmax", rows_shape(rows, op)?, stream)
    }
}

/// The shared body of the element-wise ops `out = f(a, b)` over `n` BF16 values: the
/// reference's checks (inputs in order, then the output), then one launch of `kernel`.
fn binary_elementwise<L: KernelLauncher>(
    launcher: &L,
    (op, kernel): (&'static str, &'static str),
    out: DevicePtr,
    (a, a_name): (DevicePtr, &str),
    (b, b_name): (DevicePtr, &str),
    n: usize,
    stream: u64,
) -> Result<(), BackendError> {
    let (a_what, b_what, out_what) = (
        format!("{op} {a_name}"),
        format!("{op} {b_name}"),
        format!("{op} out"),
    );
    check_in_order(
        launcher,
        op,
        &[
            (a, n, Dtype::Bf16, &a_what),
            (b, n, Dtype::Bf16, &b_what),
            (out, n, Dtype::Bf16, &out_what),
        ],
    )?;
    let mut args = Args::new(launcher, op);
    args.ptr(out, n, Dtype::Bf16, &out_what)?;
    args.ptr(a, n, Dtype::Bf16, &a_what)?;
    args.ptr(b, n, Dtype::Bf16, &b_what)?;
    args.int("n", n)?;
    if n == 0 {
        return Ok(());
    }
    args.launch(kernel, element_shape(n), stream)
}
