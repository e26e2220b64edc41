"""Finding expert slices in a GGUF checkpoint: one file, or a split set of shards.

GGUF stores each layer's experts merged (llama.cpp's names, ``gguf.constants.TENSOR_NAMES``):
``blk.{L}.ffn_{gate,up,down}_exps.{weight,bias,scale}``, or gate and up fused in one
``blk.{L}.ffn_gate_up_exps.*`` (gemma4, qwen35moe, qwen3next, mistral4, deepseek2-ocr). The
outermost axis (the first numpy axis, the last GGML dimension) of each is the expert, so expert
``E`` of such a tensor is one contiguous slice of ``n_bytes // n_expert`` bytes at
``data_offset + E * n_bytes // n_expert``; this holds for quantized types too, whose blocks
never straddle rows. Non-gated models (nomic-bert-moe, nemotron_h_moe) have up and down only.

What an expert's view holds, per tensor (canonical name, then what it is):

* ``gate_proj``, ``up_proj``, ``down_proj`` (``.weight``), and ``gate_proj.bias``,
  ``down_proj.scale`` ... for the other suffixes (gpt-oss's biases, gemma4's per-expert
  ``ffn_down_exps.scale``): every per-expert tensor travels with its expert;
* ``gate_up_proj`` (and ``gate_up_proj.bias``) for a fused tensor, plus ``gate_proj`` and
  ``up_proj`` as zero-copy :class:`~iosched._layout.DerivedTensor` halves of its ``2I`` axis
  (numpy axis 0 of the expert: GGML's ``ne[1]``). The halves follow llama.cpp's convention:
  ``build_moe_ffn`` (src/llama-graph.cpp) multiplies by ``ffn_gate_up_exps`` once and takes
  the first ``n_ff = ne[0] / 2`` outputs as gate and the next ``n_ff`` as up (two
  ``ggml_view_3d`` at offsets ``0`` and ``n_ff * nb[0]``), the bias added before the split;
  so gate is rows ``[0, I)`` and up rows ``[I, 2I)``, never interleaved. A quantized row is
  whole blocks, so the halves are whole rows of bytes as well;
* dtypes and shapes: F32/F16/F64 and the integer types as numbers, **BF16 as
  ``ml_dtypes.bfloat16`` with the model's shape** (``gguf.GGUFReader`` gives it as ``uint8``
  with a doubled last axis, which is no shape of the model); every quantized type (Q8_0, the
  k-quants, MXFP4 ...) as its raw bytes, ``uint8`` with the last axis counting bytes, as the
  reader gives it. Every tensor's GGML type is recorded (``view.ggml_types``) so an engine
  knows how to decode it.

Left out on purpose, and counted in ``IndexNotes.skipped`` by kind: dense FFN layers
(``ffn_gate``/``ffn_up``/``ffn_down``, e.g. DeepSeek's leading dense blocks), shared experts
(``*_shexp``, run for every token), routers (``ffn_gate_inp``, ``exp_probs_b``), GroveMoE's
chunk experts (``*_chexps``) and NextN/MTP layers: every tensor of a ``blk.N.nextn.*`` layer
and of the last ``{arch}.nextn_predict_layers`` blocks of ``{arch}.block_count``, experts
included (a draft head, not the model's forward pass; llama.cpp itself loads them aside).

Refused, by a :class:`CheckpointError` naming the file and tensor: merged tensors of one layer
(or of two layers) that disagree on the number of experts, ``{arch}.expert_count`` disagreeing
with a tensor, an incomplete expert set (gate without up, no down, a fused and a separate gate
at once, a bias without its weight), a fused tensor whose ``2I`` axis is odd; and (by
``build_index``) ``{arch}.expert_used_count`` above the experts of a layer.

Split sets (``{name}-00001-of-00004.gguf``, as ``gguf.GGUFWriter`` and llama.cpp's
``gguf-split`` write them) are one index: every shard present, each saying ``split.count`` =
the set's size, ``split.no`` = its place, ``split.tensors.count`` = the tensors of all shards,
no tensor in two shards; the metadata comes from the first shard (the writer puts it there
only). Passing one shard opens the whole set; a shard whose name does not say its set is
refused (never a silent subset).

The header is read by :mod:`iosched.formats._gguf_header` (bounded work, no memory map; it says why
not ``gguf.GGUFReader``). A merged tensor's expert axis is a count the header claims, so
before it is expanded into one entry per expert it must fit: between 1 and
:data:`~iosched.formats._index_build.MAX_EXPERTS_PER_LAYER` experts, each of at least one byte, the
whole inside the file (checked by the header reader) and within
:data:`~iosched.formats._index_build.MAX_EXPERT_TENSORS` in all.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from iosched._errors import CheckpointError
from iosched._layout import DerivedTensor, SkippedTensors

from ._gguf_header import GgufHeader, GgufTensor, read_header
from ._index_build import (
    MAX_EXPERTS_PER_LAYER,
    IndexNotes,
    RawExpertTensor,
    check_tensor_count,
    parse_id,
)
from ._untrusted import list_folder, quote

_EXPERT_RE = re.compile(r"blk\.([0-9]+)\.ffn_(gate_up|gate|up|down)_exps\.(.+)")
_LAYER_RE = re.compile(r"blk\.([0-9]+)\.(.+)")
SPLIT_RE = re.compile(r"(.+)-([0-9]{5})-of-([0-9]{5})\.gguf")
"""A shard's file name, as ``gguf``'s ``SHARD_NAME_FORMAT`` and llama.cpp's ``gguf-split`` spell it."""

