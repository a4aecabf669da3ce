"""pytest-cov and marked tests: every rank measures, the controller's report counts it.

With ``--cov`` active in the controller, each job's ranks get :data:`COV_ENV` (the controller's
data file, sources, rcfile, branch). A rank starts coverage as early as pytest lets it (before
its conftests load), writes a parallel data file beside the controller's (``.coverage.<host>.<pid>.<n>``)
when its session ends - or when msrun tears its world down (SIGTERM: coverage's ``sigterm``
setting saves first) - and pytest-cov's own combine at the end of the session takes them in.
No user configuration: no ``.pth``, no ``patch = subprocess``.
"""

from __future__ import annotations

import contextlib
import json
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    import pytest

COV_ENV = "MSRUN_COV"
_running: list[Any] = []
_saving: list[bool] = []  # non-empty while this rank saves its data
_deferred: list[Any] = []  # coverage's SIGTERM handler, when a SIGTERM came during a save


def rank_env(config: pytest.Config) -> dict[str, str]:
    """The controller: what its ranks need to measure into its coverage report ({} without --cov)."""
    plugin = config.pluginmanager.get_plugin("_cov")
    controller = getattr(plugin, "cov_controller", None)
    cov = getattr(controller, "cov", None)
    if cov is None or hasattr(config, "workerinput"):
        return {}
    options = getattr(plugin, "options", None)
    rcfile = getattr(options, "cov_config", None) or ".coveragerc"
    rcfile = os.path.abspath(rcfile) if os.path.exists(rcfile) else ""
    spec = {
        "data_file": os.path.abspath(cov.config.data_file),
        "source": [s for s in (getattr(options, "cov_source", None) or []) if s],
        "rcfile": rcfile,
        "branch": bool(getattr(options, "cov_branch", None)),
    }
    return {COV_ENV: json.dumps(spec)}


def start_in_rank(env: dict[str, str]) -> None:
    """A rank: measure from now on (once), into a parallel data file beside the controller's."""
    text = env.get(COV_ENV, "")
    if not text or _running:
        return
    try:
        import coverage

        spec = json.loads(text)
        cov = coverage.Coverage(
            data_file=spec["data_file"],
            data_suffix=True,
            source=spec.get("source") or None,
            branch=spec.get("branch") or None,
            config_file=spec.get("rcfile") or True,
        )
        with contextlib.suppress(Exception):  # an older coverage without the setting
            cov.set_option("run:sigterm", True)  # a world torn down by msrun saves its data first
        cov.start()
    except Exception:  # coverage missing or broken here: the test runs unmeasured, not broken
        return
    _running.append(cov)
    _hold_sigterm_while_saving()
    import atexit

    atexit.register(stop)


def _hold_sigterm_while_saving() -> None:
    """coverage saves its data on SIGTERM; one arriving while this rank saves after a test would
    run that save inside ours (the data file half-made: both fail, a corrupt file is left). It
    waits for our save to end instead."""
    import signal

    handler = signal.getsignal(signal.SIGTERM)
    if not callable(handler):
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        if _saving:
            _deferred.append(lambda: handler(signum, frame))
            return
        handler(signum, frame)

    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGTERM, on_sigterm)


def _saved(action: Any) -> None:
    _saving.append(True)
    try:
        with contextlib.suppress(Exception):
            action()
    finally:
        _saving.pop()
    while _deferred and not _saving:
        _deferred.pop(0)()


def flush() -> None:
    """Save what was measured so far (after each test: a rank that crashes later keeps it)."""
    for cov in _running:
        _saved(cov.save)


def stop() -> None:
    """Save what this rank measured (its session ended)."""
    while _running:
        cov = _running.pop()
        _saved(cov.stop)
        _saved(cov.save)
