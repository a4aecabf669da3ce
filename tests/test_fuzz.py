"""Property-based fuzzing of msrun's input: command lines, bind dicts and bind files.

Invariant: whatever the input, msrun either plans the job or refuses it with exit status 2 and
exactly one ``msrun: error:`` line - no traceback, no log directory, no process started. The
real parsing, validation and planning code runs in this process (``cli.plan_from_args``, which
is everything msrun does before it starts anything), on the 8-GPU snapshot in ``fixtures/``.
"""

from __future__ import annotations

import json
import os

import psutil
import pytest
from conftest import REPO, record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_msrun.engine.cli import plan_from_args

SNAPSHOT = REPO / "fixtures" / "dgx_8gpu_2numa.json"

numbers = st.one_of(
    st.integers(-3, 12),
    st.sampled_from([-1, 0, 1, 2, 8, 128, 129, 4095, 65535, 65536, 65537, 70000, 2**20, 2**20 + 1, 10**12]),
    st.integers(),
).map(str) | st.sampled_from(["x", "", "1.5", "0x10", " 3", "--"])
words = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
ranges = st.one_of(
    st.sampled_from(["0", "0-3", "3-1", "0-99999999999", "1,,2", "", "a", "-1", "0-65535", "65536", "7,8-9"]),
    words,
)
keys = st.sampled_from(["device0", "device1", "device_2", "device7", "device9", "scheduler", "gpu0", "device", "x"])
bind_dicts = st.dictionaries(
    keys, st.one_of(st.lists(ranges, max_size=3), ranges, st.integers(-2, 70000), st.none()), max_size=4
).map(json.dumps)
bind_values = st.one_of(
    st.sampled_from(["True", "False", "true", "1", "0", "yes", "{}", "[]", "{", "null"]), bind_dicts
)
sections = st.dictionaries(
    keys,
    st.one_of(
        ranges,
        st.integers(-2, 9),
        st.dictionaries(
            st.sampled_from(["main", "runtime", "minddata", "pynative", "other"]),
            st.one_of(ranges, st.integers(-1, 3)),
            max_size=3,
        ),
    ),
    max_size=3,
)
bind_files = st.fixed_dictionaries(
    {
        "bind_config": st.fixed_dictionaries(
            {},
            optional={
                "bind_cpu_mode": st.sampled_from(["cpu", "numa", "none", "bogus", 3]),
                "bind_memory_mode": st.sampled_from(["numa", "none", "cpu"]),
                "actor_thread_fix_bind": st.sampled_from([True, False, "yes"]),
            },
        )
    },
    optional={"bind_cpu": sections, "bind_memory": sections},
)

FLAGS = {
    "--worker_num": numbers,
    "--local_worker_num": numbers,
    "--master_addr": st.sampled_from(["127.0.0.1", "::1", "[::1]", "localhost", "", "256.1.1.1", "0.0.0.0", "[x]"]),
    "--master_port": numbers,
    "--node_rank": numbers,
    "--log_dir": st.sampled_from(["logs", "a/b/c", "task.py", "task.py/sub", ""]),
    "--join": st.sampled_from(["True", "False", "true", "1", "0", "maybe", "", "[1]"]),
    "--cluster_time_out": numbers,
    "--bind_core": bind_values,
    "--bind_numa": bind_values | st.just("@bindfile"),
    "--sim_level": numbers,
    "--sim_rank_id": numbers,
    "--rank_table_file": st.sampled_from(["", "missing.json", "task.py", "."]),
    "--worker_log_name": st.sampled_from(["", "w_{ip}", "a/b", "{hostname}", "x{ip}/y"]) | words,
    "--tail_worker_log": st.sampled_from(["-1", "0", "0,1", "a", "9" * 40, "", "1,,2", "-2"]) | words,
    "--sim_select": st.sampled_from(["", "0", "first:2", "last:0", "sample:3:7", "0-99999999999", "5-1", "x:1"])
    | words,
    "--sim_concurrency": numbers,
    "--scheduler": st.sampled_from(["auto", "builtin", "mindspore", "task", "bogus", ""]),
    "--dist_port": numbers,
}
TASKS = st.sampled_from(["task.py", "missing.py", "job.sh", "python", "no_such_command_here", "./task.py"])


@pytest.fixture
def place(tmp_path, monkeypatch):
    (tmp_path / "task.py").write_text("pass\n")
    (tmp_path / "job.sh").write_text("#!/bin/sh\necho hi\n")
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "MSRUN_TOPOLOGY": str(SNAPSHOT), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    for name in ("RANK_ID", "MS_SIMULATION_LEVEL", "MSRUN_JOB_TOKEN", "CUDA_VISIBLE_DEVICES"):
        env.pop(name, None)
    return tmp_path, env


COUNTS = {"planned": 0, "refused": 0}


def check(argv: list[str], place, capsys) -> None:
    tmp_path, env = place
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    dirs_before = {p for p in tmp_path.rglob("*") if p.is_dir()}
    try:
        plan_from_args(argv, env, "fuzz")
        COUNTS["planned"] += 1
        code = 0
    except SystemExit as exc:
        code = exc.code
        COUNTS["refused"] += 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    if code != 0:
        assert code == 2, (argv, code, err)
        errors = [line for line in err.splitlines() if line.startswith("msrun: error:")]
        assert len(errors) == 1, (argv, err)
    assert {p for p in tmp_path.rglob("*") if p.is_dir()} <= dirs_before | {
        tmp_path / "config",
        tmp_path / "config" / "msrun",
    }, argv
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before, argv


SETTINGS = settings(
    max_examples=600,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@SETTINGS
@given(
    flags=st.lists(st.sampled_from(sorted(FLAGS)).flatmap(lambda f: st.tuples(st.just(f), FLAGS[f])), max_size=6),
    task=TASKS,
    task_args=st.lists(st.sampled_from(["--join=True", "-x", "--worker_num", "9", "--b=1"]), max_size=2),
)
def test_command_lines(place, capsys, flags, task, task_args):
    argv = [f"{flag}={value}" for flag, value in flags if value != "@bindfile"]
    check([*argv, task, *task_args], place, capsys)


@SETTINGS
@given(core=bind_values, numa=bind_values, local=st.integers(1, 9))
def test_bind_dicts(place, capsys, core, numa, local):
    argv = [f"--worker_num={local}", f"--local_worker_num={local}", f"--bind_core={core}", f"--bind_numa={numa}"]
    check([*argv, "task.py"], place, capsys)


@SETTINGS
@given(data=bind_files, local=st.integers(1, 9), raw=st.sampled_from(["", "{not json", "[]", "null"]))
def test_bind_files(place, capsys, data, local, raw):
    tmp_path, _ = place
    path = tmp_path / "bind.json"
    path.write_text(raw or json.dumps(data))
    check([f"--worker_num={local}", f"--local_worker_num={local}", f"--bind_numa={path}", "task.py"], place, capsys)


def test_fuzz_figures():
    """(Runs after the three properties in this file.)"""
    total = COUNTS["planned"] + COUNTS["refused"]
    if total:
        record(
            "fuzzed inputs (command lines, bind dicts, bind files)",
            "0 tracebacks, 0 processes, 0 dirs",
            f"{total} inputs: {COUNTS['refused']} refused with exit 2",
        )
