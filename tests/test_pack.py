"""``iosched pack``: every expert one aligned extent, the same bytes, a valid safetensors copy.

Sources are written by the real writers (``gguf.GGUFWriter`` with Q8_0 from
``gguf.quants.quantize``, transformers' ``save_pretrained``); the copies are read back by the
real readers (``safetensors.safe_open``, ``gguf.GGUFReader``, transformers'
``from_pretrained``) and by iosched's store on every backend.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from iosched import CheckpointError, ExpertStore, ExpertView, PackError, load_index, pack_checkpoint
from iosched._layout import CheckpointIndex, GgmlType
from iosched.formats._pack_meta import apply_pack_metadata, pack_metadata
from iosched.tools.cli import main
from tests.test_checkpoint_hostile import expert_bytes as extent_bytes

LAYERS, EXPERTS, HIDDEN, INTER = 2, 4, 64, 32
Q8_0 = GgmlType("Q8_0", 32, 34)
F16 = GgmlType("F16", 1, 2)
F32 = GgmlType("F32", 1, 4)
EXPECTED_TYPES = {"gate_proj": Q8_0, "up_proj": F16, "down_proj": Q8_0}


def write_gguf(path: Path) -> Path:
    """llama.cpp's layout: three merged expert tensors per layer (gate and down in Q8_0, up in
    F16), so three extents per expert; and tensors that are not experts, Q8_0 and F32."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch="qwen3moe")
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(2)
    writer.add_tensor("token_embd.weight", rng.standard_normal((16, HIDDEN)).astype(np.float32))
    for layer in range(LAYERS):
        q = quantize(rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(f"blk.{layer}.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", rng.standard_normal((EXPERTS, HIDDEN)).astype(np.float32))
        gate = quantize(rng.standard_normal((EXPERTS, INTER, HIDDEN)).astype(np.float32),
                        gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", gate, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight",
                          rng.standard_normal((EXPERTS, INTER, HIDDEN)).astype(np.float16))
        down = quantize(rng.standard_normal((EXPERTS, HIDDEN, INTER)).astype(np.float32),
                        gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", down, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_hf(folder: Path, kind: str) -> Path:
    """A tiny Qwen3-MoE or Mixtral in bf16, by transformers' ``save_pretrained``."""
    torch = pytest.importorskip("torch", reason="torch (a test extra) writes the transformers checkpoints")
    transformers = pytest.importorskip("transformers", reason="transformers (a test extra) writes the checkpoints")
    common: dict[str, Any] = dict(vocab_size=64, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, num_experts_per_tok=2)
    if kind == "qwen":
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=32, num_experts=EXPERTS, intermediate_size=64,
                                             decoder_sparse_step=1, mlp_only_layers=[], **common)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(num_local_experts=EXPERTS, intermediate_size=32, **common)
        model = transformers.MixtralForCausalLM(config)
    torch.manual_seed(0)
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def packed_index(folder: Path) -> CheckpointIndex:
    """The packed copy's index with its ``__metadata__`` applied (what load_index does once
    apply_pack_metadata is wired into it)."""
    index = load_index(folder)
    return apply_pack_metadata(index, pack_metadata(index.files))


@pytest.fixture(scope="module")
def gguf_packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("pack-gguf")
    src = write_gguf(tmp / "moe.gguf")
    report = pack_checkpoint(src, tmp / "packed")
    return src, tmp / "packed", report.as_dict()


def test_gguf_pack_report(gguf_packed: tuple[Path, Path, dict[str, Any]]) -> None:
    src, dst, report = gguf_packed
    n = LAYERS * EXPERTS
    assert report["verified"] and report["align"] == 4096 and report["source_format"] == "gguf"
    assert report["experts"] == n and report["extents_before"] == 3 * n and report["extents_after"] == n
    assert report["other_tensors"] == 1 + 2 * LAYERS
    assert report["files"] == ["model.safetensors"] and sorted(os.listdir(dst)) == ["model.safetensors"]
    for row in report["experts_detail"]:
        assert len(row["before"]) == 3 and all(p["file"] == "moe.gguf" for p in row["before"])
        assert row["after"]["offset"] % 4096 == 0 and row["after"]["file"] == "model.safetensors"
        assert row["after"]["length"] == sum(p["length"] for p in row["before"])
    assert not [name for name in os.listdir(dst.parent) if name.startswith(".packed")]  # no temp folder left


def test_gguf_pack_index_and_types(gguf_packed: tuple[Path, Path, dict[str, Any]]) -> None:
    src, dst, _ = gguf_packed
    before, after = load_index(src), packed_index(dst)
    assert after.format == "safetensors" and sorted(after.experts) == sorted(before.experts)
    assert after.experts_per_token == 2 and "iosched.experts_per_token" in after.k_source
    assert after.architecture == "qwen3moe"
    for key, lay in after.experts.items():
        (ext,) = lay.extents
        assert ext.offset % 4096 == 0 and ext.length == lay.nbytes == before.experts[key].nbytes
        assert len(before.experts[key].extents) == 3
        assert [(t.name, t.dtype, t.shape, t.buf_offset) for t in lay.tensors] == \
            [(t.name, t.dtype, t.shape, t.buf_offset) for t in before.experts[key].tensors]
        assert dict(lay.ggml_types) == EXPECTED_TYPES
        if before.experts[key].ggml_types:  # once the GGUF reader records them
            assert dict(before.experts[key].ggml_types) == EXPECTED_TYPES
        assert extent_bytes(after, key) == extent_bytes(before, key)
        view = ExpertView.over(lay, memoryview(extent_bytes(after, key)))
        assert dict(view.ggml_types) == EXPECTED_TYPES
        assert view.tensors["gate_proj"].shape == (INTER, HIDDEN // 32 * 34)
    # an ordinary checkpoint's index is left as it is
    assert apply_pack_metadata(before, {}) is before


@pytest.mark.asyncio
async def test_gguf_packed_views_equal_the_sources_on_every_backend(
        gguf_packed: tuple[Path, Path, dict[str, Any]], backend: str) -> None:
    src, dst, _ = gguf_packed
    budget = 1 << 20
    async with await ExpertStore.open(src, budget_bytes=budget, backend=backend) as a, \
            await ExpertStore.open(dst, budget_bytes=budget, backend=backend) as b:
        assert all(len(lay.extents) == 1 and lay.extents[0].offset % 4096 == 0 for lay in b.index.experts.values())
        for key in sorted(a.index.experts):
            async with a.acquire(key) as va, b.acquire(key) as vb:
                assert va.data.tobytes() == vb.data.tobytes()
                assert set(va.tensors) == set(vb.tensors) == set(EXPECTED_TYPES)
                for name, arr in va.tensors.items():
                    assert vb.tensors[name].dtype == arr.dtype and vb.tensors[name].shape == arr.shape
                    np.testing.assert_array_equal(vb.tensors[name], arr)
                assert dict(va.ggml_types) == dict(vb.ggml_types) == EXPECTED_TYPES  # the store's views too
        assert b.stats()["misses"] == len(a.index.experts)
        reads = sum(d["reads"] for d in b.stats()["per_device"].values())
        assert reads == len(b.index.experts)  # one read per expert


def test_gguf_packed_reads_back_through_safe_open(gguf_packed: tuple[Path, Path, dict[str, Any]]) -> None:
    """Every tensor of the copy, read by safetensors, is the GGUF reader's tensor (experts: one
    slice of the merged tensor), and the copy's metadata states each GGML type and shape."""
    from gguf import GGUFReader
    from safetensors import safe_open

    src, dst, _ = gguf_packed
    reader = GGUFReader(str(src), "r")
    theirs = {str(t.name): (np.array(t.data), t.tensor_type.name, [int(d) for d in reversed(t.shape)])
              for t in reader.tensors}
    del reader
    roles = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    seen = set()
    with safe_open(str(dst / "model.safetensors"), framework="numpy") as f:
        metadata = f.metadata()
        for name in f.keys():
            ours = f.get_tensor(name)
            if name.startswith("iosched.pad."):
                assert not ours.any()
                continue
            if ".experts." in name:
                parts = name.split(".")
                layer, expert, role = int(parts[2]), int(parts[5]), parts[6]
                part = next(k for k, v in roles.items() if v == role)
                gguf_name = f"blk.{layer}.ffn_{part}_exps.weight"
                data, ggml, shape = theirs[gguf_name]
                np.testing.assert_array_equal(ours, data[expert])
                assert json.loads(metadata[f"iosched.ggml.{name}"]) == {"type": ggml, "shape": shape[1:]}
                seen.add(gguf_name)
            else:
                data, ggml, shape = theirs[name]
                np.testing.assert_array_equal(ours, data)
                assert json.loads(metadata[f"iosched.ggml.{name}"]) == {"type": ggml, "shape": shape}
                seen.add(name)
    assert seen == set(theirs)
    assert metadata["iosched.pack.version"] == "1" and metadata["iosched.pack.align"] == "4096"


@pytest.mark.parametrize("kind", ["qwen", "mixtral"])
def test_safetensors_pack_keeps_names_dtypes_and_loads_in_transformers(tmp_path: Path, kind: str) -> None:
    from safetensors import safe_open

    src = write_hf(tmp_path / "src", kind)
    report = pack_checkpoint(src, tmp_path / "dst", align=8192, max_shard_bytes=40_000)
    dst = tmp_path / "dst"
    assert report.verified and len(report.files) > 1 and (dst / "model.safetensors.index.json").is_file()
    assert (dst / "config.json").read_bytes() == (src / "config.json").read_bytes()
    before, after = load_index(src), packed_index(dst)
    assert after.experts_per_token == before.experts_per_token == 2
    for key, lay in after.experts.items():
        (ext,) = lay.extents
        assert ext.offset % 8192 == 0
        assert [t.source_name for t in lay.tensors] == [t.source_name for t in before.experts[key].tensors]
        assert [(t.dtype, t.shape) for t in lay.tensors] == [(t.dtype, t.shape) for t in before.experts[key].tensors]
        assert extent_bytes(after, key) == extent_bytes(before, key)
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        original = {name: f.get_tensor(name) for name in f.keys()}
    copied: dict[str, Any] = {}
    for shard in report.files:
        with safe_open(str(dst / shard), framework="pt") as f:
            copied.update({name: f.get_tensor(name) for name in f.keys() if not name.startswith("iosched.pad.")})
    assert copied.keys() == original.keys()
    for name, tensor in original.items():
        assert copied[name].dtype == tensor.dtype and copied[name].equal(tensor), name
    import transformers

    cls = transformers.Qwen3MoeForCausalLM if kind == "qwen" else transformers.MixtralForCausalLM
    model = cls.from_pretrained(dst)
    state = model.state_dict()
    for name, tensor in original.items():
        if name in state:
            assert state[name].to(tensor.dtype).equal(tensor), name


def test_repacking_a_packed_copy_keeps_ggml_types(gguf_packed: tuple[Path, Path, dict[str, Any]],
                                                  tmp_path: Path) -> None:
    _, dst, _ = gguf_packed
    report = pack_checkpoint(dst, tmp_path / "again", align=65536)
    assert report.source_format == "safetensors" and report.extents_before == report.extents_after
    again = packed_index(tmp_path / "again")
    assert all(dict(lay.ggml_types) == EXPECTED_TYPES and lay.extents[0].offset % 65536 == 0
               for lay in again.experts.values())


def test_pack_into_an_empty_folder(gguf_packed: tuple[Path, Path, dict[str, Any]], tmp_path: Path) -> None:
    src, _, _ = gguf_packed
    (tmp_path / "empty").mkdir()
    assert pack_checkpoint(src, tmp_path / "empty", align=8).verified
    assert all(lay.extents[0].offset % 8 == 0 for lay in packed_index(tmp_path / "empty").experts.values())


def test_refusals_leave_everything_as_it_was(gguf_packed: tuple[Path, Path, dict[str, Any]], tmp_path: Path) -> None:
    src, _, _ = gguf_packed
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(PackError, match=f"{full} exists and is not empty"):
        pack_checkpoint(src, full)
    assert os.listdir(full) == ["keep.txt"] and (full / "keep.txt").read_text() == "mine"
    file = tmp_path / "file"
    file.write_text("mine")
    with pytest.raises(PackError, match=f"{file} exists and is not a folder"):
        pack_checkpoint(src, file)
    assert file.read_text() == "mine"
    with pytest.raises(PackError, match="parent folder .* does not exist"):
        pack_checkpoint(src, tmp_path / "no" / "such")
    folder = write_hf(tmp_path / "hf", "qwen")
    with pytest.raises(PackError, match="is inside the source"):
        pack_checkpoint(folder, folder / "packed")
    for align in (0, 3, 4, 4095, 1 << 31):
        with pytest.raises(PackError, match=f"align={align} is not a power of two"):
            pack_checkpoint(src, tmp_path / "x", align=align)
    with pytest.raises(CheckpointError, match="does not exist"):
        pack_checkpoint(tmp_path / "missing.gguf", tmp_path / "x")
    assert sorted(os.listdir(tmp_path)) == ["file", "full", "hf"]  # no temporary folder left behind


def _packed_file(tmp_path: Path, entry: str, extra: dict[str, str] | None = None) -> Path:
    """A one-expert packed file whose gate_proj GGML entry is ``entry``, by safetensors' writer."""
    import safetensors.numpy

    tensors = {f"model.layers.0.mlp.experts.0.{r}.weight": np.arange(4 * 34, dtype=np.uint8).reshape(4, 34)
               for r in ("gate_proj", "up_proj", "down_proj")}
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(tensors, str(path), metadata={
        "iosched.pack.version": "1", "iosched.ggml.model.layers.0.mlp.experts.0.gate_proj.weight": entry,
        **(extra or {})})
    return path


@pytest.mark.parametrize("item,message", [
    ({"name": "lower", "parent": "up_proj", "axis": 0, "start": 0, "stop": 2, "step": 1}, ""),
    ({"name": "lower", "parent": "up_proj", "axis": 0, "start": 0, "stop": 5, "step": 1}, "outside the tensor"),
    ({"name": "lower", "parent": "gate_proj", "axis": 0, "start": 0, "stop": 2, "step": 1}, "parent"),
    ({"name": "down_proj", "parent": "up_proj", "axis": 0, "start": 0, "stop": 2, "step": 1}, "stored tensor"),
])
def test_derived_views_in_pack_metadata(tmp_path: Path, item: dict[str, Any], message: str) -> None:
    path = _packed_file(tmp_path, '{"type": "Q8_0", "shape": [4, 32]}',
                        {"iosched.derived.model.layers.0.mlp.experts.0.up_proj.weight": json.dumps([item])})
    if message:  # load_index applies the metadata: a bad entry is its error
        with pytest.raises(CheckpointError, match=message):
            load_index(path)
        return
    once = load_index(path)
    assert apply_pack_metadata(once, pack_metadata(once.files)) == once
    lay = once.experts[(0, 0)]
    view = ExpertView.over(lay, memoryview(extent_bytes(once, (0, 0))))
    np.testing.assert_array_equal(view.tensors["lower"], view.tensors["up_proj"][0:2])


@pytest.mark.parametrize("entry,message", [
    ('{"type": "Q8_0", "shape": [4, 32]}', ""),
    ('{"type": "Q8_0", "shape": [4, 64]}', "says Q8_0 of shape"),
    ('{"type": "Q9_9", "shape": [4, 32]}', "unknown GGML type"),
    ('{"type": "Q8_0", "shape": [4, 31]}', "not whole Q8_0 blocks"),
    ('{"type": "Q8_0"}', "is not"),
    ("not json", "gate_proj.weight"),
])
def test_hostile_pack_metadata_names_the_file_and_tensor(tmp_path: Path, entry: str, message: str) -> None:
    path = _packed_file(tmp_path, entry)
    if not message:  # load_index applies the metadata
        once = load_index(path)
        assert dict(once.experts[(0, 0)].ggml_types) == {"gate_proj": Q8_0}
        assert apply_pack_metadata(once, pack_metadata(once.files)) == once
        return
    with pytest.raises(CheckpointError, match=message) as info:
        load_index(path)
    assert "model.safetensors" in str(info.value) and "gate_proj" in str(info.value)


def test_cli_pack_json(gguf_packed: tuple[Path, Path, dict[str, Any]], tmp_path: Path,
                       capsys: pytest.CaptureFixture[str]) -> None:
    src, _, _ = gguf_packed
    assert main(["pack", str(src), str(tmp_path / "out"), "--align", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verified"] and out["extents_before"] == 3 * out["extents_after"] == 3 * LAYERS * EXPERTS
    assert {"experts", "expert_bytes", "seconds", "align", "experts_detail", "files"} <= set(out)
    assert main(["pack", str(src), str(tmp_path / "out"), "--json"]) == 2  # exists now
    error = json.loads(capsys.readouterr().out)
    assert error["type"] == "PackError" and str(tmp_path / "out") in error["error"]
    assert main(["pack", str(src), str(tmp_path / "out2"), "--align", "100", "--json"]) == 2
    assert "power of two" in json.loads(capsys.readouterr().out)["error"]


def test_bench_pack_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark end to end at a small size: three reads per expert from the GGUF, one from
    the packed copy, every acquire a miss, the files deleted afterwards."""
    assert main(["bench-pack", "--layers", "1", "--experts", "8", "--hidden", "256", "--intermediate", "128",
                 "--rounds", "2", "--reads", "8", "--backends", "odirect", "--dir", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["layout"]: r for r in out["rows"]}
    assert rows["gguf"]["reads_per_expert"] == 3 and rows["packed"]["reads_per_expert"] == 1
    assert rows["gguf"]["hits"] == rows["packed"]["hits"] == 0 and rows["packed"]["speedup_median"] > 0
    assert out["pack"]["verified"] and os.listdir(tmp_path) == []


def test_a_dtype_numpy_cannot_read_is_copied_and_verified(tmp_path: Path) -> None:
    """MXFP4 checkpoints carry F8_E8M0 scales, which safetensors' numpy reader cannot return:
    the tensor is copied as it is and verified as the bytes safe_open's header places."""
    torch = pytest.importorskip("torch", reason="torch (a test extra) writes the F8_E8M0 tensor")
    import safetensors.torch

    tensors = {"model.layers.0.mlp.router.scales": torch.arange(5, dtype=torch.float32).exp2().to(torch.float8_e8m0fnu)}
    tensors.update({f"model.layers.0.mlp.experts.{e}.{r}.weight": torch.full((4, 8), float(e), dtype=torch.bfloat16)
                    for e in range(2) for r in ("gate_proj", "up_proj", "down_proj")})
    (tmp_path / "src").mkdir()
    safetensors.torch.save_file(tensors, str(tmp_path / "src" / "model.safetensors"))
    report = pack_checkpoint(tmp_path / "src", tmp_path / "dst")
    assert report.verified and report.other_tensors == 1
    back = safetensors.torch.load_file(str(tmp_path / "dst" / "model.safetensors"))
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].view(torch.uint8).equal(tensor.view(torch.uint8))


@pytest.mark.parametrize("index_json", [True, False])
def test_sharded_source_with_and_without_weight_map(tmp_path: Path, index_json: bool) -> None:
    from iosched.tools.synth import write_safetensors_moe

    src = write_safetensors_moe(tmp_path / "src", n_layers=3, n_experts=4, hidden=64, intermediate=32,
                                n_shards=3, index_json=index_json, experts_per_token=2)
    report = pack_checkpoint(src, tmp_path / "dst", align=4096)
    before, after = load_index(src), packed_index(tmp_path / "dst")
    assert report.verified and report.other_tensors == 1 + 2 * 3  # embedding, attention and router per layer
    assert all(len(lay.extents) == 1 and lay.extents[0].offset % 4096 == 0 for lay in after.experts.values())
    assert all(extent_bytes(after, key) == extent_bytes(before, key) for key in before.experts)


@pytest.mark.asyncio
@pytest.mark.parametrize("arch,qtype,layout,variant", [
    ("gemma4", "Q4_K", "fused", ""),      # fused gate_up_exps with zero-copy halves, a scalar scale per expert
    ("qwen3moe", "Q8_0", "separate", "split"),  # a split set: every shard's experts into one copy
    ("gpt-oss", "MXFP4", "separate", ""),  # MXFP4 experts with per-expert biases
])
async def test_packing_llama_cpp_layouts(tmp_path: Path, backend: str, arch: str, qtype: str, layout: str,
                                         variant: str) -> None:
    """GGUF layouts of the conformance corpus (tests/_gguf_corpus.py) pack to one aligned extent
    per expert whose store views equal the source's: bytes, dtypes, shapes, derived views and
    GGML types."""
    from tests import _gguf_corpus as gc

    case = next(c for c in gc.cases() if (c.arch, c.qtype, c.layout, c.variant) == (arch, qtype, layout, variant))
    src = gc.write_case(case, tmp_path / "src").source
    report = pack_checkpoint(src, tmp_path / "dst")
    assert report.verified and report.extents_after == len(load_index(src).experts)
    async with await ExpertStore.open(src, budget_bytes=1 << 22, backend=backend) as a, \
            await ExpertStore.open(tmp_path / "dst", budget_bytes=1 << 22, backend=backend) as b:
        assert set(a.index.experts) == set(b.index.experts)
        for key in sorted(a.index.experts):
            assert len(b.index.experts[key].extents) == 1
            async with a.acquire(key) as va, b.acquire(key) as vb:
                assert va.data.tobytes() == vb.data.tobytes()
                assert set(va.tensors) == set(vb.tensors)
                for name, arr in va.tensors.items():
                    assert vb.tensors[name].dtype == arr.dtype and vb.tensors[name].shape == arr.shape, name
                    assert vb.tensors[name].tobytes() == arr.tobytes(), name
                assert dict(va.ggml_types) == dict(vb.ggml_types) and va.ggml_types


@pytest.mark.asyncio
@pytest.mark.parametrize("model_type", ["gpt_oss", "llama4_text", "granitemoe"])
async def test_packing_fused_transformers_checkpoints(tmp_path: Path, model_type: str) -> None:
    """Fused 3-D experts as transformers saves them (tests/_hf_corpus.py): each expert's slices
    of the fused tensors (and biases) pack into one aligned extent; its views, derived halves
    included, equal the source's."""
    from tests import _hf_corpus as hc

    cls = dict(hc.moe_config_classes())[model_type]
    entry = hc.build_one(model_type, cls, tmp_path / "src")
    assert entry.folder is not None, entry.error
    report = pack_checkpoint(entry.folder, tmp_path / "dst")
    assert report.verified
    async with await ExpertStore.open(entry.folder, budget_bytes=1 << 22, backend="pread") as a, \
            await ExpertStore.open(tmp_path / "dst", budget_bytes=1 << 22, backend="pread") as b:
        assert set(a.index.experts) == set(b.index.experts)
        assert a.index.experts_per_token == b.index.experts_per_token
        for key in sorted(a.index.experts):
            assert len(b.index.experts[key].extents) == 1
            async with a.acquire(key) as va, b.acquire(key) as vb:
                assert va.data.tobytes() == vb.data.tobytes()
                assert set(va.tensors) == set(vb.tensors) and len(va.tensors) > 2
                for name, arr in va.tensors.items():
                    assert vb.tensors[name].shape == arr.shape and vb.tensors[name].tobytes() == arr.tobytes(), name
