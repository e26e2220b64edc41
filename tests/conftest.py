"""Shared fixtures.  Every asyncio test runs twice: on plain asyncio and on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from iosched.tools.synth import write_gguf_moe, write_safetensors_moe

if TYPE_CHECKING:
    from iosched import ExpertKey, ExpertStore

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def _uvloop_factory() -> LoopFactory:
    try:
        import uvloop
    except ImportError:
        def skip() -> asyncio.AbstractEventLoop:
            pytest.skip("uvloop is not installed (pip install uvloop); the asyncio run covers this test")

        return skip
    return uvloop.new_event_loop


def loop_factories() -> dict[str, LoopFactory]:
    """The event loops every asyncio test runs on, by name; uvloop's factory skips the test
    (with the reason) where uvloop is not installed."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": _uvloop_factory()}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything collection made (the test modules and what they import, torch and
    transformers among them: a few hundred thousand objects) lives for the whole session:
    ``gc.freeze()`` takes it out of the collector's sight, so that the full collections during
    the tests (the views' finalizer tests call ``gc.collect()``, and hypothesis' stateful runs
    trigger many) walk only what the tests made."""
    import gc

    gc.freeze()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """On a pytest-xdist worker under ``--dist loadgroup`` (``make test``), a test with an
    ``xdist_group`` mark must carry its group in its node id, which is all the scheduler sees.
    A pytest on which pytest-xdist cannot add it (pytest-xdist issue 1386) spreads a group
    over the workers: the corpus built on each, the loop-device tests side by side.  Each
    such test fails, saying so, instead of passing slower or flaking."""
    if (getattr(item.config.option, "loadgroup", False)  # set on xdist's workers only
            and item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid):
        pytest.fail(f"pytest-xdist did not apply this test's xdist_group mark on pytest {pytest.__version__}: "
                    "install the pytest the [test] extra allows (pyproject.toml), or run without --dist loadgroup",
                    pytrace=False)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, LoopFactory]:
    return loop_factories()


def require_backend(name: str, needs: str | None = None) -> str:
    """``name``, or skip the test with the reason the backend ``needs`` (default: ``name``)
    cannot run here."""
    from iosched import backends

    reason = backends.available()[needs or name]
    if reason is not None:
        pytest.skip(f"backend {name} is unavailable here: {reason}")
    return name


@pytest.fixture(params=["pread", "odirect", "mmap", "uring"])
def backend(request: pytest.FixtureRequest) -> str:
    """Each read backend in turn; one that cannot run here is skipped with its reason."""
    return require_backend(request.param)


def random_file(folder: Path, size: int) -> tuple[str, bytes]:
    """A file of ``size`` random bytes in ``folder``: its path and its bytes."""
    payload = os.urandom(size)
    path = folder / "blob.bin"
    path.write_bytes(payload)
    return str(path), payload


def cached_pages(path: str | os.PathLike[str], offset: int = 0, length: int = 0) -> int:
    """How many of the file's pages in ``[offset, offset + length)`` (0: to the end) the page
    cache holds (``mincore`` over a fresh read-only mapping: for a file this process owns, it
    reports the page cache, not only our mappings)."""
    import ctypes
    import mmap

    import numpy as np

    size = os.path.getsize(path)
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
        pages = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
        address = np.frombuffer(mm, dtype=np.uint8)
        rc = libc.mincore(address.ctypes.data, size, pages)
        del address  # the mapping closes only once no view of it is left
    if rc != 0:
        raise OSError(ctypes.get_errno(), f"mincore of {path}")
    first = offset // mmap.PAGESIZE
    last = -(-(offset + length) // mmap.PAGESIZE) if length else len(pages.raw)
    return sum(b & 1 for b in pages.raw[first:last])


def drop_page_cache(path: str | os.PathLike[str], offset: int = 0, length: int = 0) -> None:
    """Write back and drop the file's cached pages in ``[offset, offset + length)`` (0: to the
    end), so the next read of them goes to the drive.  Skips the test where the kernel keeps
    them (tmpfs, or a page mapped elsewhere), which would make a drive read look cached."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if cached_pages(path, offset, length):
        # (a partial drop too: the mmap backend would call such a range cached; a range the
        # kernel keeps cannot stand for a drive read)
        pytest.skip(f"the kernel keeps {path}'s pages [{offset}, +{length or 'end'}) cached after "
                    "POSIX_FADV_DONTNEED (tmpfs, or mapped elsewhere)")


def warm_page_cache(path: str | os.PathLike[str]) -> None:
    """Read the whole file through the page cache (buffered, not mapped)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass


@contextlib.contextmanager
def last_expert_cut_short(store: ExpertStore) -> Iterator[tuple[ExpertKey, list[ExpertKey], str]]:
    """The checkpoint's last expert made unreadable: its shard truncated where the expert
    begins (put back whole on exit).  Yields that expert, three experts of other shards, and
    the shard's path (a ``ReadError`` names it)."""
    bad = (LAYERS - 1, EXPERTS - 1)
    layout = store.index.experts[bad]
    path = store.index.files[layout.extents[0].file]
    good = [k for k, lay in store.index.experts.items() if store.index.files[lay.extents[0].file] != path][:3]
    original = Path(path).read_bytes()
    os.truncate(path, layout.extents[0].offset)
    try:
        yield bad, good, path
    finally:
        Path(path).write_bytes(original)


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


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache folder of the whole test session (one per xdist worker): where the commands
    build their checkpoints on first use (the demo's, the replay's, the soak's), so each is
    written once and reused by every test that runs that command, as a user's second run
    reuses it.  A test that checks where a command builds, or that it builds nothing, gives
    the command a ``tmp_path`` of its own instead."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session", autouse=True)
def _cache_dir_of_the_session(cache_dir: Path) -> Iterator[None]:
    """Every command the tests run, in this process or in a child process, caches under
    :func:`cache_dir`, never under the user's ``~/.cache/iosched``."""
    from iosched import override_settings

    saved = os.environ.get("IOSCHED_CACHE_DIR")
    os.environ["IOSCHED_CACHE_DIR"] = str(cache_dir)
    try:
        with override_settings(cache_dir=str(cache_dir)):
            yield
    finally:
        if saved is None:
            del os.environ["IOSCHED_CACHE_DIR"]
        else:
            os.environ["IOSCHED_CACHE_DIR"] = saved


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
