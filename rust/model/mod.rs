//! The model layer: the configuration, the levers, the forward context, weights and their
//! loaders, the one decoder layer the target and the draft heads share ([`layers`]), and
//! the target model.
//!
//! Invariants:
//! - A [`ModelConfig`] that exists is consistent: heads divide the hidden size (or an
//!   explicit `head_dim` is given), KV heads divide the attention heads, sizes are non-zero.
//! - [`ModelLevers`] is resolved once (from `SPECDRAFT_*` variables or by hand) and then
//!   copied; nothing reads the environment on the hot path.
//! - Loaders never trust a file: every tensor's presence, shape, type and byte range is
//!   checked, and an error names the tensor and the file.

mod batch;
mod capture;
mod config;
mod config_json;
mod config_limits;
mod context;
pub mod decoder_weights;
mod error;
mod file_bytes;
pub mod gguf;
mod gguf_reader;
pub mod hf_checkpoint;
pub mod layers;
mod levers;
pub mod quantized_source;
mod sequence;
mod target;
pub mod tensors;
mod weights;

pub use capture::check_layer_ids;
pub use config::{
    yarn_mscale, ConfigError, MlaConfig, ModelConfig, ModelFamily, MoeConfig, RopeScaling,
    YarnParams, MAX_CONFIG_BYTES,
};
pub use config_limits::LIMITS;
pub use context::{Communicator, ForwardContext};
pub use decoder_weights::{DecoderWeights, NameScheme};
pub use error::ModelError;
pub use gguf::{GgufFile, GgufValue};
pub use hf_checkpoint::SafetensorsCheckpoint;
pub use levers::ModelLevers;
pub use quantized_source::{parse_weights_format, QuantizedSource};
pub use target::{ForwardOutput, KvSequence, LoadOptions, LogitRows, TargetModel, BLOCK_SIZE};
pub use tensors::{RawTensor, TensorSource, TensorType};
pub use weights::{
    DenseWeight, DeviceAllocations, Fp8Weight, Linear, PackedLinear, QuantizedWeight,
};
