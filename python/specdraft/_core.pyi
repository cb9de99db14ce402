"""Type stubs of the ``specdraft._core`` extension module (the Rust core).

Signatures are written here and checked against the built module by ``mypy.stubtest``;
docstrings are the Rust doc comments, copied in by ``scripts/stub_docs.py --write`` and
checked by ``scripts/stub_docs.py --check``: edit them in ``rust/python/``, not here.
"""

from collections.abc import Sequence
from os import PathLike
from typing import Any, ClassVar, TypeAlias, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, disjoint_base

__version__: str
#: The protocol's method names, in the specification's order (the three required first).
PROTOCOL_METHODS: list[str]

class SpecdraftError(Exception):
    """Base class of every error specdraft raises."""

class AllocationError(SpecdraftError):
    """Device memory, KV blocks or the forward scratch failed.

    Out of memory, double free, unknown pointer, out-of-bounds access, an exhausted KV block pool.
    """

class BackendUnavailableError(SpecdraftError):
    """A backend cannot be used on this machine.

    No CUDA driver, no such device, kernels the device cannot load, a build without CUDA, or a backend handle lent for a call that has ended.
    """

class ConfigError(SpecdraftError):
    """A model configuration or a lever setting could not be read or is inconsistent."""

class CheckpointError(SpecdraftError):
    """A checkpoint (safetensors or GGUF) could not be loaded."""

class BackendError(SpecdraftError):
    """A device operation failed.

    A driver call, a kernel given inconsistent arguments, an unknown stream.
    """

class ProposerError(SpecdraftError):
    """A proposer failed or broke the DraftProposer contract.

    For a Python proposer the message names the method and class and carries the Python traceback.
    """

class RequestError(SpecdraftError, ValueError):
    """A request was refused before anything ran.

    An empty or too-long prompt, token ids outside the vocabulary, sampling parameters out of range. Also a ValueError.
    """

class GenerationError(SpecdraftError):
    """The engine failed while running a request.

    A target output of the wrong shape, a grammar matcher that failed or refused a token.
    """

@final
class DevicePtr:
    """`DevicePtr(value=0)`: an address in a backend's device memory (frozen, hashable,
    ordered). Wherever specdraft takes a pointer it also takes a plain non-negative `int`.
    """

    #: The null address.
    NULL: ClassVar[DevicePtr]
    def __new__(cls, value: int = 0) -> Self: ...
    @property
    def value(self) -> int:
        """The raw address."""
    def is_null(self) -> bool:
        """Whether this is `DevicePtr.NULL`."""
    def offset(self, nbytes: int) -> DevicePtr:
        """The address `nbytes` further on (not bounds-checked here; the backend checks on use)."""
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __lt__(self, other: DevicePtr, /) -> bool: ...
    def __le__(self, other: DevicePtr, /) -> bool: ...
    def __gt__(self, other: DevicePtr, /) -> bool: ...
    def __ge__(self, other: DevicePtr, /) -> bool: ...
    def __hash__(self) -> int: ...

_PtrLike: TypeAlias = DevicePtr | int
_DtypeLike: TypeAlias = str | np.dtype[Any] | type[np.generic]

@disjoint_base
class Backend:
    """A GPU backend: device memory, copies, and the allocation ledger.

    Instances come from `CpuBackend()` (or `CudaBackend(...)`). A backend lent to a
    proposer for one call by a Rust caller is a `Backend` that raises
    `BackendUnavailableError` when used after that call; a backend you created reaches
    your proposer as itself.
    """

    @property
    def name(self) -> str:
        """A short name: `"cpu"`, `"cuda:0"`."""
    def alloc(self, nbytes: int, tag: str = "python") -> DevicePtr:
        """Allocates `nbytes` zeroed bytes recorded under `tag`."""
    def free(self, ptr: _PtrLike) -> None:
        """Frees an allocation; a double free or an unknown pointer raises `AllocationError`."""
    def upload(
        self, array: npt.NDArray[Any], tag: str = "python", dtype: _DtypeLike | None = None
    ) -> DevicePtr:
        """Allocates a buffer holding `array`'s elements (flattened in C order).

        Arrays of float32, float16, uint32, int32 and uint8 are stored as they are;
        `dtype="bf16"` stores float32 data as bf16 (round to nearest even), or a uint16
        array as raw bf16 bit patterns.
        """
    def write(
        self, ptr: _PtrLike, array: npt.NDArray[Any], dtype: _DtypeLike | None = None
    ) -> None:
        """Writes `array`'s elements at `ptr` (bounds-checked; same dtypes as `upload`)."""
    def download(
        self, ptr: _PtrLike, dtype: _DtypeLike, shape: int | Sequence[int], raw: bool = False
    ) -> npt.NDArray[Any]:
        """Reads `shape` elements of `dtype` at `ptr` into a new numpy array.

        bf16 comes back as float32, or as its uint16 bit patterns with `raw=True`. A range
        outside one live allocation raises `AllocationError`.
        """
    def synchronize(self, stream: int = 0) -> None:
        """Waits until the work queued on `stream` is done."""
    @property
    def live_allocs(self) -> int:
        """Number of live allocations."""
    @property
    def live_bytes(self) -> int:
        """Bytes in live allocations."""
    def live_report(self) -> list[tuple[DevicePtr, int, str]]:
        """Every live allocation as `(ptr, nbytes, tag)`, in address order."""

@final
class CpuBackend(Backend):
    """`CpuBackend(memory_limit=None, threads=None)`: the CPU reference backend, host memory
    behind the backend interface. `memory_limit` caps its live bytes the way a device's
    memory would; `threads` (at least 1) sets how many threads its kernels run on, one per
    core by default.
    """

    def __new__(cls, memory_limit: int | None = None, threads: int | None = None) -> Self: ...
    @property
    def threads(self) -> int:
        """Threads its kernels run on, the calling thread included: one per core by default."""
    @property
    def instruction_set(self) -> str:
        """The instruction set its kernels run on, the fastest this CPU has:
        `"avx512-vnni"`, `"avx2-vnni"`, `"avx2"` or `"portable"` (every one gives the same
        bits; AMX tiles, slower than AVX-512 VNNI on a forward's calls, are not used).
        """

@final
class CudaBackend(Backend):
    """`CudaBackend(device=0)`: an NVIDIA GPU running the kernels compiled into the package.

    Opens GPU `device` (0-based) and loads the kernels. Raises `BackendUnavailableError`
    when there is no CUDA driver, no such device, or the package was built without CUDA.
    """

    def __new__(cls, device: int = 0) -> Self: ...
    @property
    def device(self) -> int:
        """The 0-based device ordinal."""
    @property
    def device_name(self) -> str:
        """The device's name as the driver reports it."""
    def memory_info(self) -> tuple[int, int]:
        """`(free, total)` device memory in bytes."""

