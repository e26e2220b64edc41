"""Hostile checkpoint files (issue #13, points 1 and 7, and ``experts_per_token`` of point 8).

Each test reproduces one finding of the issue on real files (written by the real safetensors
and gguf libraries, or byte for byte by hand where no library would write them) and asserts
the :class:`CheckpointError` and what its message names. docs/reliability.md, "Hostile
checkpoint files", lists the rules and points at these tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from iosched import BudgetError, ExpertStore
from iosched._errors import CheckpointError
from iosched._layout import CheckpointIndex
from iosched.formats._checkpoint import load_index
from iosched.formats._gguf_header import MAX_TENSORS, read_header
from iosched.formats._index_build import MAX_EXPERTS_PER_LAYER
from iosched.formats._untrusted import MAX_CONFIG_JSON_BYTES, MAX_INDEX_JSON_BYTES, list_folder
from iosched.tools.synth import write_gguf_moe, write_safetensors_moe

SIZES: dict[str, Any] = dict(n_layers=2, n_experts=4, hidden=16, intermediate=8)
EXPERT0 = "model.layers.0.mlp.experts.0"


def raises(source: Path, *needles: str) -> str:
    with pytest.raises(CheckpointError) as info:
        load_index(source)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert len(message) < 2000, message  # a value quoted from a file is cut short
    return message


def checkpoint(folder: Path, **kw: Any) -> Path:
    return write_safetensors_moe(folder, dtype="float16", **{**SIZES, **kw})


def set_weight_map(folder: Path, tensor: str, shard: str) -> None:
    path = folder / "model.safetensors.index.json"
    doc = json.loads(path.read_text())
    doc["weight_map"][tensor] = shard
    path.write_text(json.dumps(doc))


def raw_safetensors(path: Path, header: object, data: bytes = b"", blob: bytes | None = None) -> Path:
    blob = json.dumps(header).encode() if blob is None else blob
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def entry(begin: int, end: int) -> dict[str, Any]:
    return {"dtype": "F32", "shape": [(end - begin) // 4], "data_offsets": [begin, end]}


def expert_bytes(index: CheckpointIndex, key: tuple[int, int]) -> bytes:
    out = b""
    for ext in index.experts[key].extents:
        with open(index.files[ext.file], "rb") as f:
            f.seek(ext.offset)
            out += f.read(ext.length)
    return out


# --------------------------------------------------------------------------- 1. confinement


def test_weight_map_naming_a_shard_outside_the_folder(tmp_path: Path) -> None:
    """Finding: ``../other/x.safetensors`` was followed and its bytes served."""
    folder = checkpoint(tmp_path / "ck")
    checkpoint(tmp_path / "other", seed=9)  # a valid checkpoint beside it: the bytes were served
    (tmp_path / "other" / "model.safetensors").rename(tmp_path / "other" / "x.safetensors")
    tensor = f"{EXPERT0}.up_proj.weight"
    set_weight_map(folder, tensor, "../other/x.safetensors")
    raises(folder, "model.safetensors.index.json", tensor, "../other/x.safetensors", "'..' component")


def test_weight_map_naming_an_absolute_path(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "ck")
    elsewhere = checkpoint(tmp_path / "elsewhere", seed=9) / "model.safetensors"
    tensor = f"{EXPERT0}.gate_proj.weight"
    set_weight_map(folder, tensor, str(elsewhere))
    raises(folder, "model.safetensors.index.json", tensor, "absolute path")


def test_weight_map_naming_etc_passwd_quotes_none_of_its_bytes(tmp_path: Path) -> None:
    """Finding: ``../../../../etc/passwd`` was read, and its first 8 bytes, decoded as a header
    length, were quoted in the message."""
    folder = checkpoint(tmp_path / "ck")
    tensor = f"{EXPERT0}.down_proj.weight"
    set_weight_map(folder, tensor, "../../../../etc/passwd")
    message = raises(folder, "model.safetensors.index.json", tensor, "'..' component")
    assert "header length" not in message


def test_a_link_to_a_file_that_is_no_checkpoint_quotes_none_of_its_bytes(tmp_path: Path) -> None:
    """A shard linked (allowed) to something that is not a safetensors file: refused as such,
    and the message holds no value decoded from its bytes."""
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 4)
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(secret)
    message = raises(folder, "model.safetensors", "not a safetensors file", "header length prefix out of range")
    assert str(struct.unpack("<Q", secret.read_bytes()[:8])[0]) not in message
    assert "root" not in message.replace(str(tmp_path), "")


@pytest.mark.parametrize(
    "name, why",
    [
        ("", "non-empty string"),
        (".", "'..' component"),
        ("./model.safetensors", "'..' component"),
        ("shards//model.safetensors", "'..' component"),
        ("shards/../model.safetensors", "'..' component"),
        ("model.safetensors/", "'..' component"),
        ("shards\\model.safetensors", "backslash"),
        ("model.safe\x00tensors", "NUL"),
        ("//server/share/x.safetensors", "absolute path"),
    ],
)
def test_weight_map_names_must_be_plain(tmp_path: Path, name: str, why: str) -> None:
    folder = checkpoint(tmp_path / "ck")
    tensor = f"{EXPERT0}.gate_proj.weight"
    set_weight_map(folder, tensor, name)
    raises(folder, "model.safetensors.index.json", tensor, why)


def test_weight_map_may_name_a_subfolder_inside(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "ck")
    before = expert_bytes(load_index(folder), (1, 3))
    (folder / "shards").mkdir()
    (folder / "model.safetensors").rename(folder / "shards" / "model.safetensors")
    doc = json.loads((folder / "model.safetensors.index.json").read_text())
    doc["weight_map"] = {k: "shards/model.safetensors" for k in doc["weight_map"]}
    (folder / "model.safetensors.index.json").write_text(json.dumps(doc))
    index = load_index(folder)
    assert index.files == (os.path.abspath(folder / "shards" / "model.safetensors"),)
    assert expert_bytes(index, (1, 3)) == before


@pytest.mark.parametrize("with_index", [True, False])
def test_symlinked_shards_as_in_a_hugging_face_cache(tmp_path: Path, with_index: bool) -> None:
    """snapshots/<rev>/model-*.safetensors are links into ../../blobs: allowed, bytes exact."""
    src = checkpoint(tmp_path / "src", n_shards=2, index_json=with_index)
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, file in enumerate(sorted(src.iterdir())):
        (blobs / f"blob{i}").write_bytes(file.read_bytes())
        (snap / file.name).symlink_to(Path("../../blobs") / f"blob{i}")
    index, direct = load_index(snap), load_index(src)
    assert sorted(index.experts) == sorted(direct.experts)
    for key in index.experts:
        assert expert_bytes(index, key) == expert_bytes(direct, key)


def test_a_fifo_named_as_a_shard_is_refused_without_blocking(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "ck", n_shards=2)
    fifo = folder / "model-00002-of-00002.safetensors"
    fifo.unlink()
    os.mkfifo(fifo)
    start = time.monotonic()
    raises(folder, "model-00002-of-00002.safetensors", "not a regular file")
    assert time.monotonic() - start < 10


def test_a_link_loop_and_a_name_too_long_are_checkpoint_errors(tmp_path: Path) -> None:
    """Finding: a path the process cannot look at raised a raw OSError."""
    folder = checkpoint(tmp_path / "ck", n_shards=2)
    loop = folder / "model-00002-of-00002.safetensors"
    loop.unlink()
    loop.symlink_to(loop.name)  # a link to itself: ELOOP
    raises(folder, "model-00002-of-00002.safetensors", "cannot look at", "symbolic links")
    (folder / "README.loop").symlink_to("README.loop")  # one that does not matter is left out
    loop.unlink()
    checkpoint(folder, n_shards=2)
    assert load_index(folder).experts
    folder = checkpoint(tmp_path / "ck2")
    tensor = f"{EXPERT0}.gate_proj.weight"
    set_weight_map(folder, tensor, "x" * 300 + ".safetensors")  # ENAMETOOLONG
    raises(folder, "model.safetensors.index.json", "cannot look at shard")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 folder anyway (CI runs as root); "
                    "test_a_folder_that_cannot_be_listed covers the same code path")
def test_an_unreadable_folder(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "ck")
    folder.chmod(0)
    try:
        raises(folder, str(folder), "Permission denied")
    finally:
        folder.chmod(0o755)


def test_a_folder_that_cannot_be_listed(tmp_path: Path) -> None:
    """The listing's OSError (here ENOTDIR, under root too) is a CheckpointError naming it."""
    file = tmp_path / "plain"
    file.write_bytes(b"")
    with pytest.raises(CheckpointError, match="cannot read checkpoint folder .*plain"):
        list_folder(file)


