"""pytest's own options on a marked test: each run unmarked and marked ``msrun(worker_num=2)``
(as the compatibility matrix runs a plugin), with the same exit status, outcomes and failure lines.

The options here are those a marked test once broke (``--setup-only`` ran it, ``--doctest-modules``
left the ranks unable to find a module's doctests, ``-p no:capture`` gave the ranks an option they
did not have, ``-vv`` left a rank's assertion diff short) and a few whose effect depends on the
ranks seeing the session's settings.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from compat_cases import Case
from test_compat_matrix import run

BODY = '''
import warnings

import pytest


def test_passes():
    assert [1, 2] == [1, 2]


def test_fails():
    assert [1, 2, 3] == [1, 2, 4]


def test_skips():
    pytest.skip("not today")


@pytest.mark.xfail(reason="known")
def test_xfails():
    assert False


def test_warns():
    warnings.warn("old", DeprecationWarning)


def check_named_otherwise():
    pass


def double(x):
    """
    >>> double(2)
    4
    """
    return 2 * x
'''

HABITS = [
    ("--setup-only",),
    ("--setup-plan",),
    ("--doctest-modules",),
    ("-p", "no:capture"),
    ("--runxfail",),
    ("-vv",),
    ("-o", "xfail_strict=true", "-o", "python_functions=test_* check_*"),
    ("-W", "error::DeprecationWarning"),
    ("--maxfail=1",),
    ("--deselect", "test_case.py::test_fails", "-k", "not skips"),
    ("--tb=line",),
    ("-l", "--tb=long"),
    ("--show-capture=no", "-rA"),
    ("--import-mode=importlib",),
    ("-p", "no:warnings"),
    ("-o", "filterwarnings=error", "--strict-markers"),
    ("--capture=tee-sys",),
    ("-o", "verbosity_assertions=2", "-q"),
]


@pytest.mark.parametrize("args", HABITS, ids=[" ".join(h) for h in HABITS])
def test_a_pytest_option_acts_on_a_marked_test_as_on_a_plain_one(args: tuple[str, ...], tmp_path: Path) -> None:
    case = Case("pytest", 0, "", BODY, args=args)
    plain, plain_out = run(case, tmp_path / "plain", marked=False)
    marked, marked_out = run(case, tmp_path / "marked", marked=True)
    assert marked == plain, f"--- unmarked:\n{plain_out}\n--- marked:\n{marked_out}"
