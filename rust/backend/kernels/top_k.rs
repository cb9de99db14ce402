//! Arguments of `top_k`: each row's `k` largest logits with their softmax probabilities,
//! so that a draft tree's round downloads a few ids and probabilities a row instead of the
//! row's whole logits (see the module docs of `kernels`).

use super::check::{apart, count, invalid, CheckedMemory, Operand};
use crate::backend::{BackendError, DevicePtr, Dtype};

/// The most children one `top_k` call returns a row. The kernels keep a row's candidates in
/// registers, so the bound is small; tree growth offers 4.
pub const TOP_K_MAX: usize = 8;

/// The `k` largest finite logits of each row among the ids `bitmask` allows, highest first
/// (ties to the lower id, as `argmax` picks), each with its softmax probability over every
/// finite logit of the row, allowed or not: `exp(l - max) / sum(exp(l' - max))`.
///
/// `logits` f32 `[rows, width]`; `ids` u32 `[rows, k]` and `probs` f32 `[rows, k]`. A row
/// with fewer than `k` allowed finite logits fills its last places with `u32::MAX` and
/// probability 0, and so does a place whose probability rounds to 0 in f32: such a child
/// could never pay for a verify row. `bitmask` is argmax's (i32 `[rows, ceil(width / 32)]`,
/// id t allowed when bit t % 32 of word t / 32 is set). `1 <= k <=` [`TOP_K_MAX`]; the
/// outputs are apart from the inputs and from each other.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopKArgs<P = DevicePtr> {
    /// u32 `[rows, k]`: the chosen ids of each row, best first.
    pub ids: P,
    /// f32 `[rows, k]`: their softmax probabilities.
    pub probs: P,
    /// f32 `[rows, width]`.
    pub logits: P,
    /// i32 `[rows, ceil(width / 32)]`: the allowed ids, or `None` for all.
    pub bitmask: Option<P>,
    /// Rows of logits.
    pub rows: usize,
    /// Logits per row.
    pub width: usize,
    /// Ids kept per row.
    pub k: usize,
    /// The stream the op is queued on.
    pub stream: u64,
}

impl TopKArgs {
    /// The checks every backend makes before it runs the op.
    pub fn validate<M: CheckedMemory + ?Sized>(
        self,
        mem: &M,
    ) -> Result<TopKArgs<M::Range>, BackendError> {
        let op = "top_k";
        if self.k == 0 || self.k > TOP_K_MAX {
            return Err(invalid(
                op,
                format!("k is {}; it must be 1 to {TOP_K_MAX}", self.k),
            ));
        }
        let logits = Operand::new(
            op,
            self.logits,
            count(op, &[self.rows, self.width])?,
            Dtype::F32,
            "top_k logits",
        )?;
        let words = count(op, &[self.rows, self.width.div_ceil(32)])?;
        let bitmask = self
            .bitmask
            .map(|m| Operand::new(op, m, words, Dtype::I32, "top_k bitmask"))
            .transpose()?;
        let kept = count(op, &[self.rows, self.k])?;
        let ids = Operand::new(op, self.ids, kept, Dtype::U32, "top_k ids")?;
        let probs = Operand::new(op, self.probs, kept, Dtype::F32, "top_k probs")?;
        let args = TopKArgs {
            logits: logits.check(mem)?,
            bitmask: bitmask.map(|m| m.check(mem)).transpose()?,
            ids: ids.check(mem)?,
            probs: probs.check(mem)?,
            rows: self.rows,
            width: self.width,
            k: self.k,
            stream: self.stream,
        };
        for out in [ids, probs] {
            apart(op, out, logits)?;
            if let Some(m) = bitmask {
                apart(op, out, m)?;
            }
        }
        apart(op, probs, ids)?;
        Ok(args)
    }
}