# --------------------------------------------------------------------------- 7. hostile headers


def test_deeply_nested_json_everywhere(tmp_path: Path) -> None:
    """Finding: RecursionError out of json.loads."""
    deep = b"[" * 200_000 + b"]" * 200_000
    raises(raw_safetensors(tmp_path / "deep.safetensors", None, blob=deep), "deep.safetensors", "nested too deeply")
    folder = checkpoint(tmp_path / "ck")
    (folder / "config.json").write_bytes(deep)
    raises(folder, "config.json", "nested too deeply")
    (folder / "config.json").unlink()
    (folder / "model.safetensors.index.json").write_bytes(deep)
    raises(folder, "model.safetensors.index.json", "nested too deeply")


def test_integers_of_thousands_of_digits(tmp_path: Path) -> None:
    """Finding: ValueError (int of more than 4300 digits) out of json.loads."""
    big = "9" * 5000
    blob = f'{{"{EXPERT0}.gate_proj.weight": {{"dtype": "F32", "shape": [{big}], "data_offsets": [0, 4]}}}}'
    raises(raw_safetensors(tmp_path / "big.safetensors", None, bytes(4), blob.encode()), "big.safetensors",
           "too many digits")
    folder = checkpoint(tmp_path / "ck")
    (folder / "config.json").write_text(f'{{"num_experts_per_tok": {big}}}')
    raises(folder, "config.json", "too many digits")


