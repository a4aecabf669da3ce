"""What the console shows a user: short fixture reprs, trimmed hang reports, idle ranks in words,
the HTML report's line on its own line - in warm worlds, fresh (forked) tests and suite mode."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from conftest import job_args

FAILING = """
import pytest

@pytest.mark.msrun(worker_num=2)
def test_rank_one_fails(msrun):
    local_value = 3
    assert msrun.rank == 0
"""


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
@pytest.mark.parametrize("showlocals", [False, True])
def test_the_msrun_fixture_is_shown_short(pytester: pytest.Pytester, worlds: str, showlocals: bool) -> None:
    pytester.makepyfile(test_repr=FAILING)
    args = ["-p", "no:cacheprovider", f"--msrun-worlds={worlds}"] + (["-l"] if showlocals else [])
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "MsrunContext(" not in out and "MASTER_PORT" not in out, out
    result.stdout.fnmatch_lines(["msrun = <msrun rank 1/2>", "*where 1 = <msrun rank 1/2>.rank"])
    if showlocals:
        result.stdout.fnmatch_lines(["local_value = 3", "msrun * = <msrun rank 1/2>"])


def test_the_msrun_fixture_is_shown_short_in_suite_mode(msrun) -> None:
    (msrun.cwd / "suite").mkdir()
    (msrun.cwd / "suite" / "test_repr.py").write_text(textwrap.dedent(FAILING))
    job = msrun.run(job_args(2, "--scheduler=builtin", "pytest", "-l", "-p", "no:cacheprovider", "suite"))
    assert job.returncode == 1, job.stdout + job.stderr
    log = job.log("worker_1.log")
    assert "<msrun rank 1/2>" in log and "MsrunContext(" not in log, log


def test_the_fields_stay(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_fields(msrun):
            assert (msrun.rank, msrun.world_size, msrun.local_rank, msrun.local_world_size) == (0, 1, 0, 1)
            assert msrun.env == {} and msrun.log_dir is None and msrun.tmp_path.is_dir()
            assert repr(msrun) == "<msrun rank 0/1>"
        """
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


HANG = """
import time

import pytest


def compute():
    time.sleep(120)


@pytest.mark.msrun(worker_num=2, timeout=5)
def test_stuck(rank, msrun):
    msrun.barrier()
    if rank == 0:
        msrun.barrier()  # HERE-0
    else:
        compute()
"""


def _timed_out(pytester: pytest.Pytester, source: str, *args: str) -> str:
    pytester.makepyfile(test_hang=source)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    out = result.stdout.str()
    assert "timed out after 5 s" in out, out
    return out


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
def test_a_hang_report_shows_the_frames_that_matter(pytester: pytest.Pytester, worlds: str) -> None:
    out = _timed_out(pytester, HANG, f"--msrun-worlds={worlds}")
    assert out.count("test session starts") == 1, out  # the controller's header; no rank's
    assert "pluggy" not in out.split("collected 1 item", 1)[1] and "/_pytest/" not in out, out
    assert "<frozen runpy>" not in out and "rootdir:" not in out.split("collected 1 item", 1)[1], out
    hang = str(pytester.path / "test_hang.py")
    for rank, line, func in ((0, 14, "test_stuck"), (1, 7, "compute")):
        section = out[out.index(f"stack of rank {rank} at the timeout") :]
        head = section.splitlines()[1]
        assert re.search(r"\(\d+ pytest frames hidden; every frame of every thread: .*pytest_rank\d\.stacks\)", head)
        stacks = Path(head.rsplit(": ", 1)[1].rstrip("):"))
        assert stacks.is_file() and "pluggy" in stacks.read_text(), head  # every frame stays there
        assert f'File "{hang}", line {line} in {func}' in section, section
    assert re.search(r'fixtures.py", line \d+ in barrier \(\d+ msrun frames inside it hidden\)', out), out
    assert "rank 0: barrier() at test_hang.py:14 <- test_stuck()" in out


IDLE = """
import time

import pytest


@pytest.fixture
def slow_teardown(rank):
    yield
    if rank == 0 and {teardown}:
        time.sleep(120)


@pytest.mark.msrun(worker_num=2, timeout=5)
def test_one_rank_works(rank, slow_teardown):
    if rank == 0 and not {teardown}:
        time.sleep(120)
"""


@pytest.mark.parametrize("worlds", ["warm", "fresh"])
@pytest.mark.parametrize(
    ("teardown", "words"),
    [
        (False, "finished the test's call; waits for the other ranks before its teardown"),
        (True, "finished the test; waits in its warm world for the next one"),
    ],
)
def test_an_idle_rank_is_described_in_words(pytester: pytest.Pytester, worlds: str, teardown: bool, words: str) -> None:
    if teardown and worlds == "fresh":
        pytest.skip("a forked test's rank ends with its test: it never idles in the world's loop")
    if worlds == "fresh":  # the forked process of rank 1 tore its test down at once and ended
        words = "finished the test in a process of its own, which ended; waits for the other ranks"
    out = _timed_out(pytester, IDLE.format(teardown=teardown), f"--msrun-worlds={worlds}")
    assert f"rank 1: {words}\n" in out, out
    assert f"{words} (msrun's serve loop;" in out
    assert "receive() at serve.py" not in out and 'serve.py", line' not in out, out


@pytest.mark.parametrize("verbosity", ["-q", "-qq", "", "-v", "-vv"])
def test_the_html_report_line_has_a_line_of_its_own(pytester: pytest.Pytester, verbosity: str) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.msrun(worker_num=2)
        def test_ok(rank):
            assert rank in (0, 1)
        """
    )
    page = pytester.path / "report.html"
    args = ["-p", "no:cacheprovider", f"--msrun-report={page}"] + ([verbosity] if verbosity else [])
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == 0 and page.is_file()
    lines = [line for line in result.stdout.lines if "msrun: HTML report" in line]
    assert len(lines) == 1 and re.match(r"^-+ msrun: HTML report of 1 marked test\(s\): ", lines[0]), result.stdout
    assert str(page) in lines[0]
