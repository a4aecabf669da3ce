"""``--msrun-env-scope=test``: tests differing only in ``env`` share a world, each test with its own
variables - and never where that would differ from a job started with them."""

from __future__ import annotations

import os
import re
import uuid

import pytest
from conftest import MARK, wait_gone
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_msrun.plugin import envscope

SHAPES = """
import os

import pytest


@pytest.fixture(scope="module")
def seen_at_setup():
    with open(os.environ["SETUPS"], "a") as fh:
        fh.write(f"{os.getpid()}\\n")
    return os.environ.get("SHAPE")


def show(name, rank, seen):
    print(f"SEEN {name} {rank} {os.getpid()} {os.environ.get('SHAPE')} {seen}")


@pytest.mark.msrun(worker_num=2, env={"SHAPE": "a"})
def test_a(rank, seen_at_setup):
    show("a", rank, seen_at_setup)


@pytest.mark.msrun(worker_num=2, env={"SHAPE": "a"})
def test_a_again(rank, seen_at_setup):
    show("a2", rank, seen_at_setup)


@pytest.mark.msrun(worker_num=2, env={"SHAPE": "b"})
def test_b(rank, seen_at_setup):
    show("b", rank, seen_at_setup)


@pytest.mark.msrun(worker_num=2)
def test_none(rank, seen_at_setup):
    show("none", rank, seen_at_setup)


@pytest.mark.msrun(worker_num=2, env={"SHAPE": "c"}, isolated=True)
def test_c_isolated(rank, seen_at_setup):
    show("c", rank, seen_at_setup)
"""

READ_AT_IMPORT = """
import os

import pytest

AT_IMPORT = os.environ.get("KIND")


@pytest.mark.msrun(worker_num=2, env={"KIND": "x"})
def test_x(rank):
    print(f"SEEN x {rank} {os.getpid()} {os.environ.get('KIND')} {AT_IMPORT}")


@pytest.mark.msrun(worker_num=2, env={"OTHER": "z"})
def test_z(rank):
    print(f"SEEN z {rank} {os.getpid()} {os.environ.get('OTHER')} {AT_IMPORT}")


@pytest.mark.msrun(worker_num=2, env={"OTHER": "w"})
def test_w(rank):
    print(f"SEEN w {rank} {os.getpid()} {os.environ.get('OTHER')} {AT_IMPORT}")
"""

JOB_SCOPED = """
import os

import pytest

AT_IMPORT = os.environ.get("MS_SHAPE")


@pytest.mark.msrun(worker_num=2, env={"MS_SHAPE": "1"})
def test_one(rank):
    print(f"SEEN one {rank} {os.getpid()} {os.environ.get('MS_SHAPE')} {AT_IMPORT}")


@pytest.mark.msrun(worker_num=2, env={"MS_SHAPE": "2"})
def test_two(rank):
    print(f"SEEN two {rank} {os.getpid()} {os.environ.get('MS_SHAPE')} {AT_IMPORT}")
"""

COPIED_AT_IMPORT = """
import os

import pytest

SNAPSHOT = {HOW}  # a copy of the whole environment, taken at import


@pytest.mark.msrun(worker_num=2, env={"KIND": "x"})
def test_x(rank):
    assert SNAPSHOT.get("KIND") == "x", "the module's copy lacks the test's variable"


@pytest.mark.msrun(worker_num=2, env={"KIND": "y"})
def test_y(rank):
    assert SNAPSHOT.get("KIND") == "y", "the module's copy lacks the test's variable"
"""

FAILING = """
import pytest


@pytest.mark.msrun(worker_num=2, env={"SHAPE": "b"})
def test_fails(rank):
    assert rank == 0
"""


def _run(pytester, monkeypatch, source: str, *args: str):
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    monkeypatch.setenv("SETUPS", str(pytester.path / "setups.txt"))
    pytester.makepyfile(test_env_scope_case=source)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", *args, timeout=240)
    left = wait_gone(mark)
    assert not left, f"leftover processes: {[p.cmdline() for p in left]}"
    return result


