"""Type stubs of the ``specdraft._core`` extension module (the Rust core)."""

from collections.abc import Sequence
from os import PathLike
from typing import Any, ClassVar, final

import numpy as np
import numpy.typing as npt

__version__: str
#: The 22 protocol method names, required ones first.
PROTOCOL_METHODS: list[str]

class SpecdraftError(Exception):
    """Base class of every error specdraft raises."""

class AllocationError(SpecdraftError):
    """Device memory or KV blocks went wrong.

    Out of memory, double free, unknown pointer, out-of-bounds access, exhausted block pool.
    """

class BackendUnavailableError(SpecdraftError):
    """A backend cannot be used on this machine.

    No CUDA driver, no such device, or kernels the device cannot load; the message says which.
    """

class ConfigError(SpecdraftError):
    """A model configuration or a lever setting could not be read or is inconsistent."""

class CheckpointError(SpecdraftError):
    """A checkpoint (safetensors or GGUF) could not be loaded."""

class ProposerError(SpecdraftError):
    """A proposer failed or broke the DraftProposer contract.

    For a Python proposer the message names the method and class and carries the Python
    traceback.
    """

@final
class DevicePtr:
    """An address in a backend's device memory (frozen, hashable, ordered).

    Wherever specdraft takes a pointer it also takes a plain non-negative ``int``.
    """

    #: The null address.
    NULL: ClassVar[DevicePtr]
    def __init__(self, value: int = 0) -> None:
        """A pointer to ``value``."""
    @property
    def value(self) -> int:
        """The raw address."""
    def is_null(self) -> bool:
        """Whether this is ``DevicePtr.NULL``."""
    def offset(self, nbytes: int) -> DevicePtr:
        """The address ``nbytes`` further on (the backend bounds-checks on use)."""
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __eq__(self, other: object) -> bool: ...
    def __lt__(self, other: DevicePtr) -> bool: ...
    def __le__(self, other: DevicePtr) -> bool: ...
    def __gt__(self, other: DevicePtr) -> bool: ...
    def __ge__(self, other: DevicePtr) -> bool: ...
    def __hash__(self) -> int: ...

PtrLike = DevicePtr | int
DtypeLike = str | np.dtype[Any] | type[np.generic]

class Backend:
    """A GPU backend: device memory, copies, and the allocation ledger.

    Instances come from ``CpuBackend()`` (or ``CudaBackend(...)``). A backend lent to a
    proposer for one call by a Rust caller is a ``Backend`` that raises ``SpecdraftError``
    when used after that call; a backend you created reaches your proposer as itself.
    """

    @property
    def name(self) -> str:
        """A short name: ``"cpu"``, ``"cuda:0"``."""
    def alloc(self, nbytes: int, tag: str = "python") -> DevicePtr:
        """Allocates ``nbytes`` zeroed bytes recorded under ``tag``."""
    def free(self, ptr: PtrLike) -> None:
        """Frees an allocation; a double free or unknown pointer raises ``AllocationError``."""
    def upload(
        self, array: npt.NDArray[Any], tag: str = "python", dtype: DtypeLike | None = None
    ) -> DevicePtr:
        """Allocates a buffer holding ``array``'s elements (flattened in C order).

        Arrays of float32, float16, uint32, int32 and uint8 are stored as they are;
        ``dtype="bf16"`` stores float32 data as bf16 (round to nearest even), or a uint16
        array as raw bf16 bit patterns.
        """
    def write(self, ptr: PtrLike, array: npt.NDArray[Any], dtype: DtypeLike | None = None) -> None:
        """Writes ``array``'s elements at ``ptr`` (bounds-checked; same dtypes as ``upload``)."""
    def download(
        self, ptr: PtrLike, dtype: DtypeLike, shape: int | Sequence[int], raw: bool = False
    ) -> npt.NDArray[Any]:
        """Reads ``shape`` elements of ``dtype`` at ``ptr`` into a new array.

        bf16 comes back as float32, or as its uint16 bit patterns with ``raw=True``. A range
        outside one live allocation raises ``AllocationError``.
        """
    def synchronize(self, stream: int = 0) -> None:
        """Waits until the work queued on ``stream`` is done."""
    @property
    def live_allocs(self) -> int:
        """Number of live allocations."""
    @property
    def live_bytes(self) -> int:
        """Bytes in live allocations."""
    def live_report(self) -> list[tuple[DevicePtr, int, str]]:
        """Every live allocation as ``(ptr, nbytes, tag)``, in address order."""

