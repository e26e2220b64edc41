"""Writers of small but real MoE checkpoints, for ``iosched demo`` and the tests.

The files are produced by the real libraries wherever they can be, so the index is tested
against what the ecosystem actually writes: ``safetensors.numpy.save_file`` for float16 and
float32, ``gguf.GGUFWriter`` for GGUF. bfloat16 has no numpy dtype without ``ml_dtypes``
(an optional dependency), so bfloat16 shards are written here by hand, byte for byte in the
library's layout (JSON header padded to 8 bytes, tensors sorted by name, packed back to
back). ``safetensors.numpy.load_file`` cannot return bfloat16 without ``ml_dtypes`` either,
so tests check bf16 shards with ``safetensors.deserialize``, the library's own parser.

Values are deterministic for a given ``seed`` and always finite (no NaN), so arrays read
back can be compared with ``==``.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import safetensors.numpy

SafetensorsDtype = Literal["bfloat16", "float16", "float32"]
GgufDtype = Literal["float16", "float32"]
Naming = Literal["qwen", "mixtral"]

_VOCAB = 128
"""Rows of the embedding table written with ``dense=True``."""


def write_safetensors_moe(
    folder: str | os.PathLike[str],
    *,
    n_layers: int,
    n_experts: int,
    hidden: int,
    intermediate: int,
    dtype: SafetensorsDtype = "bfloat16",
    n_shards: int = 1,
    index_json: bool = True,
    naming: Naming = "qwen",
    seed: int = 0,
    dense: bool = True,
    experts_per_token: int | None = None,
    sparse: bool = False,
) -> Path:
    """Write a Hugging Face style MoE checkpoint into ``folder`` and return the folder.

    Expert tensors: ``model.layers.{L}.mlp.experts.{E}.{gate_proj,up_proj,down_proj}.weight``
    (``naming="qwen"``) or ``model.layers.{L}.block_sparse_moe.experts.{E}.{w1,w3,w2}.weight``
    (``naming="mixtral"``), gate/up of shape ``(intermediate, hidden)`` and down of shape
    ``(hidden, intermediate)``. ``dense=True`` adds tensors the index must skip: the
    embedding, and per layer an attention projection and the router.

    Layers are split into ``n_shards`` contiguous ranges: one shard is ``model.safetensors``,
    several are ``model-0000i-of-0000n.safetensors`` (the Hugging Face names).
    ``index_json`` writes ``model.safetensors.index.json`` with the ``weight_map``.
    ``experts_per_token`` (k) writes a minimal ``config.json`` with ``num_experts_per_tok``
    (and the expert count under the naming's key); ``None`` writes no ``config.json``.
    ``sparse`` (bfloat16 only) writes the same files with their headers and no data: each
    shard's bytes after the header are a hole (zeros, no disk blocks), for a store that never
    reads them (the critical-path replay's modelled drive).
    """
    _check_sizes(n_layers=n_layers, n_experts=n_experts, hidden=hidden, intermediate=intermediate)
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, not {dtype!r}")
    if naming not in ("qwen", "mixtral"):
        raise ValueError(f"naming must be 'qwen' or 'mixtral', not {naming!r}")
    if not 1 <= n_shards <= n_layers:
        raise ValueError(f"n_shards must be between 1 and n_layers ({n_layers}), not {n_shards}")
    if experts_per_token is not None:
        _check_sizes(experts_per_token=experts_per_token)
    if sparse and dtype != "bfloat16":
        raise ValueError(f"sparse checkpoints are written in bfloat16, not {dtype!r}")

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    layer_ranges = np.array_split(np.arange(n_layers), n_shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, layers in enumerate(layer_ranges):
        shard = (
            "model.safetensors"
            if n_shards == 1
            else f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        )
        shapes: dict[str, tuple[int, ...]] = {}
        if dense and i == 0:
            shapes["model.embed_tokens.weight"] = (_VOCAB, hidden)
        for layer in (int(x) for x in layers):
            shapes.update(_layer_tensors(layer, n_experts, hidden, intermediate, naming, dense))
        if sparse:
            total += _save_bf16_sparse(shapes, out / shard)
        else:
            tensors = {name: _values(rng, shape, dtype) for name, shape in shapes.items()}
            if dtype == "bfloat16":
                _save_bf16(tensors, out / shard)
            else:
                safetensors.numpy.save_file(tensors, str(out / shard), metadata={"format": "pt"})
            total += sum(int(t.nbytes) for t in tensors.values())
        weight_map.update({name: shard for name in shapes})

    if index_json:
        doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(doc, indent=2) + "\n")
    if experts_per_token is not None:
        config = {
            "model_type": "qwen3_moe" if naming == "qwen" else "mixtral",
            "num_hidden_layers": n_layers,
            "hidden_size": hidden,
            "moe_intermediate_size" if naming == "qwen" else "intermediate_size": intermediate,
            "num_experts" if naming == "qwen" else "num_local_experts": n_experts,
            "num_experts_per_tok": experts_per_token,
        }
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def write_gguf_moe(
    path: str | os.PathLike[str],
    *,
    n_layers: int,
    n_experts: int,
    hidden: int,
    intermediate: int,
    dtype: GgufDtype = "float16",
    seed: int = 0,
    experts_per_token: int | None = None,
) -> Path:
    """Write a llama.cpp style MoE GGUF file (architecture ``qwen3moe``) and return its path.

    Expert tensors are merged per layer: ``blk.{L}.ffn_{gate,up}_exps.weight`` of numpy
    shape ``(n_experts, intermediate, hidden)`` and ``blk.{L}.ffn_down_exps.weight`` of shape
    ``(n_experts, hidden, intermediate)``. Also written, for the index to skip: the token
    embedding and, per layer, the router ``blk.{L}.ffn_gate_inp.weight`` and ``attn_q``.
    ``qwen3moe.expert_used_count`` (k) is ``experts_per_token``, by default
    ``min(2, n_experts)``.
    """
    import gguf

    _check_sizes(n_layers=n_layers, n_experts=n_experts, hidden=hidden, intermediate=intermediate)
    if dtype not in ("float16", "float32"):
        raise ValueError(f"dtype must be float16 or float32, not {dtype!r}")
    if experts_per_token is not None:
        _check_sizes(experts_per_token=experts_per_token)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    writer = gguf.GGUFWriter(str(out), arch="qwen3moe")
    try:
        writer.add_name("iosched synthetic MoE")
        writer.add_block_count(n_layers)
        writer.add_embedding_length(hidden)
        writer.add_expert_feed_forward_length(intermediate)
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(min(2, n_experts) if experts_per_token is None else experts_per_token)
        writer.add_tensor("token_embd.weight", _values(rng, (_VOCAB, hidden), dtype))
        for layer in range(n_layers):
            blk = f"blk.{layer}"
            writer.add_tensor(f"{blk}.attn_q.weight", _values(rng, (hidden, hidden), dtype))
            writer.add_tensor(f"{blk}.ffn_gate_inp.weight", _values(rng, (n_experts, hidden), "float32"))
            up_shape = (n_experts, intermediate, hidden)
            writer.add_tensor(f"{blk}.ffn_gate_exps.weight", _values(rng, up_shape, dtype))
            writer.add_tensor(f"{blk}.ffn_up_exps.weight", _values(rng, up_shape, dtype))
            down_shape = (n_experts, hidden, intermediate)
            writer.add_tensor(f"{blk}.ffn_down_exps.weight", _values(rng, down_shape, dtype))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return out


def _check_sizes(**sizes: int) -> None:
    for key, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, not {value!r}")


def _layer_tensors(
    layer: int, n_experts: int, hidden: int, intermediate: int, naming: Naming, dense: bool
) -> Iterator[tuple[str, tuple[int, int]]]:
    prefix = f"model.layers.{layer}"
    if dense:
        yield f"{prefix}.self_attn.q_proj.weight", (hidden, hidden)
    if naming == "qwen":
        block, gate, up, down = "mlp", "gate_proj", "up_proj", "down_proj"
        router = f"{prefix}.mlp.gate.weight"
    else:
        block, gate, up, down = "block_sparse_moe", "w1", "w3", "w2"
        router = f"{prefix}.block_sparse_moe.gate.weight"
    if dense:
        yield router, (n_experts, hidden)
    for e in range(n_experts):
        experts = f"{prefix}.{block}.experts.{e}"
        yield f"{experts}.{gate}.weight", (intermediate, hidden)
        yield f"{experts}.{up}.weight", (intermediate, hidden)
        yield f"{experts}.{down}.weight", (hidden, intermediate)


_BIT_PATTERNS: dict[str, tuple[type[np.unsignedinteger[Any]], int, int]] = {
    # dtype: (same-width unsigned type, bits kept from random, bits forced on). Keeping the
    # sign, the mantissa and the lowest exponent bit, and forcing the exponent to 2**-7,
    # gives finite values of magnitude 2**-7 .. 2**-5, weight-like, with no NaN or inf.
    "bfloat16": (np.uint16, 0x80FF, 0x3C00),  # 1 sign, 8 exponent, 7 mantissa bits
    "float16": (np.uint16, 0x87FF, 0x2000),  # 1 sign, 5 exponent, 10 mantissa bits
    "float32": (np.uint32, 0x80FFFFFF, 0x3C000000),  # 1 sign, 8 exponent, 23 mantissa bits
}


def _values(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> npt.NDArray[Any]:
    """Finite random values in ``dtype``; bfloat16 comes back as its ``uint16`` bit pattern.

    Built from random integer bits rather than ``standard_normal``: about three times faster,
    which matters for the demo's few hundred megabytes.
    """
    uint, keep, force = _BIT_PATTERNS[dtype]
    bits = rng.integers(0, np.iinfo(uint).max, size=shape, dtype=uint, endpoint=True)
    np.bitwise_and(bits, uint(keep), out=bits)
    np.bitwise_or(bits, uint(force), out=bits)
    return bits if dtype == "bfloat16" else bits.view(np.dtype(dtype))


def _bf16_header(shapes: dict[str, tuple[int, ...]]) -> tuple[bytes, list[str], int]:
    """The ``BF16`` safetensors header of tensors of these shapes, in the library's layout
    (names sorted, data back to back, the JSON padded with spaces to 8 bytes): the bytes to
    write before the data (its length included), the names in data order, the data's size."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = sorted(shapes)
    for name in names:
        n = 2 * math.prod(shapes[name])
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, names, offset


def _save_bf16(tensors: dict[str, npt.NDArray[Any]], path: Path) -> None:
    """Write ``uint16`` bit patterns as a ``BF16`` safetensors file, in the library's layout."""
    head, names, _ = _bf16_header({name: tuple(t.shape) for name, t in tensors.items()})
    with open(path, "wb") as f:
        f.write(head)
        for name in names:
            f.write(np.ascontiguousarray(tensors[name], dtype="<u2").tobytes())


def _save_bf16_sparse(shapes: dict[str, tuple[int, ...]], path: Path) -> int:
    """:func:`_save_bf16`'s file with its data a hole (``truncate``): only the header takes
    disk space.  Returns the data's size."""
    head, _, size = _bf16_header(shapes)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + size)
    return size