def default_backend() -> Backend:
    """The best backend this build and machine offer: a `CudaBackend` on GPU 0 when the
    package is built with feature `cuda` and a driver and device work, else a `CpuBackend`.
    """

@final
class BlockAllocator:
    """`BlockAllocator(num_blocks, block_size)`: a pool of `num_blocks` KV blocks of
    `block_size` rows, with per-block reference counts. Both sizes must be at least 1 (else
    `AllocationError`). Allocation is all or nothing; a failed call leaves the pool
    unchanged.
    """

    def __new__(cls, num_blocks: int, block_size: int) -> Self: ...
    def alloc(self, n: int) -> list[int]:
        """Allocates `n` blocks (reference count 1 each); all or nothing."""
    def free(self, blocks: Sequence[int]) -> None:
        """Gives the blocks back (one holder each)."""
    def retain(self, blocks: Sequence[int]) -> None:
        """Adds a holder to each block, for sharing a prefix."""
    def release(self, blocks: Sequence[int]) -> None:
        """Drops one holder of each block; a block with no holder left returns to the pool."""
    def refcount(self, block: int) -> int:
        """The reference count of `block` (0 when free)."""
    def blocks_for(self, rows: int) -> int:
        """Blocks needed to hold `rows` rows."""
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
        """Parses the text of a Hugging Face `config.json` (`ConfigError` when invalid)."""
    @staticmethod
    def from_file(path: str | PathLike[str]) -> ModelConfig:
        """Reads a Hugging Face `config.json` file."""
    @staticmethod
    def tiny(vocab_size: int = 256) -> ModelConfig:
        """A small Llama-family config for tests and examples."""
    @property
    def model_type(self) -> str:
        """The Hugging Face `model_type` of the family."""
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
        """RoPE scaling as a dict, or None."""
    @property
    def moe(self) -> dict[str, Any] | None:
        """Mixture-of-experts sizes as a dict, or None for dense models."""

@final
class ModelLevers:
    """`ModelLevers(*, mtp_kv_exact=False, mtp_target_postnorm=False, mtp_chain_postnorm=False,
    defer_drafter_prefill=False)`: the switches that change how the model and its draft head
    run (resolved once). Levers set by hand; unset means off.
    """

    def __new__(
        cls,
        *,
        mtp_kv_exact: bool = False,
        mtp_target_postnorm: bool = False,
        mtp_chain_postnorm: bool = False,
        defer_drafter_prefill: bool = False,
    ) -> Self: ...
    @staticmethod
    def from_env() -> ModelLevers:
        """Reads the levers from the `SPECDRAFT_*` environment variables; unset means off
        (`ConfigError` on bad values).
        """
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
    """`BufferArena(max_rows=1)`: the shared forward scratch (a read-only view). Made by hand,
    an arena with no buffers, for proposers that never touch the scratch.
    """

    def __new__(cls, max_rows: int = 1) -> Self: ...
    @property
    def max_rows(self) -> int:
        """Rows every slot holds."""
    @property
    def slots(self) -> list[tuple[str, DevicePtr, str, int]]:
        """Every slot as `(name, ptr, dtype, row_elems)`."""

@final
class ForwardContext:
    """`ForwardContext(gpu, config, levers=None, buffers=None, target_hidden_stack=None,
    target_hidden_stacks=None)`: what a forward runs with (backend, shared scratch,
    configuration, levers, and the captured target rows of a proposer that names
    `target_layer_ids`). It holds shared handles, so keeping it is safe. Made by hand, a
    single-rank context (`gpu` must be a backend you created).
    """

    def __new__(
        cls,
        gpu: Backend,
        config: ModelConfig,
        levers: ModelLevers | None = None,
        buffers: BufferArena | None = None,
        target_hidden_stack: DevicePtr | int | None = None,
        target_hidden_stacks: list[DevicePtr | int] | None = None,
    ) -> Self: ...
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
    @property
    def target_hidden_stack(self) -> DevicePtr | None:
        """The captured target rows paired row for row with the `hiddens` of the call this
        context was passed to (bf16 `[rows, len(target_layer_ids) * hidden]`), or None when
        the proposer names no layers or the call has no hiddens.
        """
    @property
    def target_hidden_stacks(self) -> list[DevicePtr] | None:
        """In `propose_batch`, one entry per sequence of the batch, in order: the captured rows
        that sequence's `propose` would get as `target_hidden_stack`. None in every other
        call, and when the proposer names no layers.
        """

@final
class ProposerState:
    """Per-sequence state of a Rust proposer, opaque to Python."""

@disjoint_base
class DraftRunner:
    """A draft runner: what `set_circuit_draft` runs in place of a draft head's own forward.
    Made by specdraft (see `ReferenceDraftRunner`); opaque to Python.
    """

@final
class ReferenceDraftRunner(DraftRunner):
    """The reference circuit runner: drafts from the binding `circuit_draft` describes, with
    the MTP head's equations, grammar masks included.

    `head.set_circuit_draft(specdraft.ReferenceDraftRunner())` makes an `MtpHead` draft
    through it (one sequence at a time: `propose_batch` then answers None); the drafts are
    the head's own. A check for a circuit executor, and an example of the binding's use.
    """

    def __new__(cls) -> ReferenceDraftRunner: ...