@final
class CpuBackend(Backend):
    """The CPU reference backend: host memory behind the backend interface."""

    def __init__(self, memory_limit: int | None = None) -> None:
        """A CPU backend; ``memory_limit`` caps its live bytes as a device's memory would."""

@final
class CudaBackend(Backend):
    """An NVIDIA GPU running the kernels compiled into the package.

    Present when the package is built with the ``cuda`` feature (the default for a wheel).
    """

    def __init__(self, device: int = 0) -> None:
        """Opens GPU ``device`` (0-based) and loads the kernels.

        Raises ``BackendUnavailableError`` when there is no CUDA driver or no such device.
        """
    @property
    def device(self) -> int:
        """The 0-based device ordinal."""
    @property
    def device_name(self) -> str:
        """The device's name as the driver reports it."""
    def memory_info(self) -> tuple[int, int]:
        """``(free, total)`` device memory in bytes."""

def default_backend() -> Backend:
    """The best backend this build and machine offer.

    A ``CudaBackend`` on GPU 0 when the package has the CUDA kernels and a driver and device
    work, else a ``CpuBackend``.
    """

@final
class BlockAllocator:
    """A pool of ``num_blocks`` KV blocks of ``block_size`` rows, with reference counts.

    Allocation is all or nothing; a failed call leaves the pool unchanged.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        """A pool; both sizes must be at least 1 (else ``AllocationError``)."""
    def alloc(self, n: int) -> list[int]:
        """Allocates ``n`` blocks (reference count 1 each); raises when too few are free."""
    def free(self, blocks: Sequence[int]) -> None:
        """Gives the blocks back (one holder each)."""
    def retain(self, blocks: Sequence[int]) -> None:
        """Adds a holder to each block, for sharing a prefix."""
    def release(self, blocks: Sequence[int]) -> None:
        """Drops one holder of each block; a block with none left returns to the pool."""
    def refcount(self, block: int) -> int:
        """The reference count of ``block`` (0 when free)."""
    def blocks_for(self, rows: int) -> int:
        """Blocks needed to hold ``rows`` rows."""
    @property
    def num_free(self) -> int:
        """Blocks currently free."""
    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
    @property
    def block_size(self) -> int:
        """Rows per block."""

@final
class ModelConfig:
    """The sizes and switches of a target model (read-only)."""

    @staticmethod
    def from_json(text: str) -> ModelConfig:
        """Parses the text of a Hugging Face ``config.json`` (``ConfigError`` when invalid)."""
    @staticmethod
    def from_file(path: str | PathLike[str]) -> ModelConfig:
        """Reads a Hugging Face ``config.json`` file."""
    @staticmethod
    def tiny(vocab_size: int = 256) -> ModelConfig:
        """A small Llama-family config for tests and examples."""
    @property
    def model_type(self) -> str:
        """The Hugging Face ``model_type`` of the family."""
    @property
    def hidden_size(self) -> int:
        """Model width."""
    @property
    def intermediate_size(self) -> int:
        """Dense MLP width."""
    @property
    def num_hidden_layers(self) -> int:
        """Decoder layers of the main model."""
    @property
    def num_attention_heads(self) -> int:
        """Query heads."""
    @property
    def num_key_value_heads(self) -> int:
        """Key/value heads."""
    @property
    def head_dim(self) -> int:
        """Width of one head."""
    @property
    def vocab_size(self) -> int:
        """Vocabulary size."""
    @property
    def rms_norm_eps(self) -> float:
        """RMSNorm epsilon."""
    @property
    def rope_theta(self) -> float:
        """RoPE base."""
    @property
    def partial_rotary_factor(self) -> float:
        """Fraction of each head RoPE rotates."""
    @property
    def max_position_embeddings(self) -> int:
        """Longest context the model was trained for."""
    @property
    def tie_word_embeddings(self) -> bool:
        """Whether the LM head shares the embedding's weights."""
    @property
    def attention_bias(self) -> bool:
        """Whether q/k/v projections carry biases."""
    @property
    def qk_norm(self) -> bool:
        """Whether q and k get a per-head RMSNorm."""
    @property
    def num_nextn_predict_layers(self) -> int:
        """MTP modules in the checkpoint (0 when none)."""
    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence token ids."""
    @property
    def q_size(self) -> int:
        """Width of the query projection's output."""
    @property
    def kv_size(self) -> int:
        """Width of the key (and value) projection's output."""
    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        """RoPE scaling, or None."""
    @property
    def moe(self) -> dict[str, Any] | None:
        """Mixture-of-experts sizes, or None for dense models."""

