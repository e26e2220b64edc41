"""Misuse of the API never loses a file, hangs, or leaks (issue #13, points 2, 5, 6 and 8).

* ``telemetry=`` / ``history=`` never write into a checkpoint nor over a file not ours, and a
  bad path is refused before anything is opened;
* a store belongs to its event loop: use from another thread or loop fails at once;
* ``open`` cancelled at any await, or failing at any step, and ``close`` cancelled or failing
  to save the history, leave no descriptor, thread or ring behind;
* every ``open`` argument of the wrong kind is a ``StoreError`` naming it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from iosched import ExpertStore, StoreError


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def settled_fds(baseline: set[str], seconds: float = 5.0) -> set[str]:
    """The descriptors open beyond ``baseline`` once worker threads finished (a cancelled
    backend open closes its descriptors when its thread ends)."""
    deadline = time.monotonic() + seconds
    while True:
        extra = open_fds() - baseline
        if not extra or time.monotonic() > deadline:
            return extra
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------------- telemetry= and history=


@pytest.mark.asyncio
async def test_outputs_inside_the_checkpoint_are_refused(st_copy: Path, tmp_path: Path) -> None:
    shard = next(st_copy.glob("*.safetensors"))
    before = shard.read_bytes()
    link = tmp_path / "looks-elsewhere.jsonl"
    link.symlink_to(shard)  # a path outside that resolves to a shard
    baseline = open_fds()
    for name, path, words in [
        ("telemetry", shard, "inside the checkpoint"),
        ("telemetry", st_copy / "new.jsonl", "inside the checkpoint"),
        ("telemetry", link, "inside the checkpoint"),
        ("history", st_copy / "usage.npz", "inside the checkpoint"),
        ("history", st_copy / "sub" / ".." / "usage.npz", "inside the checkpoint"),
    ]:
        with pytest.raises(StoreError, match=words) as info:
            kwargs: dict[str, Any] = {name: path}
            await ExpertStore.open(st_copy, budget_bytes=1 << 20, **kwargs)
        assert f"{name}=" in str(info.value)
    assert shard.read_bytes() == before
    assert not (st_copy / "new.jsonl").exists() and not (st_copy / "usage.npz").exists()
    assert not open_fds() - baseline


@pytest.mark.asyncio
async def test_a_file_of_the_checkpoint_outside_its_folder_is_refused(st_checkpoint: Path, tmp_path: Path) -> None:
    """A Hugging Face snapshot: the shards are links to blobs elsewhere; a blob is the shard."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    for f in st_checkpoint.iterdir():
        shutil.copy(f, blobs / f.name)
        (snapshot / f.name).symlink_to(blobs / f.name)
    blob = next(blobs.glob("*.safetensors"))
    before = blob.read_bytes()
    with pytest.raises(StoreError, match="is the checkpoint's file"):
        await ExpertStore.open(snapshot, budget_bytes=1 << 20, telemetry=blob)
    assert blob.read_bytes() == before


@pytest.mark.asyncio
async def test_an_existing_file_not_ours_is_never_overwritten(st_checkpoint: Path, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(StoreError, match="not an iosched telemetry file"):
        await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, telemetry=notes)
    unrelated = tmp_path / "weights.npy"
    np.save(unrelated, np.arange(4))
    data = unrelated.read_bytes()
    with pytest.raises(StoreError, match="not a history file"):  # was a TypeError
        await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, policy="default",
                               experts_per_token=2, history=unrelated)
    assert notes.read_text() == "my notes\n" and unrelated.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "weights.npy"]


@pytest.mark.asyncio
async def test_our_own_telemetry_file_is_replaced_at_close(st_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.jsonl"
    for run in range(2):
        async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, telemetry=out) as store:
            for _ in range(run + 1):
                store.token_boundary()
        assert len(out.read_text().splitlines()) == run + 2  # this run's lines only
    assert [p.name for p in tmp_path.iterdir()] == ["run.jsonl"]


@pytest.mark.asyncio
async def test_bad_output_paths_are_refused_before_anything_opens(st_checkpoint: Path, tmp_path: Path) -> None:
    baseline, threads = open_fds(), threading.active_count()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"telemetry": tmp_path}, "is a directory"),
        ({"telemetry": tmp_path / "missing" / "t.jsonl"}, "does not exist"),
        ({"history": tmp_path / "missing" / "h.npz", "policy": "default", "experts_per_token": 2},
         "does not exist"),
        ({"telemetry": tmp_path / "same", "history": tmp_path / "same", "policy": "default",
          "experts_per_token": 2}, "the same file"),
        ({"telemetry": ""}, "must be a file path"),
    ]
    for kwargs, words in cases:
        with pytest.raises(StoreError, match=words):
            await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend="odirect", **kwargs)
    assert not open_fds() - baseline and threading.active_count() == threads
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.asyncio
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: a read-only folder refuses nothing to it")
async def test_a_folder_we_may_not_write_is_refused(st_checkpoint: Path, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(StoreError, match="permission denied"):
        await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, telemetry=locked / "t.jsonl")


@pytest.mark.asyncio
async def test_close_reports_a_history_it_cannot_save_after_closing_everything(
        st_checkpoint: Path, tmp_path: Path) -> None:
    folder = tmp_path / "state"
    folder.mkdir()
    baseline = open_fds()
    store = await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend="odirect", policy="default",
                                   experts_per_token=2, history=folder / "usage.npz")
    async with store.acquire((0, 0)):
        pass
    shutil.rmtree(folder)  # the history's folder went away during the run
    with pytest.raises(StoreError, match="cannot save the usage history"):
        await store.close()
    assert not await settled_fds(baseline)  # the backend was closed before the error was raised
    await store.close()  # and closing again is a no-op


