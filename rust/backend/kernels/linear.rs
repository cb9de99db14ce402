//! Arguments of `linear`, the one matrix product, and [`LinearWeight`], the descriptor of
//! its weight in whatever format it is stored.
//!
//! A weight format is one variant of [`LinearWeight`] (its buffers and scalars), one arm of
//! [`LinearWeight::validate`] (its shape rules and the bytes it reads), and one kernel per
//! backend. Everything else about `linear` (the input, bias, output dtype, aliasing) is
//! checked once here for every format.

use super::check::{apart, count, invalid, CheckedMemory, Operand};
use crate::backend::quant::BlockFormat;
use crate::backend::{BackendError, DevicePtr, Dtype};

/// Columns of an NVFP4 weight that share one FP8 block scale.
pub const NVFP4_BLOCK: usize = 16;
/// Rows and columns of an FP8 weight that share one scale (DeepSeek-V3's
/// `weight_block_size = [128, 128]`).
pub const FP8_BLOCK: usize = 128;

/// A linear layer's weight, `[out_features, in_features]` logically, in its stored format.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LinearWeight<P = DevicePtr> {
    /// BF16, row-major.
    Bf16 {
        /// BF16 `[out_features, in_features]`.
        weight: P,
    },
    /// NVFP4 in NVIDIA ModelOpt's layout (W4A16: activations stay BF16): `codes` u8
    /// `[out_features, in_features / 2]` (two E2M1 codes a byte, low nibble first),
    /// `block_scales` FP8 E4M3 `[out_features, in_features / 16]`, and the tensor-wide
    /// `global_scale`: `W[o, c] = e2m1 * fp8(block_scales[o, c / 16]) * global_scale`.
    /// `in_features` must be a multiple of 16.
    Nvfp4 {
        /// u8 `[out_features, in_features / 2]`: two E2M1 codes a byte, low nibble first.
        codes: P,
        /// FP8 E4M3 `[out_features, in_features / 16]`.
        block_scales: P,
        /// Tensor-wide multiplier of every element.
        global_scale: f32,
    },
    /// FP8 E4M3 (`float8_e4m3fn`, W8A16) in the block-scaled layout of DeepSeek-V3's FP8
    /// checkpoints: `weight` one E4M3 byte per element `[out_features, in_features]`, and
    /// `block_scales` f32 `[ceil(out_features / 128), ceil(in_features / 128)]` (the
    /// checkpoint's `weight_scale_inv`, a multiplier despite its name):
    /// `W[o, c] = e4m3(weight[o, c]) * block_scales[o / 128, c / 128]`. A per-tensor scale is
    /// the same value in every block.
    Fp8 {
        /// E4M3 `[out_features, in_features]`, one byte per element.
        weight: P,
        /// f32 `[ceil(out_features / 128), ceil(in_features / 128)]`: each 128x128 block's multiplier.
        block_scales: P,
    },
    /// A GGUF block format ([`BlockFormat`]: Q4_0 .. Q8_0, the K-quants, or F32/F16/BF16),
    /// `blocks` holding the matrix repacked for the CPU kernels
    /// ([`crate::backend::quant::PackedWeight::bytes`]): exactly as many bytes as the file's
    /// rows of blocks. The shape it was packed for travels with it and must be the op's.
    /// Backends without block kernels (CUDA) are given BF16 instead at upload.
    Packed {
        /// The repacked blocks, `format.matrix_bytes(out_features, in_features)` bytes.
        blocks: P,
        /// The GGUF block format of the rows.
        format: BlockFormat,
        /// Rows of the matrix it was packed as.
        out_features: usize,
        /// Columns of the matrix it was packed as.
        in_features: usize,
    },
}

