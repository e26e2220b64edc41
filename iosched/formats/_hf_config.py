"""What a Hugging Face ``config.json`` says about a MoE checkpoint: k, E, the architecture.

The file is untrusted (capped read, bounded JSON, :mod:`iosched.formats._untrusted`). Keys are looked
up at the top level, then in the nested configs of :data:`~iosched.formats._hf_names.NESTED_CONFIG_KEYS`
(``text_config``, ``thinker_config.text_config``, ``ffn_config`` ...), the first scope stating
a key winning.  A JSON ``null`` is a key not stated (transformers writes ``null`` for settings
a config class leaves unset, Gemma 4's expert count among them); any other value that is not a
positive integer is a :class:`CheckpointError` naming the file and the key.  k may be a list,
one k per layer (Hunyuan's ``moe_topk``): then :attr:`ConfigFacts.k_by_layer` holds it and
``k`` is its largest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iosched._errors import CheckpointError

from ._hf_names import EXPERT_COUNT_KEYS, EXPERTS_PER_TOKEN_KEYS, NESTED_CONFIG_KEYS
from ._untrusted import MAX_CONFIG_JSON_BYTES, parse_json, quote, read_capped

CONFIG_JSON = "config.json"
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
"""Keys naming the decoder's layer count: a layer numbered past it is a multi-token-prediction
layer (DeepSeek-V3 and GLM-4.5 write theirs as ``model.layers.<num_hidden_layers>``)."""


@dataclass(frozen=True)
class ConfigFacts:
    """The numbers a ``config.json`` states, each with the file and key it came from."""

    k: int | None = None
    k_source: str = ""
    k_by_layer: dict[int, int] | None = None
    n_experts: int | None = None
    e_source: str = ""
    architectures: tuple[str, ...] = ()
    """``model_type`` of the top level, then of the nested configs (``gpt_oss``; ``llama4``,
    ``llama4_text``)."""
    n_layers: int | None = None
    """The language model's layer count, from the scope that states E (or the top level)."""
    scopes: tuple[str, ...] = field(default=(), repr=False)


def read_config(folder: Path) -> ConfigFacts:
    """The :class:`ConfigFacts` of ``folder/config.json``; empty facts when there is none (as
    before: a folder, a FIFO or a broken link named ``config.json`` is no config)."""
    path = folder / CONFIG_JSON
    if not os.path.isfile(path):
        return ConfigFacts()
    doc = parse_json(read_capped(path, MAX_CONFIG_JSON_BYTES, "config.json"), path, "malformed config.json")
    if not isinstance(doc, dict):
        raise CheckpointError(
            f"{path}: malformed config.json: a JSON {type(doc).__name__}, not an object "
            f"(looking for key {EXPERTS_PER_TOKEN_KEYS[0]!r})"
        )
    scopes = _scopes(doc)
    k_found = _find(path, scopes, EXPERTS_PER_TOKEN_KEYS, "experts routed per token", allow_list=True)
    e_found = _find(path, scopes, EXPERT_COUNT_KEYS, "experts per layer", allow_list=False)
    k: int | None = None
    k_by_layer: dict[int, int] | None = None
    k_source = ""
    if k_found is not None:
        value, k_source, _ = k_found
        if isinstance(value, list):
            k_by_layer = dict(enumerate(value))
            k = max(value)
        else:
            k = value
    n_experts, e_source, e_scope = (None, "", scopes[0][1]) if e_found is None else e_found
    n_layers = _layer_count(e_scope)
    archs = tuple(dict.fromkeys(  # a model_type is a short identifier; a longer string is no name
        s["model_type"] for _, s in scopes if isinstance(s.get("model_type"), str) and len(s["model_type"]) <= 128))
    return ConfigFacts(k=k, k_source=k_source, k_by_layer=k_by_layer, n_experts=n_experts if isinstance(
        n_experts, int) else None, e_source=e_source, architectures=archs, n_layers=n_layers,
        scopes=tuple(p for p, _ in scopes))


def _scopes(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    scopes: list[tuple[str, dict[str, Any]]] = [("", doc)]
    for key in NESTED_CONFIG_KEYS:
        nested = doc.get(key)
        if isinstance(nested, dict):
            scopes.append((key + ".", nested))
            for inner in NESTED_CONFIG_KEYS:
                deeper = nested.get(inner)
                if isinstance(deeper, dict):
                    scopes.append((f"{key}.{inner}.", deeper))
    return scopes


def _find(path: Path, scopes: list[tuple[str, dict[str, Any]]], keys: tuple[str, ...], meaning: str,
          *, allow_list: bool) -> tuple[Any, str, dict[str, Any]] | None:
    """The first of ``keys`` stated in ``scopes`` (value, where, its scope), checked."""
    for prefix, scope in scopes:
        for key in keys:
            value = scope.get(key)
            if value is None:
                continue
            if allow_list and isinstance(value, list):
                if not value or len(value) > 1 << 14 or not all(_positive(v) for v in value):
                    raise CheckpointError(
                        f"{path}: malformed config.json: key {prefix + key!r} is {quote(value)}, "
                        f"not a positive integer or a list of them ({meaning})")
                return value, f"{path} key {prefix + key!r}", scope
            if not _positive(value):
                raise CheckpointError(
                    f"{path}: malformed config.json: key {prefix + key!r} is {quote(value)}, "
                    f"not a positive integer ({meaning})"
                )
            return value, f"{path} key {prefix + key!r}", scope
    return None


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _layer_count(scope: dict[str, Any]) -> int | None:
    for key in LAYER_COUNT_KEYS:
        value = scope.get(key)
        if isinstance(value, int) and _positive(value):
            return value
    return None
