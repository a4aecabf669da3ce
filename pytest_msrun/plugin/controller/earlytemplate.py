"""The session's template forked from the session's own process as it starts.

In ``pytest_load_initial_conftests`` a controller's process has imported pytest and every plugin
(through pytest's assertion rewriting, as a rank imports them) and nothing else of the session:
no conftest, no collection, no capture, no coverage. Forked then, it is a fork server's template
for the price of a fork - no interpreter's start, no imports - ready before the session's first
job needs it. Only a clean process is forked (:func:`unforkable_session`); elsewhere the session
starts its template as before (:class:`~pytest_msrun.plugin.controller.forkserver.ForkServer`).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

import pytest

from pytest_msrun.engine import preloadrule, template
from pytest_msrun.engine.processes import become_fresh_child, forked
from pytest_msrun.plugin import options
from pytest_msrun.plugin.controller.forkserver import (
    MARKED_BEFORE,
    ForkedProcess,
    ForkServer,
    last_session,
    preload_for,
    session_fork_server,
    template_env,
)
from pytest_msrun.plugin.controller.frameworks import distribution_tops, module_names

EARLY = pytest.StashKey[ForkServer]()  # the session's fork server, its template forked from this process
_sessions_seen = 0  # sessions of this process that reached their initial conftests


def _started_as_pytest() -> bool:
    """This interpreter was started as ``python -m pytest ARGS`` or a ``pytest`` script, with no
    interpreter option: its state is a fresh ``python``'s plus pytest's own start."""
    argv = list(getattr(sys, "orig_argv", []))
    if argv[1:3] == ["-m", "pytest"] or argv[1:2] == ["-mpytest"]:
        return True
    return len(argv) > 1 and os.path.basename(argv[1]) in ("pytest", "py.test")


def unforkable_session(config: pytest.Config) -> str:
    """Why this session's process, now (its plugins imported, no conftest yet), cannot be the
    template its ranks are forked from; "" when it can."""
    ns = config.known_args_namespace
    forking = getattr(ns, "msrun_fork_server", None) or config.getini("msrun_fork_server") or "on"
    if forking != "on":
        return "the fork server is off"
    runs_nothing = ("collectonly", "msrun_inprocess", "help", "version", "showfixtures", "show_fixtures_per_test")
    if any(getattr(ns, name, False) for name in runs_nothing):
        return "this session runs no job"
    if getattr(ns, "numprocesses", None) or getattr(ns, "tx", None) or hasattr(config, "workerinput"):
        return "pytest-xdist runs the tests in other processes"
    if _sessions_seen > 1 or not _started_as_pytest():
        return "this process ran other code before this session (in-process pytester, pytest.main)"
    if any(name == "conftest" or name.endswith(".conftest") for name in sys.modules):
        return "a conftest is imported already"
    monitoring = getattr(sys, "monitoring", None)
    traced = monitoring is not None and any(monitoring.get_tool(i) for i in range(6))
    if traced or sys.gettrace() is not None or sys.getprofile() is not None:
        return "this process is traced (coverage, a profiler, a debugger)"
    if not preloadrule.single_threaded():
        return "this process runs threads"
    return ""


def _marked_before(config: pytest.Config) -> tuple[bool | None, list[str], list[str]]:
    """What pytest's cache says of the project's last session: it had marked tests (None: no
    cache to ask), and the frameworks to preload with their modules (:func:`last_session`)."""
    if not config.pluginmanager.has_plugin("cacheprovider"):
        return None, [], []
    try:
        from _pytest.cacheprovider import resolve_from_str

        root = resolve_from_str(config.getini("cache_dir"), config.rootpath)
        spec = getattr(config.known_args_namespace, "msrun_preload", None) or config.getini("msrun_preload")
        with open(root / "v" / MARKED_BEFORE, encoding="utf-8") as fh:
            return last_session(json.load(fh), spec or "auto")
    except (OSError, ValueError, AttributeError, ImportError):
        return False, [], []


def project_modules(rootdir: str) -> list[str]:
    """The modules imported from the project's own files (under ``rootdir``, not an installed
    package's: a ``-p`` plugin of the project, what it imported): a started template never
    imports them, so a fork of this process forgets them and each rank imports them anew."""
    import site

    installed = [sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(), site.getusersitepackages()]
    kept = tuple(os.path.join(p, "") for p in {*installed, *map(os.path.realpath, installed)} if p)
    roots = tuple(os.path.join(p, "") for p in {rootdir, os.path.realpath(rootdir)})
    out = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or name.partition(".")[0] == "pytest_msrun":
            continue
        if file.startswith(roots) and not file.startswith(kept):
            out.append(name)
    return out


def distribution_modules(dist: Any) -> list[str]:
    """The modules of the installed distribution ``dist`` that this process imported: a plugin's
    import may change its distribution's other modules (hypothesis's plugin counts its start in
    ``_hypothesis_globals``), which a template that forgot only the plugin would keep."""
    return module_names(distribution_tops(dist))


def fork_session(config: pytest.Config) -> None:
    """Fork this clean process (:func:`unforkable_session`) as the session's template, its
    :class:`ForkServer` kept in ``config.stash[EARLY]``. Its imports of msrun's modules start at
    once where the last session had marked tests (or no cache says), else with the first job."""
    global _sessions_seen
    _sessions_seen += 1
    if unforkable_session(config):
        return
    skip = options.unused_rank_plugins(config)
    preload, plugins = preload_for(config, skip)
    marked, frameworks, modules = _marked_before(config)
    hello: dict[str, Any] = {"preload": preload, "plugins": plugins, "early": "lazy" if marked is False else "eager"}
    hello.update(frameworks=frameworks, modules=modules, n=0)
    # the modules of plugins the ranks do not load, and the project's own: gone from the template,
    # as from a started one (a rank imports them under its own environment)
    forget = project_modules(str(config.rootpath)) + [
        name
        for p, dist in config.pluginmanager.list_plugin_distinfo()
        if config.pluginmanager.get_name(p) in skip
        for name in [getattr(p, "__name__", ""), *distribution_modules(dist)]
    ]
    origin = template_env()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()

    def be_template() -> int:
        """In the fork: what a spawned template is at its start - its own session, signals,
        streams (/dev/null until the session sends its log) and environment, and no
        assertion-rewriting hook (each rank's pytest installs its own) - then the template's life."""
        ours.close()
        null = os.open(os.devnull, os.O_RDWR)
        env = {**origin, template.FD_ENV: str(theirs.fileno()), template.HELLO_ENV: json.dumps(hello)}
        become_fresh_child(env, stdin_fd=null, stdout_fd=null, stderr_fd=null, keep_fds=(theirs.fileno(),))
        sys.meta_path[:] = [hook for hook in sys.meta_path if type(hook).__name__ != "AssertionRewritingHook"]
        for name in forget:
            sys.modules.pop(name, None)
        sys.argv = [template.__file__]
        template.show_as([sys.executable, "-m", template.__name__], env)  # as the spawned one shows
        return template.serve(theirs, parent)

    try:
        pid = forked(be_template, os.fork)
    except OSError:
        ours.close()
        return
    finally:
        theirs.close()
    forks = session_fork_server(config)
    argv = [sys.executable, "-m", template.__name__]
    forks.adopt(ForkedProcess(tag=None, pid=pid, started=time.time(), args=argv), ours, origin)
    forks.frameworks, forks.modules = frameworks, modules
    config.stash[EARLY] = forks
    config.add_cleanup(forks.close)  # (where the session ended first, or had no controller)