@final
class ModelLevers:
    """The switches that change how the model and its draft head run (resolved once)."""

    def __init__(
        self,
        *,
        mtp_kv_exact: bool = False,
        mtp_target_postnorm: bool = False,
        mtp_chain_postnorm: bool = False,
        defer_drafter_prefill: bool = False,
    ) -> None:
        """Levers set by hand; unset means off."""
    @staticmethod
    def from_env() -> ModelLevers:
        """Reads the ``SPECDRAFT_*`` environment variables (``ConfigError`` on bad values)."""
    @property
    def mtp_kv_exact(self) -> bool:
        """Write exact drafter KV rows for accepted drafts after each verify."""
    @property
    def mtp_target_postnorm(self) -> bool:
        """Feed the draft head the target hidden after the final norm."""
    @property
    def mtp_chain_postnorm(self) -> bool:
        """Feed the head's own hidden after its final norm for later drafts."""
    @property
    def defer_drafter_prefill(self) -> bool:
        """Always run the drafter prefill at the first propose."""

@final
class BufferArena:
    """The shared forward scratch (read-only view)."""

    def __init__(self, max_rows: int = 1) -> None:
        """An arena with no buffers, for proposers that never touch the scratch."""
    @property
    def max_rows(self) -> int:
        """Rows every slot holds."""
    @property
    def slots(self) -> list[tuple[str, DevicePtr, str, int]]:
        """Every slot as ``(name, ptr, dtype, row_elems)``."""

@final
class ForwardContext:
    """What a forward runs with. It holds shared handles, so keeping it is safe."""

    def __init__(
        self,
        gpu: Backend,
        config: ModelConfig,
        levers: ModelLevers | None = None,
        buffers: BufferArena | None = None,
    ) -> None:
        """A single-rank context (``gpu`` must be a backend you created)."""
    @property
    def gpu(self) -> Backend:
        """The backend every buffer belongs to."""
    @property
    def config(self) -> ModelConfig:
        """The target model's configuration."""
    @property
    def levers(self) -> ModelLevers:
        """The levers."""
    @property
    def buffers(self) -> BufferArena:
        """The shared forward scratch."""

@final
class ProposerState:
    """Per-sequence state of a Rust proposer, opaque to Python. Pass it back unchanged."""

@final
class DraftRunner:
    """A runner that replaces a draft head's own forward (see ``set_circuit_draft``)."""