MAX_SHARDS = 4096
"""Shards of one split set, at most: the largest released GGUFs come in under a hundred (a
1 TB model in 50 GB shards is 20); it bounds the header reads a file name can ask for."""

_SKIP_KINDS: tuple[tuple[str, re.Pattern[str], str], ...] = (
    ("shared_expert", re.compile(r"ffn_(gate_inp_shexp|gate_shexp|up_shexp|down_shexp)\..+"),
     "shared experts run for every token (dense, never routed)"),
    ("router", re.compile(r"(ffn_gate_inp|exp_probs_b)\..+"),
     "the router (and its expert-selection bias) runs for every token"),
    ("chunk_expert", re.compile(r"ffn_(gate|up|down)_chexps\..+"),
     "GroveMoE's chunk (adjugate) experts run with their group, not routed one by one"),
    ("dense", re.compile(r"ffn_(gate|up|down)\..+"),
     "a dense feed-forward block (no experts)"),
)
"""Kinds of ``blk.N.*`` tensors the index leaves out and counts (first match wins)."""
_MTP_REASON = ("NextN/MTP draft layers predict further tokens; the model's forward pass does not "
               "route through them (llama.cpp loads them aside)")
_FUSED_ROLES = ("gate", "up")
_PROJECTOR_ARCH = "clip"
"""``general.architecture`` of a multimodal projector (llama.cpp's ``MODEL_ARCH.CLIP``)."""


@dataclass(frozen=True)
class GgufFound:
    """What a GGUF checkpoint says about its experts: the expert slices and the notes
    (counts and where they came from, what was skipped, remarks)."""

    raws: list[RawExpertTensor]
    notes: IndexNotes = field(default_factory=IndexNotes)

    @property
    def experts_per_token(self) -> int | None:
        return self.notes.experts_per_token

    @property
    def expert_count(self) -> int | None:
        return self.notes.n_experts


@functools.cache
def _bfloat16() -> np.dtype[Any] | None:
    """``ml_dtypes.bfloat16``, loaded at the first BF16 tensor (its extension takes 0.6 s)."""
    try:  # a dependency (pyproject.toml); raw bytes as the reader gives them if it is missing
        ml_dtypes: Any = importlib.import_module("ml_dtypes")
    except ImportError:
        return None
    bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return bf16


