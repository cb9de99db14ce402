"""Shared fixtures: a fresh CPU backend that must end every test with nothing live."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import specdraft


@pytest.fixture
def gpu() -> Iterator[specdraft.CpuBackend]:
    backend = specdraft.CpuBackend()
    yield backend
    assert backend.live_allocs == 0, backend.live_report()
    assert backend.live_bytes == 0


@pytest.fixture
def ctx(gpu: specdraft.CpuBackend) -> specdraft.ForwardContext:
    return specdraft.ForwardContext(gpu, specdraft.ModelConfig.tiny(256))
