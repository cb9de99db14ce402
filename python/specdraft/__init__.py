"""specdraft: the drafting half of speculative decoding.

A Rust core (GPU backends, the ``DevicePtr`` lifecycle, the paged KV block allocator, the
proposers, the engine) exposed to Python. Write a proposer by subclassing
:class:`DraftProposer`; the methods you define are called from Rust, every other method runs
the Rust default without entering Python. Rust proposers such as :class:`PromptLookup` and
:class:`SuffixDecoding` (and the draft heads :class:`MtpHead`, :class:`Eagle3Head` and
:class:`DFlashHead`) are subclasses of :class:`DraftProposer` too, and a Python subclass of
one overrides single methods. :class:`Hybrid` drafts with the first of several proposers that
has a draft (retrieval where the text repeats, a learned head elsewhere).

Run one against a model with :class:`SpecEngine` (``load_model("smollm2")`` brings its
tokenizer, so text and chat messages just work), and check any proposer against the
protocol with :func:`check_proposer`. :func:`load_draft_head` loads a trained MTP draft
head shipped with the package (``"smollm2-mtp"``) beside its target model. Hooks for
tests live in :mod:`specdraft.testing`.
"""

from __future__ import annotations

from specdraft._core import (
    PROTOCOL_METHODS,
    AllocationError,
    Backend,
    BackendError,
    BackendUnavailableError,
    BlockAllocator,
    BufferArena,
    CheckpointError,
    ConfigError,
    ConformanceReport,
    Conversation,
    CpuBackend,
    CudaBackend,
    DevicePtr,
    DFlashHead,
    DraftProposer,
    DraftRunner,
    Eagle3Head,
    ForwardContext,
    GenerationError,
    GenerationResult,
    GenerationStream,
    Hybrid,
    ModelConfig,
    ModelLevers,
    MtpHead,
    PromptLookup,
    ProposerError,
    ProposerState,
    ReferenceDraftRunner,
    RequestError,
    ServingEngine,
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
from specdraft.chat_template import UnsafeTemplateError
from specdraft.heads import load_draft_head
from specdraft.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "PROTOCOL_METHODS",
    "AllocationError",
    "Backend",
    "BackendError",
    "BackendUnavailableError",
    "BlockAllocator",
    "BufferArena",
    "CheckpointError",
    "ConfigError",
    "ConformanceReport",
    "Conversation",
    "CpuBackend",
    "CudaBackend",
    "DevicePtr",
    "DFlashHead",
    "DraftProposer",
    "DraftRunner",
    "Eagle3Head",
    "ForwardContext",
    "GenerationError",
    "GenerationResult",
    "GenerationStream",
    "Hybrid",
    "ModelConfig",
    "ModelLevers",
    "MtpHead",
    "PromptLookup",
    "ProposerError",
    "ProposerState",
    "ReferenceDraftRunner",
    "RequestError",
    "ServingEngine",
    "SpecdraftError",
    "SpecEngine",
    "SuffixDecoding",
    "TargetModel",
    "Tokenizer",
    "UnsafeTemplateError",
    "Violation",
    "__version__",
    "check_proposer",
    "default_backend",
    "load_draft_head",
    "load_model",
    "load_tokenizer",
    "quantize_nvfp4",
]
