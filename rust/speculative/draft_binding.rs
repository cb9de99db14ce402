//! A draft head described for a circuit executor ([`DraftBinding`], one [`WeightSlot`] a
//! weight) and the runner that executes it in the head's place ([`DraftRunner`]; see
//! [`DraftProposer::set_circuit_draft`](super::DraftProposer::set_circuit_draft)).
//!
//! Nothing here runs a forward: the head builds its binding (`circuit_draft`), and a caller
//! hands the head a runner (`set_circuit_draft`), which the head then drafts through (the
//! runner's contract is [`DraftRunner::run`]).

use super::ProposerState;
use crate::backend::{DevicePtr, Dtype};
use crate::model::ForwardContext;
use crate::Result;

/// One weight of a draft head as the circuit executor binds it.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightSlot {
    /// The slot's name (`"eh_proj"`, `"layer.self_attn.q_proj"`, ...).
    pub name: String,
    /// Where the weight lives.
    pub ptr: DevicePtr,
    /// Element type of `ptr` (`U8` for packed NVFP4 codes).
    pub dtype: Dtype,
    /// Logical shape, outermost first.
    pub shape: Vec<usize>,
    /// Per-block scales (NVFP4's FP8 `weight_scale`), when quantized.
    pub block_scale: Option<DevicePtr>,
    /// The tensor-wide scale (NVFP4's `weight_scale_2`), when quantized.
    pub global_scale: Option<f32>,
}

/// A draft head described completely enough for a [`DraftRunner`] to run its forward.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftBinding {
    /// What kind of head this is (`"mtp:deepseek_v3"`, ...).
    pub kind: String,
    /// Every weight, by slot.
    pub weights: Vec<WeightSlot>,
    /// Model width.
    pub hidden_size: usize,
    /// Query heads of the head's attention.
    pub num_attention_heads: usize,
    /// Key/value heads.
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// RoPE base.
    pub rope_theta: f32,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Full vocabulary.
    pub vocab_size: usize,
    /// Rows of the LM head the drafts are chosen from (0: all).
    pub draft_vocab_size: usize,
    /// Rows per drafter KV block.
    pub kv_block_size: usize,
    /// Blocks in the drafter's KV pool.
    pub kv_num_blocks: usize,
    /// The key cache, `[kv_num_blocks, kv_block_size, num_key_value_heads, head_dim]` BF16.
    pub k_cache: DevicePtr,
    /// The value cache, same shape.
    pub v_cache: DevicePtr,
}

/// Runs a draft head's forward in place of the head's own (see
/// [`DraftProposer::set_circuit_draft`](super::DraftProposer::set_circuit_draft)).
pub trait DraftRunner: Send + Sync {
    /// Drafts `num_drafts` tokens for one sequence from the binding's weights, with the same
    /// meaning of every argument as
    /// [`DraftProposer::propose`](super::DraftProposer::propose), writing the drafter KV row
    /// of each step it runs. With a `grammar_bitmask`, every draft is a token whose bit is
    /// set, and the run ends at the first step whose mask allows no token of the draft
    /// vocabulary: that step's row is written, but no token drafted for it (so a run returns
    /// fewer than `num_drafts` tokens only when it ended that way).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        binding: &DraftBinding,
        last_token: u32,
        target_hidden: DevicePtr,
        position: usize,
        num_drafts: usize,
        state: &mut dyn ProposerState,
        ctx: &ForwardContext<'_>,
        stream: u64,
        grammar_bitmask: Option<&[i32]>,
    ) -> Result<Vec<u32>>;
}
