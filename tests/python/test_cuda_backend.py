"""The CUDA backend from Python: the error without a GPU, ``default_backend``'s fallback,
and, on a machine with a GPU, round trips and a model forward that agrees with the CPU.

Without a GPU the GPU tests are skipped with their reason (``pytest -rs`` lists them). With
``SPECDRAFT_REQUIRE_GPU=1`` (set by ``tests/gpu/run.sh`` on the GPU machine) they are never
skipped: a GPU that cannot be opened makes them fail."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import specdraft
from specdraft import AllocationError, BackendUnavailableError

NOT_BUILT = "built without the `cuda` feature"


def _driver_present() -> bool:
    """Whether the CUDA driver library loads, looked at independently of specdraft."""
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return True
    return False


def _open_gpu() -> tuple[specdraft.Backend | None, bool]:
    """A GPU backend if this machine and build have one, and whether the build has CUDA."""
    try:
        return specdraft.CudaBackend(0), True
    except BackendUnavailableError as e:
        return None, NOT_BUILT not in str(e)


DRIVER = _driver_present()
_PROBE, BUILT_WITH_CUDA = _open_gpu()
HAS_GPU = _PROBE is not None
del _PROBE
needs_cuda_build = pytest.mark.skipif(
    not BUILT_WITH_CUDA, reason="specdraft was built without the `cuda` feature"
)
REQUIRE_GPU = os.environ.get("SPECDRAFT_REQUIRE_GPU") == "1"
needs_gpu = pytest.mark.skipif(
    not HAS_GPU and not REQUIRE_GPU, reason="no usable CUDA GPU on this machine"
)


@pytest.fixture
def cuda() -> specdraft.Backend:
    backend = specdraft.CudaBackend(0)
    yield backend
    assert backend.live_allocs == 0, backend.live_report()
    assert backend.live_bytes == 0


def test_backend_unavailable_error_is_a_specdraft_error():
    assert issubclass(BackendUnavailableError, specdraft.SpecdraftError)
    assert not issubclass(BackendUnavailableError, AllocationError)


def test_cuda_backend_is_a_backend_subclass_in_every_build():
    assert issubclass(specdraft.CudaBackend, specdraft.Backend)
    assert not issubclass(specdraft.CudaBackend, specdraft.CpuBackend)
    assert "CudaBackend" in specdraft.__all__


@pytest.mark.skipif(BUILT_WITH_CUDA, reason="this build has the `cuda` feature")
def test_a_build_without_cuda_says_so():
    with pytest.raises(BackendUnavailableError, match="built without the `cuda` feature"):
        specdraft.CudaBackend(0)


@needs_cuda_build
@pytest.mark.skipif(DRIVER, reason="a CUDA driver is installed here")
def test_without_a_driver_the_error_names_the_missing_driver():
    with pytest.raises(BackendUnavailableError, match=r"no CUDA driver \(libcuda\) found"):
        specdraft.CudaBackend(0)
    with pytest.raises(BackendUnavailableError, match="CUDA unavailable"):
        specdraft.CudaBackend(device=3)


@needs_cuda_build
@pytest.mark.skipif(not DRIVER, reason="no CUDA driver here")
def test_a_device_that_does_not_exist_is_named():
    with pytest.raises(BackendUnavailableError, match=r"no CUDA device 4096 \(found \d+\)"):
        specdraft.CudaBackend(4096)


def test_a_negative_device_is_rejected_not_a_crash():
    with pytest.raises(OverflowError):
        specdraft.CudaBackend(-1)


def test_default_backend_is_the_best_available_and_works():
    backend = specdraft.default_backend()
    if HAS_GPU:
        assert isinstance(backend, specdraft.CudaBackend)
        assert backend.name == "cuda:0"
    else:
        assert isinstance(backend, specdraft.CpuBackend)
        assert backend.name == "cpu"
    a = np.arange(-6, 6, dtype=np.float32).reshape(3, 4) / 4
    p = backend.upload(a, tag="default")
    assert backend.live_allocs == 1 and backend.live_bytes == a.nbytes
    np.testing.assert_array_equal(backend.download(p, "f32", (3, 4)), a)
    backend.free(p)
    assert backend.live_allocs == 0 and backend.live_bytes == 0


def test_default_backend_returns_a_fresh_backend_each_call():
    a, b = specdraft.default_backend(), specdraft.default_backend()
    assert a is not b
    p = a.upload(np.ones(4, dtype=np.float32))
    assert b.live_allocs == 0
    with pytest.raises(AllocationError):
        b.free(p)
    a.free(p)


@needs_gpu
def test_cuda_round_trips_every_dtype(cuda):
    assert cuda.name == "cuda:0" and cuda.device == 0
    assert cuda.device_name
    free, total = cuda.memory_info()
    assert 0 < free <= total
    cases = [
        (np.linspace(-3.0, 7.5, 24, dtype=np.float32).reshape(2, 3, 4), "f32"),
        (np.array([0, 1, 2**32 - 1, 49151], dtype=np.uint32), "u32"),
        (np.array([-5, 0, 2**31 - 1], dtype=np.int32), "int32"),
        (np.arange(7, dtype=np.uint8), np.uint8),
        (np.array([0.5, -1.25, 65504.0], dtype=np.float16), "f16"),
    ]
    for arr, dtype in cases:
        p = cuda.upload(arr)
        out = cuda.download(p, dtype, arr.shape)
        assert out.dtype == arr.dtype
        np.testing.assert_array_equal(out, arr)
        cuda.free(p)
    p = cuda.upload(np.array([1.0, 1.0 + 2**-8, -2.5], dtype=np.float32), dtype="bf16")
    np.testing.assert_array_equal(cuda.download(p, "bf16", 3), [1.0, 1.0, -2.5])
    cuda.free(p)


@needs_gpu
def test_cuda_ledger_errors_are_exceptions(cuda):
    p = cuda.alloc(64, tag="probe")
    assert cuda.live_report()[0][1:] == (64, "probe")
    with pytest.raises(AllocationError, match="outside every live allocation"):
        cuda.download(p, "f32", 17)
    cuda.write(p.offset(32), np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(cuda.download(p.offset(32), "f32", 8), np.arange(8))
    cuda.free(p)
    with pytest.raises(AllocationError, match="double free"):
        cuda.free(p)


@needs_gpu
def test_a_model_on_the_gpu_agrees_with_the_cpu_and_keeps_its_backend(tmp_path, cuda):
    pytest.importorskip("gguf")
    sys.path.insert(0, str(Path(__file__).parent))
    from test_model import VOCAB, _write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    opts = {"max_rows": 32, "max_seq_len": 64, "kv_blocks": 8}
    cpu_model = specdraft.load_model(path, gpu=specdraft.CpuBackend(), **opts)
    gpu_model = specdraft.load_model(path, gpu=cuda, **opts)
    # The registry hands the user's own object back, with its Python type.
    assert gpu_model.gpu is cuda
    tokens = [1, 7, 33, 2, 79, 40, 40, 5, 12, 64, 3, 17]
    want = cpu_model.logits(tokens).reshape(len(tokens), VOCAB)
    got = gpu_model.logits(tokens).reshape(len(tokens), VOCAB)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
    assert (got.argmax(axis=1) == want.argmax(axis=1)).mean() >= 0.9
    del cpu_model, gpu_model
