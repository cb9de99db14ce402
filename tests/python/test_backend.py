"""Backend round trips, ledger errors as exceptions, DevicePtr and the block allocator."""

from __future__ import annotations

import os

import numpy as np
import pytest
import specdraft
from specdraft import AllocationError, DevicePtr


def test_f32_round_trip_keeps_values_and_shape(gpu):
    a = np.linspace(-3.0, 7.5, 24, dtype=np.float32).reshape(2, 3, 4)
    p = gpu.upload(a, tag="f32")
    assert gpu.live_allocs == 1 and gpu.live_bytes == a.nbytes
    out = gpu.download(p, "f32", a.shape)
    assert out.dtype == np.float32 and out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, a)
    gpu.free(p)


def test_u32_and_i32_and_u8_round_trip(gpu):
    for arr, name in [
        (np.array([0, 1, 2**32 - 1, 49151], dtype=np.uint32), "u32"),
        (np.array([-5, 0, 2**31 - 1], dtype=np.int32), "int32"),
        (np.arange(7, dtype=np.uint8), np.uint8),
    ]:
        p = gpu.upload(arr)
        np.testing.assert_array_equal(gpu.download(p, name, arr.shape), arr)
        gpu.free(p)


def test_bf16_rounds_to_nearest_even_and_comes_back_as_float32(gpu):
    # 1 + 2**-8 is halfway between two bf16 values: ties go to the even mantissa (1.0).
    a = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 3.140625], dtype=np.float32)
    p = gpu.upload(a, dtype="bf16")
    assert gpu.live_bytes == 2 * a.size
    out = gpu.download(p, "bf16", a.size)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [1.0, 1.0, 1.0 + 2**-6, -2.5, 3.140625])
    raw = gpu.download(p, "bf16", a.size, raw=True)
    assert raw.dtype == np.uint16 and raw[0] == 0x3F80
    gpu.free(p)


def test_f16_round_trip_and_write(gpu):
    a = np.array([0.5, -1.25, 65504.0], dtype=np.float16)
    p = gpu.upload(a)
    gpu.write(p.offset(2), np.array([7.0], dtype=np.float16))
    np.testing.assert_array_equal(gpu.download(p, np.float16, 3), [0.5, 7.0, 65504.0])
    gpu.free(p)


def test_non_contiguous_array_is_uploaded_in_c_order(gpu):
    a = np.arange(12, dtype=np.float32).reshape(3, 4).T
    p = gpu.upload(a)
    np.testing.assert_array_equal(gpu.download(p, "f32", (4, 3)), a)
    gpu.free(p)


def test_double_free_and_unknown_pointer_raise_allocation_error(gpu):
    p = gpu.alloc(16, tag="scratch")
    gpu.free(p)
    with pytest.raises(AllocationError, match=r"double free .*scratch"):
        gpu.free(p)
    with pytest.raises(AllocationError, match="unknown pointer"):
        gpu.free(DevicePtr(0x1234))
    assert isinstance(AllocationError("x"), specdraft.SpecdraftError)


def test_out_of_bounds_download_and_write_raise_and_name_the_allocation(gpu):
    p = gpu.alloc(16, tag="small")
    with pytest.raises(
        AllocationError, match=r"outside every live allocation.*\"small\" .* 16 bytes"
    ):
        gpu.download(p, "f32", 5)
    with pytest.raises(AllocationError, match="outside"):
        gpu.write(p.offset(12), np.zeros(2, dtype=np.float32))
    # Checked before any host buffer is made: a huge shape cannot exhaust host memory.
    with pytest.raises(AllocationError, match="outside every live allocation"):
        gpu.download(p, "f32", (2**34,))
    with pytest.raises(AllocationError, match="null pointer"):
        gpu.download(DevicePtr.NULL, "u8", 1)
    gpu.free(p)


def test_bad_arguments_raise_clear_errors_and_allocate_nothing(gpu):
    with pytest.raises(TypeError, match="numpy array"):
        gpu.upload([1.0, 2.0])
    with pytest.raises(TypeError, match="float64 are not supported"):
        gpu.upload(np.zeros(3))
    with pytest.raises(ValueError, match="does not match"):
        gpu.upload(np.zeros(3, dtype=np.uint32), dtype="bf16")
    with pytest.raises(ValueError, match="unknown dtype"):
        gpu.download(DevicePtr(0x1000), "float128", 1)
    with pytest.raises(AllocationError, match="zero bytes"):
        gpu.alloc(0)
    with pytest.raises(TypeError, match="DevicePtr or an int"):
        gpu.free("0x10")