class DraftProposer:
    """Base class of every draft proposer.

    Subclass it and define at least ``alloc_state``, ``propose`` and ``after_verify`` with
    the argument names and order below. Every method you define is called from Rust; every
    one you do not define runs the Rust default without entering Python. Calling a method
    on the base (``super().method(...)``) runs the Rust implementation: the protocol's
    default here, the Rust proposer's in a subclass of ``PromptLookup``.

    State is any Python object your ``alloc_state`` returns. ``propose`` must return at
    most ``num_drafts`` token ids, each in ``0 <= id < ctx.config.vocab_size``. Its
    optional arguments (``draft_embed_target``, ``grammar_bitmask``,
    ``target_hidden_stack``) are passed by keyword and only when set, so a ``propose``
    that never uses them may leave them out of its signature.

    An exception in a method, or a return value that breaks the contract, becomes a
    ``ProposerError`` naming the method and class and carrying the traceback. Methods that
    cannot fail in Rust (``needs_comm``, ``block_gamma``, ...) report through
    ``sys.unraisablehook`` and answer with the Rust default instead.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Accepts and ignores any arguments, so subclasses define their own ``__init__``."""
    def alloc_state(self, gpu: Backend) -> Any:
        """Allocates per-sequence state."""
    def propose(
        self,
        last_token: int,
        target_hidden: DevicePtr,
        position: int,
        num_drafts: int,
        state: Any,
        ctx: ForwardContext,
        stream: int = 0,
        draft_embed_target: DevicePtr | None = None,
        grammar_bitmask: npt.NDArray[np.int32] | Sequence[int] | None = None,
        target_hidden_stack: DevicePtr | None = None,
    ) -> list[int]:
        """Proposes up to ``num_drafts`` tokens after ``last_token`` at ``position``.

        ``target_hidden`` is the target's ``[1, hidden_size]`` bf16 hidden for
        ``last_token``; ``grammar_bitmask`` (int32 words, token ``t`` allowed when bit
        ``t % 32`` of word ``t // 32`` is set) limits the drafts when given.
        """
    def after_verify(self, num_accepted: int, state: Any, stream: int = 0) -> None:
        """Trims the state after a verify that accepted ``num_accepted`` drafts."""
    def alloc_state_for(self, gpu: Backend, budget_tokens: int) -> Any:
        """``alloc_state`` given the sequence's token budget (``2**64 - 1``: unknown)."""
    def block_gamma(self) -> int | None:
        """The block size of a block-diffusion drafter; None for others."""
    def prefill_hidden_rows(self, max_seq_len: int) -> int:
        """Rows of the prefill hidden capture this proposer can use (default ``max_seq_len``)."""
    def needs_comm(self) -> bool:
        """Whether the proposer's block is sharded across ranks (default False)."""
    def prefill_uses_shared_buffers(self) -> bool:
        """Whether the drafter prefill uses the shared scratch (default False)."""
    def drafter_rows(self, state: Any) -> int:
        """Drafter KV rows held in ``state``; 0 when unknown."""
    def last_pair_key(self, state: Any) -> int | None:
        """Sequence-space pair key of the newest drafter row; None when untracked."""
    def take_drafter_kv(self, state: Any) -> tuple[list[int], int, int | None] | None:
        """Moves the drafter KV blocks out of ``state``: ``(blocks, rows, last_pair_key)``."""
    def install_drafter_kv(
        self, state: Any, blocks: Sequence[int], rows: int, last_pair_key: int | None = None
    ) -> bool:
        """Installs carried blocks into a fresh state; False when unsupported."""
    def free_drafter_kv(self, blocks: Sequence[int]) -> None:
        """Releases drafter KV blocks no state owns."""
    def catchup_drafter(
        self,
        tokens: Sequence[int],
        hiddens: DevicePtr,
        row_base: int,
        pos_base: int,
        state: Any,
        ctx: ForwardContext,
        stream: int = 0,
    ) -> int:
        """Appends drafter rows from ``(tokens, hiddens)`` pairs; returns the rows written."""
    def propose_batch(
        self,
        last_tokens: Sequence[int],
        target_hiddens: Sequence[DevicePtr],
        positions: Sequence[int],
        num_drafts: int,
        states: Sequence[Any],
        ctx: ForwardContext,
        stream: int = 0,
        out_conf: list[list[float]] | None = None,
    ) -> list[list[int]] | None:
        """Drafts for several sequences at once; None when unsupported.

        When ``out_conf`` is a list it is filled with one list of confidences per sequence.
        A Python subclass that overrides ``propose`` but not ``propose_batch`` is proposed
        per sequence, so its ``propose`` is never bypassed.
        """
    def propose_batch_max(self, buffers: BufferArena, config: ModelConfig) -> int:
        """The widest batch ``propose_batch`` accepts; 1 means per-sequence only.

        A Python override sees a view with the arena's ``max_rows`` (no slots).
        """
    def catchup_batch(
        self,
        tokens: Sequence[Sequence[int]],
        hiddens: Sequence[Sequence[DevicePtr]],
        first_pos: Sequence[int],
        states: Sequence[Any],
        ctx: ForwardContext,
        stream: int = 0,
    ) -> int:
        """Appends one drafter row per accepted draft, for several sequences."""
    def prefill_drafter(
        self,
        prompt_tokens: Sequence[int],
        hiddens: DevicePtr,
        state: Any,
        ctx: ForwardContext,
        stream: int = 0,
    ) -> int:
        """Prefills the drafter over the prompt; returns the drafter rows written."""
    def read_deferred_draft_token(self, gpu: Backend) -> int:
        """The draft token the last propose with ``draft_embed_target`` left on the device."""
    def free_state(self, gpu: Backend, state: Any) -> None:
        """Frees per-sequence state: every ``DevicePtr`` ``alloc_state`` allocated."""
    def circuit_draft(self, config: ModelConfig, levers: ModelLevers) -> dict[str, Any] | None:
        """The draft head as the circuit executor binds it; None for most proposers.

        A Python proposer must return None.
        """
    def set_circuit_draft(self, runner: DraftRunner | None) -> None:
        """Runs ``runner`` in place of the draft head's own forward (None: its own again)."""

