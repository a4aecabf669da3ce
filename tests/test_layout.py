"""The layout keeps its rooms: imports flow one way, the architecture page (docs/architecture.md)
names every module, and the docstrings stand on their own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "pytest_msrun"
BASE = {
    "record",
    "targets",
    "cpulist",
    "netaddr",
    "pathsearch",
    "proc",
    "perfetto",
    "boundedjson",
    "fsinfo",
    "fileio",
    "waiting",
    "sizes",
    "",
}
# Which layers each layer may import (lazy imports inside functions included).
ALLOWED = {
    "base": {"base"},
    "binding": {"base", "binding"},
    "control": {"base", "control"},
    "engine": {"base", "binding", "control", "engine"},
    "plugin": {"base", "binding", "control", "engine", "plugin", "public"},
    "entry": {"base", "engine", "entry"},
    "public": {"base", "control"},
}


def layer(module: str) -> str:
    parts = module.split(".")[1:]  # below pytest_msrun
    head = parts[0] if parts else ""
    if head in BASE:
        return "base"
    if head in ("binding", "control", "engine", "plugin"):
        return head
    if head == "pytest_plugin":
        return "plugin"
    if head in ("entry", "__main__"):
        return "entry"
    if head in ("cluster", "dryrun"):  # the in-rank APIs' public names
        return "public"
    raise AssertionError(f"{module}: no layer")


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "rankhook" in path.parts:  # runs inside ranks, imports nothing of the package
            continue
        rel = path.relative_to(REPO).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        out.append((name, path))
    return out


def imported(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pytest_msrun"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pytest_msrun"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if node.module in ("pytest_msrun",))
    return {m for m in found if m != "pytest_msrun"}


@pytest.mark.parametrize("name,path", modules(), ids=[m for m, _ in modules()])
def test_imports_flow_one_way(name, path):
    mine = layer(name)
    wrong = sorted(m for m in imported(path) if layer(m) not in ALLOWED[mine])
    assert not wrong, f"{name} ({mine}) imports {wrong}"


# Inside the plugin, where code runs: which part each part may import (the shared modules at
# plugin/'s top are what both sides of the process boundary use).
PLUGIN_PARTS = {
    "rule": {"rule"},
    "shared": {"shared", "rule"},
    "reports": {"reports", "rule", "shared"},
    "rank": {"rank", "rule", "shared"},
    "controller": {"controller", "reports", "rule", "shared"},
}


def plugin_part(module: str) -> str | None:
    """The part of the plugin ``module`` belongs to (None: outside the plugin, or its entry point)."""
    parts = module.split(".")
    if parts[:2] != ["pytest_msrun", "plugin"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in PLUGIN_PARTS else "shared"


@pytest.mark.parametrize("name,path", [m for m in modules() if plugin_part(m[0])], ids=lambda v: str(v))
def test_plugin_code_shows_where_it_runs(name, path):
    """The plugin is split where its code runs: the controller's side never imports the rank's
    (nor the rank's the controller's or the reports), reports import no side, and the rule - the
    record and the verdict - imports nothing else of the plugin, and no pytest (msrun reads it)."""
    mine = plugin_part(name)
    assert mine is not None
    found = _all_imports(path)
    wrong = sorted(
        m for m in found if (plugin_part(m) or "") not in PLUGIN_PARTS[mine] and m.startswith("pytest_msrun.plugin")
    )
    if mine == "rule":
        wrong += sorted(m for m in found if m.split(".")[0] in ("pytest", "_pytest"))
    assert not wrong, f"{name} ({mine}) imports {wrong}"


def _all_imports(path: Path) -> set[str]:
    """Every module ``path`` imports (lazy imports too); ``from package import module`` as the module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] != "pytest_msrun" or _is_module(m)}


def _is_module(name: str) -> bool:
    """Whether ``name`` is a module of the package (not a package's ``__init__``, nor a name in a module)."""
    return (REPO / Path(*name.split("."))).with_suffix(".py").is_file()


def test_the_architecture_layout_names_every_module():
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Layout", 1)[1]
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(PACKAGE)
        if path.name not in section and str(rel) not in section:  # by file name, in its directory's block
            missing.append(str(rel))
    assert not missing, f"docs/architecture.md's Layout does not name: {missing}"


def test_docstrings_and_comments_stand_alone():
    pattern = re.compile(r"(spec|design)\s*§|§\s*\d|msrun-spec\.md|design\.md")
    hits = [
        f"{path.relative_to(REPO)}:{i}"
        for path in [*PACKAGE.rglob("*.py"), *(REPO / "tests").rglob("*.py"), *(REPO / "bench").rglob("*.py")]
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and path.name != "test_layout.py"
    ]
    assert not hits, f"references to documents outside the repository: {hits}"