/// The buffers one weight format reads, for the aliasing check (at most two so far; a
/// format with more raises the bound).
pub(super) type WeightOperands = [Option<Operand<'static>>; 2];

impl LinearWeight {
    /// The format's shape rules, then the ledger check of each buffer it reads (in the
    /// order listed in the variant). Returns the checked weight and the operands it reads,
    /// for the aliasing check.
    pub(super) fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
        op: &'static str,
        out_features: usize,
        in_features: usize,
    ) -> Result<(LinearWeight<M::Range>, WeightOperands), BackendError> {
        // Operand names in messages: the weight of a `linear`, the table of an `embedding`.
        let name = |part: usize| -> &'static str {
            let table = op == "embedding";
            match (table, part) {
                (false, 0) => "linear weight",
                (false, 1) => "linear nvfp4 codes",
                (false, 2) => "linear nvfp4 block_scales",
                (false, _) => "linear packed blocks",
                (true, 0) => "embedding table",
                (true, 1) => "embedding table nvfp4 codes",
                (true, 2) => "embedding table nvfp4 block_scales",
                (true, _) => "embedding table packed blocks",
            }
        };
        match self {
            LinearWeight::Bf16 { weight } => {
                let n = count(op, &[out_features, in_features])?;
                let w = Operand::new(op, weight, n, Dtype::Bf16, name(0))?;
                let checked = LinearWeight::Bf16 {
                    weight: w.check(mem)?,
                };
                Ok((checked, [Some(w), None]))
            }
            LinearWeight::Nvfp4 {
                codes,
                block_scales,
                global_scale,
            } => {
                if !in_features.is_multiple_of(NVFP4_BLOCK) {
                    return Err(invalid(
                        op,
                        format!(
                            "an nvfp4 weight needs in_features a multiple of {NVFP4_BLOCK}, got {in_features}"
                        ),
                    ));
                }
                let n = count(op, &[out_features, in_features / 2])?;
                let c = Operand::new(op, codes, n, Dtype::U8, name(1))?;
                let n = count(op, &[out_features, in_features / NVFP4_BLOCK])?;
                let s = Operand::new(op, block_scales, n, Dtype::U8, name(2))?;
                let checked = LinearWeight::Nvfp4 {
                    codes: c.check(mem)?,
                    block_scales: s.check(mem)?,
                    global_scale,
                };
                Ok((checked, [Some(c), Some(s)]))
            }
            LinearWeight::Fp8 {
                weight,
                block_scales,
            } => {
                let n = count(op, &[out_features, in_features])?;
                let w = Operand::new(op, weight, n, Dtype::F8E4M3, "linear fp8 weight")?;
                let grid = [
                    out_features.div_ceil(FP8_BLOCK),
                    in_features.div_ceil(FP8_BLOCK),
                ];
                let s = Operand::new(
                    op,
                    block_scales,
                    count(op, &grid)?,
                    Dtype::F32,
                    "linear fp8 block_scales",
                )?;
                let checked = LinearWeight::Fp8 {
                    weight: w.check(mem)?,
                    block_scales: s.check(mem)?,
                };
                Ok((checked, [Some(w), Some(s)]))
            }
            LinearWeight::Packed {
                blocks,
                format,
                out_features: packed_out,
                in_features: packed_in,
            } => {
                if (packed_out, packed_in) != (out_features, in_features) {
                    return Err(invalid(
                        op,
                        format!(
                            "a {format} weight packed as [{packed_out}, {packed_in}] used as [{out_features}, {in_features}]"
                        ),
                    ));
                }
                let n = format
                    .matrix_bytes(out_features, in_features)
                    .map_err(|e| invalid(op, format!("a {format} weight: {e}")))?;
                let b = Operand::new(op, blocks, n, Dtype::U8, name(3))?;
                let checked = LinearWeight::Packed {
                    blocks: b.check(mem)?,
                    format,
                    out_features,
                    in_features,
                };
                Ok((checked, [Some(b), None]))
            }
        }
    }
}

impl<P> LinearWeight<P> {
    /// The format's name in messages and bindings (`"bf16"`, `"nvfp4"`, `"fp8"`,
    /// `"q4_1"`, ...).
    pub fn format(&self) -> &'static str {
        match self {
            LinearWeight::Bf16 { .. } => "bf16",
            LinearWeight::Nvfp4 { .. } => "nvfp4",
            LinearWeight::Fp8 { .. } => "fp8",
            LinearWeight::Packed { format, .. } => format.name(),
        }
    }
}