class PromptLookup(DraftProposer):
    """N-gram drafting from the prompt and the output so far (Rust; no device memory).

    The most recent earlier occurrence of the longest matching suffix is continued by one
    draft per token it matches (counted back past ``max_ngram``), up to ``num_drafts``.

    Its state is an opaque :class:`ProposerState`. A Python subclass may override single
    methods; the others run in Rust. The constructor's arguments reach ``__new__``, so a
    subclass's ``__init__`` takes the same ones (or the subclass defines ``__new__``).
    """

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4) -> None:
        """Matches suffixes of ``min_ngram ..= max_ngram`` tokens.

        Raises ``ProposerError`` unless ``1 <= min_ngram <= max_ngram``.
        """
    @property
    def min_ngram(self) -> int:
        """Shortest suffix it matches."""
    @property
    def max_ngram(self) -> int:
        """Longest suffix it matches."""
    def lookup(self, history: Sequence[int], num_drafts: int) -> list[int]:
        """The drafts for ``history`` without any state."""

class SuffixDecoding(DraftProposer):
    """Drafting from suffix trees (Rust; no device memory), after SuffixDecoding.

    One tree per sequence over its prompt and output, and one shared by every sequence of
    this proposer over the outputs of finished ones (added at ``free_state``; the oldest
    evicted beyond ``max_tree_nodes``). Drafts the most frequent continuation of the
    history's end as a chain, while its estimated probability stays at least
    ``min_token_prob``, at most ``floor(L * max_spec_factor)`` drafts for an ``L``-token
    match. ``propose_batch``'s ``out_conf`` gets each draft's probability given those before
    it. Its state is an opaque :class:`ProposerState`.
    """

    def __init__(
        self,
        max_depth: int = 24,
        min_token_prob: float = 0.1,
        max_spec_factor: float = 1.0,
        max_tree_nodes: int = 1048576,
    ) -> None:
        """Raises ``ProposerError`` naming the first option out of range."""
    @property
    def max_depth(self) -> int:
        """Longest string the trees keep: the matched suffix plus its drafts."""
    @property
    def min_token_prob(self) -> float:
        """Drafting stops before a draft reached with a lower estimated probability."""
    @property
    def max_spec_factor(self) -> float:
        """A match of ``L`` tokens drafts at most ``floor(L * max_spec_factor)`` tokens."""
    @property
    def max_tree_nodes(self) -> int:
        """The shared tree's bound, in nodes and in stored output tokens (0: none kept)."""
    def shared_tree(self) -> dict[str, int]:
        """What the shared tree holds: ``outputs``, ``tokens``, ``nodes``, ``bytes``."""
    def remember_output(self, output: Sequence[int]) -> None:
        """Adds ``output`` to the shared tree as if a sequence had just produced it."""

