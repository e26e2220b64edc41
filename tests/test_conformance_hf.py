"""Conformance: every MoE checkpoint transformers' ``save_pretrained`` writes opens byte-exact,
or is refused by a :class:`CheckpointError` naming it.

The corpus (``tests/_hf_corpus.py``) holds one tiny random-weight model per MoE config class of
the installed transformers, written by the model's own ``save_pretrained`` in several shards;
it is built once per test session.  For every layout it holds:

* the index finds exactly the (layer, expert) pairs the in-memory model has (its experts
  modules, :func:`tests._hf_corpus.experts_modules`), k and the architecture ``config.json``
  states;
* on every backend (pread, odirect, mmap, uring; one that cannot run here is skipped with its
  reason), ``view.data`` and every ``view.tensors[...]`` equal what ``safetensors.safe_open``
  reads (a fused tensor's slice for its expert), with the dtype and shape the model gives them,
  and every derived view is the zero-copy slice its record says; all backends are compared
  with the same reference, so they agree with each other;
* a layout that is refused is refused by name (the folder and a tensor of it);
* the gate/up split of every fused gate+up tensor is checked through the model's own
  ``from_pretrained`` and forward pass (:func:`test_gate_up_split_matches_the_models_forward`).

Refusals on real saved checkpoints edited with safetensors' own writer (an expert missing a
tensor, fused tensors disagreeing on E, ``config.json`` disagreeing with the tensors, an
unknown block name), MTP and tower stacks, the F8_E8M0/MXFP4 layout of gpt-oss's release, and
the k and E spellings of the installed transformers' config classes are tested below too.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

pytest.importorskip("torch", reason="torch is not installed (the test extras install it): no corpus to build")
pytest.importorskip("transformers", reason="transformers is not installed (the test extras install it)")

import safetensors.numpy
from safetensors import safe_open

from iosched import ExpertStore
from iosched._errors import CheckpointError
from iosched._layout import CheckpointIndex, DerivedTensor
from iosched.formats._hf_names import (
    ATTENTION_BLOCKS,
    EXPERTS_PER_TOKEN_KEYS,
    GATE_UP_FC1,
    GATE_UP_NAMES,
    HALVES,
    INTERLEAVED,
    stack_kind,
)
from iosched.formats._safetensors_index import INDEX_JSON, load_folder
from tests import _hf_corpus as hc
from tests.test_checkpoint import _raises as _refused

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning"),
    # one worker runs the module under pytest-xdist (--dist loadgroup): the corpus is built once
    pytest.mark.xdist_group("hf_corpus"),
]

MIN_OPEN = 40
"""Layouts of the corpus that must open byte-exact (the issue's aim)."""


@dataclass
class Corpus:
    root: Path
    entries: list[hc.Entry]
    seconds: float
    outcomes: dict[str, CheckpointIndex | CheckpointError] = field(default_factory=dict)
    references: dict[str, dict[str, npt.NDArray[Any]]] = field(default_factory=dict)

    def built(self) -> list[hc.Entry]:
        return [e for e in self.entries if e.folder is not None]

    def opened(self) -> Iterator[tuple[hc.Entry, CheckpointIndex]]:
        for e in self.built():
            outcome = self.outcomes[e.model_type]
            if isinstance(outcome, CheckpointIndex):
                yield e, outcome

    def reference(self, entry: hc.Entry) -> dict[str, npt.NDArray[Any]]:
        """Every tensor of the checkpoint as ``safe_open`` reads it."""
        if entry.model_type not in self.references:
            assert entry.folder is not None
            out: dict[str, npt.NDArray[Any]] = {}
            for shard in sorted(entry.folder.glob("*.safetensors")):
                with safe_open(str(shard), "np") as f:
                    for name in f.keys():
                        out[name] = f.get_tensor(name)
            self.references[entry.model_type] = out
        return self.references[entry.model_type]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    root = tmp_path_factory.mktemp("hf_corpus")
    start = time.perf_counter()
    entries = hc.build_corpus(root)
    built = Corpus(root, entries, time.perf_counter() - start)
    for e in built.built():
        assert e.folder is not None
        try:
            built.outcomes[e.model_type] = load_folder(e.folder)
        except CheckpointError as exc:
            built.outcomes[e.model_type] = exc
    # The modeling modules the build imported stay for the session: out of the collector's
    # sight, as collection's imports are (conftest.pytest_collection_finish).
    import gc

    gc.collect()
    gc.freeze()
    return built


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The tiny models' forward passes on one thread, as the corpus is built: their matrices
    are far too small for threads to pay, and under ``make test`` each core runs a test
    worker of its own."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def expected_tensor(ref: dict[str, npt.NDArray[Any]], source_name: str) -> npt.NDArray[Any]:
    """The tensor a :class:`TensorSpec` names: ``name`` itself, or ``name[e]`` of a fused one."""
    m = re.fullmatch(r"(.+)\[([0-9]+)\]", source_name)
    return ref[m.group(1)][int(m.group(2))] if m else ref[source_name]


def sliced(arr: npt.NDArray[Any], d: DerivedTensor) -> npt.NDArray[Any]:
    return arr[(slice(None),) * d.axis + (slice(d.start, d.stop, d.step),)]


# --------------------------------------------------------------------------- the corpus


def test_corpus_table(corpus: Corpus) -> None:
    """The corpus table (model_type, classes, build time, result), written to the session's tmp
    folder as ``corpus.md``; models the generic shrinker could not build are listed with the
    reason in a warning (the test summary shows it), never counted."""
    for e in corpus.entries:
        if e.folder is None:
            continue
        outcome = corpus.outcomes[e.model_type]
        if isinstance(outcome, CheckpointError):
            e.result = f"refused: {outcome}"
        else:
            lay = next(iter(outcome.experts.values()))
            derived = "".join(f", ({d.name})" for d in lay.derived)
            e.result = (f"opens byte-exact: {len(outcome.layers())} MoE layers x {outcome.experts_per_layer()} "
                        f"experts, k {outcome.experts_per_token}; {', '.join(t.name for t in lay.tensors)}{derived}")
    table = hc.markdown_table(corpus.entries)
    opened = sum(1 for _ in corpus.opened())
    summary = (f"{len(corpus.entries)} MoE config classes; {len(corpus.built())} built in {corpus.seconds:.1f} s; "
               f"{opened} open byte-exact")
    (corpus.root / "corpus.md").write_text(table + "\n\n" + summary + "\n")
    print(f"\n{table}\n\n{summary}\n(written to {corpus.root / 'corpus.md'})")
    not_built = [e for e in corpus.entries if e.folder is None]
    if not_built:
        listed = "; ".join(f"{e.model_type} ({e.error})" for e in not_built)
        warnings.warn(UserWarning(f"{len(not_built)} MoE config classes the generic shrinker cannot build: {listed}"),
                      stacklevel=1)
    assert opened >= MIN_OPEN, summary


def test_the_corpus_has_moe_and_dense_layers(corpus: Corpus) -> None:
    """Every built model with an experts module holds MoE layers; the shrinker keeps a dense
    layer where the architecture has one (DeepSeek's first_k_dense_replace and the like): at
    least a few layouts index fewer MoE layers than the model has layers."""
    with_dense = 0
    for e, index in corpus.opened():
        assert index.layers(), e.model_type
        if any(s.kind == "dense" for s in index.skipped):
            with_dense += 1
    assert with_dense >= 10


def _model_keys(entry: hc.Entry) -> set[tuple[int, int]]:
    """The (layer, expert) pairs the in-memory model has, from its experts modules: attention
    experts and towers' experts left out, an encoder-decoder's decoder layers numbered after
    the encoder's."""
    stacks: dict[str, dict[int, int]] = {}
    for name, count in entry.extra["experts_modules"].items():
        m = re.fullmatch(r"(.*?)(?:layers|block|blocks|h)\.([0-9]+)\.(.*)", name)
        assert m is not None, name
        prefix, layer, rest = m.group(1), int(m.group(2)), m.group(3)
        if rest.split(".")[0] in ATTENTION_BLOCKS or stack_kind(prefix) != "language":
            continue
        stacks.setdefault(prefix, {})[layer] = count
    shift = 0
    keys: set[tuple[int, int]] = set()
    for prefix in sorted(stacks, key=lambda p: (not p.endswith("encoder."), p)):
        for layer, count in stacks[prefix].items():
            keys |= {(shift + layer, e) for e in range(count)}
        if prefix.endswith("encoder."):
            shift = entry.extra["stack_layers"][prefix]
    return keys


def test_the_index_finds_what_the_model_has(corpus: Corpus) -> None:
    """Every (layer, expert) of the model, nothing else; k and the architecture as config.json
    states them; E as the config states it."""
    for e, index in corpus.opened():
        assert e.folder is not None
        config = json.loads((e.folder / "config.json").read_text())
        assert set(index.experts) == _model_keys(e), e.model_type
        assert index.architecture == config["model_type"], e.model_type
        stated = _stated(config, EXPERTS_PER_TOKEN_KEYS)
        assert index.experts_per_token == (e.extra["k"] if stated else None), e.model_type
        assert index.experts_per_layer() == hc.EXPERTS, e.model_type


def _stated(config: dict[str, Any], keys: tuple[str, ...]) -> bool:
    for value in config.values():
        if isinstance(value, dict) and _stated(value, keys):
            return True
    return any(config.get(k) is not None for k in keys)


@pytest.mark.asyncio
async def test_every_layout_opens_byte_exact(corpus: Corpus, backend: str) -> None:
    """``view.data``, every tensor and every derived view against ``safe_open``, on ``backend``."""
    checked = 0
    for e, index in corpus.opened():
        ref = corpus.reference(e)
        assert e.folder is not None
        async with await ExpertStore.open(e.folder, budget_bytes=1 << 23, backend=backend) as store:
            assert set(store.index.experts) == set(index.experts)
            for key, lay in store.index.experts.items():
                async with store.acquire(key) as view:
                    parts = []
                    for t in lay.tensors:
                        want = expected_tensor(ref, t.source_name)
                        got = view.tensors[t.name]
                        assert (got.dtype, got.shape) == (want.dtype, want.shape), (e.model_type, t.source_name)
                        assert got.tobytes() == want.tobytes(), (e.model_type, backend, t.source_name)
                        parts.append(want.tobytes())
                    assert view.data.tobytes() == b"".join(parts), (e.model_type, backend, key)
                    for d in lay.derived:
                        parent = next(t for t in lay.tensors if t.name == d.parent)
                        want = sliced(expected_tensor(ref, parent.source_name), d)
                        got = view.tensors[d.name]
                        assert np.shares_memory(got, view.data), (e.model_type, d.name)
                        assert got.shape == want.shape and got.tobytes() == want.tobytes(), (e.model_type, d.name)
                    checked += 1
    assert checked > 0


def test_refused_layouts_name_the_folder_and_a_tensor(corpus: Corpus) -> None:
    for e in corpus.built():
        outcome = corpus.outcomes[e.model_type]
        if not isinstance(outcome, CheckpointError):
            continue
        assert e.folder is not None
        message = str(outcome)
        assert str(e.folder) in message, message
        names = json.loads((e.folder / INDEX_JSON).read_text())["weight_map"]
        assert any(repr(n) in message for n in names), message


# --------------------------------------------------------------------------- gate/up split


def _fused_gate_up(index: CheckpointIndex) -> dict[str, tuple[int, DerivedTensor, DerivedTensor, str, str]]:
    """Fused gate+up tensor name -> (per-expert 2I axis, gate view, up view, its down tensor's
    name, its bias's name or "") from the index's derived records."""
    out: dict[str, tuple[int, DerivedTensor, DerivedTensor, str, str]] = {}
    for lay in index.experts.values():
        by_name = {t.name: t for t in lay.tensors}
        derived = {d.name: d for d in lay.derived}
        if "gate_proj" not in derived or "gate_proj" in by_name:
            continue
        gate, up = derived["gate_proj"], derived["up_proj"]
        parent = by_name[gate.parent].source_name.rsplit("[", 1)[0]
        down = next(t for t in lay.tensors if t.name in ("down_proj", "output_linear.weight", "fc2.weight"))
        bias = by_name[derived["gate_proj_bias"].parent].source_name.rsplit("[", 1)[0] if (
            "gate_proj_bias" in derived) else ""
        out[parent] = (gate.axis, gate, up, down.source_name.rsplit("[", 1)[0], bias)
    return out


def _positions(d: DerivedTensor) -> npt.NDArray[np.intp]:
    return np.arange(d.stop)[d.start:d.stop:d.step]


def _other(gate: DerivedTensor, up: DerivedTensor) -> tuple[DerivedTensor, DerivedTensor]:
    """The same tensor split by the other convention (halves <-> interleaved)."""
    two_i = max(gate.stop, up.stop)
    if gate.step == 2:
        return (DerivedTensor("gate_proj", gate.parent, gate.axis, 0, two_i // 2),
                DerivedTensor("up_proj", up.parent, up.axis, two_i // 2, two_i))
    return (DerivedTensor("gate_proj", gate.parent, gate.axis, 0, two_i, 2),
            DerivedTensor("up_proj", up.parent, up.axis, 1, two_i, 2))


def _edit(folder: Path, out: Path, edits: dict[str, npt.NDArray[Any]]) -> Path:
    """A copy of the checkpoint with ``edits`` written over its tensors by safetensors' writer."""
    shutil.copytree(folder, out)
    weight_map = json.loads((out / INDEX_JSON).read_text())["weight_map"]
    for shard in sorted({weight_map[name] for name in edits}):
        tensors = safetensors.numpy.load_file(str(out / shard))
        tensors.update({n: np.ascontiguousarray(a) for n, a in edits.items() if weight_map[n] == shard})
        safetensors.numpy.save_file(tensors, str(out / shard), metadata={"format": "pt"})
    return out


def _forward(entry: hc.Entry, folder: Path) -> Any:
    import torch
    import transformers

    auto = getattr(transformers, entry.extra["auto"])
    model = auto.from_pretrained(folder).eval()
    ids = torch.arange(1, 9).reshape(1, 8) * 7 % 150 + 3
    torch.manual_seed(0)  # a forward that samples (Diffusion Gemma's noise) draws the same each time
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _permuted(ref: dict[str, npt.NDArray[Any]], fused: dict[str, tuple[int, DerivedTensor, DerivedTensor, str, str]],
              use_other: bool) -> dict[str, npt.NDArray[Any]]:
    """Every fused gate+up tensor (and its bias and down projection) with the intermediate units
    of each expert reversed, gate and up positions taken from the split (or the other one): a
    permutation of units leaves the model's output unchanged exactly when the split is right."""
    edits: dict[str, npt.NDArray[Any]] = {}
    for name, (axis, gate, up, down, bias) in fused.items():
        if use_other:
            gate, up = _other(gate, up)
        g, u = _positions(gate), _positions(up)
        order = np.arange(len(g))[::-1]
        gu = ref[name].copy()
        idx: list[Any] = [slice(None)] * gu.ndim
        src = ref[name]
        for pos in (g, u):
            idx[axis + 1] = pos
            take: list[Any] = [slice(None)] * gu.ndim
            take[axis + 1] = pos[order]
            gu[tuple(idx)] = src[tuple(take)]
        edits[name] = gu
        down_axis = 2 - axis  # [E, I, H] when gate_up is [E, H, 2I], [E, H, I] when it is [E, 2I, H]
        edits[down] = np.take(ref[down], order, axis=down_axis)
        if bias:
            b = ref[bias].copy()
            for pos in (g, u):
                b[:, pos] = ref[bias][:, pos[order]]
            edits[bias] = b
    return edits


def test_gate_up_split_matches_the_models_forward(corpus: Corpus, tmp_path: Path) -> None:
    """How the split is determined: by architecture (``_hf_names.INTERLEAVED``: gpt-oss, Inkling
    2; ``HALVES``: transformers' ``chunk(2, dim=-1)`` models), its axis by the partner down
    projection's shape.  Checked here through each model's own ``from_pretrained`` (with its
    conversion mapping) and forward pass, formula-free:

    * reversing the intermediate units of every expert, gate and up positions taken from the
      index's views (and the down projection's rows likewise), leaves the output unchanged;
      the same permutation built from the *other* convention changes it (so the check can fail);
    * zeroing the gate positions (weights and bias) gives the output of zeroing the down
      projection: the activated side is the gate (for gpt-oss, zeroing ``up`` would not).
    Every corpus layout with a fused gate+up tensor is in one of the tables."""
    import torch

    checked: list[str] = []
    unchecked: list[str] = []
    for e, index in corpus.opened():
        archs = {index.architecture}
        gate_up = GATE_UP_NAMES if archs & GATE_UP_FC1 else GATE_UP_NAMES - {"fc1.weight"}
        has_fused = any(t.name in gate_up and t.source_name.endswith("]")
                        for lay in index.experts.values() for t in lay.tensors)
        if not has_fused:
            continue
        assert archs & (HALVES | INTERLEAVED), f"{e.model_type}: fused gate+up of an architecture in no table"
        fused = _fused_gate_up(index)
        assert fused, e.model_type
        assert e.folder is not None
        ref = corpus.reference(e)
        try:
            base = _forward(e, e.folder)
        except Exception as exc:
            unchecked.append(f"{e.model_type} ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})")
            continue
        right = _forward(e, _edit(e.folder, tmp_path / f"{e.model_type}-perm", _permuted(ref, fused, False)))
        wrong = _forward(e, _edit(e.folder, tmp_path / f"{e.model_type}-other", _permuted(ref, fused, True)))
        torch.testing.assert_close(right, base, rtol=1e-4, atol=1e-5, msg=f"{e.model_type}: split is wrong")
        assert not torch.allclose(wrong, base, rtol=1e-4, atol=1e-5), f"{e.model_type}: check cannot fail"
        zero_gate: dict[str, npt.NDArray[Any]] = {}
        zero_down: dict[str, npt.NDArray[Any]] = {}
        for name, (axis, gate, _, down, bias) in fused.items():
            gu = ref[name].copy()
            idx: list[Any] = [slice(None)] * gu.ndim
            idx[axis + 1] = _positions(gate)
            gu[tuple(idx)] = 0
            zero_gate[name] = gu
            if bias:
                b = ref[bias].copy()
                b[:, _positions(gate)] = 0
                zero_gate[bias] = b
            zero_down[down] = np.zeros_like(ref[down])
        gated = _forward(e, _edit(e.folder, tmp_path / f"{e.model_type}-zg", zero_gate))
        downed = _forward(e, _edit(e.folder, tmp_path / f"{e.model_type}-zd", zero_down))
        torch.testing.assert_close(gated, downed, rtol=1e-4, atol=1e-5, msg=f"{e.model_type}: gate is not gate")
        checked.append(e.model_type)
    if unchecked:
        warnings.warn(UserWarning("gate/up split not checked through the forward pass (the tiny model's forward "
                                  "does not run): " + "; ".join(unchecked)), stacklevel=1)
    print(f"\ngate/up split checked through the forward pass: {', '.join(checked)}")
    assert len(checked) >= 10, (checked, unchecked)


# --------------------------------------------------------------------------- refusals on real checkpoints


def _layout(corpus: Corpus, model_type: str, tmp_path: Path) -> Path:
    """A copy of one corpus layout to edit."""
    entry = next(e for e in corpus.built() if e.model_type == model_type)
    assert entry.folder is not None
    out = tmp_path / model_type
    shutil.copytree(entry.folder, out)
    return out


def _rewrite(folder: Path, drop: tuple[str, ...] = (), rename: tuple[str, str] | None = None,
             add: dict[str, npt.NDArray[Any]] | None = None, update_map: bool = True) -> None:
    """Edit a checkpoint with safetensors' own writer: ``drop`` tensors, ``rename`` every name
    holding ``old`` to hold ``new``, ``add`` tensors in a new shard; the index follows."""
    index_path = folder / INDEX_JSON
    doc = json.loads(index_path.read_text())
    weight_map: dict[str, str] = doc["weight_map"]
    for shard in sorted(set(weight_map.values())):
        tensors = safetensors.numpy.load_file(str(folder / shard))
        kept = {(n.replace(*rename) if rename else n): a for n, a in tensors.items() if n not in drop}
        if kept != tensors:
            safetensors.numpy.save_file(kept, str(folder / shard), metadata={"format": "pt"})
    if update_map:
        weight_map = {(n.replace(*rename) if rename else n): s for n, s in weight_map.items() if n not in drop}
    if add:
        safetensors.numpy.save_file(add, str(folder / "extra.safetensors"), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(add, "extra.safetensors"))
    doc["weight_map"] = weight_map
    index_path.write_text(json.dumps(doc))


def _set_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_an_expert_missing_a_tensor_is_refused_by_name(corpus: Corpus, tmp_path: Path) -> None:
    folder = _layout(corpus, "qwen3_moe", tmp_path)
    gone = "model.layers.1.mlp.experts.2.up_proj.weight"
    _rewrite(folder, drop=(gone,))
    _refused(folder, str(folder), "expert (layer 1, expert 2) has no 'up_proj' tensor",
             "'model.layers.1.mlp.experts.0.up_proj.weight'")
    # the shard lost it but the index still lists it: the index is refused, naming both
    stale = _layout(corpus, "qwen3_moe", tmp_path / "stale")
    _rewrite(stale, drop=(gone,), update_map=False)
    _refused(stale, repr(gone), "has no such tensor")


def test_fused_tensors_of_a_layer_disagreeing_on_experts_are_refused(corpus: Corpus, tmp_path: Path) -> None:
    folder = _layout(corpus, "gpt_oss", tmp_path)
    name = "model.layers.0.mlp.experts.down_proj"
    shard = json.loads((folder / INDEX_JSON).read_text())["weight_map"][name]
    tensors = safetensors.numpy.load_file(str(folder / shard))
    tensors[name] = np.ascontiguousarray(tensors[name][:3])
    safetensors.numpy.save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    message = _refused(folder, str(folder), repr(name), f"{name}' [3, ", "holds 3", "holds 4")
    assert re.match(rf"{re.escape(str(folder))}/[^:]+\.safetensors: fused expert tensor '", message), message


@pytest.mark.parametrize("model_type, key", [("gpt_oss", "num_local_experts"), ("qwen3_moe", "num_local_experts")])
def test_config_json_disagreeing_with_the_tensors_is_refused(corpus: Corpus, tmp_path: Path, model_type: str,
                                                             key: str) -> None:
    folder = _layout(corpus, model_type, tmp_path)
    _set_config(folder, **{key: 8})
    message = _refused(folder, str(folder / "config.json"), f"key {key!r}", "8")
    if model_type == "gpt_oss":  # fused: the tensor is named with its shape
        assert "'model.layers.0.mlp.experts." in message and "[4, " in message


def test_fused_experts_under_an_unknown_block_are_refused_saying_what_was_found(corpus: Corpus,
                                                                                tmp_path: Path) -> None:
    folder = _layout(corpus, "gpt_oss", tmp_path)
    _rewrite(folder, rename=(".mlp.experts.", ".foo.experts."))
    message = _refused(folder, "no expert tensors found", str(folder), "found instead",
                       "unsupported block name 'foo'", "fused 3-D expert tensors (e.g. shape [4, ")
    assert re.search(r"'model\.layers\.[0-9]\.foo\.experts\.[a-z_]+'", message), message


def test_mtp_layers_are_left_out_never_colliding(corpus: Corpus, tmp_path: Path) -> None:
    """DeepSeek writes its multi-token-prediction layer as ``model.layers.<num_hidden_layers>``;
    other models as an ``mtp.layers.*`` stack: both are skipped (kind ``mtp``), the model's own
    layers indexed as before."""
    folder = _layout(corpus, "deepseek_v3", tmp_path)
    before = load_folder(folder)
    n_layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    ref = safetensors.numpy.load_file(str(next(folder.glob("*.safetensors"))))
    layer1 = {}
    for shard in sorted(folder.glob("*.safetensors")):
        layer1.update({n: a for n, a in safetensors.numpy.load_file(str(shard)).items()
                       if n.startswith("model.layers.1.mlp.")})
    del ref
    add = {n.replace("model.layers.1.", f"model.layers.{n_layers}."): a for n, a in layer1.items()}
    add |= {n.replace("model.layers.1.", "mtp.layers.0."): a for n, a in layer1.items()}
    _rewrite(folder, add=add)
    after = load_folder(folder)
    assert set(after.experts) == set(before.experts)
    (mtp,) = [s for s in after.skipped if s.kind == "mtp"]
    assert mtp.count == len(add)


def test_a_towers_experts_are_left_out_when_the_language_models_exist(corpus: Corpus, tmp_path: Path) -> None:
    folder = _layout(corpus, "qwen3_vl_moe", tmp_path)
    before = load_folder(folder)
    lay = before.experts[min(before.experts)]
    ref = corpus.reference(next(e for e in corpus.built() if e.model_type == "qwen3_vl_moe"))
    add = {f"visual.blocks.0.mlp.experts.{e}.{t.name}.weight": np.ascontiguousarray(
        expected_tensor(ref, t.source_name)) for e in range(2) for t in lay.tensors if t.name == "down_proj"}
    _rewrite(folder, add=add)
    after = load_folder(folder)
    assert set(after.experts) == set(before.experts)
    (tower,) = [s for s in after.skipped if s.kind == "tower"]
    assert tower.count == len(add) and tower.example.startswith("visual.blocks.0.mlp.experts.")


def test_skipped_kinds_are_recorded(corpus: Corpus) -> None:
    kinds: dict[str, set[str]] = {}
    for e, index in corpus.opened():
        for s in index.skipped:
            kinds.setdefault(s.kind, set()).add(e.model_type)
            assert s.count > 0 and s.example and s.reason
    assert {"dense", "shared_expert", "router", "attention_experts"} <= set(kinds), kinds
    assert "jetmoe" in kinds["attention_experts"]
    index = next(i for e, i in corpus.opened() if e.model_type == "deepseek_v3")
    assert {"dense", "shared_expert", "router"} <= {s.kind for s in index.skipped}


def test_encoder_decoder_stacks_are_numbered_apart(corpus: Corpus) -> None:
    for model_type in ("nllb-moe", "switch_transformers"):
        index = next(i for e, i in corpus.opened() if e.model_type == model_type)
        assert any(n.startswith("encoder-decoder:") for n in index.notes), index.notes


# --------------------------------------------------------------------------- k and E


K_LIKE = re.compile(r"top_?k|per_tok|(^|_)k($|_)")
NOT_K = {
    "index_topk": "tokens the sparse-attention indexer keeps (DeepSeek-V3.2, GLM-5)",
    "index_topk_blocks": "blocks the sparse-attention indexer keeps",
    "topk_group": "expert groups a token may use (group-limited routing), not experts",
    "topk_method": "a routing method's name",
    "norm_topk_prob": "a flag",
    "centroid_intermediate_top_k": "a retrieval head's setting (Gemma 4 assistant)",
}
"""Fields that match :data:`K_LIKE` near an expert or MoE setting but are not k, and why."""


def _moe_fields() -> set[str]:
    """Field names of the installed transformers' config classes (and sub-configs), with their
    ``attribute_map`` aliases, that speak of experts or MoE."""
    registry, names = hc._mappings()
    out: set[str] = set()
    for model_type in names:
        try:
            cls = registry[model_type]
        except Exception:
            continue
        fields = hc._field_names(cls)
        for c in [cls, *(getattr(cls, "sub_configs", None) or {}).values()]:
            for alias, real in (getattr(c, "attribute_map", None) or {}).items():
                fields |= {alias, real}
        out |= {f for f in fields if "expert" in f or "moe" in f or f == "top_k"}
    return out


def test_every_k_spelling_of_the_installed_transformers_is_read() -> None:
    fields = _moe_fields()
    k_like = {f for f in fields if K_LIKE.search(f)}
    assert {"num_experts_per_tok", "moe_k", "moe_topk", "top_k_experts"} <= k_like
    missing = sorted(k_like - set(EXPERTS_PER_TOKEN_KEYS) - set(NOT_K))
    assert not missing, f"config fields that look like k but _hf_names.EXPERTS_PER_TOKEN_KEYS lacks: {missing}"


def test_every_expert_count_spelling_of_the_installed_transformers_is_read() -> None:
    from iosched.formats._hf_names import EXPERT_COUNT_KEYS

    fields = _moe_fields()
    counts = {f for f in fields if re.search(r"(^|_)(num|n)_.*experts$|experts_num$|^moe_num_experts$", f)
              and "shared" not in f}
    assert {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"} <= counts
    missing = sorted(counts - set(EXPERT_COUNT_KEYS))
    assert not missing, f"config fields that count experts but _hf_names.EXPERT_COUNT_KEYS lacks: {missing}"


@pytest.mark.parametrize("config, k, source, by_layer", [
    ({"num_experts_per_tok": [2, 2, 2]}, 2, "'num_experts_per_tok'", {0: 2, 1: 2, 2: 2}),
    ({"num_experts_per_tok": None, "thinker_config": {"text_config": {"num_experts_per_tok": 3}}}, 3,
     "'thinker_config.text_config.num_experts_per_tok'", None),
    ({"num_experts_per_tok": None, "ffn_config": {"moe_top_k": 1, "moe_num_experts": 4}}, 1,
     "'ffn_config.moe_top_k'", None),
    ({"num_experts_per_tok": None, "top_k_experts": 4}, 4, "'top_k_experts'", None),
    ({"num_experts_per_tok": None, "moe_k": 2}, 2, "'moe_k'", None),
])
def test_k_spellings_nested_and_per_layer(corpus: Corpus, tmp_path: Path, config: dict[str, Any], k: int,
                                          source: str, by_layer: dict[int, int] | None) -> None:
    folder = _layout(corpus, "qwen3_moe", tmp_path)
    _set_config(folder, **config)
    index = load_folder(folder)
    assert index.experts_per_token == k and source in index.k_source
    assert index.k_by_layer == by_layer


@pytest.mark.parametrize("config, needle", [
    ({"num_experts_per_tok": [2, 5, 2]}, "experts per token of layer 1 is 5, more than its 4 experts"),
    ({"num_experts_per_tok": None, "moe_topk": 6}, "'moe_topk': experts per token is 6, more than 4 experts"),
    ({"num_local_experts": None, "ffn_config": {"moe_num_experts": 8}}, "key 'ffn_config.moe_num_experts' says 8"),
    ({"num_experts_per_tok": [2, 0, 2]}, "key 'num_experts_per_tok' is a list of 3 items, not a positive integer"),
])
def test_k_and_e_are_validated_against_the_experts(corpus: Corpus, tmp_path: Path, config: dict[str, Any],
                                                   needle: str) -> None:
    folder = _layout(corpus, "qwen3_moe", tmp_path)
    _set_config(folder, **config)
    with pytest.raises(CheckpointError) as info:
        load_folder(folder)
    assert needle in str(info.value) and str(folder / "config.json") in str(info.value)
