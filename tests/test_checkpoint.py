"""The checkpoint index against files written by the real safetensors and gguf libraries.

Each layout is checked the way the store will use it: read each extent with plain file I/O,
concatenate, and find every tensor at its ``buf_offset``, equal to what the format's own
library loads. Bad inputs must raise :class:`CheckpointError` naming the offending file.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
import safetensors
import safetensors.numpy

from iosched._errors import CheckpointError
from iosched._layout import CheckpointIndex, ExpertLayout, GgmlType
from iosched.formats._checkpoint import load_index
from iosched.tools.synth import write_gguf_moe, write_safetensors_moe

L, E, H, INTER = 3, 6, 64, 32  # layers, experts, hidden, intermediate
SIZES: dict[str, Any] = dict(n_layers=L, n_experts=E, hidden=H, intermediate=INTER)
QWEN_ORDER = ["down_proj", "gate_proj", "up_proj"]  # safetensors sorts tensors by name
MIXTRAL_ORDER = ["gate_proj", "down_proj", "up_proj"]  # w1, w2, w3


# --------------------------------------------------------------------------- helpers


def read_expert(index: CheckpointIndex, lay: ExpertLayout) -> bytes:
    """The expert's buffer as the store builds it: its extents, read and concatenated."""
    parts = []
    for ext in lay.extents:
        with open(index.files[ext.file], "rb") as f:
            f.seek(ext.offset)
            chunk = f.read(ext.length)
        assert len(chunk) == ext.length
        parts.append(chunk)
    return b"".join(parts)