def _seen(text: str) -> dict[tuple[str, str], tuple[str, str, str]]:
    """(test, rank) -> (pid, the variable during the test, what the module fixture or import saw)."""
    return {(m[0], m[1]): (m[2], m[3], m[4]) for m in re.findall(r"SEEN (\w+) (\d) (\d+) (\S+) (\S+)", text)}


def test_tests_differing_in_env_share_one_world_each_with_its_own_variables(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, SHAPES, "--msrun-env-scope=test")
    result.assert_outcomes(passed=5)
    out = result.stdout.str()
    assert "MsrunLeakWarning" not in out  # a test's own variables are not its leak
    seen = _seen(out)
    for rank in ("0", "1"):
        pids = {seen[(name, rank)][0] for name in ("a", "a2", "b", "none")}
        assert len(pids) == 1  # one world ran every warm test
        assert seen[("c", rank)][0] not in pids  # isolated=True: a process of its own
        for name, value in (("a", "a"), ("a2", "a"), ("b", "b"), ("none", "None"), ("c", "c")):
            during, fixture = seen[(name, rank)][1:]
            assert during == value  # its own variables, and none of another test's
            assert fixture == value  # the module fixture was set up under them
    # the module fixture: once for a and a_again, again for b, for none, and in c's child
    assert len((pytester.path / "setups.txt").read_text().split()) == 2 * 4


def test_by_default_each_env_is_a_world_of_its_own(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, SHAPES)
    result.assert_outcomes(passed=5)
    seen = _seen(result.stdout.str())
    for rank in ("0", "1"):
        assert seen[("a", rank)][0] == seen[("a2", rank)][0]
        assert len({seen[(name, rank)][0] for name in ("a", "b", "none")}) == 3


def test_a_variable_read_while_collecting_makes_the_test_a_fresh_job(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, READ_AT_IMPORT, "--msrun-env-scope=test")
    result.assert_outcomes(passed=3)
    out = result.stdout.str()
    assert out.count("ran as a fresh job: its world's ranks read KIND while collecting") == 1
    seen = _seen(out)
    for rank in ("0", "1"):
        assert seen[("x", rank)][1:] == ("x", "x")  # set from the job's start: its import saw it
        assert seen[("z", rank)][0] == seen[("w", rank)][0] != seen[("x", rank)][0]
        assert seen[("z", rank)][1:] == ("z", "None")
        assert seen[("w", rank)][1:] == ("w", "None")


@pytest.mark.parametrize(
    "how",
    [
        "os.environ.copy()",
        "dict(os.environ)",
        "{k: v for k, v in os.environ.items()}",
        "{os.fsdecode(k): os.fsdecode(v) for k, v in os.environb.items()}",
    ],
    ids=["copy", "dict", "items", "environb"],
)
def test_a_module_that_copies_the_environment_at_import_sees_each_tests_variables(pytester, monkeypatch, how):
    """A wholesale read while collecting reads every test's variables: each test runs as a fresh
    job with them set from its start, and the module's copy has them."""
    result = _run(pytester, monkeypatch, COPIED_AT_IMPORT.replace("{HOW}", how), "--msrun-env-scope=test")
    result.assert_outcomes(passed=2)
    assert result.stdout.str().count("ran as a fresh job: its world's ranks read KIND while collecting") == 2


def test_variables_launchers_and_frameworks_read_stay_the_jobs(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, JOB_SCOPED, "--msrun-env-scope=test")
    result.assert_outcomes(passed=2)
    seen = _seen(result.stdout.str())
    for rank in ("0", "1"):
        assert seen[("one", rank)][0] != seen[("two", rank)][0]  # a world each
        assert seen[("one", rank)][1:] == ("1", "1")
        assert seen[("two", rank)][1:] == ("2", "2")


