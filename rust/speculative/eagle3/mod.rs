//! The EAGLE-3 draft head (Li et al., arXiv 2503.01840; vLLM's `llama_eagle3.py`, the
//! `speculators` library's `eagle3` format): one decoder layer that drafts from the target's
//! hidden states captured at several depths.
//!
//! For the row of the token `t` at position `p`, paired (as the MTP head's rows) with the
//! target's captured rows `c` computed at `p - 1` (the layers' hiddens side by side):
//! `fused = fc(c)`; `x = [input_layernorm(embed(t)) | hidden_norm(fused)]` feeds the
//! attention's q/k/v (`2 * hidden` columns) with `fused` as the residual (or
//! `hidden_norm(fused)` under `norm_before_residual`); then the SwiGLU MLP, `norm`, and the
//! head's own `lm_head` over a reduced draft vocabulary, whose id `d` is the target id `d +
//! d2t[d]`. A later draft step feeds the pre-norm output hidden back instead of `fused` (no
//! `fc`) with the drafted token.
//!
//! One file per job: [`config`] (`config.json` in the speculators and original forms, and the
//! aux layer ids), `load` (the tensors, `d2t` checked), `head` (construction, what the head
//! reports) and `proposer` (the protocol methods). The machinery (drafter KV pool, draft
//! loop, rollback, deferred rows) is the MTP head's, run over [`MtpLayout::Eagle3`] weights.
//!
//! Capture layers: the checkpoint's `eagle_aux_hidden_state_layer_ids` name the hidden
//! entering layer `k` (vLLM's convention; default `(2, L / 2, L - 3)`), which is the output
//! of layer `k - 1`: [`DraftProposer::target_layer_ids`](crate::speculative::DraftProposer)
//! returns `k - 1` for each, and `k = 0` (the embedding) is refused.
//!
//! [`MtpLayout::Eagle3`]: crate::speculative::mtp::MtpLayout::Eagle3

pub mod config;
mod head;
mod load;
mod proposer;

pub use config::{Eagle3Config, Eagle3Format};
pub use head::Eagle3Head;
pub use proposer::Eagle3State;
