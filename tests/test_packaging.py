"""What installing this project puts on PATH (never a script that another distribution owns), and
the versions it declares it supports (the ones CI tests)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import distribution
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_console_scripts_never_clash_with_mindspore():
    scripts = {ep.name for ep in distribution("pytest-msrun").entry_points if ep.group == "console_scripts"}
    assert "msrun" not in scripts, "msrun is MindSpore's; pip would overwrite it, and uninstalling ours delete it"
    assert {"msrun-topology", "msrun-gen-bind-json", "msrun-numa-wrap"} <= scripts
    assert "pmsrun" not in scripts, "pmsrun is scripts/pmsrun, a plain script (see the test below)"
    assert {ep.name for ep in distribution("pytest-msrun").entry_points if ep.group == "pytest11"} == {"msrun"}


def test_the_wheel_carries_every_module_and_the_rank_hook(tmp_path):
    """Built from a copy (building writes build/ and egg-info beside the sources)."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "pytest_msrun", src / "pytest_msrun", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "scripts", src / "scripts")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
        + [str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("pytest_msrun-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {str(p.relative_to(REPO)) for p in (REPO / "pytest_msrun").rglob("*.py") if "__pycache__" not in p.parts}
    assert sources - names == set(), "modules missing from the wheel"
    assert "pytest_msrun/engine/rankhook/sitecustomize.py" in names
    (script,) = [n for n in names if n.endswith(".data/scripts/pmsrun")]
    assert zipfile.ZipFile(wheel).read(script).startswith(b"#!python\n")  # pip writes its interpreter there


def test_pmsrun_is_a_plain_script_that_imports_nothing_before_msrun():
    """``pmsrun`` (installed beside this interpreter from scripts/pmsrun) imports msrun's entry and
    nothing else first: a generated console script's ``import re`` (enum, functools, collections)
    would come before it and delay msrun's start into its job's cgroup."""
    script = shutil.which("pmsrun", path=str(Path(sys.executable).parent))
    assert script is not None, "pmsrun is not installed"
    for path in (Path(script), REPO / "scripts" / "pmsrun"):
        tree = ast.parse(path.read_text())
        imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
        assert [ast.unparse(node) for node in imports] == ["from pytest_msrun.entry import run"], path
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "usage: pmsrun" in proc.stdout, proc.stdout + proc.stderr


def test_the_declared_lower_bounds_are_the_ones_ci_tests():
    """Each lower bound pyproject.toml declares for what the package imports (and for pytest-xdist
    and hypothesis, whose behaviour the plugin follows) is pinned in .ci/oldest.txt, where .ci/run
    runs the plugin-facing tests at it - and nothing else is pinned there."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    from packaging.version import Version

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    declared = [*project["dependencies"], *extras["xdist"], *(r for r in extras["test"] if r.startswith("hypothesis"))]
    floors = {}
    for requirement in declared:
        name, sep, version = requirement.partition(">=")
        assert sep and "," not in version, f"{requirement}: a lower bound (>=) and nothing else"
        floors[name.strip().lower()] = version.strip()
    pins = {}
    for line in (REPO / ".ci" / "oldest.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip().lower()] = version.strip()
    assert {name: Version(v) for name, v in pins.items()} == {name: Version(v) for name, v in floors.items()}
    listed = (REPO / ".ci" / "oldest-tests.txt").read_text().split()
    assert listed and all((REPO / path).is_file() for path in listed), listed
