"""The frameworks a session's fork server preloads: what its marked tests' modules import.

Read from what collection imported: the top-level packages of the modules (and of the classes and
functions) a marked test's module, its conftests and the project's modules they use hold in their
globals - ``import torch``, ``from numpy import ndarray``, ``import torch.distributed as dist`` -
that are installed code: not the standard library, not the project's own files (which each rank
imports under its own environment), not pytest's or this plugin's (the template holds those
already), not a pytest plugin's distribution (hypothesis: pytest rewrites its asserts as each rank
imports it). The template imports each package's modules that collection imported, in their order
(:func:`module_names`: ``torch.distributed.fsdp`` too, which ``import torch`` does not import). ``--msrun-preload``
changes the list: ``auto`` (default: those), ``none``, ``NAME`` adds one, ``-NAME`` takes one out.
Whether each may stay in a template is the template's decision (:mod:`pytest_msrun.engine.preloadrule`).
"""

from __future__ import annotations

import functools
import os
import sys
import types
from collections.abc import Iterable
from typing import Any

import pytest

from pytest_msrun.engine import preloadrule
from pytest_msrun.plugin.marker import MARKER

OWN = frozenset({"pytest", "_pytest", "pluggy", "py", "pytest_msrun", "__main__", "builtins"})


class PreloadSpecError(ValueError):
    pass


def parse_spec(spec: str) -> tuple[bool, set[str], set[str]]:
    """``--msrun-preload``'s value: (detect, names added, names taken out)."""
    auto, added, removed = True, set(), set()
    for item in (p.strip() for p in spec.split(",")):
        if item in ("", "auto"):
            continue
        name = item[1:] if item.startswith("-") else item
        if not name.isidentifier():
            raise PreloadSpecError(f"--msrun-preload: {item!r} is not auto, none, NAME or -NAME (a top-level module)")
        if item == "none":
            auto = False
        elif item.startswith("-"):
            removed.add(name)
        else:
            added.add(name)
    return auto, added, removed


def chosen(found: Iterable[str], spec: str) -> list[str]:
    """``found`` (detected, or cached from the last session) as ``spec`` changes it."""
    auto, added, removed = parse_spec(spec)
    return sorted(((set(found) if auto else set()) | added) - removed)


def distribution_tops(dist: Any) -> set[str]:
    """The top-level modules of the installed distribution ``dist``: its Python files' (as pytest
    marks a plugin distribution's for rewriting)."""
    tops = set()
    for file in getattr(dist, "files", None) or []:
        parts = str(file).split("/")
        if parts[-1].endswith(".py") and ".." not in parts and not parts[0].endswith((".dist-info", ".data")):
            tops.add(parts[0][:-3] if len(parts) == 1 else parts[0])
    return tops


@functools.lru_cache(maxsize=1)
def plugin_distributions_modules() -> frozenset[str]:
    """The top-level modules of the installed distributions that are pytest plugins (a ``pytest11``
    entry point): pytest imports them in each rank through its assertion rewriting (hypothesis's
    package, not only its plugin module), which a module imported before cannot have."""
    import importlib.metadata

    dists = importlib.metadata.distributions()
    return frozenset(
        top
        for dist in dists
        if any(ep.group == "pytest11" for ep in dist.entry_points)
        for top in distribution_tops(dist)
    )


def is_framework(top: str, rootdir: str, plugins: frozenset[str] = frozenset()) -> bool:
    """Whether the imported top-level module ``top`` is installed code a template may preload (not
    a module of a pytest plugin's distribution, ``plugins``)."""
    module = sys.modules.get(top)
    file = getattr(module, "__file__", None)
    if top in OWN or top in plugins or top.startswith("_") or not isinstance(file, str):
        return False  # a builtin or a namespace package, pytest's and ours, a plugin distribution's
    return preloadrule.installed_file(file, rootdir)


def _in_project(module: types.ModuleType, rootdir: str) -> bool:
    file = getattr(module, "__file__", None)
    return isinstance(file, str) and os.path.realpath(file).startswith(os.path.join(os.path.realpath(rootdir), ""))


def referenced(module: types.ModuleType) -> set[str]:
    """The modules of what ``module``'s globals hold (modules, classes, functions)."""
    out = set()
    for value in list(vars(module).values()):
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str) and name:
            out.add(name)
    return out


def module_names(tops: Iterable[str]) -> list[str]:
    """The modules of the packages ``tops`` imported in this process, in the order of their imports."""
    wanted = set(tops)
    return [name for name in list(sys.modules) if name.partition(".")[0] in wanted]


def file_frameworks(path: str, spec: str) -> tuple[list[str], list[str]]:
    """The frameworks a test file that uses the msrun marker imports, read from its text before the
    session imports it (:func:`preloadrule.script_imports`), as ``spec`` changes them: the
    packages and their modules. ([], []) for a file that does not mention the marker."""
    try:
        with open(path, encoding="utf-8") as fh:
            if f"mark.{MARKER}" not in fh.read():
                return [], []
    except (OSError, UnicodeDecodeError):
        return [], []
    if not parse_spec(spec)[0]:
        return [], []
    plugins = plugin_distributions_modules()
    modules = [m for m in preloadrule.script_imports(path) if m.partition(".")[0] not in OWN | plugins]
    tops = chosen({m.partition(".")[0] for m in modules}, spec)
    return tops, [m for m in modules if m.partition(".")[0] in tops]


def rank_modules(items: Iterable[pytest.Item], tops: Iterable[str]) -> list[str]:
    """The modules msrun's own rank-side code imports for ``items``, of the frameworks ``tops``: a
    dry run of torch code makes its process group with torch's fake one and counts collectives
    with its ``CommDebugMode`` (:data:`pytest_msrun.control.torchdry.RANK_MODULES`)."""
    if "torch" not in tops:
        return []
    for item in items:
        mark = item.get_closest_marker(MARKER)
        if mark is not None and mark.kwargs.get("sim_level") is not None:
            from pytest_msrun.control.torchdry import RANK_MODULES

            return list(RANK_MODULES)
    return []


def _modules(items: Iterable[pytest.Item]) -> list[types.ModuleType]:
    seen: dict[int, types.ModuleType] = {}
    for item in items:
        if item.get_closest_marker(MARKER) is None:
            continue
        module = getattr(item, "module", None)
        if isinstance(module, types.ModuleType):
            seen.setdefault(id(module), module)
    return list(seen.values())


def frameworks(items: Iterable[pytest.Item], config: pytest.Config, spec: str) -> list[str]:
    """The frameworks to preload for ``items`` (marked ones count), as ``spec`` says."""
    found: set[str] = set()
    if parse_spec(spec)[0]:
        modules = _modules(items)
        if modules:
            conftests = [p for p in config.pluginmanager.get_plugins() if isinstance(p, types.ModuleType)]
            rootdir = str(config.rootpath)
            todo = [*modules, *(c for c in conftests if c.__name__.rpartition(".")[2] == "conftest")]
            seen = {id(m) for m in todo}
            plugins = plugin_distributions_modules()
            while todo:  # the project's own modules they use: what those import, too
                for name in referenced(todo.pop()):
                    top, used = name.partition(".")[0], sys.modules.get(name)
                    if is_framework(top, rootdir, plugins):
                        found.add(top)
                    elif isinstance(used, types.ModuleType) and id(used) not in seen and _in_project(used, rootdir):
                        seen.add(id(used))
                        todo.append(used)
    return chosen(found, spec)