@disjoint_base
class DraftProposer:
    """Base class of every draft proposer.

    Subclass it and define at least `alloc_state`, `propose` and `after_verify` with
    the argument names and order below. Every method you define is called from Rust; every
    one you do not define runs the Rust default without entering Python. Calling a method
    on the base (`super().method(...)`) runs the Rust implementation: the protocol's
    default here, the Rust proposer's in a subclass of `PromptLookup`. The constructor
    accepts and ignores any arguments, so subclasses define their own `__init__`.

    State is any Python object your `alloc_state` returns (None for a proposer without
    state). `propose` must return at most `num_drafts` token ids, each in
    `0 <= id < ctx.config.vocab_size`. Its optional arguments (`draft_embed_target`,
    `grammar_bitmask`, `target_hidden_stack`) are passed by keyword and only when set, so a
    `propose` that never uses them may leave them out of its signature.

    An exception in a method, or a return value that breaks the contract, becomes a
    `ProposerError` naming the method and class and carrying the traceback. Methods that
    cannot fail in Rust (`needs_comm`, `block_gamma`, ...) report through
    `sys.unraisablehook` and answer with the Rust default instead.
    """

    def __new__(cls, *_args: Any, **_kwargs: Any) -> Self: ...
    def alloc_state(self, gpu: Backend) -> Any:
        """Allocates per-sequence state: any object, or None for a proposer without state."""
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
        """Proposes up to `num_drafts` tokens after `last_token` at `position`.

        `target_hidden` is the target's `[1, hidden_size]` bf16 hidden for
        `last_token`; `grammar_bitmask` (int32 words, token `t` allowed when bit
        `t % 32` of word `t // 32` is set) limits the drafts when given.
        """
    def after_verify(self, num_accepted: int, state: Any, stream: int = 0) -> None:
        """Trims the state after a verify that accepted `num_accepted` drafts."""
    def alloc_state_for(self, gpu: Backend, budget_tokens: int) -> Any:
        """`alloc_state` given the sequence's token budget (`2**64 - 1`: unknown)."""
    def block_gamma(self) -> int | None:
        """The block size of a block-diffusion drafter; None for others. The engine asks
        `Some(γ)` for `γ - 1` drafts a step (at least 1), whatever its `num_drafts`.
        """
    def target_layer_ids(self) -> list[int]:
        """The target layers whose hiddens this proposer fuses (default: none).

        Id `i` is the hidden after decoder layer `i` (0-based) before the final norm; EAGLE-3's
        "hidden entering layer k" is id `k - 1`. The engine checks the ids when it is built
        (each below the model's layer count, none twice) and then passes the captured rows,
        bf16 `[rows, len(ids) * hidden]`, as `propose`'s `target_hidden_stack` and as
        `ctx.target_hidden_stack` of `prefill_drafter`; such a proposer is proposed per
        sequence.
        """
    def prefill_hidden_rows(self, max_seq_len: int) -> int:
        """Rows of the prefill hidden capture this proposer can use (default `max_seq_len`)."""
    def needs_comm(self) -> bool:
        """Whether the proposer's block is sharded across ranks (default False)."""
    def prefill_uses_shared_buffers(self) -> bool:
        """Whether the drafter prefill uses the shared scratch (default False)."""
    def drafter_rows(self, state: Any) -> int:
        """Drafter KV rows held in `state`; 0 when unknown."""
    def last_pair_key(self, state: Any) -> int | None:
        """Sequence-space pair key of the newest drafter row; None when untracked."""
    def take_drafter_kv(self, state: Any) -> tuple[list[int], int, int | None] | None:
        """Moves the drafter KV blocks out of `state`: `(blocks, rows, last_pair_key)`."""
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
        """Appends drafter rows from `(tokens, hiddens)` pairs; returns the rows written."""
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

        When `out_conf` is a list it is filled with one list per sequence: the
        probability of each of its drafts, or an empty list where none is reported.
        A Python subclass that overrides `propose` but not `propose_batch` is proposed
        per sequence, so its `propose` is never bypassed.
        """
    def propose_batch_max(self, buffers: BufferArena, config: ModelConfig) -> int:
        """The widest batch `propose_batch` accepts; 1 means per-sequence only.

        A Python override sees a view with the arena's `max_rows` (no slots).
        """
    def propose_tree(
        self,
        last_token: int,
        target_hidden: DevicePtr,
        position: int,
        budget: int,
        state: Any,
        ctx: ForwardContext,
        stream: int = 0,
        draft_embed_target: DevicePtr | None = None,
        grammar_bitmask: npt.NDArray[np.int32] | Sequence[int] | None = None,
        target_hidden_stack: DevicePtr | None = None,
    ) -> tuple[list[int], list[int]] | tuple[list[int], list[int], list[float]]:
        """Proposes a tree of at most `budget` draft tokens after `last_token`:
        `(tokens, parents)` or `(tokens, parents, probs)`, each parent an earlier node's
        index or -1 for a child of `last_token`. The other arguments are `propose`'s.

        The default is the chain of `budget` drafts from `propose`; a Python class that
        defines `propose` gets the chain of its own `propose`.
        """
    def propose_tree_batch(
        self,
        last_tokens: Sequence[int],
        target_hiddens: Sequence[DevicePtr],
        positions: Sequence[int],
        budget: int,
        states: Sequence[Any],
        ctx: ForwardContext,
        stream: int = 0,
    ) -> list[tuple[list[int], list[int]] | tuple[list[int], list[int], list[float]]] | None:
        """Proposes a tree of at most `budget` nodes for each sequence at once: a list of
        trees in `propose_tree`'s form, or None when unsupported (then each sequence is
        asked `propose_tree`). No grammar mask: a sequence under a grammar proposes alone.

        A Python subclass that overrides `propose` or `propose_tree` but not this gets
        None, so its own method is never bypassed.
        """
    def grows_trees(self) -> bool:
        """Whether `propose_tree` grows branching trees (default False: its chain); under
        `SpecEngine(draft_shape="tree")` such a proposer is asked for a tree each step.
        """
    def after_verify_tree(self, path: Sequence[int], state: Any, stream: int = 0) -> None:
        """`after_verify` after a `propose_tree` whose tree branched: `path` lists the accepted
        nodes, root side first. The default calls `after_verify(len(path), state, stream)`.
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
        """The draft token the last propose with `draft_embed_target` left on the device."""
    def free_state(self, gpu: Backend, state: Any) -> None:
        """Frees per-sequence state: every `DevicePtr` `alloc_state` allocated."""
    def circuit_draft(self, config: ModelConfig, levers: ModelLevers) -> dict[str, Any] | None:
        """The draft head as the circuit executor binds it (a dict; see `DraftBinding` in the
        Rust docs); None for most proposers. A Python proposer must return None.
        """
    def set_circuit_draft(self, runner: DraftRunner | None) -> None:
        """Runs `runner` in place of the draft head's own forward (None: its own again)."""

@disjoint_base
class PromptLookup(DraftProposer):
    """`PromptLookup(min_ngram, max_ngram, *, trees=False)`: n-gram drafting from the prompt
    and the output so far (Rust; no device memory).

    Matches suffixes of `min_ngram ..= max_ngram` tokens (by default the lengths measured
    fastest: see `PromptLookup().min_ngram` and `.max_ngram`); raises `ProposerError` unless
    `1 <= min_ngram <= max_ngram`. With `trees=True` it grows trees (`grows_trees()`): its
    `propose_tree` drafts the continuations of several earlier matches as branches, and the
    engine asks it for them under `draft_shape="tree"`; off by default, as on SmolLM2 trees
    ran at 1.00x-1.03x the chain's speed alone and 0.91x-0.96x at `max_batch` 4. Its state is an opaque `ProposerState`. A Python subclass
    may override single methods; the others run in Rust. The constructor's arguments reach
    `__new__`, so a subclass's `__init__` takes the same ones (or the subclass defines
    `__new__`).
    """

    def __new__(
        cls, min_ngram: int = ..., max_ngram: int = ..., *, trees: bool = False
    ) -> Self: ...
    @property
    def min_ngram(self) -> int:
        """Shortest suffix it matches."""
    @property
    def max_ngram(self) -> int:
        """Longest suffix it matches."""
    def lookup(self, history: Sequence[int], num_drafts: int) -> list[int]:
        """The drafts for `history` without any state: the continuation of the most recent
        earlier occurrence of its longest matching suffix.
        """