def check_expert(
    index: CheckpointIndex,
    key: tuple[int, int],
    expected: Mapping[str, npt.NDArray[Any]],
    order: list[str],
) -> None:
    """``expected`` maps canonical name -> the array the format's own library loaded."""
    lay = index.experts[key]
    assert lay.key == key
    assert [t.name for t in lay.tensors] == order
    assert [(t.file, t.offset) for t in lay.tensors] == sorted((t.file, t.offset) for t in lay.tensors)
    buf = read_expert(index, lay)
    assert len(buf) == lay.nbytes == sum(t.nbytes for t in lay.tensors)
    assert buf == b"".join(np.ascontiguousarray(expected[name]).tobytes() for name in order)
    pos = 0
    for t in lay.tensors:
        assert t.buf_offset == pos
        pos += t.nbytes
        arr = np.frombuffer(buf, dtype=t.dtype, count=t.nbytes // t.dtype.itemsize, offset=t.buf_offset)
        np.testing.assert_array_equal(arr.reshape(t.shape), expected[t.name])
        assert t.shape == expected[t.name].shape


def load_all(folder: Path) -> dict[str, npt.NDArray[Any]]:
    out: dict[str, npt.NDArray[Any]] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(safetensors.numpy.load_file(str(shard)))
    return out


def qwen_expected(tensors: Mapping[str, npt.NDArray[Any]], layer: int, expert: int) -> dict[str, npt.NDArray[Any]]:
    p = f"model.layers.{layer}.mlp.experts.{expert}"
    return {n: tensors[f"{p}.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")}


def raw_safetensors(path: Path, header: dict[str, Any], data: bytes) -> Path:
    """A hand-made safetensors file, for headers no library would write."""
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def expert_entry(offsets: list[int], shape: list[int] | None = None, dtype: str = "F32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape or [(offsets[1] - offsets[0]) // 4], "data_offsets": offsets}


EXPERT0 = "model.layers.0.mlp.experts.0"


# --------------------------------------------------------------------------- safetensors


def test_single_file(tmp_path: Path) -> None:
    folder = write_safetensors_moe(tmp_path / "ck", dtype="float16", index_json=False, **SIZES)
    file = folder / "model.safetensors"
    index = load_index(file)
    assert index.format == "safetensors"
    assert index.root == os.path.abspath(file)
    assert index.files == (os.path.abspath(file),)
    assert index.file_sizes == (file.stat().st_size,)
    assert type(index.experts) is dict
    assert sorted(index.experts) == [(layer, e) for layer in range(L) for e in range(E)]
    assert index.layers() == list(range(L))
    assert index.expert_bytes_by_layer() == {layer: 3 * H * INTER * 2 for layer in range(L)}
    tensors = safetensors.numpy.load_file(str(file))
    for key in [(0, 0), (1, 3), (L - 1, E - 1)]:
        check_expert(index, key, qwen_expected(tensors, *key), QWEN_ORDER)
    # An expert's three tensors are adjacent on disk: one extent, one read.
    assert all(len(lay.extents) == 1 for lay in index.experts.values())
    assert all(t.dtype == np.float16 for lay in index.experts.values() for t in lay.tensors)


@pytest.mark.parametrize("index_json", [True, False])
def test_shards(tmp_path: Path, index_json: bool) -> None:
    folder = write_safetensors_moe(
        tmp_path / "ck", dtype="float32", n_shards=3, index_json=index_json, seed=7, **SIZES
    )
    assert (folder / "model.safetensors.index.json").exists() == index_json
    index = load_index(folder)
    assert index.root == os.path.abspath(folder)
    shards = sorted(os.path.abspath(p) for p in folder.glob("*.safetensors"))
    assert len(shards) == 3 and list(index.files) == shards
    assert index.file_sizes == tuple(os.stat(p).st_size for p in shards)
    assert len(index.experts) == L * E
    tensors = load_all(folder)
    for layer in range(L):
        for e in (0, E - 1):
            check_expert(index, (layer, e), qwen_expected(tensors, layer, e), QWEN_ORDER)
        assert {index.experts[(layer, e)].extents[0].file for e in range(E)} == {layer}  # one shard per layer


def test_mixtral_naming(tmp_path: Path) -> None:
    folder = write_safetensors_moe(tmp_path / "ck", dtype="float16", naming="mixtral", n_shards=2, **SIZES)
    index = load_index(folder)
    tensors = load_all(folder)
    for key in [(0, 1), (L - 1, E - 2)]:
        p = f"model.layers.{key[0]}.block_sparse_moe.experts.{key[1]}"
        expected = {"gate_proj": tensors[f"{p}.w1.weight"], "down_proj": tensors[f"{p}.w2.weight"],
                    "up_proj": tensors[f"{p}.w3.weight"]}  # fmt: skip
        check_expert(index, key, expected, MIXTRAL_ORDER)
        assert [t.source_name for t in index.experts[key].tensors] == [f"{p}.{w}.weight" for w in ("w1", "w2", "w3")]


def test_bfloat16_checked_by_the_library_parser(tmp_path: Path) -> None:
    folder = write_safetensors_moe(tmp_path / "ck", dtype="bfloat16", **SIZES)
    file = folder / "model.safetensors"
    parsed = dict(safetensors.deserialize(file.read_bytes()))  # type: ignore[no-untyped-call]
    index = load_index(folder)
    lay = index.experts[(1, 2)]
    buf = read_expert(index, lay)
    for t in lay.tensors:
        assert parsed[t.source_name]["dtype"] == "BF16"
        assert list(t.shape) == parsed[t.source_name]["shape"]
        assert t.dtype == np.dtype(ml_dtypes.bfloat16)  # typed: ml_dtypes is a dependency
        assert buf[t.buf_offset : t.buf_offset + t.nbytes] == bytes(parsed[t.source_name]["data"])


def test_prefixed_names_and_other_suffixes(tmp_path: Path) -> None:
    """Any prefix before ``layers.``; suffixes other than the three weights keep their name."""
    p = "model.language_model.layers.2.mlp.experts.0"
    tensors = {
        f"{p}.gate_proj.weight": np.arange(8, dtype=np.float32).reshape(2, 4),
        f"{p}.gate_proj.bias": np.arange(2, dtype=np.float32),
        f"{p}.up_proj.weight_scale": np.ones(1, dtype=np.float32),
        "model.language_model.layers.2.mlp.gate.weight": np.zeros((6, 4), dtype=np.float32),
    }
    file = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(tensors, str(file))
    index = load_index(file)
    assert list(index.experts) == [(2, 0)]
    names = {t.name: t for t in index.experts[(2, 0)].tensors}
    assert set(names) == {"gate_proj", "gate_proj.bias", "up_proj.weight_scale"}
    assert names["gate_proj"].shape == (2, 4)
    assert len(index.experts[(2, 0)].extents) == 1


def _gpt_oss_mxfp4(folder: Path, experts: int = 4, hidden: int = 64, inter: int = 32) -> dict[str, Any]:
    """gpt-oss's release layout, written by safetensors' torch writer: MXFP4 experts as
    ``_blocks`` (U8, 16 bytes = 32 values a block) and ``_scales`` (F8_E8M0), biases in BF16."""
    import safetensors.torch
    import torch

    gen = torch.Generator().manual_seed(3)
    p = "model.layers.0.mlp.experts"
    tensors = {
        f"{p}.gate_up_proj_blocks": torch.randint(0, 256, (experts, 2 * inter, hidden // 32, 16), generator=gen,
                                                  dtype=torch.uint8),
        f"{p}.gate_up_proj_scales": torch.randint(100, 140, (experts, 2 * inter, hidden // 32), generator=gen,
                                                  dtype=torch.uint8).view(torch.float8_e8m0fnu),
        f"{p}.gate_up_proj_bias": torch.randn(experts, 2 * inter, generator=gen).to(torch.bfloat16),
        f"{p}.down_proj_blocks": torch.randint(0, 256, (experts, hidden, inter // 32, 16), generator=gen,
                                               dtype=torch.uint8),
        f"{p}.down_proj_scales": torch.randint(100, 140, (experts, hidden, inter // 32), generator=gen,
                                               dtype=torch.uint8).view(torch.float8_e8m0fnu),
        f"{p}.down_proj_bias": torch.randn(experts, hidden, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.router.weight": torch.randn(experts, hidden, generator=gen),
    }
    folder.mkdir()
    safetensors.torch.save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "gpt_oss", "num_local_experts": experts, "experts_per_token": 2}))
    return tensors


def test_mxfp4_blocks_and_f8_e8m0_scales_travel_with_their_expert(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed: it writes the F8_E8M0 tensors")
    folder = tmp_path / "gpt-oss"
    tensors = _gpt_oss_mxfp4(folder)
    index = load_index(folder)
    assert index.experts_per_token == 2 and "'experts_per_token'" in index.k_source
    assert sorted(index.experts) == [(0, e) for e in range(4)]
    p = "model.layers.0.mlp.experts"
    for e in range(4):
        lay = index.experts[(0, e)]
        buf = read_expert(index, lay)
        assert {t.name for t in lay.tensors} == {"gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                                                 "down_proj_blocks", "down_proj_scales", "down_proj_bias"}
        for t in lay.tensors:
            want = tensors[f"{p}.{t.name}"][e]
            assert t.source_name == f"{p}.{t.name}[{e}]" and t.shape == tuple(want.shape)
            raw = want.contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes()
            assert buf[t.buf_offset : t.buf_offset + t.nbytes] == raw
        kinds = {t.name: t.dtype for t in lay.tensors}
        assert kinds["gate_up_proj_scales"] == np.dtype(ml_dtypes.float8_e8m0fnu)
        assert kinds["gate_up_proj_bias"] == np.dtype(ml_dtypes.bfloat16)
        assert kinds["down_proj_blocks"] == np.uint8
        assert lay.derived == ()  # packed blocks: no zero-copy gate/up views of MXFP4


def test_mxfp4_scales_typed_in_the_view(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="torch is not installed: it writes the F8_E8M0 tensors")
    import asyncio

    from iosched import ExpertStore

    folder = tmp_path / "gpt-oss"
    tensors = _gpt_oss_mxfp4(folder)

    async def main() -> None:
        async with await ExpertStore.open(folder, budget_bytes=1 << 20, backend="pread") as store:
            async with store.acquire((0, 1)) as view:
                scales = view.tensors["gate_up_proj_scales"]
                want = tensors["model.layers.0.mlp.experts.gate_up_proj_scales"][1]
                assert scales.dtype == np.dtype(ml_dtypes.float8_e8m0fnu)
                np.testing.assert_array_equal(scales.astype(np.float32), want.float().numpy())

    asyncio.run(main())


def test_files_without_experts_are_left_out(tmp_path: Path) -> None:
    folder = write_safetensors_moe(tmp_path / "ck", dtype="float16", index_json=False, **SIZES)
    safetensors.numpy.save_file({"lm_head.weight": np.zeros((4, 4), np.float16)}, str(folder / "zz_head.safetensors"))
    index = load_index(folder)
    assert index.files == (os.path.abspath(folder / "model.safetensors"),)


def test_gap_between_tensors_is_not_bridged(tmp_path: Path) -> None:
    header = {
        f"{EXPERT0}.gate_proj.weight": expert_entry([0, 16]),
        f"{EXPERT0}.up_proj.weight": expert_entry([16, 32]),
        "padding.weight": expert_entry([32, 48]),
        f"{EXPERT0}.down_proj.weight": expert_entry([48, 64]),
    }
    file = raw_safetensors(tmp_path / "gap.safetensors", header, bytes(range(64)))
    index = load_index(file)
    lay = index.experts[(0, 0)]
    assert [(x.offset - lay.extents[0].offset, x.length) for x in lay.extents] == [(0, 32), (48, 16)]
    assert [t.buf_offset for t in lay.tensors] == [0, 16, 32]
    assert read_expert(index, lay) == bytes(range(32)) + bytes(range(48, 64))


# --------------------------------------------------------------------------- GGUF


def test_gguf(tmp_path: Path) -> None:
    import gguf

    path = write_gguf_moe(tmp_path / "moe.gguf", dtype="float16", seed=3, **SIZES)
    index = load_index(path)
    assert index.format == "gguf"
    assert index.files == (os.path.abspath(path),)
    assert index.file_sizes == (path.stat().st_size,)
    assert sorted(index.experts) == [(layer, e) for layer in range(L) for e in range(E)]
    reader = gguf.GGUFReader(path, "r")
    merged = {t.name: np.array(t.data) for t in reader.tensors}
    del reader
    for key in [(0, 0), (1, E // 2), (L - 1, E - 1)]:
        expected = {f"{r}_proj": merged[f"blk.{key[0]}.ffn_{r}_exps.weight"][key[1]] for r in ("gate", "up", "down")}
        assert expected["gate_proj"].shape == (INTER, H) and expected["down_proj"].shape == (H, INTER)
        check_expert(index, key, expected, ["gate_proj", "up_proj", "down_proj"])
    # Three merged tensors: an expert is three separate slices, so three extents.
    assert all(len(lay.extents) == 3 for lay in index.experts.values())


def test_gguf_float32_in_a_folder(tmp_path: Path) -> None:
    path = write_gguf_moe(tmp_path / "ck" / "model.gguf", dtype="float32", **SIZES)
    index = load_index(path.parent)
    assert index.format == "gguf" and index.files == (os.path.abspath(path),)
    assert index.experts[(0, 0)].tensors[0].dtype == np.float32
    assert index.expert_bytes_by_layer() == {layer: 3 * H * INTER * 4 for layer in range(L)}


def _mapped(path: Path) -> bool:
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps here")
    return str(path.resolve()) in maps.read_text()


def test_gguf_memory_map_is_released(tmp_path: Path) -> None:
    path = write_gguf_moe(tmp_path / "moe.gguf", **SIZES)
    index = load_index(path)
    assert index.experts
    assert not _mapped(path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))  # maps, then fails in the reader
    with pytest.raises(CheckpointError) as info:
        load_index(bad)
    assert "bad.gguf" in str(info.value)
    assert not _mapped(bad)


# --------------------------------------------------------------------------- bad inputs


def _raises(source: Path, *needles: str) -> str:
    with pytest.raises(CheckpointError) as info:
        load_index(source)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    return message


def test_truncated_file(tmp_path: Path) -> None:
    folder = write_safetensors_moe(tmp_path / "ck", dtype="float16", index_json=False, **SIZES)
    file = folder / "model.safetensors"
    size = file.stat().st_size
    os.truncate(file, size - 100)
    message = _raises(file, "model.safetensors", "extends past end of file", str(size - 100))
    assert str(size) in message  # the tensor's end, which lies past the file's end


def test_garbage_bytes(tmp_path: Path) -> None:
    file = tmp_path / "garbage.safetensors"
    file.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _raises(file, "garbage.safetensors")


def test_too_short(tmp_path: Path) -> None:
    file = tmp_path / "short.safetensors"
    file.write_bytes(b"\x01\x02\x03")
    _raises(file, "short.safetensors", "too short")


@pytest.mark.parametrize("n", [10**12, 200 * 10**6, 1000])
def test_absurd_header_length(tmp_path: Path, n: int) -> None:
    file = tmp_path / "huge.safetensors"
    file.write_bytes(struct.pack("<Q", n) + b"{}" + bytes(64))
    _raises(file, "huge.safetensors", "header length")


@pytest.mark.parametrize(
    "blob, needle",
    [(b"{not json", "not valid JSON"), (b"\xff\xfe{}", "not valid JSON"), (b"[1, 2]", "not an object")],
)
def test_bad_json(tmp_path: Path, blob: bytes, needle: str) -> None:
    file = tmp_path / "badjson.safetensors"
    file.write_bytes(struct.pack("<Q", len(blob)) + blob)
    _raises(file, "badjson.safetensors", needle)


@pytest.mark.parametrize(
    "entry, needle",
    [
        ({"dtype": "F32", "shape": [4], "data_offsets": [0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16.0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}, "shape"),
        ({"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}, "needs 20"),
        ({"dtype": 7, "shape": [4], "data_offsets": [0, 16]}, "dtype"),
        ("oops", "not an object"),
    ],
)
def test_malformed_entry(tmp_path: Path, entry: Any, needle: str) -> None:
    name = f"{EXPERT0}.gate_proj.weight"
    file = raw_safetensors(tmp_path / "entry.safetensors", {name: entry}, bytes(16))
    _raises(file, "entry.safetensors", name, needle)


def test_unknown_dtype_on_an_expert_tensor(tmp_path: Path) -> None:
    name = f"{EXPERT0}.gate_proj.weight"
    header = {name: {"dtype": "F4", "shape": [32], "data_offsets": [0, 16]},
              "other.weight": {"dtype": "F4", "shape": [32], "data_offsets": [16, 32]}}  # fmt: skip
    file = raw_safetensors(tmp_path / "f4.safetensors", header, bytes(32))
    _raises(file, "f4.safetensors", name, "'F4'")
    # The same unknown dtype on a tensor we never read is fine.
    header[name] = expert_entry([0, 16])
    file = raw_safetensors(tmp_path / "f4.safetensors", header, bytes(32))
    assert list(load_index(file).experts) == [(0, 0)]


def test_overlapping_tensors(tmp_path: Path) -> None:
    gate, up = f"{EXPERT0}.gate_proj.weight", f"{EXPERT0}.up_proj.weight"
    header = {gate: expert_entry([0, 16]), up: expert_entry([8, 24])}
    file = raw_safetensors(tmp_path / "overlap.safetensors", header, bytes(24))
    _raises(file, "overlap.safetensors", gate, up, "overlap")


def test_missing_shard(tmp_path: Path) -> None:
    folder = write_safetensors_moe(tmp_path / "ck", dtype="float16", n_shards=2, **SIZES)
    (folder / "model-00002-of-00002.safetensors").unlink()
    _raises(folder, "model-00002-of-00002.safetensors", "missing", "model.safetensors.index.json")


def test_weight_map_names_a_tensor_the_shard_lacks(tmp_path: Path) -> None:
    folder = write_safetensors_moe(tmp_path / "ck", dtype="float16", n_shards=2, **SIZES)
    doc = json.loads((folder / "model.safetensors.index.json").read_text())
    moved = f"model.layers.{L - 1}.mlp.experts.0.up_proj.weight"
    doc["weight_map"][moved] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(doc))
    _raises(folder, moved, "model-00001-of-00002.safetensors")


def test_bad_index_json(tmp_path: Path) -> None:
    folder = write_safetensors_moe(tmp_path / "ck", dtype="float16", n_shards=2, **SIZES)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    _raises(folder, "model.safetensors.index.json", "weight_map")


def test_duplicate_tensor_across_shards_without_index(tmp_path: Path) -> None:
    tensors = {f"{EXPERT0}.gate_proj.weight": np.zeros(4, np.float32)}
    safetensors.numpy.save_file(tensors, str(tmp_path / "a.safetensors"))
    safetensors.numpy.save_file(tensors, str(tmp_path / "b.safetensors"))
    _raises(tmp_path, "a.safetensors", "b.safetensors", f"{EXPERT0}.gate_proj.weight")


def test_two_names_for_one_role(tmp_path: Path) -> None:
    tensors = {
        "model.layers.0.mlp.experts.0.gate_proj.weight": np.zeros(4, np.float32),
        "model.layers.0.block_sparse_moe.experts.0.w1.weight": np.zeros(4, np.float32),
    }
    safetensors.numpy.save_file(tensors, str(tmp_path / "dup.safetensors"))
    _raises(tmp_path / "dup.safetensors", "dup.safetensors", "gate_proj", "w1.weight")


def test_missing_source(tmp_path: Path) -> None:
    _raises(tmp_path / "nowhere", "nowhere", "does not exist")


def test_folder_without_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "README.txt").write_text("nothing here")
    _raises(tmp_path, str(tmp_path), "no checkpoint")


def test_unsupported_file_type(tmp_path: Path) -> None:
    file = tmp_path / "pytorch_model.bin"
    file.write_bytes(bytes(16))
    _raises(file, "pytorch_model.bin")


def test_no_expert_tensors(tmp_path: Path) -> None:
    file = tmp_path / "dense.safetensors"
    safetensors.numpy.save_file({"model.layers.0.mlp.gate_proj.weight": np.zeros((4, 4), np.float16)}, str(file))
    _raises(file, "dense.safetensors", "no expert tensors found", "experts.{E}")


def test_gguf_without_experts(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "dense.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tensor("blk.0.ffn_gate.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _raises(path, "dense.gguf", "no expert tensors found")


def test_corrupt_gguf(tmp_path: Path) -> None:
    file = tmp_path / "corrupt.gguf"
    file.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _raises(file, "corrupt.gguf", "GGUF")
    file.write_bytes(b"")
    _raises(file, "corrupt.gguf")


def test_truncated_gguf(tmp_path: Path) -> None:
    path = write_gguf_moe(tmp_path / "cut.gguf", **SIZES)
    os.truncate(path, path.stat().st_size - 1000)
    _raises(path, "cut.gguf")


def test_two_ggufs_in_a_folder(tmp_path: Path) -> None:
    write_gguf_moe(tmp_path / "a.gguf", **SIZES)
    write_gguf_moe(tmp_path / "b.gguf", **SIZES)
    _raises(tmp_path, "a.gguf", "b.gguf")


# --------------------------------------------------------------------------- GGUF layouts (#14)


def gguf_moe(path: Path, tensors: Mapping[str, Any], arch: str = "qwen3moe", *, n_experts: int | None = 4,
             k: int | None = 2, extra: Mapping[str, int] | None = None, split_max_tensors: int = 0) -> Path:
    """A GGUF written by ``gguf.GGUFWriter``: ``tensors`` maps a name to an array, or to
    ``(raw bytes, GGMLQuantizationType)``; the counts as ``{arch}.*`` keys when given."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch=arch, split_max_tensors=split_max_tensors)
    if n_experts is not None:
        writer.add_expert_count(n_experts)
    if k is not None:
        writer.add_expert_used_count(k)
    for key, value in (extra or {}).items():
        writer.add_uint32(key.format(arch=arch), value)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            writer.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _f16(rng: np.random.Generator, *shape: int) -> npt.NDArray[np.float16]:
    return rng.standard_normal(shape).astype(np.float16)


def _reader_tensors(*paths: Path) -> dict[str, npt.NDArray[Any]]:
    import gguf

    out: dict[str, npt.NDArray[Any]] = {}
    for path in paths:
        reader = gguf.GGUFReader(path, "r")
        out.update({t.name: np.array(t.data) for t in reader.tensors})
        del reader
    return out


def _view(index: CheckpointIndex, key: tuple[int, int]) -> Any:
    from iosched.runtime._view import ExpertView

    return ExpertView.over(index.experts[key], memoryview(bytearray(read_expert(index, index.experts[key]))))


def test_gguf_fused_gate_up_halves_follow_llama_cpp(tmp_path: Path) -> None:
    """``ffn_gate_up_exps`` (2I rows per expert): gate is rows [0, I), up rows [I, 2I), as
    llama.cpp's build_moe_ffn splits it; both zero-copy views of ``gate_up_proj``, the bias
    split likewise, the GGML type on the halves too."""
    rng = np.random.default_rng(4)
    path = gguf_moe(tmp_path / "fused.gguf", {
        "blk.0.ffn_gate_up_exps.weight": _f16(rng, 4, 2 * INTER, H),
        "blk.0.ffn_gate_up_exps.bias": rng.standard_normal((4, 2 * INTER)).astype(np.float32),
        "blk.0.ffn_down_exps.weight": _f16(rng, 4, H, INTER),
        "blk.0.ffn_down_exps.scale": rng.standard_normal(4).astype(np.float32),
    }, arch="gemma4")
    index = load_index(path)
    ref = _reader_tensors(path)
    assert index.architecture == "gemma4" and sorted(index.experts) == [(0, e) for e in range(4)]
    view = _view(index, (0, 2))
    fused = ref["blk.0.ffn_gate_up_exps.weight"][2]
    np.testing.assert_array_equal(view.tensors["gate_up_proj"], fused)
    np.testing.assert_array_equal(view.tensors["gate_proj"], fused[:INTER])
    np.testing.assert_array_equal(view.tensors["up_proj"], fused[INTER:])
    bias = ref["blk.0.ffn_gate_up_exps.bias"][2]
    np.testing.assert_array_equal(view.tensors["gate_proj.bias"], bias[:INTER])
    np.testing.assert_array_equal(view.tensors["up_proj.bias"], bias[INTER:])
    assert view.tensors["down_proj.scale"].shape == () and view.tensors["down_proj.scale"] == ref[
        "blk.0.ffn_down_exps.scale"][2]
    for half in ("gate_proj", "up_proj"):
        assert np.shares_memory(view.tensors[half], view.tensors["gate_up_proj"])
        assert view.ggml_types[half].name == "F16"
    assert view.ggml_types["gate_up_proj.bias"].name == "F32"


def test_gguf_bf16_is_typed_and_quantized_types_are_recorded(tmp_path: Path) -> None:
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(5)
    bf16 = quantize(rng.standard_normal((4, INTER, H)).astype(np.float32), gguf.GGMLQuantizationType.BF16)
    q8 = quantize(rng.standard_normal((4, INTER, H)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    q4k = rng.integers(0, 256, (4, H, INTER // 256 * 144 if INTER >= 256 else 144), dtype=np.uint8)
    path = gguf_moe(tmp_path / "types.gguf", {
        "blk.0.ffn_gate_exps.weight": (bf16, gguf.GGMLQuantizationType.BF16),
        "blk.0.ffn_up_exps.weight": (q8, gguf.GGMLQuantizationType.Q8_0),
        "blk.0.ffn_down_exps.weight": (q4k, gguf.GGMLQuantizationType.Q4_K),
    })
    index = load_index(path)
    ref = _reader_tensors(path)
    view = _view(index, (0, 1))
    gate = view.tensors["gate_proj"]
    assert gate.dtype == ml_dtypes.bfloat16 and gate.shape == (INTER, H)
    assert gate.tobytes() == ref["blk.0.ffn_gate_exps.weight"][1].tobytes()
    assert view.tensors["up_proj"].dtype == np.uint8 and view.tensors["up_proj"].shape == (INTER, H // 32 * 34)
    assert view.tensors["down_proj"].shape == q4k.shape[1:]
    assert view.ggml_types == {"gate_proj": GgmlType("BF16", 1, 2), "up_proj": GgmlType("Q8_0", 32, 34),
                               "down_proj": GgmlType("Q4_K", 256, 144)}


def test_gguf_skipped_kinds_and_mtp_layers(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    experts = {f"blk.{la}.ffn_{r}_exps.weight": _f16(rng, 4, *((H, INTER) if r == "down" else (INTER, H)))
               for la in (1, 2, 3) for r in ("gate", "up", "down")}
    path = gguf_moe(tmp_path / "glm.gguf", {
        "blk.0.ffn_gate.weight": _f16(rng, INTER, H), "blk.0.ffn_up.weight": _f16(rng, INTER, H),
        "blk.0.ffn_down.weight": _f16(rng, H, INTER),
        **{f"blk.{la}.ffn_gate_inp.weight": _f16(rng, 4, H) for la in (1, 2)},
        **{f"blk.{la}.ffn_up_shexp.weight": _f16(rng, INTER, H) for la in (1, 2)},
        **experts,
        "blk.3.nextn.eh_proj.weight": _f16(rng, H, 2 * H),
    }, arch="glm4moe", extra={"{arch}.block_count": 4, "{arch}.nextn_predict_layers": 1,
                              "{arch}.leading_dense_block_count": 1})
    index = load_index(path)
    assert index.layers() == [1, 2]
    kinds = {s.kind: (s.count, s.example) for s in index.skipped}
    assert kinds == {"dense": (3, "blk.0.ffn_gate.weight"), "router": (2, "blk.1.ffn_gate_inp.weight"),
                     "shared_expert": (2, "blk.1.ffn_up_shexp.weight"), "mtp": (4, "blk.3.ffn_gate_exps.weight")}


def test_gguf_split_set_is_one_index(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    tensors = {f"blk.{la}.ffn_{r}_exps.weight": _f16(rng, 4, *((H, INTER) if r == "down" else (INTER, H)))
               for la in range(3) for r in ("gate", "up", "down")}
    gguf_moe(tmp_path / "ck" / "m.gguf", tensors, split_max_tensors=4)
    shards = sorted((tmp_path / "ck").glob("*.gguf"))
    assert [p.name for p in shards] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    ref = _reader_tensors(*shards)
    for source in (tmp_path / "ck", shards[1]):  # the folder, or any one shard: the whole set
        index = load_index(source)
        assert len(index.files) == 3 and sorted(index.experts) == [(la, e) for la in range(3) for e in range(4)]
        assert index.experts_per_token == 2
        view = _view(index, (2, 3))
        np.testing.assert_array_equal(view.tensors["down_proj"], ref["blk.2.ffn_down_exps.weight"][3])
    (tmp_path / "ck" / "mmproj-f16.gguf").write_bytes(b"")  # a projector beside it: left out, noted
    assert any("mmproj-f16.gguf" in n for n in load_index(tmp_path / "ck").notes)
    shards[2].unlink()
    for source in (tmp_path / "ck", shards[0]):
        _raises(source, "m-00003-of-00003.gguf", "lacks 1")


def test_gguf_split_shards_that_do_not_belong_together(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    tensors = {f"blk.{la}.ffn_{r}_exps.weight": _f16(rng, 4, 8, 32) for la in range(2) for r in ("gate", "up", "down")}
    gguf_moe(tmp_path / "a" / "m.gguf", tensors, split_max_tensors=3)
    gguf_moe(tmp_path / "b" / "m.gguf", tensors, split_max_tensors=2)  # 3 shards of 2: split.count 3
    os.replace(tmp_path / "b" / "m-00002-of-00003.gguf", tmp_path / "a" / "m-00002-of-00002.gguf")
    _raises(tmp_path / "a", "m-00002-of-00002.gguf", "'split.count' is 3")
    lone = tmp_path / "lone.gguf"
    os.replace(tmp_path / "a" / "m-00001-of-00002.gguf", lone)
    _raises(lone, "lone.gguf", "split.no 0", "of a split GGUF of 2 shards")


def test_gguf_folder_with_only_a_projector_or_two_models(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    gguf_moe(tmp_path / "p" / "mmproj-model.gguf", {"v.blk.0.attn_q.weight": _f16(rng, 8, 8)}, arch="clip",
             n_experts=None, k=None)
    _raises(tmp_path / "p", "only multimodal projector", "mmproj-model.gguf")
    tensors = {f"blk.0.ffn_{r}_exps.weight": _f16(rng, 4, 8, 32) for r in ("gate", "up", "down")}
    gguf_moe(tmp_path / "p" / "model.gguf", tensors)
    gguf_moe(tmp_path / "p" / "vision.gguf", {"v.blk.0.attn_q.weight": _f16(rng, 8, 8)}, arch="clip",
             n_experts=None, k=None)  # a projector by its architecture, whatever its name
    index = load_index(tmp_path / "p")
    assert {Path(n.split(":")[0]).name for n in index.notes} == {"mmproj-model.gguf", "vision.gguf"}
    gguf_moe(tmp_path / "p" / "other.gguf", tensors)
    _raises(tmp_path / "p", "2 GGUF models", "model.gguf", "other.gguf")


@pytest.mark.parametrize("tensors,needles", [
    ({"blk.0.ffn_gate_exps.weight": (4, 8, 32), "blk.0.ffn_up_exps.weight": (3, 8, 32),
      "blk.0.ffn_down_exps.weight": (4, 32, 8)}, ["'blk.0.ffn_up_exps.weight' holds 3 experts", "says 4"]),
    ({"blk.0.ffn_gate_exps.weight": (4, 8, 32), "blk.0.ffn_down_exps.weight": (4, 32, 8)},
     ["blk.0.ffn_gate_exps.weight without blk.0.ffn_up_exps.weight"]),
    ({"blk.0.ffn_gate_exps.weight": (4, 8, 32), "blk.0.ffn_up_exps.weight": (4, 8, 32)},
     ["no blk.0.ffn_down_exps.weight"]),
    ({"blk.0.ffn_gate_up_exps.weight": (4, 16, 32), "blk.0.ffn_gate_exps.weight": (4, 8, 32),
      "blk.0.ffn_down_exps.weight": (4, 32, 8)}, ["both a fused blk.0.ffn_gate_up_exps.weight"]),
    ({"blk.0.ffn_gate_up_exps.weight": (4, 15, 32), "blk.0.ffn_down_exps.weight": (4, 32, 8)},
     ["'blk.0.ffn_gate_up_exps.weight' has 15 rows", "odd"]),
    ({"blk.0.ffn_up_exps.weight": (4, 8, 32), "blk.0.ffn_down_exps.weight": (4, 32, 8),
      "blk.0.ffn_gate_exps.bias": (4, 8)}, ["'blk.0.ffn_gate_exps.bias' has no blk.0.ffn_gate_exps.weight"]),
])
def test_gguf_refuses_inconsistent_experts_by_name(tmp_path: Path, tensors: dict[str, tuple[int, ...]],
                                                  needles: list[str]) -> None:
    rng = np.random.default_rng(10)
    path = gguf_moe(tmp_path / "bad.gguf", {n: _f16(rng, *s) for n, s in tensors.items()})
    _raises(path, "bad.gguf", *needles)


def test_gguf_refuses_layers_that_disagree_on_experts_without_metadata(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    tensors = {f"blk.{la}.ffn_{r}_exps.weight": _f16(rng, 4 + la, 8, 32) for la in range(2) for r in ("up", "down")}
    path = gguf_moe(tmp_path / "bad.gguf", tensors, n_experts=None, k=None)
    _raises(path, "bad.gguf", "'blk.1.ffn_up_exps.weight' holds 5 experts", "'blk.0.ffn_up_exps.weight' holds 4")


def test_gguf_refuses_k_above_the_experts(tmp_path: Path) -> None:
    rng = np.random.default_rng(12)
    tensors = {f"blk.0.ffn_{r}_exps.weight": _f16(rng, 4, 8, 32) for r in ("gate", "up", "down")}
    path = gguf_moe(tmp_path / "k.gguf", tensors, k=5)
    _raises(path, "k.gguf", "'qwen3moe.expert_used_count'", "experts per token is 5, more than 4")


def test_gguf_bf16_vectors_per_expert_and_quantized_vectors(tmp_path: Path) -> None:
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(13)
    base = {f"blk.0.ffn_{r}_exps.weight": _f16(rng, 4, 8, 32) for r in ("up", "down")}
    scale = quantize(rng.standard_normal(4).astype(np.float32), gguf.GGMLQuantizationType.BF16)
    path = gguf_moe(tmp_path / "s.gguf", {**base, "blk.0.ffn_down_exps.scale": (scale, gguf.GGMLQuantizationType.BF16)})
    index = load_index(path)
    view = _view(index, (0, 3))
    got = view.tensors["down_proj.scale"]
    assert got.dtype == ml_dtypes.bfloat16 and got.shape == () and got.tobytes() == scale.tobytes()[6:8]
    q8 = quantize(rng.standard_normal(32).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    path = gguf_moe(tmp_path / "q.gguf", {**base, "blk.0.ffn_down_exps.scale": (q8, gguf.GGMLQuantizationType.Q8_0)},
                    n_experts=None)
    _raises(path, "q.gguf", "'blk.0.ffn_down_exps.scale' is a Q8_0 vector")


def test_megabyte_long_names_cost_no_regex_time(tmp_path: Path) -> None:
    """A hostile header's names full of ``experts.`` and dots: read in linear time (the fused,
    router and dense patterns, which may backtrack, never see a name past 1024 characters)."""
    import time

    header = {"model.layers.0." + "experts." * 250_000 + "x": expert_entry([0, 16]),
              "model.layers.0." + "a." * 500_000 + "gate": expert_entry([16, 32])}
    file = raw_safetensors(tmp_path / "long.safetensors", header, bytes(32))
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="no expert tensors found"):
        load_index(file)
    assert time.monotonic() - start < 5
