//! The typed kernel entry points every backend implements, and their arguments.
//!
//! Each op is one method of [`Kernels`] taking one argument struct (pointers, sizes,
//! scalars, stream). Each struct has one `validate`, shared by every backend: it checks
//! sizes and dtypes, checks every pointer's exact byte range against the backend's ledger
//! (through [`CheckedMemory`]), reads the small index arrays whose values bound other
//! ranges, and applies the op's aliasing rule. It returns the same struct with each pointer
//! replaced by its checked range, and a kernel touches nothing else. So the CPU reference
//! and the CUDA launchers reject the same arguments with the same words, in the same order,
//! and a new op or weight format is one struct (or variant) and one check.
//!
//! Conventions every op keeps:
//! - Activations are BF16, accumulation is f32; logits and probabilities are f32; token ids,
//!   positions, slots and block tables are u32; grammar masks are i32 words.
//! - Shapes are row-major, outermost first; sizes are element counts, never bytes.
//! - Every pointer is aligned to its element size.
//! - An output shares no byte with an input, except where the op says the output may be
//!   that input itself (computed in place); a partial overlap is always an error.
//! - Checks run in a fixed order: scalar and shape checks, then each input range (and the
//!   values of index arrays), then the output range, then aliasing.
//! - Work is queued on `stream`; on the CPU it is done when the call returns.

mod attention;
mod basic;
pub(crate) mod check;
mod copy_rows;
mod kv_copy;
mod linear;
mod mla;
mod top_k;

pub use attention::{CheckedAttention, CheckedKvWrite, KvWriteArgs, PagedAttentionArgs, RopeArgs};
pub use basic::{
    ArgmaxArgs, CheckedEmbedding, ElementwiseArgs, ElementwiseOp, EmbeddingArgs, PickArgs,
    RmsNormArgs, SoftmaxArgs,
};
pub use check::CheckedMemory;
pub use copy_rows::CopyRowsArgs;
pub use kv_copy::{CheckedKvCopy, KvCopyArgs};
pub use linear::{
    GroupedLinearArgs, LinearArgs, LinearPart, LinearWeight, FP8_BLOCK, MAX_LINEAR_PARTS,
    NVFP4_BLOCK,
};
pub use mla::{attended_rows, CheckedMla, MlaAttentionArgs};
pub use top_k::{TopKArgs, TOP_K_MAX};

use super::BackendError;

/// How RoPE pairs the elements of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// Hugging Face's rotate-half: element `i` pairs with `i + rotary_dim / 2`.
    Half,
    /// Adjacent pairs: element `2i` pairs with `2i + 1` (GGUF's permuted q/k rows).
    Interleaved,
}

/// The typed kernel entry points; every backend implements each op. The contract of each
/// op is on its argument struct.
pub trait Kernels {
    /// Rows of an embedding table by token id ([`EmbeddingArgs`]).
    fn embedding(&self, args: EmbeddingArgs) -> Result<(), BackendError>;
    /// RMSNorm of each row ([`RmsNormArgs`]).
    fn rms_norm(&self, args: RmsNormArgs) -> Result<(), BackendError>;
    /// An element-wise binary op ([`ElementwiseArgs`]).
    fn elementwise(&self, args: ElementwiseArgs) -> Result<(), BackendError>;
    /// `out = x @ weight^T (+ bias)` for any weight format ([`LinearArgs`]).
    fn linear(&self, args: LinearArgs) -> Result<(), BackendError>;
    /// Several linears over one input, each part's result exactly its own `linear`'s
    /// ([`GroupedLinearArgs`]).
    fn grouped_linear(&self, args: GroupedLinearArgs) -> Result<(), BackendError>;
    /// Rotary position embedding, in place ([`RopeArgs`]).
    fn rope(&self, args: RopeArgs) -> Result<(), BackendError>;
    /// Key and value rows into a paged cache ([`KvWriteArgs`]).
    fn kv_write(&self, args: KvWriteArgs) -> Result<(), BackendError>;
    /// Grouped-query attention over a paged cache ([`PagedAttentionArgs`]).
    fn paged_attention(&self, args: PagedAttentionArgs) -> Result<(), BackendError>;
    /// Index of the largest (allowed) logit of each row ([`ArgmaxArgs`]).
    fn argmax(&self, args: ArgmaxArgs) -> Result<(), BackendError>;
    /// Softmax of each row at a temperature ([`SoftmaxArgs`]).
    fn softmax(&self, args: SoftmaxArgs) -> Result<(), BackendError>;
    /// One value of each row, at that row's index ([`PickArgs`]).
    fn pick(&self, args: PickArgs) -> Result<(), BackendError>;
    /// The largest (allowed) logits of each row with their probabilities ([`TopKArgs`]).
    fn top_k(&self, args: TopKArgs) -> Result<(), BackendError>;
    /// Rows copied into columns of wider rows ([`CopyRowsArgs`]).
    fn copy_rows(&self, args: CopyRowsArgs) -> Result<(), BackendError>;
    /// Rows copied between slots of a paged cache, in order ([`KvCopyArgs`]).
    fn kv_copy(&self, args: KvCopyArgs) -> Result<(), BackendError>;
    /// Multi-head latent attention over a paged latent cache ([`MlaAttentionArgs`]).
    fn mla_attention(&self, args: MlaAttentionArgs) -> Result<(), BackendError>;
}