@disjoint_base
class SuffixDecoding(DraftProposer):
    """Drafting from suffix trees over the prompt, the output so far and the outputs of earlier
    sequences on this proposer (host-only, no device memory). With `trees=True` it grows
    draft trees (`grows_trees()`): the continuations of its match most likely to be reached,
    best first, which the engine verifies under `draft_shape="tree"`.
    """

    def __new__(
        cls,
        max_depth: int = ...,
        min_token_prob: float = ...,
        max_spec_factor: float = ...,
        max_tree_nodes: int = ...,
        *,
        trees: bool = ...,
    ) -> Self: ...
    @property
    def max_depth(self) -> int:
        """Longest string the trees keep: the matched suffix plus its drafts."""
    @property
    def min_token_prob(self) -> float:
        """Drafting stops before a draft reached with a lower estimated probability."""
    @property
    def max_spec_factor(self) -> float:
        """A match of `L` tokens drafts at most `floor(L * max_spec_factor)` tokens."""
    @property
    def max_tree_nodes(self) -> int:
        """The shared tree's bound, in nodes and in stored output tokens."""
    @property
    def trees(self) -> bool:
        """Whether it grows draft trees (`grows_trees()`), as built with `trees=True`."""
    def shared_tree(self) -> dict[str, int]:
        """What the shared tree of earlier outputs holds: outputs, tokens, nodes, bytes."""
    def remember_output(self, output: Sequence[int]) -> None:
        """Adds `output` to the shared tree as if a sequence had just produced it."""

@final
class Violation:
    """One broken contract: which check, what happened, how to fix it."""

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
    """What `check_proposer` found; true when no contract was broken."""

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

@disjoint_base
class MtpHead(DraftProposer):
    """The multi-token-prediction draft head of a checkpoint.

    Finds the MTP module of a DeepSeek-V3 / GLM, MiMo or Qwen3-Next checkpoint and drafts
    with it; every protocol method runs in Rust. Made with `MtpHead.from_checkpoint(path,
    gpu, ...)`; `MtpHead(path, gpu, ...)` is the same call, and a subclass's `__init__`
    receives those arguments.
    """

    def __new__(
        cls,
        path: str | PathLike[str],
        gpu: Backend,
        *,
        target: TargetModel | None = None,
        quant: str = "bf16",
        mtp_vocab_size: int = 0,
        max_seq_len: int = 4096,
        main_kv_blocks: int = 4096,
        levers: ModelLevers | None = None,
    ) -> Self: ...
    @classmethod
    def from_checkpoint(
        cls,
        path: str | PathLike[str],
        gpu: Backend,
        *,
        target: TargetModel | None = None,
        quant: str = "bf16",
        mtp_vocab_size: int = 0,
        max_seq_len: int = 4096,
        main_kv_blocks: int = 4096,
        levers: ModelLevers | None = None,
    ) -> Self:
        """Loads the MTP module of the checkpoint folder `path` onto `gpu`; called on a
        subclass, returns an instance of that subclass.

        With `target` (a `TargetModel` on `gpu`) the folder need hold only the head's own
        weights: the embedding, final norm and LM head are the target's, read in place (no
        copy), and the head keeps the target alive. `quant` is how the head's projections
        are stored: `"bf16"` (as given), `"fp8"`, `"nvfp4"`, or a GGUF block format such as
        `"q8_0"`, quantized at load by the quantizer `load_model(weights=...)` uses and run
        on the CPU backend's block kernels (another backend keeps the projections as given); `mtp_vocab_size` restricts drafts to the first
        rows of the LM head (0: all, or beside a target the `mtp_vocab_size` of the head's
        `config.json`).
        """
    @property
    def draft_vocab_size(self) -> int:
        """Rows of the LM head drafts are chosen from."""
    @property
    def projection_format(self) -> str:
        """How the head's own projections are stored (`"bf16"`, `"q8_0"`, ...)."""
    @property
    def bytes_per_draft(self) -> int:
        """Bytes of weights one draft step reads."""
    @property
    def kv_blocks(self) -> tuple[int, int]:
        """`(total, free)` blocks of the drafter KV pool."""
    @property
    def shares_target(self) -> bool:
        """Whether the head reads a target's embedding and LM head in place (loaded with
        `target=`).
        """
    @property
    def layout(self) -> str:
        """The checkpoint layout: `"deepseek_v3"`, `"mimo"` or `"qwen3_next"`."""
    def last_logits(self, gpu: Backend, row: int = 0) -> npt.NDArray[np.float32]:
        """Row `row` of the f32 logits of the head's latest forward."""
    def set_grow_trees(self, on: bool) -> None:
        """Turns tree growth on or off (off by default): on, `grows_trees()` is true and an
        engine under `draft_shape="tree"` asks the head for EAGLE-2 trees, grown together
        for the sequences that propose together.
        """

@disjoint_base
class Eagle3Head(DraftProposer):
    """The EAGLE-3 draft head of a checkpoint (speculators or original EAGLE-3 layout).

    Drafts from the target's hiddens captured at several layers (its `target_layer_ids`),
    which the engine passes as `target_hidden_stack`; every protocol method runs in Rust.
    Made with `Eagle3Head.from_checkpoint(path, gpu, ...)`; `Eagle3Head(path, gpu, ...)` is the
    same call, and a subclass's `__init__` receives those arguments.
    """

    def __new__(
        cls,
        path: str | PathLike[str],
        gpu: Backend,
        *,
        target: TargetModel | None = None,
        target_layers: int | None = None,
        quant: str = "bf16",
        max_seq_len: int = 4096,
        main_kv_blocks: int = 4096,
        levers: ModelLevers | None = None,
    ) -> Self: ...
    @classmethod
    def from_checkpoint(
        cls,
        path: str | PathLike[str],
        gpu: Backend,
        *,
        target: TargetModel | None = None,
        target_layers: int | None = None,
        quant: str = "bf16",
        max_seq_len: int = 4096,
        main_kv_blocks: int = 4096,
        levers: ModelLevers | None = None,
    ) -> Self:
        """Loads the EAGLE-3 head in the checkpoint folder `path` onto `gpu`; called on a
        subclass, returns an instance of that subclass.

        The folder holds a speculators checkpoint (`config.json` with
        `speculators_model_type: "eagle3"`, `layers.0.*`) or an original EAGLE-3 one
        (`midlayer.*`): `fc`, the decoder layer, `norm`, `lm_head` over the draft vocabulary
        and `d2t`. With `target` (a `TargetModel` on `gpu`) the target's embedding is read in
        place unless the folder has `embed_tokens.weight`, and the target's layer count
        decides the default capture layers; without it, pass `target_layers` (the target's
        `num_hidden_layers`) and the folder must carry its own embedding. `quant` is how the
        head's matrices (`fc`, the layer's projections and its own LM head) are stored, as
        `MtpHead`'s `quant` says: `"bf16"` as loaded, `"q8_0"` (or another GGUF block format)
        quantized at load and run by the block-format kernels on the CPU, `"fp8"`, `"nvfp4"`.
        """
    @property
    def draft_vocab_size(self) -> int:
        """Rows of the head's own LM head (its draft vocabulary)."""
    @property
    def draft_to_target(self) -> npt.NDArray[np.uint32]:
        """The target id of each draft id (`d + d2t[d]`), as uint32."""
    @property
    def aux_layer_ids(self) -> list[int]:
        """The checkpoint's `eagle_aux_hidden_state_layer_ids` (or vLLM's default): the hidden
        entering layer `k`; `target_layer_ids()` is `k - 1` for each.
        """
    @property
    def format(self) -> str:
        """`"speculators"` or `"eagle3"` (the original release's `config.json`)."""
    @property
    def shares_target(self) -> bool:
        """Whether the head reads its target's embedding in place (loaded with `target=` from
        a folder without `embed_tokens.weight`).
        """
    @property
    def kv_blocks(self) -> tuple[int, int]:
        """`(total, free)` blocks of the drafter KV pool."""
    @property
    def bytes_per_draft(self) -> int:
        """Bytes of weights one draft step reads."""
    @property
    def projection_format(self) -> str:
        """The storage of the head's projections (`"bf16"`, `"q8_0"`, ...)."""
    @property
    def lm_head_format(self) -> str:
        """The storage of the head's own LM head (`"bf16"`, `"q8_0"`, ...)."""
    def last_logits(self, gpu: Backend, row: int = 0) -> npt.NDArray[np.float32]:
        """Row `row` of the f32 logits (over the draft vocabulary) of the head's latest forward."""
    def set_grow_trees(self, on: bool) -> None:
        """Turns tree growth on or off (off by default), as `MtpHead.set_grow_trees` does."""

