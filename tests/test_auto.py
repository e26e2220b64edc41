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
    monkeypatch.setattr(backends, "_mem_available", lambda: 1000)
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
