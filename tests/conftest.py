"""Shared fixtures.  Every asyncio test runs twice: on plain asyncio and on uvloop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable, Mapping

import pytest

from tools.synth import write_gguf_moe, write_safetensors_moe

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def _uvloop_factory() -> LoopFactory:
    try:
        import uvloop
    except ImportError:
        def skip() -> asyncio.AbstractEventLoop:
            pytest.skip("uvloop is not installed (pip install uvloop); the asyncio run covers this test")

        return skip
    return uvloop.new_event_loop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, LoopFactory]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": _uvloop_factory()}


@pytest.fixture(params=["pread", "odirect", "mmap", "uring"])
def backend(request: pytest.FixtureRequest) -> str:
    """Each read backend in turn; one that cannot run here is skipped with its reason."""
    import backends

    name: str = request.param
    reason = backends.available()[name]
    if reason is not None:
        pytest.skip(f"backend {name} is unavailable here: {reason}")
    return name


# Small shapes keep the suite fast; the index and the store treat them like real ones.
LAYERS, EXPERTS, HIDDEN, INTER = 4, 8, 64, 48


@pytest.fixture(scope="session")
def st_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-shard safetensors MoE checkpoint with model.safetensors.index.json (float16)."""
    folder = tmp_path_factory.mktemp("st")
    return write_safetensors_moe(
        folder, n_layers=LAYERS, n_experts=EXPERTS, hidden=HIDDEN, intermediate=INTER,
        dtype="float16", n_shards=2, seed=1,
    )


@pytest.fixture(scope="session")
def gguf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "moe.gguf"
    return write_gguf_moe(path, n_layers=LAYERS, n_experts=EXPERTS, hidden=HIDDEN, intermediate=INTER, seed=2)


@pytest.fixture
def st_copy(st_checkpoint: Path, tmp_path: Path) -> Path:
    """A private copy of the safetensors checkpoint, for tests that damage files."""
    import shutil

    dest = tmp_path / "ckpt"
    shutil.copytree(st_checkpoint, dest)
    return dest


@pytest.fixture
def mirrored(st_checkpoint: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Two byte-identical copies of the safetensors checkpoint: a primary and its mirror."""
    import shutil

    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    shutil.copytree(st_checkpoint, primary)
    shutil.copytree(st_checkpoint, mirror)
    return primary, mirror
