"""Checkpoint formats: files in, an index of expert extents out.

safetensors and GGUF headers read as untrusted input, Hugging Face names and configs, the
index built and checked (``load_index``), mirrors matched to their primary, and the files
iosched writes beside a checkpoint: the packed copy and the manifest that reads are verified
against.  It imports nothing of the runtime (docs/design.md, "Import rules").  Empty on
purpose: importing one module of the room does not import the rest.
"""