# ------------------------------------------------------------------------- one loop


@pytest.mark.asyncio
async def test_use_from_another_thread_fails_at_once_and_never_hangs(st_checkpoint: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20) as store:
        errors: list[BaseException] = []

        def other_thread() -> None:
            async def use() -> None:
                async with store.acquire((0, 0)):
                    pass

            try:
                asyncio.run(use())  # its own event loop
            except BaseException as exc:
                errors.append(exc)
            try:
                store.token_boundary()  # and with no loop at all
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=other_thread)
        thread.start()
        await asyncio.to_thread(thread.join, 30)
        assert not thread.is_alive(), "use from another thread hung"
        assert [type(e) for e in errors] == [StoreError, StoreError]
        assert "another event loop" in str(errors[0]) and "no event loop" in str(errors[1])
        async with store.acquire((0, 0)) as view:  # and the store still serves its own loop
            assert view.key == (0, 0)


def test_a_store_is_refused_by_a_later_event_loop(st_checkpoint: Path) -> None:
    store = asyncio.run(ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend="pread"))

    async def later() -> None:
        with pytest.raises(StoreError, match="belongs to the event loop it was opened on"):
            async with store.acquire((0, 0)):  # a miss: the first await would be on the wrong loop
                pass
        with pytest.raises(StoreError, match="belongs to the event loop it was opened on"):
            store.prefetch([(0, 1)])

    asyncio.run(later())


# ------------------------------------------------------------------------- every exit path


@pytest.mark.asyncio
async def test_open_cancelled_at_any_step_leaves_nothing_open(st_checkpoint: Path, tmp_path: Path,
                                                            backend: str) -> None:
    """Cancel ``open`` after 0, 1, 2, ... turns of the loop and then after growing delays,
    until it completes: every cancelled attempt leaves no descriptor (file, ring, eventfd)
    and no telemetry file behind."""
    out = tmp_path / "t.jsonl"
    baseline = open_fds()
    cancelled = completed = 0
    delays = [("turns", n) for n in range(12)] + [("seconds", 0.0005 * 1.5**i) for i in range(18)]
    for kind, amount in delays:
        task = asyncio.ensure_future(ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                                      telemetry=out))
        if kind == "turns":
            for _ in range(int(amount)):
                await asyncio.sleep(0)
        else:
            await asyncio.sleep(amount)
        if task.done():
            await (await task).close()
            completed += 1
            out.unlink()  # a complete run's telemetry: the next attempt starts from nothing again
            continue
        task.cancel()
        result = await asyncio.gather(task, return_exceptions=True)
        if isinstance(result[0], ExpertStore):  # it finished just as it was cancelled
            await result[0].close()
            out.unlink()
            continue
        cancelled += 1
        assert isinstance(result[0], asyncio.CancelledError), result
        leaked = await settled_fds(baseline)
        assert not leaked, f"open cancelled after {amount} {kind} left descriptors: {leaked}"
        assert not out.exists() and not list(tmp_path.glob(".t.jsonl.*"))
    assert cancelled >= 10 and completed >= 1
    assert not await settled_fds(baseline)


@pytest.mark.asyncio
async def test_open_failing_after_the_backend_opened_closes_it(st_checkpoint: Path) -> None:
    """A policy that needs k, named for a checkpoint that does not say: refused by the store's
    constructor, after ``assemble`` opened the backend."""
    baseline = open_fds()
    with pytest.raises(StoreError, match="needs k"):
        await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend="odirect", policy="moe")
    assert not await settled_fds(baseline)


@pytest.mark.asyncio
async def test_close_cancelled_still_closes(st_checkpoint: Path) -> None:
    baseline = open_fds()
    store = await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend="odirect")
    store.prefetch([(layer, e) for layer in range(2) for e in range(4)])  # loads for close to wait on
    closing = asyncio.ensure_future(store.close())
    await asyncio.sleep(0)
    closing.cancel()
    await asyncio.gather(closing, return_exceptions=True)
    assert not await settled_fds(baseline), "a cancelled close left the backend open"
    await store.close()


# ------------------------------------------------------------------------- arguments of the wrong kind


@pytest.mark.asyncio
async def test_every_open_argument_of_the_wrong_kind_names_itself(st_checkpoint: Path) -> None:
    baseline = open_fds()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"source": 123}, "source must be a path"),
        ({"backend": 123}, "backend must be"),
        ({"policy": 5}, "policy must be"),
        ({"mirrors": str(st_checkpoint)}, "mirrors must be a list of paths"),
        ({"mirrors": 7}, "mirrors must be a list of paths"),
        ({"mirrors": [3]}, "mirrors must be a list of paths"),
        ({"weights": "heavy"}, "weights must be a mapping"),
        ({"weights": {str(st_checkpoint): -1.0}}, "finite weight"),
        ({"weights": {str(st_checkpoint): float("nan")}}, "finite weight"),
        ({"routing": 1}, "routing must be"),
        ({"telemetry": 5}, "telemetry must be a file path"),
        ({"history": ["a"]}, "history must be a file path"),
        ({"experts_per_token": True}, "experts_per_token"),
        ({"queue_depth": 0}, "queue_depth"),
        ({"token_budget_bytes": -1}, "token_budget_bytes"),
    ]
    for kwargs, words in cases:
        args: dict[str, Any] = {"source": st_checkpoint, "budget_bytes": 1 << 20, **kwargs}
        with pytest.raises(StoreError, match=words):
            await ExpertStore.open(**args)
    assert not open_fds() - baseline
