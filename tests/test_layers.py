"""The import rules between iosched's layers (docs/design.md, "Import rules").

``lint-imports`` (import-linter, run by ``make test``) checks the contracts in
``pyproject.toml``: no cycles among siblings, backends and residency importing only the core's
leaf modules and not each other, private modules of backends, residency and tools imported
from inside their package only, and the rooms in layers (the tools over the public modules,
over the runtime, over the checkpoint formats and the topology, over backends and residency,
over the shared leaves).  What it cannot say is checked here, on the import graph that
grimp (import-linter's graph builder) makes from the source tree:

* the tools import the public API only: no ``_``-prefixed module outside ``iosched.tools``,
  and from a package only what its ``__all__`` exports or a public module of it (import-linter's
  wildcards match whole name segments, so "any private module" is beyond a contract);
* no module imports the bare names ``backends``, ``residency`` or ``tools`` (one import root);
* the graph holds every file of ``backends/``, ``residency/`` and ``tools/`` under its import
  name, so the contracts, which see the tree through the links under ``iosched/``, miss none;
* the ``leaves`` contract names every module of the core but the leaves, so that a core module
  added later is forbidden to backends and residency unless someone decides otherwise here;
* the contracts hold (a test runs ``lint-imports`` too, so that ``pytest`` alone catches a
  broken layer).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grimp
import pytest
from importlinter.api import read_configuration

from tests._fresh import module_import_failures

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"

SUBPACKAGES = {"backends": "iosched.backends", "residency": "iosched.residency", "tools": "iosched.tools"}
"""Top-level folders of the tree and the names they are imported by."""

LEAVES = {"iosched._errors", "iosched._settings", "iosched._devices", "iosched._layout", "iosched._atomic"}
"""The core's leaf modules: all of the core that backends and residency may import."""



@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    """iosched's import graph as import-linter builds it (``if TYPE_CHECKING:`` imports
    included), plus the tests, and the external packages by their top-level names."""
    return grimp.build_graph("iosched", "tests", include_external_packages=True,
                             exclude_type_checking_imports=False, cache_dir=None)


def _is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _private_part(module: str) -> str | None:
    return next((part for part in module.split(".") if part.startswith("_")), None)


def _where(graph: grimp.ImportGraph, importer: str, imported: str) -> str:
    details = graph.get_import_details(importer=importer, imported=imported)
    return ", ".join(f"l.{d['line_number']}: {d['line_contents']}" for d in details) or "?"


# ------------------------------------------------------------------------- the graph itself


@pytest.mark.parametrize("folder", sorted(SUBPACKAGES))
def test_the_graph_sees_every_file_under_its_import_name(graph: grimp.ImportGraph, folder: str) -> None:
    link = ROOT / "iosched" / folder
    assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve(), link
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = path.relative_to(ROOT / folder).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        module = ".".join((SUBPACKAGES[folder], *parts))
        assert module in graph.modules, f"{path}: {module} is not in the import graph"


def test_no_module_imports_the_bare_folder_names(graph: grimp.ImportGraph) -> None:
    offenders = [f"{importer} -> {bare} ({_where(graph, importer, bare)})"
                 for bare in sorted(SUBPACKAGES) if bare in graph.modules
                 for importer in sorted(graph.find_modules_that_directly_import(bare))]
    assert not offenders, "import these as iosched.backends / .residency / .tools:\n" + "\n".join(offenders)


# ------------------------------------------------------------------------- tools: public API only


def test_tools_import_no_private_module_outside_tools(graph: grimp.ImportGraph) -> None:
    offenders = []
    for importer in sorted(m for m in graph.modules if _is_within(m, "iosched.tools")):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if _is_within(imported, "iosched") and not _is_within(imported, "iosched.tools") \
                    and _private_part(imported) is not None:
                offenders.append(f"{importer} -> {imported} ({_where(graph, importer, imported)})")
    assert not offenders, ("the tools import the public API only (docs/design.md, \"Import rules\"); "
                           "export what they need instead:\n" + "\n".join(offenders))


def _tools_files() -> Iterator[tuple[Path, str]]:
    """Each file of ``tools/`` and the package its relative imports are resolved against."""
    for path in sorted((ROOT / "tools").rglob("*.py")):
        folder = path.parent.relative_to(ROOT / "tools").parts
        yield path, ".".join(("iosched.tools", *folder))


