//! The multi-token-prediction (MTP) draft head: one decoder layer that predicts the token
//! after next from the target's hidden state and the token embedding, run autoregressively
//! over its own paged KV to propose several drafts.
//!
//! One file per job: [`nvfp4`] and [`fp8`] (quantization), [`weights`] (weights and checkpoint layouts),
//! `state` (per-sequence state and the drafter KV pool), `forward` (the head's equations
//! around the model layer's decoder layer), `head` (construction), `quantization` (how projections are stored), `weight_checks`
//! (shape checks and in-place row views), `draft` (the draft loop),
//! `proposer` (the `DraftProposer` methods), `tree` (growing dynamic draft trees, alone or
//! in batches), `tree_kv` (their branches' drafter KV and its compaction), `inspect` (views of the drafter KV for tests), `checkpoint` (loading from a checkpoint folder),
//! `shared` (loading a head beside its target, sharing the target's embedding and LM head)
//! and `circuit` (the circuit binding and the reference runner).
//!
//! The same machinery drafts for [`Eagle3Head`](crate::speculative::Eagle3Head): its weights
//! are [`MtpLayout::Eagle3`] ones, and the forward (`forward`) and the draft loop (`draft`)
//! add its input fusion and its draft-to-target id map; nothing else differs.
//!
//! Invariants: every drafter row at RoPE position p pairs the token at p with the target
//! hidden computed at p - 1 (pair key p - 1); `propose_batch` returns exactly what
//! per-sequence `propose` returns; `free_state` returns every block and every byte a state
//! holds, and [`MtpHead::release`] (or dropping a head loaded from a checkpoint) every byte
//! the head holds.

mod checkpoint;
mod circuit;
mod deferred;
mod draft;
mod forward;
pub mod fp8;
mod head;
mod head_memory;
mod inspect;
pub mod nvfp4;
mod proposer;
mod quantization;
mod scratch;
mod shared;
mod state;
mod tree;
mod tree_kv;
mod weight_checks;
pub mod weights;

pub use circuit::ReferenceDraftRunner;
pub(crate) use forward::Eagle3Parts;
pub use fp8::{quantize_fp8, Fp8Host};
pub use head::{MtpHead, MTP_CHUNK_ROWS, MTP_MAX_BATCH};
pub use nvfp4::{dequantize_nvfp4, quantize_nvfp4, Nvfp4Host};
pub use quantization::MtpQuantization;
pub use state::{MtpState, DRAFTER_BLOCK_SIZE};
pub use tree::TREE_TOP_K;
pub use weights::{find_layout, MtpLayout, MtpWeights};

pub(crate) use super::error::bad;
