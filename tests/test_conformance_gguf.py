"""Every MoE layout llama.cpp's ``gguf`` package writes, indexed byte-exact on every backend.

The corpus (``tests/_gguf_corpus.py``) is one tiny GGUF per architecture with merged expert
tensors in ``gguf.constants.MODEL_TENSORS`` x expert layout x type (F16, BF16, Q8_0, Q4_K, and
MXFP4 for gpt-oss), plus alignments 8 and 4096, a split set and a model beside an mmproj.
The module fixture writes and indexes each once and holds the index against
``gguf.GGUFReader``; each backend then serves every expert of every file, compared with the
reader's data sliced per expert. The table (arch, layout, type, result) is written to the
pytest tmp dir as ``gguf_corpus.md``; ``python -m tests._gguf_corpus --table`` prints it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import _gguf_corpus as corpus

pytestmark = pytest.mark.xdist_group("gguf_corpus")
"""One worker runs the module under pytest-xdist (--dist loadgroup): the corpus is written once."""


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[corpus.Prepared]]:
    root = tmp_path_factory.mktemp("gguf-corpus")
    out: list[corpus.Prepared] = []
    failures = []
    for case in corpus.cases():
        try:
            out.append(corpus.prepare_case(case, root / case.name))
        except Exception as exc:  # every case is reported, then the test fails
            failures.append(f"{case.name}: {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)
    yield out
    table = root / "gguf_corpus.md"
    table.write_text(corpus.markdown([p.row for p in out]))
    print(f"\nGGUF corpus table: {table}")


def test_the_corpus_covers_every_architecture_with_merged_experts(prepared: list[corpus.Prepared]) -> None:
    archs = corpus.expert_archs()
    assert {p.case.arch for p in prepared} == set(archs)
    fused = {p.case.arch for p in prepared if p.case.layout == "fused"}
    assert {"gemma4", "qwen35moe", "qwen3next", "mistral4"} <= fused
    assert {p.case.qtype for p in prepared} == {"F16", "BF16", "Q8_0", "Q4_K", "MXFP4"}
    assert {p.case.variant for p in prepared} == {"", "align8", "align4096", "split", "mmproj"}
    ungated = {p.case.arch for p in prepared if p.case.layout == "ungated"}
    assert "nomic-bert-moe" in ungated


def test_every_layout_on_the_backend(prepared: list[corpus.Prepared], backend: str) -> None:
    """``backend`` (conftest: pread, odirect, mmap, uring; skipped with the reason where it
    cannot run) serves every expert of every layout byte-exact, typed and shaped."""
    for p in prepared:
        corpus.check_backend(p, backend)


def test_the_table_entry_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [corpus.check_case(corpus.Case("gpt-oss", "MXFP4", "separate"), tmp_path / "a", ("pread",)),
            corpus.check_case(corpus.Case("gemma4", "Q4_K", "fused"), tmp_path / "b", ("mmap",))]
    table = corpus.markdown(rows)
    assert "| gpt-oss | separate | MXFP4 | - | 8 |" in table and "| gemma4 | fused | Q4_K |" in table
    assert all(r.result == "ok" for r in rows)