@disjoint_base
class Hybrid(DraftProposer):
    """A proposer made of proposers: each step it drafts with the first member (in list order)
    that returns at least its `min_drafts` drafts and, under `choice="measured"` (the
    default), whose first drafts of that length (one, or more) have been accepted in this
    sequence at least as often as those of every later member; every member sees every step.

    `Hybrid([SuffixDecoding(), head])` drafts by retrieval where the text repeats and by the
    learned head elsewhere: a short suffix match on open text, right less often than the
    head, gives way to it. Until a step is measured the order decides, and a member that has
    stopped winning is tried again as its measurements fade. `choice="first"` is a fixed
    priority: the first member with a confident draft wins. Members are asked in order until
    one wins, and the members after it are still given the step with `num_drafts=0`. After
    verification the winner gets the accepted count, a member whose drafts lost the length of
    their common prefix with the accepted drafts, and the others 0; at the next step each
    member first catches up on the accepted drafts it did not draft (one `propose` of 0 drafts
    and one `after_verify(0)` per token), so its history and drafter KV follow the sequence.

    It grows draft trees (`grows_trees()`) when a member does: members that grow trees are
    asked `propose_tree` with the step's node budget, the others draft chains, the winner's
    tree is the hybrid's, and after verification each member keeps the path of its own
    drafts that the accepted tokens follow (`after_verify_tree` where its tree branched).

    `target_layers` (the target's decoder layer count) makes that catch-up exact for members
    that read `target_hidden` (the MTP head): the hybrid then also names the target's last
    layer among its `target_layer_ids`, whose captured rows are the final hiddens of the
    caught-up tokens. It defaults to the layer count of the target an `MtpHead` member was
    loaded beside (`target=` or `load_draft_head`); without one, caught-up tokens are paired
    with the step's `target_hidden`. `min_drafts` gives each member's threshold (default 1
    each). A member that raises fails the call with a `ProposerError` naming the member's
    index and class. Drafter KV is not carried between turns of a conversation.
    """

    def __new__(
        cls,
        members: Sequence[DraftProposer],
        *,
        target_layers: int | None = None,
        min_drafts: list[int] | None = None,
        choice: str = "measured",
    ) -> Self: ...
    @property
    def members(self) -> list[DraftProposer]:
        """The members, in the order they are asked (a new list each time)."""
    @property
    def min_drafts(self) -> list[int]:
        """Drafts each member must return to win a step."""
    @property
    def target_layers(self) -> int | None:
        """The target's layer count the catch-up pairs tokens with (None: not exact)."""
    @property
    def choice(self) -> str:
        """How each step's member is picked: `"measured"` or `"first"`."""

@disjoint_base
class DFlashHead(DraftProposer):
    """The DFlash draft head of a checkpoint (z-lab's layout): a few Qwen3 layers that draft a
    whole block of `block_size - 1` tokens in one forward.

    Drafts from the target's hiddens captured at several layers (its `target_layer_ids`),
    which the engine passes as `target_hidden_stack`; `block_gamma()` is the checkpoint's
    `block_size`, so an engine asks it for `block_size - 1` drafts a step. Every protocol
    method runs in Rust. Made with `DFlashHead.from_checkpoint(path, gpu, target=model)`;
    `DFlashHead(path, gpu, target=model)` is the same call, and a subclass's `__init__`
    receives those arguments.
    """

    def __new__(
        cls,
        path: str | PathLike[str],
        gpu: Backend,
        *,
        target: TargetModel,
        draft_vocab: int | None = None,
        quant: str = "bf16",
        max_seq_len: int | None = None,
        main_kv_blocks: int | None = None,
    ) -> Self: ...
    @classmethod
    def from_checkpoint(
        cls,
        path: str | PathLike[str],
        gpu: Backend,
        *,
        target: TargetModel,
        draft_vocab: int | None = None,
        quant: str = "bf16",
        max_seq_len: int | None = None,
        main_kv_blocks: int | None = None,
    ) -> Self:
        """Loads the DFlash head in the checkpoint folder `path` beside `target` (a
        `TargetModel` on `gpu`); called on a subclass, returns an instance of that subclass.

        The folder holds z-lab's layout: `config.json` (a Qwen3 config of the draft layers
        with `block_size`, `num_target_layers` and `dflash_config: {target_layer_ids,
        mask_token_id}`) and safetensors of `fc`, `hidden_norm`, `layers.*` and `norm`. The
        target's embedding and LM head are read in place. `draft_vocab`: score only the LM
        head's first `draft_vocab` rows (every row when `None`). `quant`: the head's
        projections as stored (`"bf16"`) or quantized at load to a GGUF block format
        (`"q8_0"`, ...; on the CPU backend, run by the kernels the target's quantized
        projections run on). `max_seq_len` and `main_kv_blocks` size the drafter KV pool (the
        target's by default).
        """
    @property
    def block_size(self) -> int:
        """γ: rows of one block forward; a propose drafts at most `block_size - 1` tokens."""
    @property
    def mask_token_id(self) -> int:
        """The token every block row after the first holds (`dflash_config.mask_token_id`)."""
    @property
    def draft_vocab_size(self) -> int:
        """Rows of the target's LM head drafts are chosen from."""
    @property
    def projection_format(self) -> str:
        """The storage of the head's projections (`"bf16"`, `"q8_0"`, ...)."""
    @property
    def num_layers(self) -> int:
        """Draft layers."""
    @property
    def kv_blocks(self) -> tuple[int, int]:
        """`(total, free)` blocks of the drafter KV pool."""
    @property
    def bytes_per_block(self) -> int:
        """Bytes of weights one block forward reads (the draft layers, `norm`, the block's
        embedding rows and the LM head rows drafts are chosen from).
        """
    def last_logits(self, gpu: Backend, row: int = 0) -> npt.NDArray[np.float32]:
        """Row `row` of the f32 logits (over the draft vocabulary) of the latest block: the
        logits that picked draft `row`.
        """

