"""msrun's command line read without argparse: the same reading as argparse's, or none.

The invariant: whatever :func:`parse_plain` accepts, msrun's argparse parser accepts and reads
the same way (the oracle is the parser itself); and every plain command line - exact flags with
values they accept, then the task - is accepted (so the fast path is the one msrun takes).
"""

from __future__ import annotations

import contextlib
import io

from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_msrun.engine.argv import CONVERTERS, parse_plain
from pytest_msrun.engine.cliparser import build_parser

FLAGS = sorted(CONVERTERS)
VALUES = [
    "2", "0", "-1", "+3", " 4", "x", "", "1.5", "True", "False", "true", "0x10",
    "auto", "task", "mindspore", "none", "-x", "--", "a=b", '{"main": "0-1"}', "[1]", "a b",
]  # fmt: skip
TASK_ARGS = ["s.py", "python", "-", "", "-x", "--join=True", "--worker_num", "9", "a b", "-h", "-hx", "--tb=short"]
WORDS = [*TASK_ARGS, "--", "--sim", "--bind=1"]  # and what argparse trips on


def argparse_reading(argv: list[str]) -> dict | None:
    """What msrun's argparse parser reads, or None where it exits (an error, or --help)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            ns = build_parser().parse_args(argv)
    except SystemExit:
        return None
    values = vars(ns)
    if any(isinstance(v, list) for k, v in values.items() if k != "task_script_args"):
        return None  # "--flag=--": msrun rejects it after argparse
    return values


flag_names = st.one_of(
    st.sampled_from(FLAGS),
    st.sampled_from(FLAGS).map(lambda f: f[: max(2, len(f) // 2)]),  # abbreviations argparse accepts
    st.sampled_from(["print_plan", "help", "nope", ""]),
)
tokens = st.one_of(
    st.tuples(flag_names, st.sampled_from(VALUES)).map(lambda t: [f"--{t[0]}={t[1]}"]),
    st.tuples(flag_names, st.sampled_from(VALUES)).map(lambda t: [f"--{t[0]}", t[1]]),
    st.sampled_from(WORDS).map(lambda w: [w]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(tokens, max_size=6).map(lambda parts: [a for part in parts for a in part]))
def test_what_the_fast_path_reads_argparse_reads_the_same_way(argv):
    plain = parse_plain(argv)
    if plain is not None:
        assert argparse_reading(argv) == vars(plain)


valid_values = {
    "worker_num": st.integers(0, 9999).map(str),
    "master_port": st.integers(0, 65535).map(str),
    "join": st.sampled_from(["True", "False", "true", "0", "1"]),
    "sim_level": st.sampled_from(["0", "1", "2", "3"]),
    "scheduler": st.sampled_from(["auto", "task", "mindspore"]),
    "log_dir": st.text(st.sampled_from("abc/_. 0"), max_size=8).filter(lambda v: not v.startswith("-")),
    "master_addr": st.sampled_from(["127.0.0.1", "node-1", "[::1]"]),
    "bind_core": st.sampled_from(["True", "False"]),
}


@settings(max_examples=200, deadline=None)
@given(
    flags=st.lists(st.sampled_from(sorted(valid_values)).flatmap(lambda f: st.tuples(st.just(f), valid_values[f]))),
    split=st.lists(st.booleans(), min_size=12, max_size=12),
    task=st.sampled_from(["train.py", "python", "pytest"]),
    task_args=st.lists(st.sampled_from(TASK_ARGS), max_size=4),
)
def test_every_plain_command_line_takes_the_fast_path(flags, split, task, task_args):
    argv: list[str] = []
    for (name, value), apart in zip(flags, split):
        argv += [f"--{name}", value] if apart else [f"--{name}={value}"]
    argv += [task, *task_args]
    plain = parse_plain(argv)
    assert plain is not None, argv
    assert argparse_reading(argv) == vars(plain)


def test_the_usual_launch_line():
    argv = ["--worker_num=8", "--local_worker_num=8", "--master_port=0", "--join=True", "--log_dir=logs", "t.py", "-v"]
    plain = parse_plain(argv)
    assert plain is not None and plain.worker_num == 8 and plain.join is True
    assert plain.task_script == "t.py" and plain.task_script_args == ["-v"]
