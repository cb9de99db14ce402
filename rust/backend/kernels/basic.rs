//! Arguments of the row and element ops: embedding, RMSNorm, the element-wise binary ops,
//! argmax and softmax, each with its one `validate` (see the module docs of `kernels`).

use super::check::{apart, count, invalid, same_or_apart, CheckedMemory, Operand};
use super::LinearWeight;
use crate::backend::{BackendError, DevicePtr, Dtype};

/// `out[r, :] = table[ids[r], :]`, each row decoded from the table's format and rounded to
/// BF16. `out` BF16 `[rows, hidden]`, `table` a `[vocab, hidden]` [`LinearWeight`], `ids` u32
/// `[rows]`; an id `>= vocab` is an error. `out` is apart from every input.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EmbeddingArgs<P = DevicePtr> {
    /// BF16 `[rows, hidden]`: the looked-up rows.
    pub out: P,
    /// The `[vocab, hidden]` table in any weight format (a tied LM head's descriptor).
    pub table: LinearWeight<P>,
    /// u32 `[rows]`: the token ids.
    pub ids: P,
    /// Tokens to look up.
    pub rows: usize,
    /// Elements per embedding row.
    pub hidden: usize,
    /// Rows in `table` (ids must be below it).
    pub vocab: usize,
    /// The stream the op is queued on.
    pub stream: u64,
}

/// A validated [`EmbeddingArgs`] and the token ids it read.
pub struct CheckedEmbedding<R> {
    /// The arguments, with pointers resolved.
    pub args: EmbeddingArgs<R>,
    /// The token ids, read from the device.
    pub ids: Vec<u32>,
}

impl EmbeddingArgs {
    /// The checks every backend makes before it runs the op.
    pub fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<CheckedEmbedding<M::Range>, BackendError> {
        let op = "embedding";
        let ids = Operand::new(op, self.ids, self.rows, Dtype::U32, "embedding ids")?;
        let ids_range = ids.check(mem)?;
        let values = mem.read_u32(&ids_range, self.ids, self.rows, self.stream)?;
        if let Some(&bad) = values.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(invalid(
                op,
                format!("token id {bad} is outside the vocabulary of {}", self.vocab),
            ));
        }
        let (table, table_read) = self.table.validate(mem, op, self.vocab, self.hidden)?;
        let out = Operand::new(
            op,
            self.out,
            count(op, &[self.rows, self.hidden])?,
            Dtype::Bf16,
            "embedding out",
        )?;
        let args = EmbeddingArgs {
            table,
            out: out.check(mem)?,
            ids: ids_range,
            rows: self.rows,
            hidden: self.hidden,
            vocab: self.vocab,
            stream: self.stream,
        };
        for read in table_read.into_iter().flatten() {
            apart(op, out, read)?;
        }
        apart(op, out, ids)?;
        Ok(CheckedEmbedding { args, ids: values })
    }
}

/// RMSNorm of each row: `out = x / sqrt(mean(x^2) + eps) * weight`. `x`, `out` BF16
/// `[rows, dim]`, `weight` BF16 `[dim]`. `out` may be `x` itself.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNormArgs<P = DevicePtr> {
    /// BF16 `[rows, dim]`: the normalized rows (may be `x`).
    pub out: P,
    /// BF16 `[rows, dim]`: the input rows.
    pub x: P,
    /// BF16 `[dim]`: the per-element gain.
    pub weight: P,
    /// Rows to normalize.
    pub rows: usize,
    /// Elements per row.
    pub dim: usize,
    /// Added to the mean square before the square root.
    pub eps: f32,
    /// The stream the op is queued on.
    pub stream: u64,
}

