"""Building a :class:`CheckpointIndex` from a checkpoint on disk.

``load_index`` is the one entry point: it decides the format from the path, lets the format
reader (``_safetensors_index`` or ``_gguf_index``) find every expert tensor from the file
headers alone, and hands the result to ``_index_build.build_index``, which validates it and
lays each expert out as coalesced read extents. No tensor data is read or mapped, so
indexing a checkpoint of any size costs a few header reads.

It is synchronous on purpose: the store runs it once, in a worker thread
(``asyncio.to_thread``). Every problem is a :class:`CheckpointError` naming the path.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from iosched._errors import CheckpointError
from iosched._layout import CheckpointIndex

from . import _gguf_index, _pack_meta, _safetensors_index
from ._index_build import build_index
from ._untrusted import list_folder

__all__ = ["load_index"]


def load_index(source: str | os.PathLike[str]) -> CheckpointIndex:
    """Index the expert tensors of ``source``.

    ``source`` is one of:

    * a folder of safetensors shards, with or without ``model.safetensors.index.json``
      (with it, its ``weight_map`` decides which shard holds which tensor);
    * a single ``.safetensors`` file;
    * a ``.gguf`` file (a shard ``NAME-00001-of-0000N.gguf`` of a split set opens the whole
      set), or a folder with no safetensors holding one GGUF model: one ``.gguf`` or one split
      set, beside which multimodal projectors (``mmproj*.gguf``) are left out with a note.

    ``experts_per_token`` (k) comes from the folder's ``config.json`` (safetensors folders
    only: a lone ``.safetensors`` file may be one shard of anything) or from the GGUF key
    ``{arch}.expert_used_count``; it is ``None`` when the checkpoint does not say. The experts
    per layer that ``config.json`` or ``{arch}.expert_count`` states, if any, must be what the
    tensors hold.

    A safetensors checkpoint that ``iosched pack`` wrote carries what safetensors cannot say
    (GGML types, k from a GGUF source, fused views) in its ``__metadata__``
    (:mod:`iosched.formats._pack_meta`, docs/formats.md "Packing"); it is applied here.

    Every file is read as untrusted input (:mod:`iosched.formats._untrusted`, docs/reliability.md
    "Hostile checkpoint files"). Raises :class:`CheckpointError` when the path is none of
    these, cannot be read, a file is missing or malformed, or no expert tensor is found.
    """
    index = _load(Path(os.fspath(source)))
    if index.format == "safetensors":  # a copy ``iosched pack`` wrote: its GGML types, k, views
        index = _pack_meta.apply_pack_metadata(index, _pack_meta.pack_metadata(index.files))
    return index


def _load(path: Path) -> CheckpointIndex:
    root = os.path.abspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"cannot look at checkpoint {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        return _load_folder(path, root)
    if stat.S_ISREG(st.st_mode):
        if path.suffix == ".safetensors":
            return _safetensors_index.load_file(path, root)
        if path.suffix == ".gguf":
            return _build_gguf(_gguf_index.read_gguf(path), root)
    raise CheckpointError(
        f"checkpoint {path} is not a .safetensors file, a .gguf file or a folder of them"
    )


def _build_gguf(found: _gguf_index.GgufFound, root: str) -> CheckpointIndex:
    return build_index("gguf", root, found.raws, notes=found.notes)


def _load_folder(folder: Path, root: str) -> CheckpointIndex:
    names = list_folder(folder)
    has_safetensors = _safetensors_index.find_index_json(folder, names) is not None or any(
        name.endswith(".safetensors") for name in names
    )
    if has_safetensors:
        return _safetensors_index.load_folder(folder, root)
    if any(name.endswith(".gguf") for name in names):
        return _build_gguf(_gguf_index.read_gguf_folder(folder, names), root)
    raise CheckpointError(
        f"checkpoint folder {folder} holds no checkpoint: no *.safetensors, "
        f"no {_safetensors_index.INDEX_JSON} and no *.gguf"
    )