def test_huge_dimensions_are_refused_quickly(tmp_path: Path) -> None:
    """Dimensions just under the digit limit: their product is never computed in full."""
    dims = ", ".join(["9" * 4000] * 32)
    blob = f'{{"{EXPERT0}.gate_proj.weight": {{"dtype": "F32", "shape": [{dims}], "data_offsets": [0, 4]}}}}'
    start = time.monotonic()
    raises(raw_safetensors(tmp_path / "dims.safetensors", None, bytes(4), blob.encode()), "dims.safetensors",
           "needs more than 2**64")
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("ids", ["layers.0.mlp.experts.1000000000000", "layers.0.mlp.experts." + "7" * 5000,
                                 "layers.1000000000000.mlp.experts.0"])
def test_an_absurd_expert_or_layer_id(tmp_path: Path, ids: str) -> None:
    """Finding: an expert id of 10**12 sized a policy's arrays (MemoryError); thousands of
    digits raised ValueError from int()."""
    name = f"model.{ids}.gate_proj.weight"
    file = raw_safetensors(tmp_path / "id.safetensors", {name: entry(0, 16)}, bytes(16))
    message = raises(file, "id.safetensors", "out of range")
    assert "7" * 200 not in message


def test_expert_ids_with_a_hole(tmp_path: Path) -> None:
    header = {f"model.layers.0.mlp.experts.{e}.gate_proj.weight": entry(16 * i, 16 * i + 16)
              for i, e in enumerate([0, 1, 3])}
    file = raw_safetensors(tmp_path / "hole.safetensors", header, bytes(48))
    raises(file, "hole.safetensors", "layer 0", "no expert 2", "0..E-1")


def test_layers_with_different_expert_counts(tmp_path: Path) -> None:
    """An uneven model (layers of 2 and 1 experts, each 0..E-1) opens; a stated expert count
    the largest layer does not reach, or a layer above it, is refused."""
    header = {f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight": entry(16 * i, 16 * i + 16)
              for i, (layer, e) in enumerate([(0, 0), (0, 1), (1, 0)])}
    file = raw_safetensors(tmp_path / "uneven.safetensors", header, bytes(48))
    index = load_index(file)
    assert (index.experts_per_layer(), index.fewest_experts_per_layer()) == (2, 1)
    assert sorted(index.experts) == [(0, 0), (0, 1), (1, 0)]
    folder = tmp_path / "stated"
    folder.mkdir()
    raw_safetensors(folder / "model.safetensors", header, bytes(48))
    for stated, words in [(3, "the largest layer (0) has 2 experts"), (1, "layer 0 has 2 experts")]:
        (folder / "config.json").write_text(json.dumps({"num_experts": stated}))
        raises(folder, "config.json", words)