def read_gguf(path: Path) -> GgufFound:
    """The experts of the GGUF file ``path``: a lone file, or (named as a shard) its whole
    split set. A shard whose name does not say its set is refused by name."""
    m = SPLIT_RE.fullmatch(path.name)
    if m is None:
        header = read_header(path)
        count = header.values.get("split.count")
        if isinstance(count, int) and not isinstance(count, bool) and count > 1:
            raise CheckpointError(
                f"{path}: this file is one shard (split.no {quote(header.values.get('split.no'))}) of a split "
                f"GGUF of {count} shards (key 'split.count'), but its name does not follow the shard pattern "
                "NAME-00001-of-0000N.gguf, so the rest of the set cannot be found: opening it alone "
                "would serve a subset of the experts")
        return _index([path], [header], ())
    prefix, total = m.group(1), int(m.group(3))
    return _index_split(path.parent, prefix, total, list_folder(path.parent), ())


def read_gguf_folder(folder: Path, names: list[str]) -> GgufFound:
    """The experts of the one GGUF model in ``folder`` (``names``: its entries): a lone file or
    one split set. Multimodal projectors beside it are left out with a note: files named
    ``mmproj*`` (llama.cpp's name for them) and, when more than one model would be left, files
    whose ``general.architecture`` is ``clip`` (what llama.cpp writes projectors as). Anything
    else (two models, only a projector) is refused, naming the files."""
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    projectors = [n for n in ggufs if n.lower().startswith("mmproj")]
    models = [n for n in ggufs if n not in projectors]
    sets, singles = _group(models)
    headers: dict[str, GgufHeader] = {}
    if len(singles) + len(sets) > 1:  # a projector under another name?
        for n in singles:
            headers[n] = read_header(folder / n)
            if headers[n].values.get("general.architecture") == _PROJECTOR_ARCH:
                projectors.append(n)
        models = [n for n in models if n not in projectors]
        sets, singles = _group(models)
    notes = tuple(f"{folder / n}: left out, a multimodal projector (mmproj) file, not the model's experts"
                  for n in sorted(projectors))
    if not models:
        raise CheckpointError(
            f"checkpoint folder {folder} holds only multimodal projector GGUF files "
            f"({', '.join(sorted(projectors))}), no model")
    if len(singles) + len(sets) > 1:
        raise CheckpointError(
            f"checkpoint folder {folder} holds {len(singles) + len(sets)} GGUF models ({', '.join(models)}); "
            "pass the one to use")
    if singles:
        path = folder / singles[0]
        header = headers.get(singles[0]) or read_header(path)
        count = header.values.get("split.count")
        if isinstance(count, int) and not isinstance(count, bool) and count > 1:
            raise CheckpointError(
                f"{path}: a shard of a split GGUF of {count} shards (key 'split.count') alone in its "
                "folder; the other shards are missing")
        return _index([path], [header], notes)
    (prefix, total), = sets
    return _index_split(folder, prefix, total, names, notes)


def _group(models: list[str]) -> tuple[dict[tuple[str, int], list[str]], list[str]]:
    """``models`` as split sets (by name prefix and shard count) and lone files."""
    sets: dict[tuple[str, int], list[str]] = {}
    singles: list[str] = []
    for n in models:
        m = SPLIT_RE.fullmatch(n)
        if m is None:
            singles.append(n)
        else:
            sets.setdefault((m.group(1), int(m.group(3))), []).append(n)
    return sets, singles


