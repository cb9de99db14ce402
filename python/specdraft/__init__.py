"""specdraft: the drafting half of speculative decoding.

A Rust core (GPU backends, the ``DevicePtr`` lifecycle, the paged KV block allocator, the
proposers) exposed to Python. Write a proposer by subclassing :class:`DraftProposer`; the
methods you define are called from Rust, every other method runs the Rust default without
entering Python. Rust proposers such as :class:`PromptLookup` and :class:`SuffixDecoding` are
subclasses of :class:`DraftProposer` too, and a Python subclass of one overrides single methods.

Check any proposer against the protocol with :func:`check_proposer`.
"""

from __future__ import annotations

from specdraft._core import (
    PROTOCOL_METHODS,
    AllocationError,
    Backend,
    BackendUnavailableError,
    BlockAllocator,
    BufferArena,
    CheckpointError,
    ConfigError,
    ConformanceReport,
    Conversation,
    CpuBackend,
    DevicePtr,
    DraftProposer,
    DraftRunner,
    ForwardContext,
    GenerationResult,
    ModelConfig,
    ModelLevers,
    MtpHead,
    PromptLookup,
    ProposerError,
    ProposerState,
    SpecdraftError,
    SpecEngine,
    SuffixDecoding,
    TargetModel,
    Violation,
    __version__,
    check_proposer,
    default_backend,
    load_model,
    quantize_nvfp4,
)

__all__ = [
    "PROTOCOL_METHODS",
    "AllocationError",
    "Backend",
    "BackendUnavailableError",
    "BlockAllocator",
    "BufferArena",
    "CheckpointError",
    "ConfigError",
    "ConformanceReport",
    "Conversation",
    "CpuBackend",
    "DevicePtr",
    "DraftProposer",
    "DraftRunner",
    "ForwardContext",
    "GenerationResult",
    "ModelConfig",
    "ModelLevers",
    "MtpHead",
    "PromptLookup",
    "ProposerError",
    "ProposerState",
    "SpecdraftError",
    "SpecEngine",
    "SuffixDecoding",
    "TargetModel",
    "Violation",
    "__version__",
    "check_proposer",
    "default_backend",
    "load_model",
    "quantize_nvfp4",
]

try:
    from specdraft._core import CudaBackend
except ImportError:  # built without the `cuda` feature: the CPU backend only
    pass
else:
    __all__ += ["CudaBackend"]