def test_forked_tests_have_their_variables_and_reproduce_lines_name_them(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, FAILING, "--msrun-env-scope=test", "--msrun-worlds=fresh")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "assert 1 == 0" in out  # rank 1 failed; rank 0 (SHAPE set) passed
    assert re.search(r"SHAPE=b .*pmsrun|SHAPE=b .*msrun", out), out  # the command that reruns it has it


def test_an_unknown_scope_in_the_ini_file_is_a_usage_error(pytester):
    pytester.makeini("[pytest]\nmsrun_env_scope = tests\n")
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*msrun_env_scope = 'tests' in the ini file: use job or test*"])


KEYS = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_abc0123456789", min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(KEYS | st.sampled_from([p + "X" for p in envscope.JOB_SCOPED_PREFIXES]), st.text(max_size=5)))
def test_split_partitions_a_markers_variables_by_their_names(env):
    job, own = envscope.split(env)
    assert {**job, **own} == env and not set(job) & set(own)
    for key in env:  # the oracle: a name is the job's when it starts with a listed prefix, any case
        assert (key in job) == any(key.upper().startswith(prefix) for prefix in envscope.JOB_SCOPED_PREFIXES)


NAMES = st.sampled_from(["MSRUN_T_A", "MSRUN_T_B", "MSRUN_T_C"])


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(NAMES, st.text(alphabet="xyz", max_size=3)),
    st.dictionaries(NAMES, st.text(alphabet="ab =:1", max_size=3)),
)
def test_apply_then_revert_leaves_the_environment_as_it_was(before, env):
    saved = {name: os.environ.pop(name) for name in ("MSRUN_T_A", "MSRUN_T_B", "MSRUN_T_C") if name in os.environ}
    try:
        os.environ.update(before)
        snapshot = dict(os.environ)
        replaced = envscope.apply(env)
        assert {k: os.environ[k] for k in env} == env
        envscope.revert(replaced)
        assert dict(os.environ) == snapshot
    finally:
        for name in ("MSRUN_T_A", "MSRUN_T_B", "MSRUN_T_C"):
            os.environ.pop(name, None)
        os.environ.update(saved)


def test_tracking_notes_every_kind_of_look_up_of_a_watched_variable_and_ends():
    envscope.track(["MSRUN_T_WATCHED", "MSRUN_T_ABSENT", "MSRUN_T_IN", "MSRUN_T_GETENV", "MSRUN_T_BYTES"])
    try:
        os.environ.get("MSRUN_T_WATCHED")
        assert "MSRUN_T_IN" not in os.environ
        os.getenv("MSRUN_T_GETENV")
        os.environ.get("MSRUN_T_UNWATCHED")
        os.environb.get(b"MSRUN_T_BYTES")
    finally:
        read = envscope.reads()
    assert read == ["MSRUN_T_BYTES", "MSRUN_T_GETENV", "MSRUN_T_IN", "MSRUN_T_WATCHED"]
    assert type(os.environ) is os._Environ
    os.environ.get("MSRUN_T_ABSENT")
    assert envscope.reads() == read  # nothing noted after the end


@pytest.mark.parametrize(
    "wholesale",
    [
        lambda: os.environ.copy(),
        lambda: dict(os.environ),
        lambda: {k: v for k, v in os.environ.items()},
        lambda: list(os.environ),
        lambda: len(os.environ),
        lambda: dict(os.environb),
        lambda: os.environb.copy(),
    ],
    ids=["copy", "dict", "items", "iter", "len", "environb-dict", "environb-copy"],
)
def test_a_wholesale_read_reads_every_watched_variable(wholesale):
    """A module that copies or iterates the environment at import has a snapshot without the
    test's variables (they are set only when the test starts): every one of them counts as read."""
    envscope.track(["MSRUN_T_ONE", "MSRUN_T_TWO"])
    try:
        wholesale()
    finally:
        read = envscope.reads()
    assert read == ["MSRUN_T_ONE", "MSRUN_T_TWO"]
    assert type(os.environ) is os._Environ and type(os.environb) is os._Environ
