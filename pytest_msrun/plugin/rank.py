"""pytest inside an msrun job (every rank runs it): records, inline marked tests, per-rank outputs.

Launched by the controller, a rank runs one node id and streams its reports to the directory
in ``MSRUN_PYTEST_REPORT_DIR``. Launched by a user (``msrun pytest tests/``), every rank runs
the suite; a marked test runs when the job has its ``worker_num`` ranks and is skipped with the
reason otherwise, and the records go to the job's log directory, for msrun's summary table.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from typing import IO

import pytest

from pytest_msrun.plugin.env import env_int
from pytest_msrun.plugin.marker import MARKER, MarkerError, spec_for
from pytest_msrun.plugin.records import BASETEMP_ENV, REPORT_DIR_ENV, RecordWriter, records_path, stacks_path


class RankPlugin:
    """Registered in every rank's pytest session."""

    def __init__(self, config: pytest.Config) -> None:
        env = os.environ
        self.config = config
        self.rank = env_int("RANK_ID", env_int("RANK", 0))
        self.world = env_int("RANK_SIZE", env_int("WORLD_SIZE", 1))
        self.controlled = bool(env.get(REPORT_DIR_ENV))
        directory = env.get(REPORT_DIR_ENV) or os.path.abspath(env.get("MSRUN_LOG_DIR") or ".")
        self.writer = RecordWriter(records_path(directory, self.rank), self.rank, self.world)
        self.stacks: IO[str] | None = None
        if hasattr(signal, "SIGUSR1"):
            # The controller sends SIGUSR1 on a timeout: every thread's stack lands in this file.
            self.stacks = open(stacks_path(directory, self.rank), "w")  # noqa: SIM115
            faulthandler.register(signal.SIGUSR1, file=self.stacks, all_threads=True)
        basetemp = env.get(BASETEMP_ENV)
        if basetemp:
            config.option.basetemp = os.path.join(basetemp, f"rank{self.rank}")
        xmlpath = getattr(config.option, "xmlpath", None)
        if xmlpath and not self.controlled:
            base, ext = os.path.splitext(xmlpath)
            config.option.xmlpath = f"{base}.rank{self.rank}{ext or '.xml'}"

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.writer.write("start", pid=os.getpid(), args=list(self.config.invocation_params.args))

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        for item in items:
            if item.get_closest_marker(MARKER) is None:
                continue
            try:
                spec = spec_for(item)
            except MarkerError:
                continue  # reported when the test runs
            if spec is not None and spec.worker_num != self.world:
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"needs a job of {spec.worker_num} ranks (msrun --worker_num={spec.worker_num}); "
                        f"this job has {self.world}"
                    )
                )

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
            self.writer.write("collect", data=data)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        self.writer.write("report", data=data)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.writer.write("finish", exitstatus=int(exitstatus))

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.stacks is not None and hasattr(signal, "SIGUSR1"):
            faulthandler.unregister(signal.SIGUSR1)
            self.stacks.close()
        self.writer.close()


class SchedulerRolePlugin:
    """pytest started as the scheduler (``--scheduler=task``): it is not a rank and runs no test."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if items:
            config.hook.pytest_deselected(items=list(items))
            items[:] = []

    def pytest_report_header(self, config: pytest.Config) -> str:
        return "msrun: this process has MS_ROLE=MS_SCHED (the scheduler), not a rank: it runs no tests"

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
            session.exitstatus = pytest.ExitCode.OK
