"""Verified bytes: the manifest (``iosched manifest``), every read checked against it on all
four backends, corrupt mirrors (real files with bytes changed inside experts, and a
corruption fault around a real backend) caught and served from the primary, the last
replica's mismatch a ``ChecksumError`` naming file, extent and both checksums, mirrors
sampled at open."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import xxhash

from iosched import (
    CheckpointError,
    CheckpointIndex,
    ChecksumError,
    ExpertKey,
    ExpertStore,
    ReadError,
    StoreError,
    backends,
    default_manifest_path,
    load_index,
    override_settings,
    write_manifest,
)
from iosched.backends.faults import FaultPlan, FaultyBackend
from iosched.formats._manifest import MANIFEST_NAME, is_manifest_file, load_manifest
from iosched.formats._mirrors import MirrorError
from iosched.tools.cli import main
from iosched.tools.synth import write_gguf_moe, write_safetensors_moe
from tests.conftest import EXPERTS, HIDDEN, INTER, LAYERS, require_backend
from tests.test_store import expected_bytes

BUDGET = 1 << 20


def all_extent_bytes(index: CheckpointIndex) -> int:
    return sum(ext.length for layout in index.experts.values() for ext in layout.extents)


def corrupt(index: CheckpointIndex, root: Path, keys: list[ExpertKey]) -> None:
    """Flip one byte in the middle of each extent of ``keys`` in the copy under ``root`` of
    ``index``'s files: same size, same header, wrong expert bytes."""
    for key in keys:
        for ext in index.experts[key].extents:
            rel = os.path.relpath(index.files[ext.file], index.root) if os.path.isdir(index.root) \
                else os.path.basename(index.files[ext.file])
            path = root / rel if root.is_dir() else root
            with open(path, "r+b") as f:
                f.seek(ext.offset + ext.length // 2)
                byte = f.read(1)
                f.seek(ext.offset + ext.length // 2)
                f.write(bytes([byte[0] ^ 0xFF]))


async def read_all_exact(store: ExpertStore) -> None:
    for key in sorted(store.index.experts):
        async with store.acquire(key) as view:
            assert view.data.tobytes() == expected_bytes(store.index, key), key
    store.check_invariants()


@pytest.fixture
def gguf_copy(gguf_checkpoint: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "gguf" / gguf_checkpoint.name
    dest.parent.mkdir()
    shutil.copy(gguf_checkpoint, dest)
    return dest


# ---------------------------------------------------------------------------- the manifest


def test_manifest_written_and_read_back(st_copy: Path, gguf_copy: Path) -> None:
    for source in (st_copy, gguf_copy):
        summary = write_manifest(source)
        index = load_index(source)
        assert summary.manifest == default_manifest_path(index)
        assert summary.manifest == (str(st_copy / MANIFEST_NAME) if source == st_copy
                                    else f"{gguf_copy}.{MANIFEST_NAME}")
        assert summary.experts == len(index.experts) == LAYERS * EXPERTS
        assert summary.extents == sum(len(layout.extents) for layout in index.experts.values())
        assert summary.bytes == all_extent_bytes(index) and summary.hash == "xxh3_128"
        doc = json.loads(Path(summary.manifest).read_text())
        assert (doc["format"], doc["version"], doc["hash"]) == ("iosched-manifest", 1, "xxh3_128")
        assert [f["name"] for f in doc["checkpoint"]["files"]] == [
            os.path.relpath(p, index.root) if source == st_copy else os.path.basename(p) for p in index.files]
        manifest = load_manifest(summary.manifest, index)
        for layout in index.experts.values():  # each extent's digest is that of its plain-read bytes
            for ext in layout.extents:
                with open(index.files[ext.file], "rb") as f:
                    f.seek(ext.offset)
                    data = f.read(ext.length)
                assert manifest.checksums[(ext.file, ext.offset)] == (ext.length, xxhash.xxh3_128_intdigest(data))
        assert not [p for p in Path(summary.manifest).parent.iterdir() if p.name.endswith(".tmp")]
    assert len(next(iter(load_index(gguf_copy).experts.values())).extents) == 3  # GGUF: three extents


def test_manifest_xxh3_64_and_out(st_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "elsewhere" / "m.json"
    out.parent.mkdir()
    summary = write_manifest(st_copy, out, hash_name="xxh3_64")
    assert summary.manifest == str(out) and is_manifest_file(out)
    assert not (st_copy / MANIFEST_NAME).exists()
    manifest = load_manifest(out, load_index(st_copy))
    assert manifest.hash_name == "xxh3_64" and len(manifest.hex(0)) == 16
    with pytest.raises(StoreError, match="unknown hash 'md5'"):
        write_manifest(st_copy, out, hash_name="md5")


def test_manifest_never_overwrites_a_foreign_file(st_copy: Path, tmp_path: Path) -> None:
    shard = sorted(st_copy.glob("*.safetensors"))[0]
    before = shard.read_bytes()
    with pytest.raises(StoreError, match=rf"{shard} exists and is not an iosched manifest"):
        write_manifest(st_copy, shard)
    assert shard.read_bytes() == before
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}\n')
    with pytest.raises(StoreError, match="not an iosched manifest"):
        write_manifest(st_copy, notes)
    assert notes.read_text() == '{"mine": true}\n'
    with pytest.raises(StoreError, match="is a folder"):
        write_manifest(st_copy, tmp_path)
    with pytest.raises(StoreError, match="folder does not exist"):
        write_manifest(st_copy, tmp_path / "no" / "m.json")
    first = write_manifest(st_copy)  # a manifest is replaced
    assert write_manifest(st_copy).manifest == first.manifest


def test_read_only_folder_names_the_way_out(st_copy: Path, tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder: the refusal cannot be seen as root")
    st_copy.chmod(0o555)
    try:
        with pytest.raises(StoreError, match="--out PATH"):
            write_manifest(st_copy)
    finally:
        st_copy.chmod(0o755)


@pytest.mark.asyncio
async def test_manifest_of_another_checkpoint_is_refused(st_copy: Path, tmp_path: Path) -> None:
    # Same layout, byte-identical headers (no dense tensors before the experts), other weights.
    ours, other = (write_safetensors_moe(tmp_path / name, n_layers=LAYERS, n_experts=EXPERTS, hidden=HIDDEN,
                                         intermediate=INTER, dtype="float16", n_shards=2, dense=False, seed=seed)
                   for name, seed in (("ours", 1), ("other", 99)))
    theirs = write_manifest(other).manifest
    with pytest.raises(CheckpointError, match=rf"manifest {theirs} is not of this checkpoint: the first"):
        await ExpertStore.open(ours, budget_bytes=BUDGET, verify="reads", manifest=theirs)
    mine = write_manifest(ours).manifest
    shard = sorted(ours.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    assert data.count(b'"pt"') == 1  # the header's metadata: same size, other header bytes
    shard.write_bytes(data.replace(b'"pt"', b'"pu"'))
    with pytest.raises(CheckpointError, match=rf"manifest {mine} is not of this checkpoint: the header of {shard}"):
        await ExpertStore.open(ours, budget_bytes=BUDGET, verify="reads")
    with pytest.raises(CheckpointError, match=rf"manifest {theirs} is not of this checkpoint: it was written for "
                                              r"model-00001-of-00002.safetensors of \d+ bytes"):
        await ExpertStore.open(st_copy, budget_bytes=BUDGET, verify="reads", manifest=theirs)
    bigger = write_safetensors_moe(tmp_path / "bigger", n_layers=LAYERS, n_experts=EXPERTS, hidden=HIDDEN,
                                   intermediate=INTER + 16, dtype="float16", n_shards=2, seed=1)
    theirs = write_manifest(bigger).manifest
    with pytest.raises(CheckpointError, match=rf"manifest {theirs} is not of this checkpoint: .* bytes"):
        await ExpertStore.open(st_copy, budget_bytes=BUDGET, verify="reads", manifest=theirs)
    one = write_safetensors_moe(tmp_path / "one", n_layers=LAYERS, n_experts=EXPERTS, hidden=HIDDEN,
                                intermediate=INTER, dtype="float16", n_shards=1, seed=1)
    theirs = write_manifest(one).manifest
    with pytest.raises(CheckpointError, match=rf"manifest {theirs} is not of this checkpoint: it lists the files"):
        await ExpertStore.open(st_copy, budget_bytes=BUDGET, manifest=theirs)  # given: checked even if off
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"manifest {junk} is not valid JSON"):
        await ExpertStore.open(st_copy, budget_bytes=BUDGET, verify="reads", manifest=junk)


@pytest.mark.asyncio
async def test_verify_needs_a_manifest_and_good_arguments(st_copy: Path) -> None:
    expected = st_copy / MANIFEST_NAME
    with pytest.raises(CheckpointError, match=rf"manifest {expected} does not exist; write it with `iosched manifest"):
        await ExpertStore.open(st_copy, budget_bytes=BUDGET, verify="reads")
    with pytest.raises(StoreError, match="verify must be one of off, reads, got 'on'"):
        await ExpertStore.open(st_copy / "nothing-here", budget_bytes=BUDGET, verify="on")  # before any file
    with pytest.raises(StoreError, match="verify_mirrors must be a non-negative integer, got -1"):
        await ExpertStore.open(st_copy, budget_bytes=BUDGET, verify_mirrors=-1)
    async with await ExpertStore.open(st_copy, budget_bytes=BUDGET) as store:  # off: no manifest needed
        s = store.stats()
        assert (s["verify"], s["manifest"], s["verified_bytes"], s["verify_s"]) == ("off", None, 0, 0.0)
    write_manifest(st_copy)
    with override_settings(verify="reads"):  # the setting's default
        async with await ExpertStore.open(st_copy, budget_bytes=BUDGET) as store:
            assert store.stats()["verify"] == "reads" and store.stats()["manifest"] == str(expected)


# ---------------------------------------------------------------------------- every read verified


@pytest.mark.asyncio
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
async def test_every_read_is_verified(st_copy: Path, gguf_copy: Path, backend: str, fmt: str) -> None:
    source = st_copy if fmt == "safetensors" else gguf_copy
    write_manifest(source)
    async with await ExpertStore.open(source, budget_bytes=BUDGET, backend=backend, verify="reads") as store:
        await read_all_exact(store)
        s = store.stats()
        assert s["verified_bytes"] == all_extent_bytes(store.index)  # every extent once, no more
        assert s["verify_mismatches"] == s["verify_retries"] == s["verify_bad_extents"] == 0
        assert s["verify_s"] > 0 and s["load_errors"] == 0
        async with store.acquire((0, 0)):  # a hit hashes nothing
            pass
        assert store.stats()["verified_bytes"] == s["verified_bytes"]


@pytest.mark.asyncio
async def test_corrupt_mirror_is_caught_and_served_from_the_primary(
        mirrored: tuple[Path, Path], backend: str) -> None:
    primary, mirror = mirrored
    write_manifest(primary)
    index = load_index(primary)
    bad = sorted(index.experts)[::2]  # half the experts wrong
    corrupt(index, mirror, bad)
    async with await ExpertStore.open(primary, budget_bytes=BUDGET, backend=backend, mirrors=[mirror],
                                      verify="reads", policy="lru") as store:
        await read_all_exact(store)
        s = store.stats()
        mismatches = s["verify_mismatches"]
        assert 0 < mismatches <= len(bad)  # the corrupt experts the hash routed to the mirror
        assert s["verify_retries"] == mismatches == s["verify_bad_extents"]
        assert s["failovers"] >= mismatches and s["load_errors"] == 0
        assert s["per_replica"][str(mirror)]["errors"] == mismatches
        assert s["per_replica"][str(primary)]["errors"] == 0
        assert s["verified_bytes"] == all_extent_bytes(index)
    # Unverified, the same mirror serves wrong bytes: what the check is for.
    async with await ExpertStore.open(primary, budget_bytes=BUDGET, backend=backend, mirrors=[mirror],
                                      policy="lru") as store:
        wrong = 0
        for key in index.experts:
            async with store.acquire(key) as view:
                wrong += view.data.tobytes() != expected_bytes(index, key)
        # at least as many: verified, three mismatches in a row also mark the mirror degraded
        # (the router's rule for any failed read), which sends later reads to the primary
        assert wrong >= mismatches


@pytest.mark.asyncio
async def test_a_bad_extent_is_read_from_the_primary_first_afterwards(mirrored: tuple[Path, Path]) -> None:
    primary, mirror = mirrored
    write_manifest(primary)
    index = load_index(primary)
    corrupt(index, mirror, list(index.experts))
    # A budget of two experts: every expert is evicted and read again in the second pass.
    two = 2 * max(layout.nbytes for layout in index.experts.values())
    async with await ExpertStore.open(primary, budget_bytes=two, backend="pread", mirrors=[mirror],
                                      verify="reads", policy="lru") as store:
        await read_all_exact(store)
        first = store.stats()
        await read_all_exact(store)
        second = store.stats()
        assert first["verify_mismatches"] > 0
        assert second["verify_mismatches"] == first["verify_mismatches"]  # no second try of a bad copy
        assert second["verify_bad_extents"] == first["verify_mismatches"]
        assert second["per_replica"][str(mirror)]["reads"] == first["per_replica"][str(mirror)]["reads"]


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["odirect", "uring"])
async def test_a_striped_mismatch_is_read_again_whole(mirrored: tuple[Path, Path], name: str) -> None:
    require_backend(name)
    primary, mirror = mirrored
    write_manifest(primary)
    index = load_index(primary)
    corrupt(index, mirror, list(index.experts))
    with override_settings(stripe_threshold=4096):  # the test's 18 KiB experts are striped
        async with await ExpertStore.open(primary, budget_bytes=BUDGET, backend=name, mirrors=[mirror],
                                          verify="reads", policy="lru") as store:
            if not store._io.striping:
                pytest.skip(f"{name} reads buffered here (no O_DIRECT on this filesystem): nothing is striped")
            await read_all_exact(store)
            s = store.stats()
    assert s["stripes"] > 0 and s["stripe_redos"] > 0
    # each redo: one unattributed mismatch, then the routed replica's read (the mirror's
    # mismatches marked bad, so later stripes leave that replica out)
    assert s["verify_mismatches"] >= s["stripe_redos"] and s["verify_retries"] >= s["stripe_redos"]
    assert s["load_errors"] == 0


@pytest.mark.asyncio
async def test_injected_corruption_is_caught(mirrored: tuple[Path, Path], backend: str) -> None:
    primary, mirror = mirrored
    write_manifest(primary)
    be = FaultyBackend(backends.create(backend), FaultPlan.on(mirror, seed=3, corrupt_rate=1.0))
    async with await ExpertStore.open(primary, budget_bytes=BUDGET, backend=be, mirrors=[mirror],
                                      verify="reads", policy="lru") as store:
        await read_all_exact(store)
        s = store.stats()
        corrupted = s["backend_info"]["faults"]["corrupt"]
        assert corrupted > 0 and s["verify_mismatches"] == corrupted == s["verify_retries"]
        assert s["load_errors"] == 0


# ---------------------------------------------------------------------------- the last replica


@pytest.mark.asyncio
async def test_mismatch_on_the_only_replica_is_a_checksum_error(st_copy: Path, backend: str) -> None:
    manifest = write_manifest(st_copy).manifest
    index = load_index(st_copy)
    key = sorted(index.experts)[3]
    ext = index.experts[key].extents[0]
    want = load_manifest(manifest, index).checksums[(ext.file, ext.offset)][1]
    corrupt(index, st_copy, [key])
    got = xxhash.xxh3_128_intdigest(expected_bytes(index, key))
    async with await ExpertStore.open(st_copy, budget_bytes=BUDGET, backend=backend, verify="reads") as store:
        for _ in range(2):  # nothing half-checked is published: the next acquire fails the same way
            with pytest.raises(ChecksumError) as caught:
                async with store.acquire(key):
                    pass
            message = str(caught.value)
            assert isinstance(caught.value, ReadError)
            assert message.startswith(index.files[ext.file])
            assert f"at offset {ext.offset} ({ext.length} bytes)" in message and repr(key) in message
            assert f"expected {want:032x}, read {got:032x}" in message and manifest in message
        s = store.stats()
        assert s["load_errors"] == 2 and s["verify_mismatches"] == 2 and s["resident_bytes"] == 0
        for other in sorted(index.experts):  # the store stays usable for every other expert
            if other != key:
                async with store.acquire(other) as view:
                    assert view.data.tobytes() == expected_bytes(index, other)
        store.check_invariants()


@pytest.mark.asyncio
async def test_both_replicas_corrupt_names_the_last(mirrored: tuple[Path, Path]) -> None:
    primary, mirror = mirrored
    write_manifest(primary)
    index = load_index(primary)
    key = sorted(index.experts)[5]
    corrupt(index, primary, [key])
    corrupt(index, mirror, [key])
    async with await ExpertStore.open(primary, budget_bytes=BUDGET, backend="pread", mirrors=[mirror],
                                      verify="reads", verify_mirrors=0) as store:
        with pytest.raises(ChecksumError, match="does not match the manifest"):
            async with store.acquire(key):
                pass
        s = store.stats()
        assert s["verify_mismatches"] == 2 and s["verify_retries"] == 1 and s["load_errors"] == 1


# ---------------------------------------------------------------------------- mirrors sampled at open


@pytest.mark.asyncio
@pytest.mark.parametrize("with_manifest", [True, False], ids=["manifest", "primary"])
async def test_sampling_at_open_catches_a_corrupt_mirror(mirrored: tuple[Path, Path], with_manifest: bool) -> None:
    primary, mirror = mirrored
    if with_manifest:
        write_manifest(primary)
    index = load_index(primary)
    n = len(index.experts)
    async with await ExpertStore.open(primary, budget_bytes=BUDGET, mirrors=[mirror], verify_mirrors=n) as store:
        s = store.stats()
        assert s["mirror_samples"] == all_extent_bytes(index) // next(iter(index.experts.values())).nbytes
        assert s["manifest"] == (str(primary / MANIFEST_NAME) if with_manifest else None)
    key = sorted(index.experts)[7]
    corrupt(index, mirror, [key])
    shard = mirror / os.path.relpath(index.files[index.experts[key].extents[0].file], primary)
    against = "the manifest" if with_manifest else "its primary"
    with pytest.raises(MirrorError, match=rf"mirror file {shard} does not match {against}.*expert \(0, 7\)"):
        await ExpertStore.open(primary, budget_bytes=BUDGET, mirrors=[mirror], verify_mirrors=n)
    with override_settings(verify_mirrors=n):
        with pytest.raises(MirrorError):
            await ExpertStore.open(primary, budget_bytes=BUDGET, mirrors=[mirror])
    async with await ExpertStore.open(primary, budget_bytes=BUDGET, mirrors=[mirror], verify_mirrors=0):
        pass  # not sampled: opens (and, unverified, would serve the wrong bytes)


# ---------------------------------------------------------------------------- the command line


def test_manifest_command_json(st_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["manifest", str(st_copy), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["manifest"] == str(st_copy / MANIFEST_NAME) and out["experts"] == LAYERS * EXPERTS
    assert {"checkpoint", "format", "hash", "files", "extents", "bytes", "seconds", "mb_per_s"} <= set(out)
    assert main(["manifest", str(st_copy), "--out", str(tmp_path / "m.json"), "--hash", "xxh3_64"]) == 0
    assert "wrote" in capsys.readouterr().out and is_manifest_file(tmp_path / "m.json")


def test_manifest_command_refuses_a_foreign_file(st_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = sorted(st_copy.glob("*.safetensors"))[0]
    before = shard.read_bytes()
    assert main(["manifest", str(st_copy), "--out", str(shard), "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["type"] == "StoreError" and str(shard) in out["error"] and shard.read_bytes() == before
    assert main(["manifest", str(st_copy / "missing"), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["type"] == "CheckpointError"


def test_gguf_single_file_manifest_beside_it(tmp_path: Path) -> None:
    path = write_gguf_moe(tmp_path / "m.gguf", n_layers=2, n_experts=4, hidden=HIDDEN, intermediate=INTER)
    summary = write_manifest(path)
    assert summary.manifest == f"{path}.{MANIFEST_NAME}" and summary.extents == 2 * 4 * 3


@pytest.mark.asyncio
async def test_verify_counters_in_telemetry(mirrored: tuple[Path, Path], tmp_path: Path) -> None:
    primary, mirror = mirrored
    write_manifest(primary)
    index = load_index(primary)
    corrupt(index, mirror, list(index.experts))
    out = tmp_path / "telemetry.jsonl"
    async with await ExpertStore.open(primary, budget_bytes=BUDGET, backend="pread", mirrors=[mirror],
                                      verify="reads", policy="lru", telemetry=out) as store:
        for layer in range(LAYERS):
            store.token_boundary()
            async with store.acquire_many([(layer, e) for e in range(EXPERTS)]):
                pass
        final = store.stats()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    for name in ("verified_bytes", "verify_mismatches", "verify_retries"):
        assert sum(r[name] for r in lines) == final[name], name
    assert sum(r["verify_s"] for r in lines) == pytest.approx(final["verify_s"], abs=1e-9)
    assert final["verify_mismatches"] > 0 and lines[-1]["verify_bad_extents"] == final["verify_bad_extents"]


def test_bench_verify_json(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from iosched.tools import verify_bench

    # the command as it runs, on a small checkpoint (the real shapes write 72-256 MiB)
    monkeypatch.setitem(verify_bench.SHAPES, "36K", (HIDDEN, INTER, 2, 8))
    with override_settings(cache_dir=str(tmp_path)):
        assert main(["bench-verify", "--sizes", "36K", "--backends", "pread,odirect", "--reps", "2", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert main(["bench-verify", "--sizes", "1G", "--json"]) == 2
        assert "--sizes" in json.loads(capsys.readouterr().out)["error"]
    rows = {(r["backend"], r["cache"]): r for r in out["rows"]}
    assert set(rows) == {("pread", "cold"), ("pread", "warm"), ("odirect", "cold")}
    for r in rows.values():
        assert r["off_mbps"] > 0 and r["reads_mbps"] > 0 and len(r["off_runs"]) == len(r["reads_runs"]) == 2
        assert r["verify_share"] > 0 and r["expert_bytes"] == 6 * HIDDEN * INTER
    assert set(out["hash_gbps"]) == {"xxh3_128", "xxh3_64"} and len(out["hash_placement_us"]) == 4


@pytest.mark.asyncio
async def test_hashes_in_worker_threads(mirrored: tuple[Path, Path], backend: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from iosched.formats import _verify

    monkeypatch.setattr(_verify, "THREAD_BYTES", 1)  # every extent takes the large experts' path
    primary, mirror = mirrored
    write_manifest(primary)
    index = load_index(primary)
    corrupt(index, mirror, list(index.experts))
    async with await ExpertStore.open(primary, budget_bytes=BUDGET, backend=backend, mirrors=[mirror],
                                      verify="reads", policy="lru") as store:
        async with store.acquire_many(sorted(index.experts)[:EXPERTS]) as views:  # concurrent loads
            for view in views:
                assert view.data.tobytes() == expected_bytes(index, view.key)
        await read_all_exact(store)
        s = store.stats()
        assert s["verified_bytes"] == all_extent_bytes(index) and s["verify_mismatches"] > 0


@pytest.mark.asyncio
async def test_a_cancelled_threaded_hash_waits_for_its_thread() -> None:
    import asyncio
    import threading
    import time

    from iosched.formats._verify import _in_thread

    done = threading.Event()

    def slow(data: memoryview) -> int:
        time.sleep(0.05)  # the thread still reads the buffer when the caller is cancelled
        value = xxhash.xxh3_128_intdigest(data)
        done.set()
        return value

    task = asyncio.ensure_future(_in_thread(slow, memoryview(bytearray(1 << 20))))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert done.is_set()  # the cancellation arrived only once the thread let go of the buffer