def test_verdicts_are_values():
    """A record and its verdict are values: judged once and then only read - a later fact is a new
    one (``dataclasses.replace``), never a write into one the reporters may already hold."""
    import dataclasses

    from pytest_msrun.plugin.controller.world import Called, TornDown, WarmTest
    from pytest_msrun.plugin.rule.outcomes import PhaseVerdict, Refusal, TestVerdict
    from pytest_msrun.plugin.rule.testrecord import JobRun, TestRecord

    for cls in (JobRun, TestRecord, TestVerdict, PhaseVerdict, Refusal, WarmTest, Called, TornDown):
        assert cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]
        instance = cls(
            *(
                None
                for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            )
        )
        with pytest.raises(dataclasses.FrozenInstanceError):
            instance.outcome = "passed"  # type: ignore[misc]


def test_every_verdict_is_a_records_judgement():
    """One route to a verdict in every mode - a job of its own, a world, a refusal, a suite: the
    rule is called by a record (``testrecord.TestRecord``) and by nothing else in the package."""
    callers = []
    for name, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and (
                getattr(node.func, "id", "") == "judge"
                or (getattr(node.func, "attr", "") == "judge" and getattr(node.func.value, "id", "") == "verdict")
            ):
                callers.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("Judge", "RankFacts"):
                callers.append(f"{name}:{node.lineno}")
    rule = [
        c
        for c in callers
        if c.startswith(("pytest_msrun.plugin.rule.testrecord:", "pytest_msrun.plugin.rule.verdict:"))
    ]
    assert callers == rule and any(c.startswith("pytest_msrun.plugin.rule.testrecord:") for c in rule), callers


def test_the_controller_never_asks_which_kind_of_attempt_it_holds():
    """The runner hands out every attempt (a world's, a job of its own, a refusal); the controller
    and its reporter use what an attempt gives - no kind of attempt is named or tested there."""
    kinds = re.compile(
        r"\b(WarmAttempt|FreshAttempt|RefusedAttempt)\b|\.warm\b|\.mode\s*[=!]=|isinstance\([^)]*Attempt"
    )
    for name in ("controller", "reporting"):
        path = PACKAGE / "plugin" / "controller" / f"{name}.py"
        hits = [f"{name}.py:{i}" for i, line in enumerate(path.read_text().splitlines(), 1) if kinds.search(line)]
        assert hits == [], hits


def test_no_outcome_is_written_after_construction():
    """An outcome is decided where its report or verdict is built: no module assigns ``.outcome``
    (or pytest-rerunfailures' ``.rerun``) to an object that already exists - a rerun attempt's
    reports are built as "rerun", not turned into it."""
    written = []
    for name, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            while any(isinstance(t, (ast.Tuple, ast.List)) for t in targets):  # a, b.outcome = ...
                targets = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in ("outcome", "rerun"):
                    written.append(f"{name}:{node.lineno}: .{target.attr} = ...")
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" and len(node.args) > 1:
                key = node.args[1]
                if isinstance(key, ast.Constant) and key.value in ("outcome", "rerun"):
                    written.append(f"{name}:{node.lineno}: setattr(..., {key.value!r})")
    assert written == [], written


def test_functions_run_by_name_are_named_in_one_registry():
    """Every ``module:function`` string of the package is a value of ``targets.TARGETS`` (no
    module builds or resolves its own), and each resolves to a function."""
    from pytest_msrun import targets

    spelled = []
    for name, path in modules():
        if name == "pytest_msrun.targets":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""
            if re.fullmatch(r"pytest_msrun(\.\w+)+:\w+", text):
                spelled.append(f"{name}:{node.lineno}: {text}")
            if isinstance(node, ast.JoinedStr) and any(
                isinstance(v, ast.Constant) and re.match(r":\w+$", str(v.value)) for v in node.values
            ):
                spelled.append(f"{name}:{node.lineno}: an f-string 'module:function'")
    assert spelled == []
    for key in targets.TARGETS:
        assert callable(targets.resolve(key)), key
    with pytest.raises(targets.UnknownTarget):
        targets.resolve("os:system")


MAX_CLASS_LINES = 400  # a class past it holds two roles: split it into parts it owns


def test_no_class_is_bigger_than_one_role_counting_what_it_inherits():
    """A class's size is its own lines plus those of every package class it inherits: a part
    moved into a mixin or a base class still counts where it is used (parts a class owns as
    objects do not)."""
    import importlib
    import inspect

    too_big = []
    for name, _path in modules():
        if name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not (inspect.isclass(cls) and cls.__module__ == name):
                continue
            ours = [c for c in cls.__mro__ if c.__module__.startswith("pytest_msrun")]
            size = sum(len(inspect.getsourcelines(c)[0]) for c in ours)
            if size > MAX_CLASS_LINES:
                too_big.append(f"{name}.{cls.__name__}: {size} lines ({', '.join(c.__name__ for c in ours)})")
    assert too_big == []
