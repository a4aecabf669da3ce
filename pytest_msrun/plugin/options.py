"""The controller's pytest options, carried into the ranks of a marked test's job.

A rank is a fresh ``pytest`` process that runs one test. What it needs of the controller's
command line reaches it in two ways, as pytest-xdist carries a session's options to its workers:

* **on its command line**, what acts before any plugin is configured: plugins (``-p``), the
  inifile and rootdir, ``-o`` overrides, ``-W`` filters, capture, import mode, conftest loading;
* **as the option namespace** (``config.option``), shipped as JSON in a file the rank's
  environment names and applied before any other plugin's ``pytest_configure`` - every option of
  pytest, of plugins and of ``conftest.py`` files (``--runslow``-style flags) alike.

Never shipped: options that belong to the controller's session (selection, reports and files it
writes, debugging, distribution, caching), and values JSON cannot carry.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from importlib.metadata import entry_points
from typing import Any

import pytest

from pytest_msrun.fileio import write_whole

OPTIONS_ENV = "MSRUN_PYTEST_OPTIONS"

# Options of the controller's session, by dest. A rank runs one given test, writes its results to
# the controller, and never reports, caches, debugs or distributes on its own.
SESSION_ONLY = frozenset(
    {
        # what runs: the rank is given its test
        "file_or_dir", "keyword", "markexpr", "deselect", "ignore", "ignore_glob", "continue_on_collection_errors",
        "collectonly", "exitfirst", "maxfail", "lf", "last_failed_no_failures", "failedfirst", "newfirst",
        "cacheclear", "cacheshow", "stepwise", "stepwise_skip", "pyargs",
        # files and reports of the session
        "basetemp", "xmlpath", "junitprefix", "resultlog", "report_log", "htmlpath", "self_contained_html",
        "pastebin", "durations", "durations_min", "log_file", "log_file_level", "log_file_format",
        "log_file_date_format", "debug", "traceconfig", "reportchars", "color", "code_highlight",
        "quiet", "disable_warnings", "no_header", "no_summary", "fold_skipped",
        # informational runs
        "help", "version", "showfixtures", "show_fixtures_per_test", "markers", "setuponly", "setupplan",
        "setupshow",
        # debugging: the controller's (a rank has no terminal: its pdb reaches the controller, plugin/rank/debugrank.py)
        "usepdb", "usepdb_cls", "trace",
        # on the rank's command line already (they act before configuration)
        "plugins", "inifilename", "rootdir", "override_ini", "pythonwarnings", "capture", "importmode",
        "confcutdir", "noconftest",
        # reports of other plugins: the controller's copy writes them, from the merged results
        "json_report", "json_report_file", "ctrf", "allure_report_dir", "clean_alluredir",
        # pytest-benchmark: the controller shows, saves and compares every rank's measurements
        "benchmark_save", "benchmark_autosave", "benchmark_save_data", "benchmark_json", "benchmark_compare",
        "benchmark_compare_fail", "benchmark_histogram", "benchmark_cprofile_dump",
        # pytest-xdist: ranks never distribute
        "numprocesses", "maxprocesses", "dist", "tx", "rsyncdir", "rsyncignore", "looponfail", "distload",
        "loadgroup", "max_worker_restart", "maxschedchunk", "testrunuid",
    }
)  # fmt: skip
SESSION_PREFIXES = ("msrun_", "cov")  # this plugin's own; pytest-cov measures the session, not each rank


def shippable(options: dict[str, Any]) -> dict[str, Any]:
    """The options a rank takes over: not the session's own, and JSON-representable."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name in SESSION_ONLY or name.startswith(SESSION_PREFIXES) or name.startswith("_"):
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[name] = value
    return out


JUNITXML = pytest.StashKey[bool]()  # in a rank: whether the controller writes a junitxml file
JUNITXML_KEY = "msrun_junitxml"  # (not an option: never applied as one)
SETUPSHOW = pytest.StashKey[bool]()  # in a rank: whether the controller shows fixtures (--setup-show)
SETUPSHOW_KEY = "msrun_setupshow"


def ship(config: pytest.Config, path: str) -> dict[str, str]:
    """Write the controller's options to ``path``; return the environment a rank needs to read them."""
    data = shippable(vars(config.option))
    data[JUNITXML_KEY] = bool(getattr(config.option, "xmlpath", None))
    data[SETUPSHOW_KEY] = bool(getattr(config.option, "setupshow", False))
    write_whole(path, json.dumps(data))
    return {OPTIONS_ENV: path}