/// `out = x @ weight^T (+ bias)`: `x` BF16 `[rows, in_features]`, `weight` any
/// [`LinearWeight`] format, `bias` BF16 `[out_features]` (added in f32 before the output is
/// rounded), `out` `[rows, out_features]` of `out_dtype` (`Bf16` or `F32`). `out` is apart
/// from every input.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearArgs<P = DevicePtr> {
    /// `[rows, out_features]` of `out_dtype`.
    pub out: P,
    /// Element type of `out` (`Bf16` or `F32`).
    pub out_dtype: Dtype,
    /// BF16 `[rows, in_features]`: the input rows.
    pub x: P,
    /// The weight, in its stored format.
    pub weight: LinearWeight<P>,
    /// BF16 `[out_features]`, or `None` for no bias.
    pub bias: Option<P>,
    /// Input rows.
    pub rows: usize,
    /// Elements per input row.
    pub in_features: usize,
    /// Elements per output row.
    pub out_features: usize,
    /// The stream the op is queued on.
    pub stream: u64,
}

impl LinearArgs {
    /// The checks every backend makes before it runs the op.
    pub fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<LinearArgs<M::Range>, BackendError> {
        let checked = GroupedLinearArgs::from(self).validate_as(mem, "linear")?;
        let [Some(part), ..] = checked.parts else {
            unreachable!("a linear is a group of one part")
        };
        Ok(LinearArgs {
            out: part.out,
            out_dtype: checked.out_dtype,
            x: checked.x,
            weight: part.weight,
            bias: part.bias,
            rows: checked.rows,
            in_features: checked.in_features,
            out_features: part.out_features,
            stream: checked.stream,
        })
    }

    /// The checks, as a group of one part (what the CPU backend runs).
    pub fn validate_group<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<GroupedLinearArgs<M::Range>, BackendError> {
        GroupedLinearArgs::from(self).validate_as(mem, "linear")
    }
}

/// Most linears one [`GroupedLinearArgs`] holds (q, k and v).
pub const MAX_LINEAR_PARTS: usize = 3;

/// One linear of a [`GroupedLinearArgs`]: its weight, bias and output.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearPart<P = DevicePtr> {
    /// `[rows, out_features]` of the group's `out_dtype`.
    pub out: P,
    /// The weight `[out_features, in_features]`, in its stored format.
    pub weight: LinearWeight<P>,
    /// BF16 `[out_features]`, or `None` for no bias.
    pub bias: Option<P>,
    /// Elements per output row of this part.
    pub out_features: usize,
}

/// Several linears over the same input rows (a layer's q, k and v projections; an MLP's gate
/// and up): part `i` computes exactly what one `linear` with its weight, bias and output
/// would, bit for bit. A backend may quantize the input once and spread all the parts'
/// output features over its threads at once. Every output is apart from every input and
/// from the other outputs. Parts are filled from the front (`parts[0]` is present; a `None`
/// ends the list).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupedLinearArgs<P = DevicePtr> {
    /// BF16 `[rows, in_features]`: the input rows every part reads.
    pub x: P,
    /// The linears, from the front.
    pub parts: [Option<LinearPart<P>>; MAX_LINEAR_PARTS],
    /// Element type of every output (`Bf16` or `F32`).
    pub out_dtype: Dtype,
    /// Input rows.
    pub rows: usize,
    /// Elements per input row.
    pub in_features: usize,
    /// The stream the op is queued on.
    pub stream: u64,
}

impl<P> From<LinearArgs<P>> for GroupedLinearArgs<P> {
    fn from(a: LinearArgs<P>) -> Self {
        let part = LinearPart {
            out: a.out,
            weight: a.weight,
            bias: a.bias,
            out_features: a.out_features,
        };
        GroupedLinearArgs {
            x: a.x,
            parts: [Some(part), None, None],
            out_dtype: a.out_dtype,
            rows: a.rows,
            in_features: a.in_features,
            stream: a.stream,
        }
    }
}

/// Names of each part's operands in messages (the first part's are a plain linear's).
const PART_NAMES: [[&str; 2]; MAX_LINEAR_PARTS] = [
    ["linear bias", "linear out"],
    ["linear part 1 bias", "linear part 1 out"],
    ["linear part 2 bias", "linear part 2 out"],
];

impl<P> GroupedLinearArgs<P> {
    /// The present parts, in order.
    pub fn present(&self) -> impl Iterator<Item = &LinearPart<P>> + '_ {
        self.parts.iter().map_while(Option::as_ref)
    }
}