def quantize_nvfp4(
    w: npt.NDArray[np.float32],
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], float]:
    """Quantizes a float32 `[out, in]` matrix to NVFP4 (ModelOpt layout) with the Rust
    quantizer: returns `(weight uint8 [out, in/2], weight_scale uint8 [out, in/16] (FP8
    E4M3 bytes), weight_scale_2 float)`.
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
    """Drives `proposer` through the whole lifecycle and reports every broken contract.

    The proposer is driven as the engine would drive it, on synthetic inputs; each
    violation says what to fix. Runs on `gpu` (a fresh CPU backend by default); nothing
    else should allocate on it meanwhile, since allocations still live at the end are
    reported as leaks. A proposer whose weights live on a backend (`MtpHead`) must be
    checked on that backend: pass it as `gpu=`, else `RequestError` says so.
    """

@final
class _DynProposer(DraftProposer):
    """A proposer seen through `dyn DraftProposer`: every method call goes through the same
    path the engine uses (Python overrides through the adapter, the rest in Rust).
    """

    @property
    def python_methods(self) -> list[str]:
        """The methods that call into Python; every other one runs in Rust."""

def _as_rust(proposer: DraftProposer) -> _DynProposer:
    """`proposer` as the engine sees it."""

def _time_propose(
    proposer: DraftProposer,
    iters: int = 20000,
    num_drafts: int = 4,
    vocab_size: int = 256,
    prompt_len: int = 64,
) -> dict[str, float]:
    """Times `propose` through `dyn DraftProposer`, driven from Rust with the interpreter
    released. Returns microseconds per call: median, p10, p90, mean, plus the draft count.
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
    def kv_blocks(self) -> tuple[int, int]:
        """`(total, free)` blocks of the KV pool."""
    @property
    def tokenizer(self) -> Any | None:
        """The model's tokenizer (a `specdraft.Tokenizer` with its chat template), or None when
        the model file carries none that specdraft can read.
        """
    def logits(self, tokens: Sequence[int]) -> npt.NDArray[np.float32]:
        """The f32 logits of a fresh forward over `tokens`, as a flat numpy array of
        `len(tokens) * vocab_size` values (row-major); the KV it used is returned at once.
        """
    def hidden_states(
        self, tokens: Sequence[int], layers: Sequence[int] | None = None
    ) -> npt.NDArray[np.float32]:
        """The hidden state before the final norm at every position of a fresh forward over
        `tokens` (teacher forcing), as a float32 numpy array `[len(tokens), hidden]`; long
        inputs run in chunks of `max_rows`, and the KV is returned at once.

        With `layers` (decoder layer ids, each below `config.num_hidden_layers`, none twice)
        it is instead the hidden after each of those layers, side by side in the order given:
        `[len(tokens), len(layers) * hidden]`, what the engine passes a proposer that names
        them as `target_layer_ids` (id `i` is layer `i`'s output, before any final norm).
        """
    def generate_greedy(self, prompt: Sequence[int], max_tokens: int = 16) -> list[int]:
        """Greedy decoding without drafting (the engine with no proposer): the ids that follow
        `prompt`, at most `max_tokens`, ending after an end-of-sequence id.
        """

def load_model(
    path_or_name: str | PathLike[str],
    gpu: Backend | None = None,
    max_rows: int = 512,
    max_seq_len: int | None = None,
    kv_blocks: int | None = None,
    weights: str | None = None,
    comm: Communicator | None = None,
) -> TargetModel:
    """Loads a target model from a HF checkpoint folder, a `.gguf` file, or a known name
    (`"smollm2"`), with the tokenizer the file carries as `model.tokenizer`. `gpu`
    defaults to a new `CpuBackend` (with `comm`, one whose kernels take this rank's share of
    the host's cores: cores / the ranks `mpiexec` started on the host). `weights` (`"q8_0"`, `"q4_0"`, `"q4_k"`, ...) quantizes
    a safetensors checkpoint's matrices at load; `None` keeps what the file has. `comm`
    (from `specdraft.distributed.init()`) loads this rank's share of a multi-rank model:
    each MoE layer's routed experts are split evenly across the ranks (a count the ranks do
    not divide is refused), everything else is replicated. On rank 0, `SpecEngine` then
    announces each forward to the workers, which serve it with `SpecEngine.run_worker()`.
    """

def gguf_metadata(path: str | PathLike[str], keys: Sequence[str] | None = None) -> dict[str, Any]:
    """The metadata of a GGUF file as a dict (all keys, or only `keys` that are present)."""

@final
class GenerationResult:
    """The outcome of one prompt of `SpecEngine.generate`, `SpecEngine.chat` or
    `Conversation.send`.
    """

    @property
    def tokens(self) -> list[int]:
        """Generated token ids (the EOS id included when it ended the sequence)."""
    @property
    def text(self) -> str | None:
        """The decoded text of the generated tokens, without the EOS token that ended them;
        None when the engine has no tokenizer.
        """
    @property
    def finish_reason(self) -> str:
        """Why it ended: "stop", "length", "context", "grammar" or "error"."""
    @property
    def error(self) -> SpecdraftError | None:
        """The exception that ended the sequence (a `SpecdraftError` subclass, with the error it
        wraps as its `__cause__`) when `finish_reason` is "error", else None.
        """
    @property
    def metrics(self) -> dict[str, Any]:
        """Acceptance and timing figures (a dict): drafted, accepted, verify_steps, emitted,
        decode_tokens, prompt_tokens, mean_acceptance_length, acceptance_rate,
        acceptance_by_position, drafted_at, accepted_at, draft_lengths (steps that asked
        for k drafts at index k), draft_time_s, verify_time_s, prefill_time_s, queue_time_s
        (time waiting for a slot and KV blocks), time_to_first_token_s (from the call's
        start), preemptions, recomputed_tokens, wall_time_s, tokens_per_s.
        """

