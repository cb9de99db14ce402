//! The [`Kernels`] ops of the CUDA-kernel backends: for each op, its arguments' shared
//! `validate` (the same checks, order and words as the CPU reference, because it is the same
//! code), then one launch of the matching kernel in `cuda/`.
//!
//! Invariants:
//! - Every pointer a kernel receives is a range `validate` checked against the ledger for
//!   the exact bytes the kernel touches, held until the launch returns.
//! - Data-dependent checks (token ids, slots, block tables) are made by `validate` reading
//!   those small index arrays back; a kernel never sees an index that would take it outside
//!   a buffer.
//! - The argument list of each launch matches the kernel's C signature; the emulator
//!   checks the type codes of every launch, so a drift is a test failure.
//! - An op with nothing to do checks its arguments and launches nothing.

use super::attention;
use super::launch::*;
use crate::backend::kernels::{
    ArgmaxArgs, CopyRowsArgs, ElementwiseArgs, ElementwiseOp, EmbeddingArgs, GroupedLinearArgs,
    Kernels, KvCopyArgs, KvWriteArgs, LinearArgs, LinearWeight, MlaAttentionArgs,
    PagedAttentionArgs, PickArgs, RmsNormArgs, RopeArgs, SoftmaxArgs, TopKArgs,
};
use crate::backend::{BackendError, Dtype};

/// The error for a weight format these kernels do not read: GGUF block formats reach a CUDA
/// backend as BF16 (the model loader dequantizes them at upload), and tables only as BF16.
fn unsupported_format<P>(op: &'static str, w: &LinearWeight<P>) -> BackendError {
    BackendError::InvalidArgument {
        op,
        message: format!(
            "the CUDA kernels do not read {} weights here (block formats are dequantized to bf16 at upload)",
            w.format()
        ),
    }
}

impl<L: KernelLauncher> Kernels for L {
    fn embedding(&self, args: EmbeddingArgs) -> Result<(), BackendError> {
        let op = "embedding";
        let a = args.validate(self)?.args;
        let LinearWeight::Bf16 { weight: table } = &a.table else {
            return Err(unsupported_format(op, &a.table));
        };
        let mut l = LaunchArgs::new(op);
        l.ptr(&a.out).ptr(table).ptr(&a.ids);
        l.int("rows", a.rows)?
            .int("hidden", a.hidden)?
            .int("vocab", a.vocab)?;
        if a.rows == 0 {
            return Ok(());
        }
        self.launch("sd_embedding", rows_shape(a.rows, op)?, &l.args, a.stream)
    }

    fn rms_norm(&self, args: RmsNormArgs) -> Result<(), BackendError> {
        let op = "rms_norm";
        let a = args.validate(self)?;
        let mut l = LaunchArgs::new(op);
        l.ptr(&a.out).ptr(&a.x).ptr(&a.weight);
        l.int("rows", a.rows)?.int("dim", a.dim)?.float(a.eps);
        if a.rows == 0 {
            return Ok(());
        }
        self.launch("sd_rms_norm", rows_shape(a.rows, op)?, &l.args, a.stream)
    }

    fn elementwise(&self, args: ElementwiseArgs) -> Result<(), BackendError> {
        let a = args.validate(self)?;
        let kernel = match a.op {
            ElementwiseOp::Add => "sd_add",
            ElementwiseOp::SiluMul => "sd_silu_mul",
            ElementwiseOp::SigmoidMul => "sd_sigmoid_mul",
        };
        let mut l = LaunchArgs::new(a.op.name());
        l.ptr(&a.out).ptr(&a.a).ptr(&a.b).int("n", a.n)?;
        if a.n == 0 {
            return Ok(());
        }
        self.launch(kernel, element_shape(a.n), &l.args, a.stream)
    }

