"""How msrun ends its job's processes: one SIGTERM each, then its grace, then SIGKILL.

A second SIGTERM would run a process's handler again inside the first (coverage saving its data
twice at once corrupts the file and fails both), so the rule is checked over any sequence of
teardown calls against a small oracle: each process gets SIGTERM at most once, and exactly once
if some call named it while it ran.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_msrun.engine import processes

# a call: which children it names, and which have ended (been reaped) before it
CALLS = st.lists(
    st.tuples(st.sets(st.integers(0, 5)), st.sets(st.integers(0, 5))),
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(CALLS)
def test_terminate_signals_each_process_at_most_once(calls):
    sent: list[tuple[int, int]] = []
    children = [processes.Child(tag=None, pid=1000 + i, started=0.0) for i in range(6)]
    group = processes.ProcessGroup.__new__(processes.ProcessGroup)  # no loop, no guard: only the rule
    group.children = children
    real = processes.signal_group
    processes.signal_group = lambda pid, sig: sent.append((pid, sig)) or True
    try:
        expected: set[int] = set()
        for named, ended in calls:
            for i in ended:
                if children[i].returncode is None:
                    children[i].returncode = 0
            group.terminate(children[i] for i in sorted(named))
            expected |= {1000 + i for i in named if children[i].returncode is None}
    finally:
        processes.signal_group = real
    pids = [pid for pid, sig in sent]
    assert all(sig == signal.SIGTERM for _, sig in sent)
    assert len(pids) == len(set(pids)), f"a process got SIGTERM twice: {sent}"
    assert set(pids) == expected
    assert {c.pid for c in children if c.terminated_by_us} == expected


def test_a_sigterm_during_a_ranks_coverage_save_waits_for_it(tmp_path):
    """A rank measuring for ``--cov`` saves after each test; msrun's SIGTERM arriving then runs
    coverage's own save-and-exit only after ours ended: the rank still ends on it, and its data
    file is whole."""
    coverage = pytest.importorskip("coverage")
    data_file = tmp_path / ".coverage"
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, signal, sys
            from pytest_msrun.plugin import covdata

            spec = {{"data_file": {str(data_file)!r}, "source": [{str(tmp_path)!r}], "rcfile": "", "branch": False}}
            covdata.start_in_rank({{covdata.COV_ENV: __import__("json").dumps(spec)}})
            cov = covdata._running[0]
            save = cov.save

            def save_interrupted():
                cov.save = save  # coverage's own save on SIGTERM is the plain one
                os.kill(os.getpid(), signal.SIGTERM)  # msrun tearing the job down, mid-save
                print("our save went on", flush=True)
                save()

            cov.save = save_interrupted
            covdata.flush()
            print("not ended by SIGTERM", flush=True)
            """
        )
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.stdout.split("\n")[0] == "our save went on", proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    files = list(tmp_path.glob(".coverage.*"))
    assert files, "no data saved"
    for path in files:
        data = coverage.CoverageData(str(path))
        data.read()  # raises on a half-made file
        assert any(name.endswith("rank.py") for name in data.measured_files()), json.dumps(
            sorted(data.measured_files())
        )