impl RmsNormArgs {
    /// The checks every backend makes before it runs the op.
    pub fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<RmsNormArgs<M::Range>, BackendError> {
        let op = "rms_norm";
        let n = count(op, &[self.rows, self.dim])?;
        let x = Operand::new(op, self.x, n, Dtype::Bf16, "rms_norm x")?;
        let weight = Operand::new(op, self.weight, self.dim, Dtype::Bf16, "rms_norm weight")?;
        let out = Operand::new(op, self.out, n, Dtype::Bf16, "rms_norm out")?;
        let args = RmsNormArgs {
            x: x.check(mem)?,
            weight: weight.check(mem)?,
            out: out.check(mem)?,
            rows: self.rows,
            dim: self.dim,
            eps: self.eps,
            stream: self.stream,
        };
        same_or_apart(op, out, x)?;
        apart(op, out, weight)?;
        Ok(args)
    }
}

/// The element-wise binary ops, `out = f(a, b)` over BF16 values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementwiseOp {
    /// `out = a + b`.
    Add,
    /// `out = silu(a) * b` (`a` the MLP's gate, `b` its up projection).
    SiluMul,
    /// `out = sigmoid(a) * b` (`a` the gate, `b` the attention output of Qwen3-Next's
    /// gated attention).
    SigmoidMul,
}

impl ElementwiseOp {
    /// The op's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            ElementwiseOp::Add => "add",
            ElementwiseOp::SiluMul => "silu_mul",
            ElementwiseOp::SigmoidMul => "sigmoid_mul",
        }
    }

    /// Names of `a`, `b` and `out` in messages.
    fn operand_names(self) -> [&'static str; 3] {
        match self {
            ElementwiseOp::Add => ["add a", "add b", "add out"],
            ElementwiseOp::SiluMul => ["silu_mul gate", "silu_mul up", "silu_mul out"],
            ElementwiseOp::SigmoidMul => ["sigmoid_mul gate", "sigmoid_mul x", "sigmoid_mul out"],
        }
    }
}

/// `out = op(a, b)`, BF16 `[n]` each. `out` may be `a` or `b` itself.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ElementwiseArgs<P = DevicePtr> {
    /// Which function of `a` and `b` is computed.
    pub op: ElementwiseOp,
    /// BF16 `[n]`: the result (may be `a` or `b`).
    pub out: P,
    /// BF16 `[n]`: the first operand.
    pub a: P,
    /// BF16 `[n]`: the second operand.
    pub b: P,
    /// Elements in each buffer.
    pub n: usize,
    /// The stream the op is queued on.
    pub stream: u64,
}

impl ElementwiseArgs {
    /// The checks every backend makes before it runs the op.
    pub fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<ElementwiseArgs<M::Range>, BackendError> {
        let op = self.op.name();
        let [a_what, b_what, out_what] = self.op.operand_names();
        let a = Operand::new(op, self.a, self.n, Dtype::Bf16, a_what)?;
        let b = Operand::new(op, self.b, self.n, Dtype::Bf16, b_what)?;
        let out = Operand::new(op, self.out, self.n, Dtype::Bf16, out_what)?;
        let args = ElementwiseArgs {
            op: self.op,
            a: a.check(mem)?,
            b: b.check(mem)?,
            out: out.check(mem)?,
            n: self.n,
            stream: self.stream,
        };
        same_or_apart(op, out, a)?;
        same_or_apart(op, out, b)?;
        Ok(args)
    }
}

/// Index of the largest logit of each row (ties: the lowest index; NaN never counts), each
/// row's [`crate::backend::argmax`]. `logits` f32 `[rows, vocab]`, `out` u32 `[rows]`. With
/// `bitmask` (i32 `[rows, ceil(vocab / 32)]`, token t allowed when bit t % 32 of word t / 32
/// is set) only allowed tokens count; a row with none allowed (or only NaN) gets `u32::MAX`.
/// `out` is apart from the inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ArgmaxArgs<P = DevicePtr> {
    /// u32 `[rows]`: the chosen token of each row.
    pub out: P,
    /// f32 `[rows, vocab]`.
    pub logits: P,
    /// i32 `[rows, ceil(vocab / 32)]`: the allowed tokens, or `None` for all.
    pub bitmask: Option<P>,
    /// Rows of logits.
    pub rows: usize,
    /// Logits per row.
    pub vocab: usize,
    /// The stream the op is queued on.
    pub stream: u64,
}

