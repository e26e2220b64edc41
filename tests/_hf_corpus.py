"""A corpus of tiny MoE checkpoints, one per MoE config class of the installed transformers.

Every config class that ``CONFIG_MAPPING`` registers and whose fields (or its sub-configs')
include an expert count (:data:`iosched.formats._hf_names.EXPERT_COUNT_KEYS`) is a MoE model.  Its
default config is shrunk by a small table of generic size keys (:data:`TINY`), its expert
count set to :data:`EXPERTS` and its k to :data:`K`, the layer knobs that decide which layers
are MoE (:data:`LAYER_KNOBS`) set so the tiny model has MoE layers and, where the
architecture has them, a dense one; the model is built with random weights under a fixed
seed (``AutoModelForCausalLM.from_config``, else ``AutoModel``) and written by its own
``save_pretrained`` in shards of :data:`SHARD_SIZE` with an index.

No model is picked by hand: a config the generic shrinker cannot build is listed with the
reason (``Entry.error``), never left out silently.  ``python -m tests._hf_corpus --table``
builds the corpus in a temporary folder and prints the table of what it holds and what
``load_index`` makes of each (markdown).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iosched.formats._hf_names import EXPERT_COUNT_KEYS, EXPERTS_PER_TOKEN_KEYS

EXPERTS = 4
"""Experts per MoE layer of every tiny model (the brief: 4 to 8)."""
K = 2
SEED = 0
N_LAYERS = 3
SHARD_SIZE = "100KB"
"""Small enough that every model is written in several shards (with an index json)."""

TINY: dict[str, int] = {
    # widths
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 48,
    "shared_experts_intermediate_size": 48, "expert_ffn_hidden_size": 48, "moe_shared_expert_intermediate_size": 48,
    "share_expert_dim": 48, "moe_hidden_size": 64, "d_model": 64, "d_ff": 96, "d_kv": 16,
    "encoder_ffn_dim": 96, "decoder_ffn_dim": 96, "ffn_dim": 96, "dim": 64, "out_hidden_size": 64,
    "output_dim": 64, "text_hidden_size": 64, "vision_output_dim": 64, "projection_dim": 64,
    "hidden_size_per_layer_input": 16,
    # heads
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "num_heads": 4,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "index_n_heads": 2, "index_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "global_head_dim": 16,
    # lengths and vocabularies
    "vocab_size": 256, "max_position_embeddings": 256, "vocab_size_per_layer_input": 256,
    # depths of towers and encoder-decoders
    "depth": 2, "encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2, "n_layers": 2,
    "patch_size": 8,
    # state-space layers (GraniteMoeHybrid: heads x head size = expand x hidden)
    "mamba_n_heads": 8, "mamba_d_head": 16,
    # routing
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "zero_expert_num": 0,
}  # fmt: skip
"""Generic size keys -> tiny values, applied at every level of the config (towers too); a
size left unset (``None``) gets its tiny value too (Hunyuan's default leaves ``head_dim`` so,
Gemma 4 its MoE widths until ``enable_moe_block`` turns the block on)."""
MAX_PARAMETERS = 25_000_000
"""A model still larger than this once shrunk is listed, not built (its size is counted on
the meta device first, which costs nothing): it would cost the corpus its time budget."""
TOKEN_IDS_FROM = 200
"""Special token ids past the tiny vocabulary are renumbered from here (embeddings check that
``pad_token_id`` is inside the vocabulary)."""

MOE_SWITCHES = {"is_moe": True, "enable_moe_block": True}
"""Boolean fields that turn a model's MoE layers on (Doge, Gemma 4)."""
LAYER_KNOBS: dict[str, Any] = {
    "first_k_dense_replace": 1, "moe_layer_start_index": 1, "mlp_only_layers": [0], "expert_layer_period": 2,
    "expert_layer_offset": 1, "interleave_moe_layer_step": 2, "encoder_sparse_step": 2, "decoder_sparse_step": 1,
    "moe_layer_freq": 1, "moe_layer_interval": 1, "moe_layer_end_index": N_LAYERS - 1, "moe_layers": [1, 2],
}  # fmt: skip
"""Which layers are MoE: layer 0 dense where the architecture has dense layers, the others
MoE (DeepSeek's ``first_k_dense_replace``, ERNIE's ``moe_layer_start_index``, Qwen's
``mlp_only_layers``, Jamba's period/offset, Llama 4's step, SwitchTransformers'/NLLB's sparse
steps)."""