@final
class Violation:
    """One broken contract."""

    @property
    def check(self) -> str:
        """The check that failed."""
    @property
    def message(self) -> str:
        """What happened."""
    @property
    def fix(self) -> str:
        """What to change."""

@final
class ConformanceReport:
    """What :func:`check_proposer` found; true when no contract was broken."""

    @property
    def proposer(self) -> str:
        """The proposer's name."""
    @property
    def checks_run(self) -> list[str]:
        """The names of the checks that ran."""
    @property
    def violations(self) -> list[Violation]:
        """Every broken contract."""
    @property
    def ok(self) -> bool:
        """Whether no contract was broken."""
    def __bool__(self) -> bool: ...

class MtpHead(DraftProposer):
    """The multi-token-prediction draft head of a checkpoint.

    Finds the MTP module of a DeepSeek-V3 / GLM, MiMo or Qwen3-Next checkpoint and drafts
    with it; every protocol method runs in Rust.
    """

    @staticmethod
    def from_checkpoint(
        path: str | PathLike[str],
        gpu: Backend,
        *,
        quant: str = "bf16",
        mtp_vocab_size: int = 0,
        max_seq_len: int = 4096,
        main_kv_blocks: int = 4096,
        levers: ModelLevers | None = None,
    ) -> MtpHead:
        """Load the MTP module of the checkpoint folder ``path`` onto ``gpu``.

        ``quant`` is ``"bf16"``, ``"fp8"`` or ``"nvfp4"`` (the head's projections);
        ``mtp_vocab_size`` restricts drafts to the first rows of the LM head (0: all).
        """
    @property
    def draft_vocab_size(self) -> int:
        """Rows of the LM head drafts are chosen from."""
    @property
    def bytes_per_draft(self) -> int:
        """Bytes of weights one draft step reads."""
    @property
    def kv_blocks(self) -> tuple[int, int]:
        """``(total, free)`` blocks of the drafter KV pool."""
    @property
    def layout(self) -> str:
        """The checkpoint layout: ``"deepseek_v3"``, ``"mimo"`` or ``"qwen3_next"``."""
    def last_logits(self, gpu: Backend, row: int = 0) -> npt.NDArray[np.float32]:
        """Row ``row`` of the f32 logits of the head's latest forward."""

def quantize_nvfp4(
    w: npt.NDArray[np.float32],
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], float]:
    """Quantize a float32 ``[out, in]`` matrix to NVFP4 (ModelOpt layout) in Rust.

    Returns ``(weight [out, in/2], weight_scale [out, in/16] as FP8 E4M3 bytes,
    weight_scale_2)``.
    """

def check_proposer(
    proposer: DraftProposer,
    *,
    gpu: Backend | None = None,
    label: str | None = None,
    vocab_size: int | None = None,
    hidden_size: int | None = None,
    num_sequences: int | None = None,
    num_drafts: int | None = None,
    steps: int | None = None,
    seed: int | None = None,
) -> ConformanceReport:
    """Drives ``proposer`` through the whole lifecycle and reports every broken contract.

    The proposer is driven as the engine would drive it, on synthetic inputs; each
    violation says what to fix.

    Runs on ``gpu`` (a fresh CPU backend by default); nothing else should allocate on it
    meanwhile, since allocations still live at the end are reported as leaks.
    """

@final
class _DynProposer(DraftProposer):
    """A proposer as the engine sees it (through ``dyn DraftProposer``); for tests."""

    @property
    def python_methods(self) -> list[str]:
        """The methods that call into Python; every other one runs in Rust."""

def _as_rust(proposer: DraftProposer) -> _DynProposer:
    """``proposer`` seen through ``dyn DraftProposer``."""