impl ArgmaxArgs {
    /// The checks every backend makes before it runs the op.
    pub fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<ArgmaxArgs<M::Range>, BackendError> {
        let op = "argmax";
        let logits = Operand::new(
            op,
            self.logits,
            count(op, &[self.rows, self.vocab])?,
            Dtype::F32,
            "argmax logits",
        )?;
        let words = count(op, &[self.rows, self.vocab.div_ceil(32)])?;
        let bitmask = self
            .bitmask
            .map(|m| Operand::new(op, m, words, Dtype::I32, "argmax bitmask"))
            .transpose()?;
        let out = Operand::new(op, self.out, self.rows, Dtype::U32, "argmax out")?;
        let args = ArgmaxArgs {
            logits: logits.check(mem)?,
            bitmask: bitmask.map(|m| m.check(mem)).transpose()?,
            out: out.check(mem)?,
            rows: self.rows,
            vocab: self.vocab,
            stream: self.stream,
        };
        apart(op, out, logits)?;
        if let Some(m) = bitmask {
            apart(op, out, m)?;
        }
        Ok(args)
    }
}

/// One value of each row: `out[r] = values[r, index[r]]`, or 0 where `index[r]` is not
/// below `width` (as `u32::MAX`, argmax's "nothing allowed"). It gathers, say, each row's
/// probability of its argmax, so that one download brings them all.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PickArgs<P = DevicePtr> {
    /// f32 `[rows]`.
    pub out: P,
    /// f32 `[rows, width]`.
    pub values: P,
    /// u32 `[rows]`: the column picked in each row.
    pub index: P,
    /// Rows of values.
    pub rows: usize,
    /// Values per row.
    pub width: usize,
    /// The stream the op is queued on.
    pub stream: u64,
}

impl PickArgs {
    /// The checks every backend makes before it runs the op.
    pub fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<PickArgs<M::Range>, BackendError> {
        let op = "pick";
        let values = Operand::new(
            op,
            self.values,
            count(op, &[self.rows, self.width])?,
            Dtype::F32,
            "pick values",
        )?;
        let index = Operand::new(op, self.index, self.rows, Dtype::U32, "pick index")?;
        let out = Operand::new(op, self.out, self.rows, Dtype::F32, "pick out")?;
        let args = PickArgs {
            values: values.check(mem)?,
            index: index.check(mem)?,
            out: out.check(mem)?,
            rows: self.rows,
            width: self.width,
            stream: self.stream,
        };
        apart(op, out, values)?;
        apart(op, out, index)?;
        Ok(args)
    }
}

/// Softmax of each row of `logits / temperature` into `out` (both f32 `[rows, vocab]`;
/// `out` may be `logits` itself). `temperature` must be positive.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SoftmaxArgs<P = DevicePtr> {
    /// f32 `[rows, vocab]`: the probabilities (may be `logits`).
    pub out: P,
    /// f32 `[rows, vocab]`.
    pub logits: P,
    /// Rows of logits.
    pub rows: usize,
    /// Logits per row.
    pub vocab: usize,
    /// Divisor of the logits before softmax (positive).
    pub temperature: f32,
    /// The stream the op is queued on.
    pub stream: u64,
}

impl SoftmaxArgs {
    /// The checks every backend makes before it runs the op.
    pub fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<SoftmaxArgs<M::Range>, BackendError> {
        let op = "softmax";
        let t = self.temperature;
        if t.is_nan() || t <= 0.0 {
            return Err(invalid(
                op,
                format!("temperature must be positive, got {t}"),
            ));
        }
        let n = count(op, &[self.rows, self.vocab])?;
        let logits = Operand::new(op, self.logits, n, Dtype::F32, "softmax logits")?;
        let out = Operand::new(op, self.out, n, Dtype::F32, "softmax out")?;
        let args = SoftmaxArgs {
            logits: logits.check(mem)?,
            out: out.check(mem)?,
            rows: self.rows,
            vocab: self.vocab,
            temperature: t,
            stream: self.stream,
        };
        same_or_apart(op, out, logits)?;
        Ok(args)
    }
}