@final
class GenerationStream:
    """The iterator `SpecEngine.stream` returns: yields `(request_index, new_token_ids,
    text_delta)` as tokens are verified (`text_delta` is None when the engine has no
    tokenizer; it stops before the EOS token that ends a request). After the last item,
    `results` holds one `GenerationResult` per prompt. `close()` (or leaving a `with` block)
    stops the generation and frees what it holds; requests it cut short end with an error.
    """

    def __iter__(self) -> Self: ...
    def __next__(self) -> tuple[int, list[int], str | None]: ...
    @property
    def results(self) -> list[GenerationResult] | None:
        """One `GenerationResult` per prompt once the stream has ended (or been closed), else
        None.
        """
    def close(self) -> None:
        """Stops the generation now and frees everything it holds; requests that had not
        ended end with an error saying so. Closing twice does nothing.
        """
    def __enter__(self) -> Self: ...
    def __exit__(self, *_args: object) -> bool: ...

_Messages: TypeAlias = Sequence[dict[str, str]]

@final
class Conversation:
    """A chat session that carries the drafter's KV from one turn to the next: each `send`
    adds a turn to the history and generates the reply. Made by `SpecEngine.conversation()`.
    """

    def send(
        self,
        message: str | Sequence[int],
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        grammar: Any | None = None,
        ignore_eos: bool = False,
    ) -> GenerationResult:
        """Sends `message` and returns the reply. A string is a user turn, rendered with the
        tokenizer's chat template; the assistant's turn is closed after the reply. A list of
        token ids is appended to the history as it is. The options are `generate`'s. A bad
        request raises `RequestError` and changes nothing; a failure while running raises
        and leaves the history as it was.
        """
    @property
    def history(self) -> list[int]:
        """Every token so far: prompts, replies and the template's turn closings."""
    @property
    def messages(self) -> list[dict[str, str]]:
        """The text turns so far, as `{"role", "content"}` messages."""
    @property
    def carried_rows(self) -> int:
        """Drafter KV rows carried into the next turn (0 when none)."""
    def reset(self) -> None:
        """Forgets the history and the messages, and frees carried drafter KV."""

@final
class ServingEngine:
    """`ServingEngine(engine)`: a long-lived generation on `engine` (a `SpecEngine`, whose
    proposer, draft policy, batch limits and KV pool it uses) that takes requests while it
    runs. `submit` queues a request and returns its id; `step` runs one scheduler
    iteration, in which queued requests join the running batch as slots and KV blocks allow,
    and returns `(id, new_token_ids, finish_reason, metrics, error)` for each request that
    emitted tokens or ended (`finish_reason` is "stop", "length", "context", "grammar",
    "error" or "cancelled", with the request's metrics dict, on its last update);
    `cancel(id)` ends a request and frees what it holds at once. One thread should drive it;
    calls from others wait for the running step.
    """

    def __new__(cls, engine: SpecEngine) -> Self: ...
    def submit(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        grammar: Any | None = None,
        ignore_eos: bool = False,
    ) -> int:
        """Queues one prompt (a string, or a list of token ids) with `SpecEngine.generate`'s
        options and returns its id. A bad request (the engine's checks, a prompt plus
        `max_tokens` beyond the context or the whole KV pool) raises `RequestError` and
        nothing is queued.
        """
    def cancel(self, id: int) -> bool:
        """Ends request `id` and frees its KV, proposer state and buffers now; returns False
        when no such request is queued or running. Its end ("cancelled") comes with the
        next step's updates.
        """
    def step(
        self,
    ) -> list[tuple[int, list[int], str | None, dict[str, Any] | None, SpecdraftError | None]]:
        """One scheduler iteration (nothing when no request is queued or running), then what
        each request emitted since the last step: a list of `(id, new_token_ids,
        finish_reason, metrics, error)`.
        """
    @property
    def waiting(self) -> int:
        """Requests waiting for a slot or KV blocks."""
    @property
    def running(self) -> int:
        """Requests in the running batch."""
    @property
    def idle(self) -> bool:
        """Whether no request is queued or running."""
    @property
    def kv_blocks(self) -> tuple[int, int] | None:
        """The target's KV pool as `(total_blocks, free_blocks)`, or None when the model's KV
        is not a pool of blocks.
        """
    def close(self) -> None:
        """Ends every request still queued or running and frees what they hold; later calls
        raise. Closing twice does nothing.
        """

@final
class SpecEngine:
    """`SpecEngine(model, proposer=None, num_drafts=4, *, tokenizer=None, levers=None,
    max_batch=256, max_batch_tokens=None, draft_policy="adaptive", draft_shape="tree")`:
    speculative decoding on a target model with an optional proposer.

    `tokenizer` defaults to `model.tokenizer`, so text prompts and chat messages work with
    a model that carries one; without `levers` they are read from the `SPECDRAFT_*`
    variables. Prompts wait in a queue and run while the model's KV pool has room (the
    newest is preempted and later recomputed when it runs dry, without changing its
    output): `max_batch` bounds the sequences that run at once, `max_batch_tokens` the rows
    of one forward (long prompts are prefilled in chunks of it; None: the model's limit).
    A prompt whose `max_tokens` the whole pool could never hold fails alone.
    `draft_policy` is `"adaptive"` (each step, each sequence is asked for the draft count,
    up to `num_drafts`, that maximises expected tokens per second from its measured
    acceptance and the measured cost of drafting and verifying) or `"fixed"` (always
    `num_drafts`). `draft_shape` is `"tree"` (a proposer that grows trees, such as
    `PromptLookup`, is asked `propose_tree` with that count as its node budget, and one
    forward verifies every node: greedily, or by lossless rejection sampling over the tree
    when sampling, under the grammar's masks when there is one) or `"chain"` (always
    `propose`).
    """

    def __new__(
        cls,
        model: TargetModel,
        proposer: DraftProposer | None = None,
        num_drafts: int = 4,
        *,
        tokenizer: Any | None = None,
        levers: ModelLevers | None = None,
        max_batch: int = 256,
        max_batch_tokens: int | None = None,
        draft_policy: str = "adaptive",
        draft_shape: str = "tree",
    ) -> Self: ...
    @property
    def draft_policy(self) -> str:
        """The rule that picks each step's draft count: "adaptive" or "fixed"."""
    @property
    def draft_shape(self) -> str:
        """What the engine asks its proposer for: "tree" or "chain"."""
    @property
    def drafts_trees(self) -> bool:
        """Whether steps draft trees: the shape is "tree" and the proposer grows them."""
    def run_worker(self) -> dict[str, Any]:
        """On a worker (rank > 0) of a model loaded with `load_model(..., comm=comm)`: runs
        every forward rank 0 announces (prefills, verifies, trims, frees, and the calls of a
        draft head whose experts are split, which this engine's proposer then runs) on this
        rank's shard, until rank 0 calls `close()`. Returns what it served: `{"commands",
        "by_kind", "failed", "last_error", "leftover_sequences"}` (`by_kind` counts the
        commands by their `"kind"`). Raises `RequestError` on a model
        loaded on one rank, and `BackendError` if the ranks fall out of step (a rank died or
        hung past the communicator's timeout).
        """
    def close(self) -> None:
        """On rank 0 of a multi-rank model, tells the workers to leave `run_worker()` (once;
        later calls do nothing). On one rank or on a worker it does nothing. Call it when
        done with the engine; `with SpecEngine(...) as engine:` calls it on exit.
        """
    def __enter__(self) -> Self:
        """The engine itself, for a `with` block that ends in `close()`."""
    def __exit__(self, *args: object) -> bool:
        """Calls `close()`; exceptions propagate."""
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
        """One completion per prompt (a string, or a list of token ids), all stepping
        together; prompt `i` samples with seed `seed + i`. A bad request raises
        `RequestError` and nothing runs; a prompt that fails while running (a proposer
        error, out of memory) has `finish_reason == "error"` and its exception in `error`,
        and the others run on.
        """
    def stream(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        grammar: Any | None = None,
        ignore_eos: bool = False,
    ) -> GenerationStream:
        """`generate`'s prompts and options, streamed: returns a `GenerationStream` that yields
        `(request_index, new_token_ids, text_delta)` as tokens are verified (`text_delta`
        is None without a tokenizer; multi-byte characters are never split). A bad request
        raises `RequestError` before anything runs. Use it in a `with` block, or call
        `close()`, to free its sequences early; its `results` hold the `GenerationResult`s
        once it has ended.
        """
    def chat(
        self,
        conversations: Sequence[_Messages],
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        grammar: Any | None = None,
        ignore_eos: bool = False,
    ) -> list[GenerationResult]:
        """One reply per conversation, each a list of `{"role", "content"}` messages rendered
        with the tokenizer's chat template (the assistant's turn opened); the options are
        `generate`'s.
        """
    @property
    def last_metrics(self) -> dict[str, Any] | None:
        """Figures of the last `generate` or `chat` call over all its prompts (a dict), or None."""
    @property
    def num_drafts(self) -> int:
        """Most drafts per step."""
    @property
    def max_batch(self) -> int:
        """Most sequences running at once."""
    @property
    def max_batch_tokens(self) -> int:
        """Most rows in one forward (the model's own limit included)."""
    @property
    def proposer(self) -> DraftProposer | None:
        """The proposer object given at construction, or None."""
    @property
    def tokenizer(self) -> Any | None:
        """The tokenizer text goes through (the model's own unless one was given), or None."""
    def conversation(self) -> Conversation:
        """A multi-turn chat on this engine that carries the drafter's KV between turns."""