def _index_split(folder: Path, prefix: str, total: int, names: list[str], notes: tuple[str, ...]) -> GgufFound:
    """The split set ``{prefix}-NNNNN-of-{total}.gguf`` of ``folder``, every shard present and
    agreeing with the others (module docstring)."""
    if not 1 <= total <= MAX_SHARDS:
        raise CheckpointError(f"{folder}: split GGUF {quote(prefix)} is named as a set of {total} shards, "
                              f"not between 1 and {MAX_SHARDS}")
    wanted = [f"{prefix}-{i:05d}-of-{total:05d}.gguf" for i in range(1, total + 1)]
    present = set(names)
    missing = [n for n in wanted if n not in present]
    if missing:
        raise CheckpointError(
            f"{folder}: split GGUF {quote(prefix)} of {total} shards lacks {len(missing)} of them "
            f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): a subset of a split set "
            "would serve a subset of the experts")
    paths = [folder / n for n in wanted]
    headers = [read_header(p) for p in paths]
    n_tensors = sum(len(h.tensors) for h in headers)
    arch = headers[0].values.get("general.architecture")
    shards = list(enumerate(zip(paths, headers, strict=True)))
    checks = [(i, p, h, key, want) for i, (p, h) in shards for key, want in (("split.count", total), ("split.no", i))]
    checks += [(i, p, h, "split.tensors.count", n_tensors) for i, (p, h) in shards]
    for i, p, h, key, want in checks:  # each shard's place first: a stray shard is named as such
        got = h.values.get(key)
        if got != want or isinstance(got, bool):
            raise CheckpointError(
                f"{p}: key {quote(key)} is {quote(got)}, but this is shard {i + 1} of a set of {total} "
                f"holding {n_tensors} tensors in all (it should be {want}): the shards do not belong together")
    for _, (p, h) in shards[1:]:
        other = h.values.get("general.architecture")
        if other is not None and other != arch:
            raise CheckpointError(f"{p}: general.architecture is {quote(other)} but the first shard "
                                  f"{paths[0].name} says {quote(arch)}")
    return _index(paths, headers, notes)


def _index(paths: list[Path], headers: list[GgufHeader], remarks: tuple[str, ...]) -> GgufFound:
    """The expert slices of one GGUF model held by ``paths`` (one file or a split set, in
    order), its metadata from the first."""
    values = headers[0].values
    arch = values.get("general.architecture")
    arch = arch if isinstance(arch, str) else ""
    first = paths[0]

    def meta(name: str, meaning: str) -> tuple[int | None, str]:
        if not arch:  # no architecture: the file states no count
            return None, ""
        key = f"{arch}.{name}"
        return _count(first, key, values.get(key), meaning), f"{first} key {quote(key)}"

    k, k_source = meta("expert_used_count", "experts routed per token")
    n_experts, e_source = meta("expert_count", "experts per layer")
    blocks, _ = meta("block_count", "blocks")
    nextn: int | None = None
    if values.get(f"{arch}.nextn_predict_layers") != 0:  # 0: a model whose MTP layers were dropped
        nextn, _ = meta("nextn_predict_layers", "NextN/MTP layers")
    mtp_layers = _mtp_layers(paths, headers, blocks, nextn)

    raws: list[RawExpertTensor] = []
    skipped: dict[str, list[str]] = {}
    first_merged: list[tuple[GgufTensor, int]] = []  # the model's expert count, for every other merged tensor
    roles: dict[int, dict[tuple[str, str], tuple[Path, GgufTensor]]] = {}
    seen: dict[str, Path] = {}
    for path, header in zip(paths, headers, strict=True):
        abspath = os.path.abspath(path)
        for t in header.tensors:
            other = seen.get(t.name)
            if other is not None:
                raise CheckpointError(f"{path}: tensor {quote(t.name)} is also in {other}: a tensor "
                                      "may be in one shard only")
            seen[t.name] = path
            lm = _LAYER_RE.fullmatch(t.name)
            if lm is None:
                continue  # embeddings, output head, norms: not per layer
            layer = parse_id(lm.group(1), "layer", path, t.name)
            if layer in mtp_layers:
                skipped.setdefault("mtp", []).append(t.name)
                continue
            m = _EXPERT_RE.fullmatch(t.name)
            if m is None:
                kind = next((k for k, rx, _ in _SKIP_KINDS if rx.fullmatch(lm.group(2))), None)
                if kind is not None:
                    skipped.setdefault(kind, []).append(t.name)
                continue
            role, suffix = m.group(2), m.group(3)
            dtype, full = _model_dtype_shape(path, t)
            n_expert = _check_expert_axis(path, t, full, first_merged[0] if first_merged else None, n_experts,
                                          e_source)
            first_merged[:1] = first_merged[:1] or [(t, n_expert)]
            roles.setdefault(layer, {})[(role, suffix)] = (path, t)
            name = f"{role}_proj" if suffix == "weight" else f"{role}_proj.{suffix}"
            shape = full[1:]
            per = _expert_bytes(path, t, n_expert, shape, dtype)
            derived = _halves(path, t, name, suffix, shape) if role == "gate_up" else ()
            check_tensor_count(len(raws) + n_expert, path)
            raws.extend(
                RawExpertTensor(
                    layer=layer, expert=expert, name=name, source_name=f"{t.name}[{expert}]", dtype=dtype,
                    shape=shape, path=abspath, offset=t.data_offset + expert * per, nbytes=per,
                    ggml_type=t.ggml_type, derived=derived,
                )
                for expert in range(n_expert)
            )
    for layer in sorted(roles):
        _check_roles(layer, roles[layer])
    reasons = {kind: reason for kind, _, reason in _SKIP_KINDS} | {"mtp": _MTP_REASON}
    notes = IndexNotes(
        experts_per_token=k, k_source=k_source if k is not None else "",
        n_experts=n_experts, e_source=e_source if n_experts is not None else "",
        skipped=tuple(SkippedTensors(kind=kind, reason=reasons[kind], count=len(names), example=names[0])
                      for kind, names in sorted(skipped.items())),
        notes=remarks + ((f"{first}: split GGUF of {len(paths)} shards",) if len(paths) > 1 else ()),
        architecture=arch,
    )
    return GgufFound(raws, notes)