def test_expert_count_of_config_json_is_checked(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "ck", experts_per_token=2)
    assert load_index(folder).experts_per_layer() == SIZES["n_experts"]
    config = json.loads((folder / "config.json").read_text())
    config["num_experts"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    raises(folder, "config.json", "'num_experts' says 8", "layer (0) has 4 experts")
    config["num_experts"] = "eight"
    (folder / "config.json").write_text(json.dumps(config))
    raises(folder, "config.json", "'num_experts' is 'eight'", "experts per layer")


def test_a_zero_size_expert_tensor(tmp_path: Path) -> None:
    header = {f"{EXPERT0}.gate_proj.weight": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}
    raises(raw_safetensors(tmp_path / "zero.safetensors", header), "zero.safetensors", "holds no bytes")


def test_an_overlong_tensor_name_is_not_quoted_whole(tmp_path: Path) -> None:
    name = f"{EXPERT0}.gate_proj." + "x" * 1_000_000
    raises(raw_safetensors(tmp_path / "long.safetensors", {name: "oops"}), "long.safetensors", "characters)")


@pytest.mark.parametrize("name, cap", [("model.safetensors.index.json", MAX_INDEX_JSON_BYTES),
                                       ("config.json", MAX_CONFIG_JSON_BYTES)])
def test_a_json_side_file_over_its_cap_is_not_read(tmp_path: Path, name: str, cap: int) -> None:
    """Finding: an index or config JSON of hundreds of MiB was read whole (a sparse file here:
    nothing of it is written, and nothing read)."""
    folder = checkpoint(tmp_path / "ck")
    with open(folder / name, "wb") as f:
        f.truncate(cap + 1)
    raises(folder, name, f"{cap + 1} bytes, more than the {cap}")


# --------------------------------------------------------------------------- 7. GGUF


def gguf_string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def gguf_file(path: Path, tensors: list[tuple[str, tuple[int, ...], int, int]], kvs: bytes = b"",
              n_kvs: int = 0, data: bytes = b"", counts: tuple[int, int] | None = None) -> Path:
    """A GGUF v3 file by hand: tensors are (name, GGML dims innermost first, type, offset)."""
    n_tensors, n_kv = counts or (len(tensors), n_kvs)
    out = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs
    for name, dims, gtype, offset in tensors:
        out += gguf_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, gtype, offset)
    out += bytes(-len(out) % 32) + data
    path.write_bytes(out)
    return path


def test_gguf_claiming_2_to_the_40_zero_byte_experts(tmp_path: Path) -> None:
    """Finding: ``open`` never returned, memory grew past 1 GiB."""
    path = gguf_file(tmp_path / "zero.gguf", [("blk.0.ffn_up_exps.weight", (0, 4, 1 << 40), 0, 0)])
    tracemalloc.start()
    try:
        raises(path, "zero.gguf", "blk.0.ffn_up_exps.weight", f"claims {1 << 40} experts")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_gguf_zero_byte_experts_under_the_cap(tmp_path: Path) -> None:
    path = gguf_file(tmp_path / "zero.gguf", [("blk.0.ffn_up_exps.weight", (0, 4, 8), 0, 0)])
    raises(path, "zero.gguf", "experts of no bytes")


def test_gguf_expert_axis_over_the_cap(tmp_path: Path) -> None:
    n = MAX_EXPERTS_PER_LAYER + 1
    path = gguf_file(tmp_path / "many.gguf", [("blk.0.ffn_up_exps.weight", (1, n), 1, 0)], data=bytes(2 * n))
    raises(path, "many.gguf", f"claims {n} experts")


def test_gguf_array_claiming_2_to_the_40_items(tmp_path: Path) -> None:
    """``gguf.GGUFReader`` loops 2**40 times past the end of such a file."""
    kvs = gguf_string("general.tokens") + struct.pack("<IIQ", 9, 0, 1 << 40)  # array of u8
    path = gguf_file(tmp_path / "array.gguf", [], kvs, 1)
    raises(path, "array.gguf", "cut short")
    kvs = gguf_string("general.tokens") + struct.pack("<IIQ", 9, 8, 1 << 40)  # array of strings
    raises(gguf_file(path, [], kvs + gguf_string("x") * 4, 1), "array.gguf", "cut short")


def test_gguf_counts_over_their_caps_and_nested_arrays(tmp_path: Path) -> None:
    raises(gguf_file(tmp_path / "c.gguf", [], counts=(1 << 40, 0)), "c.gguf", "tensors and 0 keys claimed")
    raises(gguf_file(tmp_path / "c.gguf", [], counts=(MAX_TENSORS + 1, 0)), "c.gguf", "more than the 65536")
    nested = gguf_string("general.deep") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 20
    raises(gguf_file(tmp_path / "c.gguf", [], nested + struct.pack("<IQ", 0, 0), 1), "c.gguf", "nests arrays")


def test_gguf_bad_magic_quotes_none_of_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    message = raises(path, "x.gguf", "not a GGUF file")
    assert "root" not in message.replace(str(tmp_path), "")


