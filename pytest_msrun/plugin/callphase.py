"""A rank's test call phase, as its peers need to see it.

* The control plane hears when this rank enters and leaves a test's call (once the rank has joined
  the group): a collective a peer entered in that call, which this rank will never join, then
  fails at once naming this rank and how its call ended (:mod:`pytest_msrun.control.calls`).
* hypothesis draws the same examples on every rank: a ``@given`` test's seed is one of the job
  (pytest-randomly's common seed, else the job's id) and the test, unless the test or the session
  chose one (``@seed``, ``derandomize``, ``--hypothesis-seed``). Left alone, each rank would draw
  its own examples and pair different ones in its collectives.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Generator
from typing import Any

import pytest

SEED_SECTION = "msrun hypothesis seed"


def outcome_text(result: Any) -> str:
    """How a call phase ended, for a peer's message: passed, skipped, xfailed, failed, raised X."""
    excinfo = getattr(result, "excinfo", None)
    if not excinfo:
        return "passed"
    kind = excinfo[0]
    if issubclass(kind, pytest.skip.Exception):
        return "skipped"
    if issubclass(kind, pytest.xfail.Exception):
        return "xfailed"
    if issubclass(kind, pytest.fail.Exception):
        return "failed"
    return f"raised {kind.__name__}"


def common_seed(nodeid: str, randomly_seed: int | None, job_id: str) -> int | None:
    """The seed every rank of this job gives hypothesis for test ``nodeid`` (None: no common basis)."""
    base = str(randomly_seed) if randomly_seed is not None else job_id
    if not base:
        return None
    return int(hashlib.sha256(f"{base}\0{nodeid}".encode()).hexdigest()[:16], 16)


class CallPhase:
    """Registered in every rank beside :class:`~pytest_msrun.plugin.rank.RankPlugin`."""

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


def _note(nodeid: str, entered: bool, outcome: str) -> None:
    cluster = sys.modules.get("pytest_msrun.control.cluster")
    if cluster is not None:  # nothing to tell before the rank joined the group
        cluster.note_call(nodeid, entered, outcome)
