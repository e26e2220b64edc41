"""``backend="auto"``: the rule in docs/backends.md, on real files, with the machine's facts
(available memory, io_uring, O_DIRECT support) varied one at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from iosched import ExpertStore, backends

pytestmark = pytest.mark.asyncio


def files_of(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.glob("*.safetensors"))


async def test_small_checkpoint_goes_through_the_page_cache(st_checkpoint: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20) as store:
        s = store.stats()
        assert s["backend"] == "pread"
        assert "fits in half the available memory" in s["backend_reason"]


async def test_large_checkpoint_reads_direct(st_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import drop_page_cache

    monkeypatch.setattr(backends, "_mem_available", lambda: 1000)
    for path in files_of(st_checkpoint):
        drop_page_cache(path)  # cold: a warm page cache keeps it buffered (the next test)
    name, reason = backends.choose_auto(files_of(st_checkpoint))
    expected = "uring" if backends.available()["uring"] is None else "odirect"
    assert name == expected and "exceeds half the available memory" in reason
    monkeypatch.setattr(backends, "_uring_reason", lambda: "io_uring disabled by seccomp")
    name, reason = backends.choose_auto(files_of(st_checkpoint))
    assert name == "odirect" and "seccomp" in reason


async def test_no_o_direct_means_pread(st_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "_mem_available", lambda: 1000)
    monkeypatch.setattr(backends, "_accepts_direct", lambda path: False)
    name, reason = backends.choose_auto(files_of(st_checkpoint))
    assert name == "pread" and "refuses O_DIRECT" in reason


async def test_a_warm_page_cache_keeps_a_large_checkpoint_buffered(
        st_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past half the available memory, ``auto`` still reads buffered when the page cache holds
    the checkpoint already (a warm start, by ``mincore``), and O_DIRECT again once it is dropped."""
    from tests.conftest import drop_page_cache

    monkeypatch.setattr(backends, "_mem_available", lambda: 1000)
    files = files_of(st_checkpoint)
    for path in files:
        Path(path).read_bytes()
    assert backends.cached_share(files) == 1.0
    name, reason = backends.choose_auto(files)
    assert name == "pread" and "page cache holds 100 %" in reason
    for path in files:
        drop_page_cache(path)
    share = backends.cached_share(files)
    assert share is not None and share < backends.WARM_SHARE
    name, reason = backends.choose_auto(files)
    assert name in ("uring", "odirect") and "exceeds half the available memory" in reason
