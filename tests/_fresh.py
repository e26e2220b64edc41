"""Imports run first thing in a clean interpreter, many at once.

No module may need another imported before it (docs/design.md, "Import rules"), so each is
imported first, on its own, in an interpreter that has imported nothing of iosched.  A fresh
``python -c`` per import pays the interpreter's start and the third-party imports (numpy,
ml_dtypes: about a second) every time; here one server interpreter pays them once and forks a
child per import (``os.fork``: POSIX only), as many at a time as there are cores.

What a child starts from, checked before every fork: the server imported the standard library
and the third-party dependencies only, never a module of ``iosched`` nor of ``tests``; it runs
as ``python -c`` in the repository root (the same ``sys.path``, working directory and
environment as the subprocess it replaces), stdin from ``/dev/null``.  The children read the
byte code of iosched's files from a cache the server compiled once (``sys.pycache_prefix``, a
temporary folder) rather than compiling every file again where ``PYTHONDONTWRITEBYTECODE`` is
set: the same code, run the same way.
"""

from __future__ import annotations

import atexit
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]

THIRD_PARTY = ("numpy", "safetensors", "gguf", "rich", "aiofiles", "ml_dtypes", "liburing", "pyudev", "uvloop",
               "xxhash", "tomli")
"""The runtime dependencies (pyproject.toml), imported by the server where installed."""

_SERVER = r"""
import ast, builtins, importlib, importlib.util, json, os, py_compile, shutil, sys, tempfile, time, traceback

ROOT, THIRD_PARTY = os.getcwd(), json.loads(sys.argv[1])
sys.argv[1:] = []  # as `python -c STATEMENT` has it


def sources():
    for folder, _, files in os.walk(os.path.join(ROOT, "iosched"), followlinks=True):
        yield from (os.path.join(folder, file) for file in files if file.endswith(".py"))


def preload():
    # the third-party dependencies and the standard library modules iosched's files name
    names = set(THIRD_PARTY)
    for path in sources():
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    for name in sorted(names):
        if name in THIRD_PARTY or name.split(".")[0] in sys.stdlib_module_names:
            try:
                importlib.import_module(name)
            except ImportError:
                pass


def compile_sources():
    sys.pycache_prefix = tempfile.mkdtemp(prefix="iosched-fresh-")
    for path in sources():
        try:
            py_compile.compile(path, cfile=importlib.util.cache_from_source(path), doraise=True)
        except py_compile.PyCompileError:
            pass  # the child that imports it reports the error


def check_clean():
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("iosched", "tests"))
    if leaked:
        raise SystemExit(f"the server imported {leaked}: its children would not start clean")


def child(statement, out, loaded):
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    code = 0
    try:
        exec(compile(statement, "<string>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    loaded.write(json.dumps(sorted(sys.modules)).encode())
    for stream in (sys.stdout, sys.stderr, loaded):
        stream.flush()
    os._exit(code)


def run(statements, timeout, jobs):
    pending, running, results = list(reversed(statements)), {}, {}
    while pending or running:
        while pending and len(running) < jobs:
            statement = pending.pop()
            out, loaded = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            check_clean()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                child(statement, out, loaded)
            running[pid] = statement, out, loaded, time.monotonic()
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for pid, (_, _, _, started) in running.items():
                if time.monotonic() - started > timeout:
                    os.kill(pid, 9)
            time.sleep(0.002)
            continue
        statement, out, loaded, _ = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        loaded.seek(0)
        text, names = out.read().decode(errors="replace"), loaded.read()
        results[statement] = {"error": None if code == 0 else f"{statement}: exit status {code}\n{text[-2000:]}",
                              "modules": json.loads(names) if code == 0 else []}
        out.close()
        loaded.close()
    return results


preload()
compile_sources()
check_clean()
jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
for line in sys.stdin:
    request = json.loads(line)
    print(json.dumps(run(request["statements"], request["timeout"], max(2, jobs))), flush=True)
shutil.rmtree(sys.pycache_prefix, ignore_errors=True)
"""


class _Server:
    """The server interpreter, started at the first request and ended at exit."""

    def __init__(self) -> None:
        self._log: IO[bytes] = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, json.dumps(THIRD_PARTY)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        atexit.register(self.close)

    def run(self, statements: list[str], timeout: float) -> dict[str, dict[str, Any]]:
        """Each statement's ``error`` (``None`` when it passed) and the ``modules`` it left loaded."""
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps({"statements": statements, "timeout": timeout}) + "\n")
        stdin.flush()
        line = stdout.readline()
        if not line:
            self.proc.wait()
            self._log.seek(0)
            raise RuntimeError(f"the fork server ended (status {self.proc.returncode}):\n"
                               + self._log.read().decode(errors="replace")[-4000:])
        results: dict[str, dict[str, Any]] = json.loads(line)
        return results

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


_server: _Server | None = None


def _run(statements: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
    return _server.run(statements, timeout)


def import_failures(statements: Iterable[str], timeout: float = 120) -> list[str]:
    """Run each statement (``import iosched.x``, ``from iosched import y``) first thing in a
    clean interpreter, several at once; for each that fails, its exit status and the end of its
    output ([] when all pass)."""
    statements = list(statements)
    results = _run(statements, timeout)
    return [error for s in statements if (error := results[s]["error"]) is not None]


def module_import_failures(modules: Iterable[str], timeout: float = 120) -> list[str]:
    """:func:`import_failures` of ``import M`` for each of ``modules``, packages before what
    they hold.  ``import a.b`` first imports ``a``; when that leaves ``a.b`` loaded, it does
    nothing more: the very run that ``import a`` is, already checked, so it runs no child of
    its own (an import of ``iosched`` loads most of the core: its ``__init__`` re-exports it)."""
    modules = sorted(set(modules), key=lambda m: (m.count("."), m))
    loaded_by: dict[str, set[str]] = {}
    failures: list[str] = []
    for depth in sorted({m.count(".") for m in modules}):
        wave = [m for m in modules if m.count(".") == depth]
        own = []
        for module in wave:
            parent = module.rpartition(".")[0]
            if module in loaded_by.get(parent, ()):
                loaded_by[module] = loaded_by[parent]  # the same run as its parent's
            else:
                own.append(module)
        results = _run([f"import {m}" for m in own], timeout)
        for module in own:
            result = results[f"import {module}"]
            loaded_by[module] = set(result["modules"])
            if result["error"] is not None:
                failures.append(result["error"])
    return failures
