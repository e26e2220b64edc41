"""The wheel as a user installs it: one import root, and the main job runs from it.

Built from a clean clone of this checkout's HEAD (never inside the working tree, so no build
output lands there), installed into a fresh virtual environment, run from a folder outside
the tree: what passes here does not depend on the checkout being on ``sys.path``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.xdist_group("wheel")
"""One worker runs the module under pytest-xdist (--dist loadgroup): the wheel is built once."""


def _run(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout: the wheel is built from a clean clone of HEAD")
    work = tmp_path_factory.mktemp("wheel")
    _run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(work / "src")], cwd=work)
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir",
          str(work / "dist"), str(work / "src")], cwd=work)
    (built,) = (work / "dist").glob("iosched-*.whl")
    return built


def test_the_wheel_has_one_top_level_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert whl.read(top_level).decode().split() == ["iosched"]
        entry_points = whl.read(top_level.replace("top_level.txt", "entry_points.txt")).decode()
    assert "iosched = iosched.tools.cli:main" in entry_points
    roots = {name.split("/")[0] for name in names}
    assert {r for r in roots if not r.endswith(".dist-info")} == {"iosched"}
    for package in ("backends", "residency", "tools"):
        assert f"iosched/{package}/__init__.py" in names  # mapped under the root, each once
        assert sum(n.endswith(f"/{package}/__init__.py") for n in names) == 1
    assert "iosched/tools/data/qwen.route.csv.gz" in names  # the bundled traces travel
    tracked = subprocess.run(["git", "ls-files", "*__init__.py"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    packages = {f"iosched/{p}" if not p.startswith("iosched/") and not p.startswith("tests/") else p
                for p in tracked if not p.startswith("tests/")}
    missing = sorted(p for p in packages if p not in names)
    assert not missing, f"packages of the tree missing from the wheel (pyproject's packages list): {missing}"


def test_the_installed_wheel_runs_the_demo(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # A bare environment (no pip of its own to bootstrap): this interpreter's pip installs
    # into it (`pip --python`), as it would with the environment's own.
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python, iosched = venv / "bin" / "python", venv / "bin" / "iosched"
    # Its dependencies come from the package registry (pip's cache, after `make test`'s install).
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", str(wheel)], cwd=tmp_path)
    where = _run([str(python), "-c", "import iosched, uvloop; print(iosched.__file__)"], cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(venv)  # the installed copy, not the checkout
    for bare in ("backends", "residency", "tools"):  # nothing but iosched was installed
        probe = subprocess.run([str(python), "-c", f"import {bare}"], cwd=tmp_path,
                               capture_output=True, text=True, timeout=60)
        assert probe.returncode != 0, f"the wheel installed a top-level {bare!r}"
    # The main job whole (the bundled trace, a checkpoint built on first use, every arm), on
    # experts 64 times smaller than Qwen3's in each dimension and two decode tokens: what runs
    # is the same code at any size. The checkpoint goes to the session's cache folder
    # (IOSCHED_CACHE_DIR, conftest), not the user's.
    demo = _run([str(iosched), "demo", "--json", "--tokens", "2", "--scale", "64"], cwd=tmp_path)
    summary = json.loads(demo.stdout)
    assert summary["tokens"] > 0 and summary["loop"] == "uvloop"  # uvloop comes by default
    assert [arm["arm"] for arm in summary["arms"]] == ["default", "lru", "handwritten"]