DEFAULT_GAPS: dict[str, dict[str, Any]] = {
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv"]},
}
"""What a config class's *defaults* leave out and its model cannot do without, by model type:
the values its released checkpoints' ``config.json`` give (LFM2-MoE's ``layer_types``, a
``conv``/``full_attention`` pattern; its default is ``None``, which its decoder layers index).
Not a list of models to test: every MoE config class is built (:func:`moe_config_classes`);
this fills a gap a generic shrinker cannot guess, so the layout the issue names is covered."""


@dataclass
class Entry:
    """One config class of the corpus and what became of it."""

    model_type: str
    config_class: str
    model_class: str = ""
    folder: Path | None = None
    error: str = ""
    """Why the generic shrinker could not build it (empty when ``folder`` holds the checkpoint)."""
    seconds: float = 0.0
    result: str = ""
    """Filled by the conformance test: what ``load_index`` made of it."""
    extra: dict[str, Any] = field(default_factory=dict)


def _field_names(cls: type, depth: int = 0) -> set[str]:
    """The config fields of ``cls`` and its sub-configs (transformers 5 configs are dataclasses)."""
    names = set(getattr(cls, "__dataclass_fields__", {}))
    if depth < 3:
        for sub in (getattr(cls, "sub_configs", None) or {}).values():
            if isinstance(sub, type):
                names |= _field_names(sub, depth + 1)
    return names


def moe_config_classes() -> Iterator[tuple[str, type]]:
    """``(model_type, config class)`` of every registered config class that states an expert count."""
    registry, names = _mappings()
    for model_type in names:
        try:
            cls = registry[model_type]
        except Exception:
            continue
        if _field_names(cls) & set(EXPERT_COUNT_KEYS):
            yield model_type, cls


def _mappings() -> tuple[Any, Any]:
    """transformers' registry of config classes: model_type -> class, and its names."""
    import importlib

    auto: Any = importlib.import_module("transformers.models.auto.configuration_auto")
    return auto.CONFIG_MAPPING, auto.CONFIG_MAPPING_NAMES


def config_keys_of_installed_transformers() -> set[str]:
    """Every field name of every registered config class (and its sub-configs)."""
    registry, names = _mappings()
    out: set[str] = set()
    for model_type in names:
        try:
            out |= _field_names(registry[model_type])
        except Exception:
            continue
    return out