def _from_imports(path: Path, package: str) -> Iterator[tuple[int, str, str]]:
    """``(line, package or module, name)`` of every ``from M import name`` in ``path``,
    relative imports resolved against ``package``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            for alias in node.names:
                yield node.lineno, source, alias.name


def _exported(package: str) -> set[str] | None:
    """The names ``package`` exports (its ``__all__``); ``None`` for a plain module."""
    mod = importlib.import_module(package)
    if not hasattr(mod, "__path__"):
        return None
    names: list[str] = getattr(mod, "__all__", [])
    return set(names)


def test_tools_import_only_exported_names() -> None:
    """``from iosched import X`` in a tool: X is in ``iosched.__all__`` or a public module of
    it; likewise for ``iosched.backends`` and ``iosched.residency``; nothing ``_``-prefixed
    from any module outside the tools."""
    offenders = []
    for path, package in _tools_files():
        for line, source, name in _from_imports(path, package):
            if not _is_within(source, "iosched") or _is_within(source, "iosched.tools"):
                continue
            where = f"{path.relative_to(ROOT)}:{line}: from {source} import {name}"
            if name.startswith("_") or _private_part(source) is not None:
                offenders.append(where)
                continue
            exported = _exported(source)
            if exported is None or name in exported or name == "*":
                continue
            if importlib.util.find_spec(f"{source}.{name}") is None:
                offenders.append(f"{where} ({name!r} is not in {source}.__all__)")
    assert not offenders, "the tools import exported names only:\n" + "\n".join(offenders)


# ------------------------------------------------------------------------- the contracts


def _config() -> dict[str, Any]:
    """The configuration as import-linter reads it (scalars as strings: ``"False"``)."""
    config: dict[str, Any] = read_configuration(str(PYPROJECT))
    return config


def _contracts() -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in _config()["contracts_options"]}


def test_the_contracts_are_the_documented_ones() -> None:
    contracts = _contracts()
    assert {(cid, c["type"]) for cid, c in contracts.items()} == {
        ("acyclic", "acyclic_siblings"), ("leaves", "forbidden"),
        ("independent", "independence"), ("private", "private_modules"), ("rooms", "layers"),
        ("residency", "layers")}
    session = _config()["session_options"]
    assert session["root_packages"] == ["iosched"]
    assert session["exclude_type_checking_imports"] == "False"  # TYPE_CHECKING imports count
    assert contracts["acyclic"]["ancestors"] == ["iosched"] and "depth" not in contracts["acyclic"]
    assert set(contracts["independent"]["modules"]) == {"iosched.backends", "iosched.residency"}
    assert set(contracts["private"]["packages_with_private_modules"]) == set(SUBPACKAGES.values())
    rooms = contracts["rooms"]
    assert rooms["containers"] == ["iosched"] and rooms["exhaustive"] == "True"  # every child placed
    assert rooms["layers"][:5] == ["tools", "_telemetry | clock | settings", "runtime", "formats | topology",
                                   "backends | residency"]
    leaves = {f"iosched.{name.strip()}" for layer in rooms["layers"][5:] for name in layer.split("|")}
    assert leaves == LEAVES, "the bottom layers are the shared leaves"
    residency = contracts["residency"]
    assert residency["containers"] == ["iosched.residency"] and residency["exhaustive"] == "True"
    assert residency["layers"][:3] == ["registry", "alternatives", "default"]  # the default imports no alternative


def test_the_leaves_contract_forbids_every_other_core_module() -> None:
    """Every module and package of ``iosched/`` but the leaves and the three linked subpackages
    is forbidden to backends and residency: a new core module fails here until it is listed
    (or, having been made a leaf, added to LEAVES and to the docs)."""
    leaves = _contracts()["leaves"]
    assert leaves["as_packages"] == "False"
    assert set(leaves["source_modules"]) == {"iosched.backends", "iosched.backends.**",
                                             "iosched.residency", "iosched.residency.**"}
    core = {"iosched"}
    for entry in (ROOT / "iosched").iterdir():
        if entry.name in SUBPACKAGES or entry.name.startswith(".") or entry.name == "__pycache__":
            continue
        if entry.is_dir() and (entry / "__init__.py").exists():
            core |= {f"iosched.{entry.name}", f"iosched.{entry.name}.**"}
        elif entry.suffix == ".py" and entry.name != "__init__.py":
            core.add(f"iosched.{entry.stem}")
    assert LEAVES <= core
    expected = (core - LEAVES) | {"iosched.tools", "iosched.tools.**"}
    forbidden = set(leaves["forbidden_modules"])
    assert forbidden == expected, (f"missing from forbidden_modules: {sorted(expected - forbidden)}; "
                                   f"listed but not a non-leaf core module: {sorted(forbidden - expected)}")


def _lint_imports() -> str:
    found = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("lint-imports is not installed (pip install -e '.[test]' brings import-linter)")
    return found


def test_the_contracts_hold() -> None:
    """``lint-imports`` over the repository's contracts, as ``make test`` runs it."""
    result = subprocess.run([_lint_imports(), "--no-cache", "--no-logo"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 6 kept, 0 broken." in result.stdout, result.stdout


# ------------------------------------------------------------------------- what the contracts miss


def test_the_leaves_import_nothing_of_iosched_but_each_other(graph: grimp.ImportGraph) -> None:
    """The ``leaves`` contract sees a leaf's imports only through backends' and residency's
    chains; this checks every leaf's own, whether anyone imports it or not."""
    offenders = [f"{leaf} -> {imported} ({_where(graph, leaf, imported)})"
                 for leaf in sorted(LEAVES)
                 for imported in sorted(graph.find_modules_directly_imported_by(leaf))
                 if _is_within(imported, "iosched") and imported not in LEAVES]
    assert not offenders, "a leaf of the core imports a non-leaf:\n" + "\n".join(offenders)


def test_only_the_tools_import_the_tools(graph: grimp.ImportGraph) -> None:
    """The command line sits on top: nothing in the core, backends or residency imports it
    (the acyclic contract misses such an import when its cycle runs through ``iosched``'s
    ``__init__``, which is no sibling)."""
    offenders = [f"{importer} -> {imported} ({_where(graph, importer, imported)})"
                 for importer in sorted(m for m in graph.modules
                                        if _is_within(m, "iosched") and not _is_within(m, "iosched.tools"))
                 for imported in sorted(graph.find_modules_directly_imported_by(importer))
                 if _is_within(imported, "iosched.tools")]
    assert not offenders, "only iosched.tools may import iosched.tools:\n" + "\n".join(offenders)


def test_every_module_imports_first_in_a_fresh_interpreter(graph: grimp.ImportGraph) -> None:
    """No import-order guard is needed anywhere: each module of iosched imports on its own,
    first thing, in a clean interpreter (``tests/_fresh.py``)."""
    modules = sorted(m for m in graph.modules if _is_within(m, "iosched"))
    failures = module_import_failures(modules)
    assert len(modules) > 60 and not failures, "\n".join(failures)