def apply(config: pytest.Config) -> None:
    """In a rank: take over the shipped options this rank's pytest knows.
    Options named but not to be read (a reproduce line whose job directory was rotated away) are
    a usage error: the rank would run without them, as another test than the one reported."""
    path = os.environ.get(OPTIONS_ENV)
    if not path:
        return
    try:
        with open(path, encoding="utf-8") as fh:
            shipped = json.load(fh)
        if not isinstance(shipped, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise pytest.UsageError(
            f"{OPTIONS_ENV}={path}: the controller's pytest options cannot be read ({why}); its job directory "
            f"may have been removed (pytest keeps the last 3 runs' basetemp): run the test with pytest again for "
            f"a new reproduce line, or leave {OPTIONS_ENV} out to run without the session's options"
        ) from None
    config.stash[JUNITXML] = shipped.get(JUNITXML_KEY) is True
    config.stash[SETUPSHOW] = shipped.get(SETUPSHOW_KEY) is True
    known = vars(config.option)
    for name, value in shippable(shipped).items():
        if name in known:
            if isinstance(known[name], tuple) and isinstance(value, list):
                value = tuple(value)
            setattr(config.option, name, value)


# The session's selection plugins: the controller keeps --lf/--nf and testmon's state, never a rank.
RANK_BLOCKED = ("no:lfplugin", "no:nfplugin", "no:stepwiseplugin", "no:xdist", "no:pytest-testmon", "no:testmon")


@functools.cache
def _entry_modules() -> dict[str, str]:
    found: Any = entry_points()  # Python 3.9: a dict of groups; later, selectable by group
    group = found.select(group="pytest11") if hasattr(found, "select") else found.get("pytest11", ())
    return {ep.name: ep.value.split(":")[0] for ep in group}


def plugin_loaded(config: pytest.Config, name: str) -> bool:
    """Whether the installed plugin ``name`` (its entry point's name, or its module's) is active,
    however it was loaded: ``-p MODULE`` (as where autoloading is off) registers it under its
    module's name, an entry point under its own (which a builtin plugin may also have)."""
    manager = config.pluginmanager
    module = _entry_modules().get(name, name)
    return (
        manager.has_plugin(name)
        or manager.has_plugin(module)
        or any(getattr(plugin, "__name__", None) == module for plugin in manager.get_plugins())
    )


def unused_rank_plugins(config: pytest.Config) -> list[str]:
    """Plugins the ranks need not load: hypothesis's, when no collected test module imported
    hypothesis (its plugin is installed with it and costs every rank ~0.3 s to start)."""
    if "hypothesis" in sys.modules or not plugin_loaded(config, "hypothesispytest"):
        return []
    return ["hypothesispytest"]


def command_line(config: pytest.Config) -> list[str]:
    """The rank's command-line options: what acts before plugins are configured. Ranks ignore
    ``addopts`` (its effect arrives with the option namespace) and never distribute; they share the
    controller's cache directory (the ``cache`` fixture and ``config.cache`` work in marked tests),
    but only the controller records last-failed and new test ids."""
    opt = config.option
    args = ["-o", "addopts=", f"--rootdir={config.rootpath}"]
    for blocked in RANK_BLOCKED:
        args += ["-p", blocked]
    cache = getattr(config, "cache", None)
    if cache is not None:
        args += ["-o", f"cache_dir={cache._cachedir}"]
    if config.inipath:
        args += ["-c", str(config.inipath)]
    for name in getattr(opt, "plugins", None) or []:
        if f"no:{name.split('.')[0]}" not in RANK_BLOCKED:
            args += ["-p", name]
    for warning in getattr(opt, "pythonwarnings", None) or []:
        args += ["-W", warning]
    for override in getattr(opt, "override_ini", None) or []:
        if not override.startswith(("addopts=", "cache_dir=")):
            args += ["-o", override]
    if getattr(opt, "capture", None):  # none under -p no:capture (a rank is given the same -p)
        args.append(f"--capture={opt.capture}")
    if getattr(opt, "importmode", None):
        args.append(f"--import-mode={opt.importmode}")
    if getattr(opt, "confcutdir", None):
        args.append(f"--confcutdir={opt.confcutdir}")
    if getattr(opt, "noconftest", False):
        args.append("--noconftest")
    return args
