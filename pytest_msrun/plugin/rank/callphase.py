"""A rank's test call phase, as its peers need to see it.

* The control plane hears when this rank enters and leaves a test's call (once the rank has joined
  the group): a collective a peer entered in that call, which this rank will never join, then
  fails at once naming this rank and how its call ended (:mod:`pytest_msrun.control.calls`).
* hypothesis draws the same examples on every rank: a ``@given`` test's seed is one of the job
  (pytest-randomly's common seed, else the job's id) and the test, unless the test or the session
  chose one (``@seed``, ``derandomize``, ``--hypothesis-seed``). Left alone, each rank would draw
  its own examples and pair different ones in its collectives. Besides its seed, hypothesis draws
  constants of the "local" modules imported so far (this package is one where it is installed
  editable): which of this package's modules a rank imported depends on the rank, so they are
  kept out of that pool (:func:`same_constants_on_every_rank`).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Generator
from typing import Any

import pytest

import pytest_msrun

SEED_SECTION = "msrun hypothesis seed"


def outcome_text(result: Any) -> str:
    """How a call phase ended, for a peer's message: passed, skipped, xfailed, failed, raised X."""
    excinfo = getattr(result, "excinfo", None)
    if not excinfo:
        return "passed"
    words = {pytest.skip.Exception: "skipped", pytest.xfail.Exception: "xfailed", pytest.fail.Exception: "failed"}
    return next((word for kind, word in words.items() if issubclass(excinfo[0], kind)), f"raised {excinfo[0].__name__}")


def common_seed(nodeid: str, randomly_seed: int | None, job_id: str) -> int | None:
    """The seed every rank of this job gives hypothesis for test ``nodeid`` (None: no common basis)."""
    base = str(randomly_seed) if randomly_seed is not None else job_id
    if not base:
        return None
    return int(hashlib.sha256(f"{base}\0{nodeid}".encode()).hexdigest()[:16], 16)


class CallPhase:
    """Registered in every rank beside :class:`~pytest_msrun.plugin.rank.rank.RankPlugin`."""

    def __init__(self, randomly_seed: int | None) -> None:
        self.randomly_seed = randomly_seed

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, None]:
        seeded = self._seed_hypothesis(item)
        _note(item.nodeid, True, "")
        result = None
        try:
            result = yield
        finally:
            _note(item.nodeid, False, outcome_text(result))
            if seeded:
                setattr(sys.modules["hypothesis.core"], "global_force_seed", None)  # noqa: B010

    def _seed_hypothesis(self, item: pytest.Item) -> bool:
        """Give a ``@given`` test the job's seed for it; whether it was given."""
        core = sys.modules.get("hypothesis.core")
        test = getattr(item, "obj", None)
        if core is None or not getattr(test, "is_hypothesis_test", False):
            return False
        same_constants_on_every_rank()
        if getattr(core, "global_force_seed", 0) is not None:  # --hypothesis-seed: every rank has it
            return False
        settings = getattr(test, "_hypothesis_internal_use_settings", None)
        if getattr(test, "_hypothesis_internal_use_seed", None) is not None or getattr(settings, "derandomize", False):
            return False  # @seed, derandomize: the same on every rank already
        seed = common_seed(item.nodeid, self.randomly_seed, os.environ.get("MSRUN_JOB_ID", ""))
        if seed is None:
            return False
        setattr(core, "global_force_seed", seed)  # noqa: B010 - what --hypothesis-seed sets
        item.add_report_section(
            "call", SEED_SECTION, f"every rank drew with seed {seed}; @hypothesis.seed({seed}) reproduces it\n"
        )
        return True


def same_constants_on_every_rank() -> None:
    """Keep this package's modules out of hypothesis's pool of local constants (once per process;
    the pool is gathered again without them). A hypothesis without that pool is left alone."""
    providers: Any = sys.modules.get("hypothesis.internal.conjecture.providers")
    is_local = getattr(providers, "is_local_module_file", None)
    if providers is None or is_local is None or getattr(is_local, "msrun_own", False):
        return
    ours = os.path.dirname(os.path.abspath(pytest_msrun.__file__)) + os.sep

    def is_local_module_file(path: str) -> bool:
        return not os.path.abspath(path).startswith(ours) and bool(is_local(path))

    is_local_module_file.msrun_own = True  # type: ignore[attr-defined]
    try:
        fresh = type(providers._local_constants)()
        providers.is_local_module_file = is_local_module_file
        providers._local_constants = fresh
        providers._seen_modules.clear()
        providers._sys_modules_len = None
        providers.CONSTANTS_CACHE.cache.clear()
    except (AttributeError, TypeError):  # another hypothesis: its pool as it is
        providers.is_local_module_file = is_local


def _note(nodeid: str, entered: bool, outcome: str) -> None:
    cluster = sys.modules.get("pytest_msrun.control.cluster")
    if cluster is not None:  # nothing to tell before the rank joined the group
        cluster.note_call(nodeid, entered, outcome)