impl GroupedLinearArgs {
    /// Each part as a single linear (the same result, bit for bit), in order.
    pub fn linears(&self) -> impl Iterator<Item = LinearArgs> + '_ {
        self.present().map(|&p| LinearArgs {
            out: p.out,
            out_dtype: self.out_dtype,
            x: self.x,
            weight: p.weight,
            bias: p.bias,
            rows: self.rows,
            in_features: self.in_features,
            out_features: p.out_features,
            stream: self.stream,
        })
    }

    /// The checks every backend makes before it runs the op.
    pub fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<GroupedLinearArgs<M::Range>, BackendError> {
        self.validate_as(mem, "grouped_linear")
    }

    /// The checks, in the fixed order: the output dtype and the parts' list, then per part
    /// its weight, the input (after the first weight), its bias and its output, then every
    /// output apart from every input and from the other outputs.
    fn validate_as<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
        op: &'static str,
    ) -> Result<GroupedLinearArgs<M::Range>, BackendError> {
        if !matches!(self.out_dtype, Dtype::Bf16 | Dtype::F32) {
            return Err(invalid(
                op,
                format!(
                    "out_dtype must be bf16 or f32, not {}",
                    self.out_dtype.name()
                ),
            ));
        }
        let n = self.present().count();
        if n == 0 || self.parts[n..].iter().any(Option::is_some) {
            return Err(invalid(
                op,
                "parts must be filled from the front, the first one present".into(),
            ));
        }
        let (rows, inf) = (self.rows, self.in_features);
        // Fixed-size lists: the hot path validates every call, so it does not allocate.
        let mut reads = OperandList::<{ 3 * MAX_LINEAR_PARTS + 1 }>::new();
        let mut outs = OperandList::<MAX_LINEAR_PARTS>::new();
        let mut x_range = None;
        let mut parts: [Option<LinearPart<M::Range>>; MAX_LINEAR_PARTS] = [None, None, None];
        for (i, &part) in self.present().enumerate() {
            let [bias_name, out_name] = PART_NAMES[i];
            let outf = part.out_features;
            let (weight, weight_read) = part.weight.validate(mem, op, outf, inf)?;
            weight_read
                .into_iter()
                .flatten()
                .for_each(|w| reads.push(w));
            if x_range.is_none() {
                let x = Operand::new(
                    op,
                    self.x,
                    count(op, &[rows, inf])?,
                    Dtype::Bf16,
                    "linear x",
                )?;
                x_range = Some(x.check(mem)?);
                reads.push(x);
            }
            let bias = part
                .bias
                .map(|b| Operand::new(op, b, outf, Dtype::Bf16, bias_name))
                .transpose()?;
            let bias_range = bias.map(|b| b.check(mem)).transpose()?;
            bias.into_iter().for_each(|b| reads.push(b));
            let out = Operand::new(
                op,
                part.out,
                count(op, &[rows, outf])?,
                self.out_dtype,
                out_name,
            )?;
            parts[i] = Some(LinearPart {
                out: out.check(mem)?,
                weight,
                bias: bias_range,
                out_features: outf,
            });
            outs.push(out);
        }
        for (i, out) in outs.iter().enumerate() {
            for input in reads.iter() {
                apart(op, out, input)?;
            }
            for other in outs.iter().take(i) {
                apart(op, out, other)?;
            }
        }
        Ok(GroupedLinearArgs {
            x: x_range.expect("the first part checked the input"),
            parts,
            out_dtype: self.out_dtype,
            rows,
            in_features: inf,
            stream: self.stream,
        })
    }
}

/// Up to `N` operands, in the order pushed.
struct OperandList<const N: usize> {
    items: [Option<Operand<'static>>; N],
    len: usize,
}

impl<const N: usize> OperandList<N> {
    fn new() -> Self {
        OperandList {
            items: [None; N],
            len: 0,
        }
    }

    fn push(&mut self, o: Operand<'static>) {
        self.items[self.len] = Some(o);
        self.len += 1;
    }

    fn iter(&self) -> impl Iterator<Item = Operand<'static>> + '_ {
        self.items[..self.len].iter().flatten().copied()
    }
}