def test_memory_limit_reports_out_of_memory():
    small = specdraft.CpuBackend(memory_limit=64)
    p = small.alloc(48)
    with pytest.raises(AllocationError, match="out of device memory"):
        small.alloc(32, tag="big")
    small.free(p)
    assert small.live_allocs == 0


def test_live_report_lists_pointer_size_and_tag(gpu):
    a = gpu.alloc(8, tag="a")
    b = gpu.alloc(24, tag="b")
    assert gpu.live_report() == [(a, 8, "a"), (b, 24, "b")]
    gpu.free(a)
    gpu.free(b)


def test_device_ptr_value_semantics():
    p = DevicePtr(0x1000)
    assert p.value == 0x1000 and int(p) == 0x1000 and not p.is_null()
    assert p.offset(16) == DevicePtr(0x1010)
    assert hash(p) == hash(DevicePtr(0x1000)) and len({p, DevicePtr(0x1000)}) == 1
    assert DevicePtr.NULL.is_null() and not DevicePtr.NULL
    assert repr(p) == "DevicePtr(0x1000)"
    with pytest.raises(AttributeError):
        p.value = 3


def test_block_allocator_exhaustion_message_and_unchanged_pool():
    pool = specdraft.BlockAllocator(4, 16)
    got = pool.alloc(3)
    assert sorted(got) == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(AllocationError, match="asked for 2 blocks, 1 of 4 free"):
        pool.alloc(2)
    assert pool.num_free == 1
    pool.retain(got[:1])
    pool.free(got)
    assert pool.num_free == 3 and pool.refcount(got[0]) == 1
    pool.release(got[:1])
    assert pool.num_free == 4 and pool.num_blocks == 4 and pool.block_size == 16
    with pytest.raises(AllocationError, match="not allocated"):
        pool.free([0])
    with pytest.raises(AllocationError, match="at least one block"):
        specdraft.BlockAllocator(0, 16)


def test_model_config_and_levers():
    cfg = specdraft.ModelConfig.tiny(1000)
    assert cfg.vocab_size == 1000 and cfg.model_type == "llama" and cfg.q_size == 64
    text = (
        '{"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256,'
        ' "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 500}'
    )
    q = specdraft.ModelConfig.from_json(text)
    assert q.attention_bias and q.num_key_value_heads == 4 and q.head_dim == 32
    with pytest.raises(specdraft.ConfigError, match='missing required key "vocab_size"'):
        specdraft.ModelConfig.from_json(text.replace(', "vocab_size": 500', ""))
    levers = specdraft.ModelLevers(mtp_kv_exact=True)
    assert levers.mtp_kv_exact and not levers.mtp_target_postnorm
    assert levers == specdraft.ModelLevers(mtp_kv_exact=True)


def test_levers_from_env(monkeypatch):
    monkeypatch.setenv("SPECDRAFT_MTP_TARGET_POSTNORM", "on")
    assert specdraft.ModelLevers.from_env().mtp_target_postnorm
    monkeypatch.setenv("SPECDRAFT_MTP_KV_EXACT", "maybe")
    with pytest.raises(specdraft.ConfigError, match="SPECDRAFT_MTP_KV_EXACT"):
        specdraft.ModelLevers.from_env()


def test_forward_context_hands_back_the_users_backend(gpu, ctx):
    assert ctx.gpu is gpu
    assert ctx.config.vocab_size == 256
    assert ctx.buffers.max_rows == 1


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (Linux), or None elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def test_cpu_backend_names_the_fastest_instruction_set_the_cpu_has():
    flags = _cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo to read the CPU's features from")
    # The kernel's own flag names, read independently of the library's run-time detection.
    # AMX tiles, where the CPU has them, are slower than AVX-512 VNNI at every row count a
    # forward makes, so a backend runs AVX-512 VNNI there too. AVX-512 VNNI does not need
    # the VEX-encoded AVX-VNNI (Zen 4 and Ice Lake have the first without the second).
    if {"avx2", "fma", "f16c"} <= flags:
        want = "avx2"
        if "avx_vnni" in flags:
            want = "avx2-vnni"
        if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
            want = "avx512-vnni"
    else:
        want = "portable"
    assert specdraft.CpuBackend().instruction_set == want


def test_cpu_backend_runs_its_kernels_on_the_threads_asked_for() -> None:
    cores = len(os.sched_getaffinity(0))
    assert specdraft.CpuBackend().threads == cores
    assert specdraft.CpuBackend(threads=3).threads == 3
    assert specdraft.CpuBackend(memory_limit=1 << 20, threads=1).threads == 1
    with pytest.raises(specdraft.RequestError, match="threads must be at least 1"):
        specdraft.CpuBackend(threads=0)
