"""pytest-cov and marked tests: every rank measures, the controller's report counts it.

With ``--cov`` active in the controller, each job's ranks get :data:`COV_ENV` (the controller's
data file, sources, rcfile, branch). A rank starts coverage as early as pytest lets it (before
its conftests load), writes a parallel data file beside the controller's (``.coverage.<host>.<pid>.<n>``)
when its session ends - or when msrun tears its world down (SIGTERM: coverage's ``sigterm``
setting saves first) - and pytest-cov's own combine at the end of the session takes them in.
No user configuration: no ``.pth``, no ``patch = subprocess``.
"""

from __future__ import annotations

import json
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    import pytest

COV_ENV = "MSRUN_COV"
_running: list[Any] = []


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
        try:
            cov.set_option("run:sigterm", True)  # a world torn down by msrun saves its data first
        except Exception:  # an older coverage without the setting
            pass
        cov.start()
    except Exception:  # coverage missing or broken here: the test runs unmeasured, not broken
        return
    _running.append(cov)
    import atexit

    atexit.register(stop)


def flush() -> None:
    """Save what was measured so far (after each test: a rank that crashes later keeps it)."""
    for cov in _running:
        try:
            cov.save()
        except Exception:
            pass


def stop() -> None:
    """Save what this rank measured (its session ended)."""
    while _running:
        cov = _running.pop()
        try:
            cov.stop()
            cov.save()
        except Exception:
            pass