def _mtp_layers(paths: list[Path], headers: list[GgufHeader], blocks: int | None, nextn: int | None) -> set[int]:
    """The NextN/MTP layers: those holding a ``blk.N.nextn.*`` tensor, and the last ``nextn``
    of ``blocks`` (llama.cpp counts them in ``block_count``)."""
    out: set[int] = set()
    if nextn is not None and blocks is not None:
        if nextn > blocks:
            raise CheckpointError(f"{paths[0]}: nextn_predict_layers is {nextn}, more than the {blocks} "
                                  "blocks of block_count")
        out.update(range(blocks - nextn, blocks))
    for path, header in zip(paths, headers, strict=True):
        for t in header.tensors:
            m = _LAYER_RE.fullmatch(t.name)
            if m is not None and m.group(2).startswith("nextn."):
                out.add(parse_id(m.group(1), "layer", path, t.name))
    return out


def _model_dtype_shape(path: Path, t: GgufTensor) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """The merged tensor's dtype and shape as the model defines them: BF16 as ``bfloat16`` (the
    reader's last axis counts its bytes, two a value), everything else as the reader gives it.
    A quantized (block) vector is refused: its blocks would straddle the experts."""
    if t.ggml_type.name == "BF16" and t.shape and (bf16 := _bfloat16()) is not None:
        return bf16, (*t.shape[:-1], t.shape[-1] // 2)
    if t.ggml_type.block_size > 1 and len(t.shape) < 2:
        raise CheckpointError(f"{path}: merged expert tensor {quote(t.name)} is a {t.ggml_type.name} vector: "
                              "its blocks of values do not split into one slice per expert")
    return t.dtype, t.shape


def _check_expert_axis(path: Path, t: GgufTensor, shape: tuple[int, ...], ref: tuple[GgufTensor, int] | None,
                       n_experts: int | None, e_source: str) -> int:
    """The experts of merged tensor ``t`` (model ``shape``): at least one, under the cap, as
    many as the first merged tensor ``ref`` holds (llama.cpp has one ``n_expert`` for every
    layer), and as the metadata's expert count when it states one."""
    if not shape or shape[0] == 0:
        raise CheckpointError(f"{path}: merged expert tensor {quote(t.name)} has no expert axis")
    n_expert = shape[0]
    if n_expert > MAX_EXPERTS_PER_LAYER:
        raise CheckpointError(
            f"{path}: merged expert tensor {quote(t.name)} claims {n_expert} experts, more than "
            f"the {MAX_EXPERTS_PER_LAYER} a layer may have")
    if n_experts is not None and n_expert != n_experts:
        raise CheckpointError(f"{path}: merged expert tensor {quote(t.name)} holds {n_expert} experts, but "
                              f"{e_source} says {n_experts}")
    if ref is not None and ref[1] != n_expert:
        raise CheckpointError(
            f"{path}: merged expert tensor {quote(t.name)} holds {n_expert} experts but {quote(ref[0].name)} "
            f"holds {ref[1]}: every merged expert tensor of a GGUF model holds the same experts")
    return n_expert


def _expert_bytes(path: Path, t: GgufTensor, n_expert: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> int:
    """The bytes of one expert of the merged tensor ``t`` (at least one, the tensor an exact
    multiple of them, and ``shape`` x ``dtype`` of them)."""
    per, rest = divmod(t.n_bytes, n_expert)
    if per == 0:
        raise CheckpointError(
            f"{path}: merged expert tensor {quote(t.name)} of {t.n_bytes} bytes claims {n_expert} "
            "experts of no bytes; a zero-size expert tensor is malformed")
    if rest or math.prod(shape) * dtype.itemsize != per:
        raise CheckpointError(
            f"{path}: merged expert tensor {quote(t.name)} of {t.n_bytes} bytes and shape "
            f"{t.shape} does not split into {n_expert} equal experts"
        )
    return per


def _halves(path: Path, t: GgufTensor, name: str, suffix: str, shape: tuple[int, ...]) -> tuple[DerivedTensor, ...]:
    """``gate_proj`` and ``up_proj`` (same suffix) as the halves of a fused expert's ``2I``
    axis, numpy axis 0 (module docstring); none for a per-expert scalar (a ``.scale``)."""
    if not shape:
        return ()
    if shape[0] % 2:
        raise CheckpointError(f"{path}: fused expert tensor {quote(t.name)} has {shape[0]} rows per expert, "
                              "an odd number: it does not split into gate and up halves")
    half = shape[0] // 2
    tail = "" if suffix == "weight" else f".{suffix}"
    return (DerivedTensor(f"gate_proj{tail}", name, 0, 0, half),
            DerivedTensor(f"up_proj{tail}", name, 0, half, 2 * half))


def _check_roles(layer: int, roles: dict[tuple[str, str], tuple[Path, GgufTensor]]) -> None:
    """A layer's merged tensors form one complete expert: down, and gate with up, or gate_up
    alone, or up alone (a non-gated FFN); every other suffix beside its role's weight."""
    weights = {role for role, suffix in roles if suffix == "weight"}
    any_path, any_t = next(iter(roles.values()))

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{any_path}: layer {layer}: {what} (e.g. {quote(any_t.name)}): an incomplete "
                               "or ambiguous expert cannot be served")

    for role, suffix in roles:
        if suffix != "weight" and role not in weights:
            path, t = roles[(role, suffix)]
            raise CheckpointError(f"{path}: tensor {quote(t.name)} has no blk.{layer}.ffn_{role}_exps.weight "
                                  "beside it: a per-expert tensor without its weight")
    if "down" not in weights:
        raise refuse(f"no blk.{layer}.ffn_down_exps.weight")
    if "gate_up" in weights and weights & set(_FUSED_ROLES):
        raise refuse(f"both a fused blk.{layer}.ffn_gate_up_exps.weight and a separate gate or up")
    if "gate" in weights and "up" not in weights:
        raise refuse(f"blk.{layer}.ffn_gate_exps.weight without blk.{layer}.ffn_up_exps.weight")
    if not weights & {"gate_up", "up"}:
        raise refuse(f"blk.{layer}.ffn_down_exps.weight without an up projection")


def _count(path: Path, key: str, value: object, meaning: str) -> int | None:
    """A metadata count: ``None`` when absent, else a positive integer or an error naming it."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(
            f"{path}: malformed GGUF metadata: key {quote(key)} is {quote(value)}, not a positive "
            f"integer ({meaning})"
        )
    return value
