//! The typed kernel entry points every backend implements.
//!
//! Each op is one method with named, typed arguments. The CPU backend implements them in
//! Rust (the reference, `cpu_kernels.rs`); the CUDA backend launches the kernels in `cuda/`.
//!
//! Conventions every op keeps:
//! - Activations are BF16, accumulation is f32; logits and probabilities are f32; token ids,
//!   positions, slots and block tables are u32; grammar masks are i32 words.
//! - Shapes are row-major, outermost first; sizes are element counts, never bytes.
//! - An output may alias an input only where the op says so.
//! - Work is queued on `stream`; on the CPU it is done when the call returns.

use super::{BackendError, DevicePtr, Dtype};

/// How RoPE pairs the elements of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// Hugging Face's rotate-half: element `i` pairs with `i + rotary_dim / 2`.
    Half,
    /// Adjacent pairs: element `2i` pairs with `2i + 1` (GGUF's permuted q/k rows).
    Interleaved,
}

/// The typed kernel entry points; every backend implements each op.
#[allow(clippy::too_many_arguments)]
pub trait Kernels {
    /// `out[r, :] = table[ids[r], :]`. `out` BF16 `[rows, hidden]`, `table` BF16
    /// `[vocab, hidden]`, `ids` u32 `[rows]`; an id `>= vocab` is an error.
    fn embedding(
        &self,
        out: DevicePtr,
        table: DevicePtr,
        ids: DevicePtr,
        rows: usize,
        hidden: usize,
        vocab: usize,
        stream: u64,
    ) -> Result<(), BackendError>;

    /// RMSNorm of each row: `out = x / sqrt(mean(x^2) + eps) * weight`. `x`, `out` BF16
    /// `[rows, dim]`, `weight` BF16 `[dim]`. `out` may alias `x`.
    fn rms_norm(
        &self,
        out: DevicePtr,
        x: DevicePtr,
        weight: DevicePtr,
        rows: usize,
        dim: usize,
        eps: f32,
        stream: u64,
    ) -> Result<(), BackendError>;

    /// `out = a + b`, BF16 `[n]`. `out` may alias `a` or `b`.
    fn add(
        &self,
        out: DevicePtr,
        a: DevicePtr,
        b: DevicePtr,
        n: usize,
        stream: u64,
    ) -> Result<(), BackendError>;

    /// `out = silu(gate) * up`, BF16 `[n]`. `out` may alias `gate` or `up`.
    fn silu_mul(
        &self,
        out: DevicePtr,
        gate: DevicePtr,
        up: DevicePtr,
        n: usize,
        stream: u64,
    ) -> Result<(), BackendError>;

    /// `out = sigmoid(gate) * x`, BF16 `[n]` (the output gate of Qwen3-Next's attention).
    /// `out` may alias `gate` or `x`. The default refuses, so a backend without the kernel
    /// reports it instead of computing something else.
    fn sigmoid_mul(
        &self,
        out: DevicePtr,
        gate: DevicePtr,
        x: DevicePtr,
        n: usize,
        stream: u64,
    ) -> Result<(), BackendError> {
        let _ = (out, gate, x, n, stream);
        Err(BackendError::InvalidArgument {
            op: "sigmoid_mul",
            message: "this backend does not implement sigmoid_mul".into(),
        })
    }

    /// `out = x @ weight^T (+ bias)`. `x` BF16 `[rows, in_features]`, `weight` BF16
    /// `[out_features, in_features]`, `bias` BF16 `[out_features]`, `out` `[rows,
    /// out_features]` of `out_dtype` (`Bf16` or `F32`). `out` must not alias `x`.
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
    ) -> Result<(), BackendError>;

    /// [`Kernels::linear`] with an NVFP4 weight (ModelOpt layout, W4A16): `weight` u8
    /// `[out_features, in_features / 2]` (two E2M1 codes a byte, low nibble first),
    /// `weight_scale` FP8 E4M3 `[out_features, in_features / 16]`, and the tensor-wide
    /// `global_scale`. `in_features` must be a multiple of 16.
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
    ) -> Result<(), BackendError>;

    /// Rotates the first `rotary_dim` elements of every head of `x` (BF16 `[rows, heads,
    /// head_dim]`, in place) by `positions[r] * inv_freq[i]`; `inv_freq` f32
    /// `[rotary_dim / 2]` carries the base and any scaling, `positions` u32 `[rows]`.
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
    ) -> Result<(), BackendError>;

    /// Writes key and value rows into a paged cache: row `r` of `k` / `v` (BF16 `[rows,
    /// kv_heads, head_dim]`) goes to slot `slots[r]` of `k_cache` / `v_cache` (BF16
    /// `[num_slots, kv_heads, head_dim]`, slot = block * block_size + offset). A slot
    /// `>= num_slots` is an error.
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
    ) -> Result<(), BackendError>;

    /// Grouped-query attention over a paged cache, for prefill and decode alike. Query row
    /// `r` (BF16 `q[r, heads, head_dim]`) belongs to sequence `row_seq[r]` and attends to
    /// that sequence's first `row_ctx_len[r]` cached rows (causality is in the lengths);
    /// cached row `j` of sequence `s` is slot `block_table[s, j / block_size] * block_size
    /// + j % block_size`. Query head `h` reads KV head `h / (heads / kv_heads)`. Scores are
    /// scaled by `scale`; `out` BF16 `[rows, heads, head_dim]` must not alias `q`.
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
    ) -> Result<(), BackendError>;

    /// Index of the largest logit of each row (ties: the lowest index). `logits` f32
    /// `[rows, vocab]`, `out` u32 `[rows]`. With `bitmask` (i32 `[rows, ceil(vocab / 32)]`,
    /// token t allowed when bit t % 32 of word t / 32 is set) only allowed tokens count; a
    /// row with none allowed gets `u32::MAX`.
    fn argmax(
        &self,
        out: DevicePtr,
        logits: DevicePtr,
        bitmask: Option<DevicePtr>,
        rows: usize,
        vocab: usize,
        stream: u64,
    ) -> Result<(), BackendError>;

    /// Softmax of each row of `logits / temperature` into `out` (both f32 `[rows, vocab]`;
    /// `out` may alias `logits`). `temperature` must be positive.
    fn softmax(
        &self,
        out: DevicePtr,
        logits: DevicePtr,
        rows: usize,
        vocab: usize,
        temperature: f32,
        stream: u64,
    ) -> Result<(), BackendError>;
}
