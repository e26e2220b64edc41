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
from iosched._hf_names import (
    ATTENTION_BLOCKS,
    EXPERTS_PER_TOKEN_KEYS,
    GATE_UP_FC1,
    GATE_UP_NAMES,
    HALVES,
    INTERLEAVED,
    stack_kind,
)
from iosched._layout import CheckpointIndex, DerivedTensor
from iosched._safetensors_index import INDEX_JSON, load_folder
from tests import _hf_corpus as hc

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

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
    return built


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