    fn linear(&self, args: LinearArgs) -> Result<(), BackendError> {
        let op = "linear";
        let a = args.validate(self)?;
        // Every linear kernel's signature is (out, out_f32, x, <the format's weight
        // arguments>, bias, rows, in_features, out_features).
        let mut l = LaunchArgs::new(op);
        l.ptr(&a.out).flag(a.out_dtype == Dtype::F32).ptr(&a.x);
        let kernel = match &a.weight {
            LinearWeight::Bf16 { weight } => {
                l.ptr(weight);
                "sd_linear_bf16"
            }
            LinearWeight::Nvfp4 {
                codes,
                block_scales,
                global_scale,
            } => {
                l.ptr(codes).ptr(block_scales).float(*global_scale);
                "sd_linear_nvfp4"
            }
            LinearWeight::Fp8 {
                weight,
                block_scales,
            } => {
                l.ptr(weight).ptr(block_scales);
                "sd_linear_fp8"
            }
            w @ LinearWeight::Packed { .. } => return Err(unsupported_format(op, w)),
        };
        l.opt_ptr(a.bias.as_ref());
        l.int("rows", a.rows)?
            .int("in_features", a.in_features)?
            .int("out_features", a.out_features)?;
        if a.rows == 0 || a.out_features == 0 {
            return Ok(());
        }
        let shape = linear_shape(op, a.rows, a.out_features)?;
        self.launch(kernel, shape, &l.args, a.stream)
    }

    fn grouped_linear(&self, args: GroupedLinearArgs) -> Result<(), BackendError> {
        // No fused kernel: the shared checks, then each part as its own launch.
        args.validate(self)?;
        args.linears().try_for_each(|a| self.linear(a))
    }

    fn rope(&self, args: RopeArgs) -> Result<(), BackendError> {
        attention::rope(self, args)
    }

    fn kv_write(&self, args: KvWriteArgs) -> Result<(), BackendError> {
        attention::kv_write(self, args)
    }

    fn kv_copy(&self, args: KvCopyArgs) -> Result<(), BackendError> {
        attention::kv_copy(self, args)
    }

    fn paged_attention(&self, args: PagedAttentionArgs) -> Result<(), BackendError> {
        attention::paged_attention(self, args)
    }

    fn mla_attention(&self, args: MlaAttentionArgs) -> Result<(), BackendError> {
        attention::mla_attention(self, args)
    }

    fn argmax(&self, args: ArgmaxArgs) -> Result<(), BackendError> {
        let op = "argmax";
        let a = args.validate(self)?;
        let mut l = LaunchArgs::new(op);
        l.ptr(&a.out).ptr(&a.logits).opt_ptr(a.bitmask.as_ref());
        l.int("rows", a.rows)?.int("vocab", a.vocab)?;
        if a.rows == 0 {
            return Ok(());
        }
        self.launch("sd_argmax", rows_shape(a.rows, op)?, &l.args, a.stream)
    }

    fn pick(&self, args: PickArgs) -> Result<(), BackendError> {
        let op = "pick";
        let a = args.validate(self)?;
        let mut l = LaunchArgs::new(op);
        l.ptr(&a.out).ptr(&a.values).ptr(&a.index);
        l.int("rows", a.rows)?.int("width", a.width)?;
        if a.rows == 0 {
            return Ok(());
        }
        self.launch("sd_pick", element_shape(a.rows), &l.args, a.stream)
    }

    fn top_k(&self, args: TopKArgs) -> Result<(), BackendError> {
        let op = "top_k";
        let a = args.validate(self)?;
        let mut l = LaunchArgs::new(op);
        l.ptr(&a.ids)
            .ptr(&a.probs)
            .ptr(&a.logits)
            .opt_ptr(a.bitmask.as_ref());
        l.int("rows", a.rows)?
            .int("width", a.width)?
            .int("k", a.k)?;
        if a.rows == 0 {
            return Ok(());
        }
        self.launch("sd_top_k", rows_shape(a.rows, op)?, &l.args, a.stream)
    }

    fn softmax(&self, args: SoftmaxArgs) -> Result<(), BackendError> {
        let op = "softmax";
        let a = args.validate(self)?;
        let mut l = LaunchArgs::new(op);
        l.ptr(&a.out).ptr(&a.logits);
        l.int("rows", a.rows)?
            .int("vocab", a.vocab)?
            .float(a.temperature);
        if a.rows == 0 || a.vocab == 0 {
            return Ok(());
        }
        self.launch("sd_softmax", rows_shape(a.rows, op)?, &l.args, a.stream)
    }

    fn copy_rows(&self, args: CopyRowsArgs) -> Result<(), BackendError> {
        let op = "copy_rows";
        let a = args.validate(self)?;
        let mut l = LaunchArgs::new(op);
        l.ptr(&a.dst).ptr(&a.src);
        l.int("rows", a.rows)?
            .int("width", a.width)?
            .int("dst_stride", a.dst_stride)?
            .int("src_stride", a.src_stride)?;
        if a.rows == 0 || a.width == 0 {
            return Ok(());
        }
        self.launch("sd_copy_rows", rows_shape(a.rows, op)?, &l.args, a.stream)
    }
}