def shrink(d: dict[str, Any], n_layers: int = N_LAYERS, k: int = K) -> dict[str, Any]:
    """``d`` (a config's ``to_dict()``) with :data:`TINY` sizes, :data:`EXPERTS` experts, k =
    :data:`K`, MoE switched on and the layer knobs set, at every nesting level."""
    old = d.get("num_hidden_layers") or d.get("num_layers")
    out: dict[str, Any] = {}
    next_id = [TOKEN_IDS_FROM]

    def token_id(value: int) -> int:
        if value < TINY["vocab_size"]:
            return value
        next_id[0] += 1
        return min(next_id[0], TINY["vocab_size"] - 1)

    for key, value in d.items():
        if isinstance(value, dict) and "layer" in key and value and all(str(x).isdigit() for x in value):
            # per-layer settings keyed by layer index (Gemma 4's per_layer_config)
            out[key] = {x: shrink(v, n_layers, k) if isinstance(v, dict) else v for x, v in value.items()
                        if int(x) < n_layers}
        elif isinstance(value, dict) and (key.endswith("config") or key.endswith("_cfg")):
            out[key] = shrink(value, n_layers, k)
        elif key.endswith("token_id") and isinstance(value, int) and not isinstance(value, bool):
            out[key] = token_id(value)
        elif key.endswith("token_id") and isinstance(value, list) and all(isinstance(x, int) for x in value):
            out[key] = [token_id(x) for x in value]
        elif key in TINY and value is None:  # a size left unset (Gemma 4's MoE widths, Hunyuan's head_dim)
            out[key] = TINY[key]
        elif key in ("rope_parameters", "rope_scaling") and isinstance(value, dict) and isinstance(
                value.get("mrope_section"), list) and len(value["mrope_section"]) == 3:
            # multimodal RoPE: (time, height, width) sections summing to half the rotary dims
            factor = value.get("partial_rotary_factor", d.get("partial_rotary_factor")) or 1.0
            rotary = TINY["qk_rope_head_dim"] if "qk_rope_head_dim" in d else TINY["head_dim"]
            half = int(rotary * factor) // 2
            out[key] = {**value, "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}
        elif key in EXPERT_COUNT_KEYS and (value is None or isinstance(value, int)):
            out[key] = EXPERTS
        elif key in EXPERTS_PER_TOKEN_KEYS and key != "top_k" and (value is None or isinstance(value, int)):
            out[key] = k
        elif key in EXPERTS_PER_TOKEN_KEYS and isinstance(value, list):
            out[key] = [k] * n_layers
        elif key in MOE_SWITCHES and isinstance(value, bool):
            out[key] = MOE_SWITCHES[key]
        elif key in LAYER_KNOBS and (value is None or type(value) is type(LAYER_KNOBS[key])):
            out[key] = LAYER_KNOBS[key]
        elif key in TINY and isinstance(value, int) and not isinstance(value, bool):
            out[key] = TINY[key]
        elif key in TINY and isinstance(value, list) and value and all(isinstance(x, int) for x in value):
            out[key] = [TINY[key]] * len(value)
        elif key in ("num_hidden_layers", "num_layers") and isinstance(value, int):
            out[key] = n_layers
        elif isinstance(value, list) and old and len(value) == old:
            out[key] = _per_layer(value, n_layers)
        else:
            out[key] = value
    return out


def _per_layer(values: list[Any], n_layers: int) -> list[Any]:
    """A per-layer list cut to ``n_layers``; one of layer kinds, "dense" and "sparse"/"moe",
    becomes dense first and sparse after, so the tiny model has both."""
    kinds = [v for v in dict.fromkeys(values) if isinstance(v, str)]
    sparse = [v for v in kinds if "sparse" in v or "moe" in v.lower()]
    dense = [v for v in kinds if v not in sparse]
    if sparse and dense and all(isinstance(v, str) for v in values):
        return [dense[0]] + [sparse[0]] * (n_layers - 1)
    return values[:n_layers]


def build_one(model_type: str, cls: Any, root: Path) -> Entry:
    """The tiny checkpoint of one config class under ``root/model_type`` (module docstring).

    k is :data:`K`, or 1 for a model that supports nothing else (its config refuses k = 2:
    ZAYA); the first of ``AutoModelForCausalLM``/``AutoModel`` that builds it is used."""
    entry = Entry(model_type=model_type, config_class=cls.__name__)
    start = time.perf_counter()
    errors: list[str] = []
    for k in (K, 1):
        errors = []
        if _build(entry, cls, root / model_type, k, errors):
            break
    if entry.folder is None:
        real = [e for e in errors if "Unrecognized configuration class" not in e]
        entry.error = "; ".join(dict.fromkeys(real or errors))
    entry.seconds = time.perf_counter() - start
    return entry


def _build(entry: Entry, cls: Any, folder: Path, k: int, errors: list[str]) -> bool:
    import torch
    import transformers

    autos: tuple[Any, ...] = (transformers.AutoModelForCausalLM, transformers.AutoModel)

    try:
        cfg = cls.from_dict({**shrink(cls().to_dict(), k=k), **DEFAULT_GAPS.get(entry.model_type, {})})
    except Exception as exc:
        errors.append(f"config: {type(exc).__name__}: {_reason(exc)}")
        return False
    for auto in autos:
        try:
            with torch.device("meta"):
                size = auto.from_config(cfg).num_parameters()
        except Exception as exc:
            errors.append(f"{auto.__name__}: {type(exc).__name__}: {_reason(exc)}")
            continue
        if size > MAX_PARAMETERS:
            errors.append(f"{auto.__name__}: {size / 1e6:.1f} M parameters once shrunk (more than "
                          f"{MAX_PARAMETERS / 1e6:.0f} M)")
            return False
        try:
            torch.manual_seed(SEED)
            model = auto.from_config(cfg)
            model.save_pretrained(folder, max_shard_size=SHARD_SIZE)
        except Exception as exc:
            errors.append(f"{auto.__name__}: {type(exc).__name__}: {_reason(exc)}")
            return False
        entry.model_class = type(model).__name__
        entry.folder = folder
        entry.extra["k"] = k
        entry.extra["auto"] = auto.__name__
        entry.extra["experts_modules"] = experts_modules(model)
        entry.extra["stack_layers"] = stack_layers(model)
        return True
    return False


def experts_modules(model: Any) -> dict[str, int]:
    """In-memory modules that hold a layer's experts, by qualified name, with their expert
    count: a ``ModuleList``/``ModuleDict`` named ``experts`` (its ``num_experts``, else its
    length), or a module whose class name ends
    in ``Experts`` (transformers' fused experts, GraniteMoe's ``ParallelExperts``: its
    ``num_experts``, else its first parameter's first axis).  What the model *is*, independent
    of any file name: the conformance test compares the index with it."""
    import torch

    out: dict[str, int] = {}
    for name, module in model.named_modules():
        if name.endswith("shared_experts") or name.endswith("shared_expert"):
            continue
        if name.split(".")[-1] == "experts" and isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            count = getattr(module, "num_experts", None)  # NLLB-MoE's dict also holds a dropout
            out[name] = count if isinstance(count, int) else len(module)
        elif type(module).__name__.endswith("Experts") and not any(n.startswith(name + ".") for n in out):
            count = getattr(module, "num_experts", None)
            if not isinstance(count, int):
                params = list(module.parameters(recurse=False))
                count = int(params[0].shape[0]) if params else 0
            out[name] = count
    return out


def stack_layers(model: Any) -> dict[str, int]:
    """Layers of each layer stack of the in-memory model, by prefix (``encoder.``: 2)."""
    out: dict[str, int] = {}
    for name, _ in model.named_modules():
        m = re.fullmatch(r"(.*?)(?:layers|block|blocks|h)\.([0-9]+)", name)
        if m is not None:
            out[m.group(1)] = max(out.get(m.group(1), 0), int(m.group(2)) + 1)
    return out


def _reason(exc: BaseException) -> str:
    """The message of ``exc`` (and of its cause, which a config validator wraps), one line."""
    text = " ".join(str(exc).split())
    cause = exc.__cause__
    if cause is not None and str(cause) not in text:
        text += ": " + " ".join(str(cause).split())
    return text[:240]


def build_corpus(root: Path) -> list[Entry]:
    """Every MoE config class's tiny checkpoint under ``root`` (module docstring)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads cost more than they save
    try:
        return _build_all(root)
    finally:
        torch.set_num_threads(threads)


def _build_all(root: Path) -> list[Entry]:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import importlib

    logging: Any = importlib.import_module("transformers.utils.logging")
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    entries = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type, cls in moe_config_classes():
            entries.append(build_one(model_type, cls, root))
    return entries


def markdown_table(entries: list[Entry]) -> str:
    lines = ["| model_type | config class | model class | build s | result |", "|---|---|---|---|---|"]
    for e in entries:
        result = e.result or (f"not built: {e.error}" if e.error else "built")
        lines.append(f"| {e.model_type} | {e.config_class} | {e.model_class or '-'} | {e.seconds:.2f} | "
                     f"{result.replace('|', '/')} |")
    return "\n".join(lines)


def classify(entry: Entry) -> str:
    """What ``load_index`` makes of a built checkpoint: ``opens: ...`` or ``refused: <message>``."""
    from iosched._errors import CheckpointError
    from iosched.formats._safetensors_index import load_folder

    assert entry.folder is not None
    try:
        index = load_folder(entry.folder)
    except CheckpointError as exc:
        return f"refused: {exc}"
    lay = next(iter(index.experts.values()))
    names = ", ".join(t.name for t in lay.tensors) + "".join(f", ({d.name})" for d in lay.derived)
    return (f"opens: {len(index.layers())} MoE layers x {index.experts_per_layer()} experts, k "
            f"{index.experts_per_token}; tensors {names}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", action="store_true", help="print the corpus table (markdown)")
    parser.add_argument("--keep", type=Path, help="build the corpus here and keep it")
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        start = time.perf_counter()
        entries = build_corpus(root)
        built = time.perf_counter() - start
        for e in entries:
            if e.folder is not None:
                e.result = classify(e)
        if args.json:
            args.json.write_text(json.dumps([{k: str(v) if isinstance(v, Path) else v for k, v in vars(e).items()}
                                             for e in entries], indent=1))
        ok = sum(e.result.startswith("opens") for e in entries)
        print(markdown_table(entries) if args.table else "")
        print(f"\n{len(entries)} MoE config classes, {sum(e.folder is not None for e in entries)} built in "
              f"{built:.1f} s, {ok} open")
    return 0


if __name__ == "__main__":
    sys.exit(main())