def _time_propose(
    proposer: DraftProposer,
    iters: int = 20000,
    num_drafts: int = 4,
    vocab_size: int = 256,
    prompt_len: int = 64,
) -> dict[str, float]:
    """Times ``propose`` through ``dyn DraftProposer``.

    The loop runs in Rust with the interpreter released; the result is microseconds per
    call (median, p10, p90, mean).
    """

@final
class TargetModel:
    """A loaded target model (Llama, SmolLM2, Qwen2/2.5/3) with its paged KV cache."""

    @property
    def config(self) -> ModelConfig:
        """The model's configuration."""
    @property
    def gpu(self) -> Backend:
        """The backend the model lives on."""
    @property
    def max_seq_len(self) -> int:
        """Longest sequence a forward accepts."""
    @property
    def vocab_size(self) -> int:
        """Vocabulary size (columns of the logits)."""
    @property
    def weight_bytes_per_token(self) -> int:
        """Weight bytes one decode step reads."""
    @property
    def kv_blocks_free(self) -> int:
        """Free KV blocks in the pool."""
    def logits(self, tokens: Sequence[int]) -> npt.NDArray[np.float32]:
        """The f32 logits of a fresh forward over ``tokens`` (flat, row-major)."""
    def generate_greedy(self, prompt: Sequence[int], max_new_tokens: int = 16) -> list[int]:
        """Greedy decoding without drafting: the ids that follow ``prompt``."""

def load_model(
    path_or_name: str | PathLike[str],
    gpu: Backend | None = None,
    max_rows: int = 512,
    max_seq_len: int | None = None,
    kv_blocks: int | None = None,
) -> TargetModel:
    """Loads a target model from a HF checkpoint folder, a ``.gguf`` file, or a known name.

    ``"smollm2"`` names the default model; ``gpu`` defaults to a new ``CpuBackend``.
    """

@final
class GenerationResult:
    """The outcome of one prompt of ``SpecEngine.generate``."""

    #: Generated token ids (the EOS id included when it ended the sequence).
    tokens: list[int]
    #: The decoded text, when the engine has a tokenizer.
    text: str | None
    #: ``"stop"``, ``"length"``, ``"context"``, ``"grammar"`` or ``"error"``.
    finish_reason: str
    #: The error message when ``finish_reason == "error"``.
    error: str | None
    #: drafted, accepted, verify_steps, emitted, decode_tokens, prompt_tokens,
    #: mean_acceptance_length, acceptance_rate, acceptance_by_position, drafted_at,
    #: accepted_at, draft_time_s, verify_time_s, prefill_time_s, wall_time_s, tokens_per_s.
    metrics: dict[str, Any]

@final
class Conversation:
    """A chat session that carries the drafter's KV from one turn to the next."""

    def send(
        self,
        message: str | Sequence[int],
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        grammar: Any | None = None,
    ) -> GenerationResult:
        """Appends ``message`` to the history and generates the reply."""
    @property
    def history(self) -> list[int]:
        """Every token so far (prompts and replies)."""
    @property
    def carried_rows(self) -> int:
        """Drafter KV rows carried into the next turn (0 when none)."""
    def reset(self) -> None:
        """Forgets the history and frees carried drafter KV."""

@final
class SpecEngine:
    """Speculative decoding on a target model with an optional proposer."""

    def __init__(
        self,
        model: TargetModel,
        proposer: DraftProposer | None = None,
        num_drafts: int = 4,
        *,
        tokenizer: Any | None = None,
        levers: ModelLevers | None = None,
        max_batch: int | None = None,
    ) -> None: ...
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        grammar: Any | None = None,
        ignore_eos: bool = False,
    ) -> list[GenerationResult]:
        """One completion per prompt, all stepping together.

        Prompt ``i`` samples with seed ``seed + i``.
        """
    @property
    def last_metrics(self) -> dict[str, Any] | None:
        """Figures of the last ``generate`` call over all its prompts."""
    @property
    def num_drafts(self) -> int:
        """Most drafts per step."""
    @property
    def proposer(self) -> DraftProposer | None:
        """The proposer given at construction."""
    def conversation(self) -> Conversation:
        """A multi-turn conversation on this engine."""