@final
class Communicator:
    """The ranks of a multi-rank serve: rank and size, sum all-reduce, broadcast, barrier, and
    rank 0's commands to its workers.

    `specdraft.distributed.init()` makes one over MPI (under `mpiexec`), or over NCCL with
    `backend="nccl"`; `Communicator.local()` is rank 0 of 1, whose collectives are the
    identity. A collective that some rank does not join within `timeout` seconds raises
    `BackendError` naming the ranks, and the communicator refuses every later call.
    """

    @staticmethod
    def local() -> Communicator:
        """Rank 0 of a world of one: every collective is the identity."""
    @staticmethod
    def _from_mpi(
        comm: Any, mpi: Any, timeout: float, command_timeout: float | None = None
    ) -> Communicator:
        """The communicator over an mpi4py communicator `comm` (`mpi` is the `mpi4py.MPI`
        module); `specdraft.distributed.init()` calls this.
        """
    @staticmethod
    def _nccl_unique_id() -> bytes:
        """A new NCCL unique id (128 bytes), made on rank 0 and sent to every rank;
        `specdraft.distributed.init(backend="nccl")` calls this. Raises
        `BackendUnavailableError` without libnccl or in a build without CUDA.
        """
    @staticmethod
    def _from_nccl(
        rank: int,
        size: int,
        unique_id: bytes,
        device: int,
        timeout: float,
        command_timeout: float | None = None,
    ) -> Communicator:
        """Rank `rank` of `size` over NCCL on GPU `device`, joining the ranks given the same
        `unique_id`; `specdraft.distributed.init(backend="nccl")` calls this.
        """
    @property
    def rank(self) -> int:
        """The rank of this process, `0..size`."""
    @property
    def size(self) -> int:
        """Number of ranks."""
    @property
    def timeout(self) -> float | None:
        """Seconds a collective waits for the other ranks (`None` for the local communicator,
        whose collectives never wait).
        """
    def all_reduce(self, array: npt.ArrayLike, dtype: str | None = None) -> npt.NDArray[Any]:
        """The element-wise sum of every rank's `array`, as a new array of its shape.

        float32 arrays sum in f32. With `dtype="bf16"`, `array` holds bf16 bit patterns as
        uint16: they are summed in f32 and rounded to bf16 once.
        """
    def broadcast(self, data: bytes | None = None, root: int = 0) -> bytes:
        """`root`'s `data` on every rank (other ranks' `data` is ignored and may be `None`)."""
    def barrier(self) -> None:
        """Returns once every rank has called it."""
    def costs(self) -> dict[str, dict[str, float]]:
        """What the calls on this communicator cost so far, by operation (`"all_reduce_f32"`,
        `"all_reduce_bf16"`, `"broadcast"`, `"barrier"`, `"send_command"`,
        `"recv_command"`): `{"calls", "bytes", "seconds"}`, bytes being the payload this
        rank passed in or received. Counts every call since `init()` or `reset_costs()`.
        """
    def reset_costs(self) -> None:
        """Forgets the costs counted so far."""
    def send_command(self, command: dict[str, Any]) -> None:
        """Rank 0 sends `command` to every worker: a dict with `"kind"` and its fields:
        `"prefill"` and `"verify"` take `"batch"` (a list of `{"seq", "tokens"}`) and
        optionally `"layers"` (capture layers), a verify also `"trees"` (per sequence a
        parent list or None); `"trim"` `"seq"` and `"len"`; `"compact"` `"seq"`, `"start"`
        and `"rows"`; `"free"` `"seq"`; `"shutdown"` nothing. A sharded proposer's calls
        name its `"state"`: `"mtp_propose"` (`"last_token"`, `"position"`, `"num_drafts"`,
        `"hidden"` bytes, optional `"grammar"`), `"proposer_alloc"` (`"budget"`),
        `"proposer_prefill"` (`"tokens"`, `"hidden"`), `"proposer_after_verify"`
        (`"accepted"`), `"proposer_catchup"` (`"tokens"`, `"hidden"`, `"row_base"`,
        `"pos_base"`) and `"proposer_free"`; `"mtp_propose_batch"` names its `"states"`, with
        `"last_tokens"`, `"positions"`, `"num_drafts"`, `"hidden"` (every row's bytes, one
        after another) and `"confidences"` (a bool).
        """
    def recv_command(self) -> dict[str, Any]:
        """A worker's next command from rank 0, as the dict `send_command` was given."""