def test_gguf_expert_count_is_checked(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "count.gguf"
    writer = gguf.GGUFWriter(str(path), arch="qwen3moe")
    writer.add_expert_count(8)
    writer.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((4, 2, 8), np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    raises(path, "count.gguf", "'qwen3moe.expert_count' says 8", "'blk.0.ffn_up_exps.weight' holds 4 experts")


def _write_reference_gguf(path: Path, endianess: Any) -> Path:
    import gguf
    from gguf.quants import quantize

    writer = gguf.GGUFWriter(str(path), arch="qwen3moe", endianess=endianess)
    writer.add_expert_used_count(2)
    writer.add_token_list([f"tok{i}" for i in range(300)])
    writer.add_array("general.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("blk.0.ffn_up_exps.weight", rng.standard_normal((4, 8, 32)).astype(np.float16))
    q = quantize(rng.standard_normal((4, 8, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_down_exps.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    bf16 = rng.integers(0, 1 << 16, (4, 8, 32), dtype=np.uint16)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", bf16.view(np.uint8).reshape(4, 8, 64),
                      raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.add_tensor("token_embd.weight", rng.standard_normal((16, 32)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_gguf_header_reads_what_the_gguf_reader_reads(tmp_path: Path, endian: str) -> None:
    """The bounded header walker agrees with ``gguf.GGUFReader`` on every tensor (dtype, numpy
    shape, bytes, offset): float16, Q8_0 and BF16 (bytes), float32, both byte orders."""
    import gguf

    path = _write_reference_gguf(tmp_path / "ref.gguf", getattr(gguf.GGUFEndian, endian))
    ours = read_header(path)
    reader = gguf.GGUFReader(path, "r")
    theirs = [(str(t.name), np.dtype(t.data.dtype), tuple(int(d) for d in t.data.shape), int(t.n_bytes),
               int(t.data_offset)) for t in reader.tensors]
    used = reader.fields["qwen3moe.expert_used_count"].contents()
    del reader
    assert [(t.name, t.dtype, t.shape, t.n_bytes, t.data_offset) for t in ours.tensors] == theirs
    assert ours.values["qwen3moe.expert_used_count"] == used == 2
    if endian == "LITTLE":
        index = load_index(path)
        assert sorted(index.experts) == [(0, e) for e in range(4)]
        assert index.experts_per_token == 2


def test_gguf_written_by_synth_still_indexes(tmp_path: Path) -> None:
    path = write_gguf_moe(tmp_path / "m.gguf", **SIZES)
    index = load_index(path)
    assert index.experts_per_layer() == SIZES["n_experts"]
    assert len(index.experts) == SIZES["n_layers"] * SIZES["n_experts"]


# --------------------------------------------------------------------------- 8. experts_per_token


@pytest.mark.parametrize("k", [5, 100])
def test_open_refuses_experts_per_token_above_the_experts_of_a_layer(tmp_path: Path, k: int) -> None:
    folder = checkpoint(tmp_path / "ck")

    async def main() -> None:
        await ExpertStore.open(folder, budget_bytes=1 << 20, experts_per_token=k, backend="pread")

    with pytest.raises(BudgetError, match=f"experts_per_token={k} is more than the 4 experts"):
        asyncio.run(main())


@pytest.mark.parametrize("k", [0, -1, True, 2.0, "2"])
def test_open_refuses_experts_per_token_that_is_no_positive_integer(tmp_path: Path, k: Any) -> None:
    folder = checkpoint(tmp_path / "ck")

    async def main() -> None:
        await ExpertStore.open(folder, budget_bytes=1 << 20, experts_per_token=k, backend="pread")

    with pytest.raises(BudgetError, match="experts_per_token must be a positive integer"):
        asyncio.run(main())


def test_open_takes_experts_per_token_up_to_the_experts_of_a_layer(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "ck")

    async def main() -> int | None:
        async with await ExpertStore.open(folder, budget_bytes=1 << 20, experts_per_token=4,
                                          backend="pread") as store:
            return store.index.experts_per_token

    assert asyncio.run(main()) == 4


def test_safetensors_written_by_the_library_still_index(tmp_path: Path) -> None:
    tensors = {f"model.layers.{layer}.mlp.experts.{e}.{p}.weight": np.ones((2, 4), np.float32)
               for layer in range(2) for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")}
    safetensors.numpy.save_file(tensors, str(tmp_path / "m.safetensors"))
    index = load_index(tmp_path / "m.safetensors")
    assert index.experts_per_layer() == 3 and len(index.experts) == 6
