"""msrun's command line read without argparse: the same reading as argparse's, or none.

The invariant: whatever :func:`parse_plain` accepts, msrun's argparse parser accepts and reads
the same way (the oracle is the parser itself); and every plain command line - exact flags with
values they accept, then the task - is accepted (so the fast path is the one msrun takes).
"""

from __future__ import annotations

import contextlib
import io

import pytest
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


# A configuration's command line (engine.argv.flags_of) - what the plugin spawns msrun with and
# prints to reproduce a test - is read back by msrun as that configuration: the one translation.
cpu_ranges = st.lists(st.sampled_from(["0", "1-3", "0,2", " 4 - 5", "0-1,3"]), max_size=3)
legacy = st.dictionaries(
    st.one_of(st.just("scheduler"), st.integers(0, 15).map(lambda n: f"device{n}")), cpu_ranges, max_size=3
)
unified = st.fixed_dictionaries(
    {
        "bind_config": st.fixed_dictionaries(
            {"bind_cpu_mode": st.sampled_from(["numa", "NONE"]), "bind_memory_mode": st.sampled_from(["numa", "none"])},
            optional={"actor_thread_fix_bind": st.booleans()},
        ),
    },
    optional={
        "bind_cpu": st.dictionaries(st.integers(0, 7).map(lambda n: f"device_{n}"), st.sampled_from(["0", "0-1", 1])),
        "bind_memory": st.dictionaries(st.sampled_from(["scheduler", "device3"]), st.sampled_from(["0", 1])),
    },
)
safe_text = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12)


def bind_values(flag: str, folder) -> st.SearchStrategy:
    import json

    from pytest_msrun.binding.flags import parse_bind_value

    raw = [st.sampled_from(["True", "False", "true"]), legacy.map(json.dumps)]
    if flag == "bind_numa":
        raw.append(unified.map(json.dumps))
        raw.append(unified.map(lambda obj: _bind_file(folder, json.dumps(obj))))
    return st.one_of(raw).map(lambda text: parse_bind_value(text, flag))


def _bind_file(folder, text: str) -> str:
    import hashlib

    path = folder / f"bind-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def bind_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("bind")


def configs(folder) -> st.SearchStrategy:
    from pytest_msrun.engine.config import SCHEDULER_MODES, LaunchConfig

    return st.builds(
        LaunchConfig,
        task_script=st.sampled_from(["train.py", "/usr/bin/python3", "python", "pytest", "a b.py"]),
        task_script_args=st.lists(st.one_of(st.sampled_from(TASK_ARGS), safe_text), max_size=5),
        worker_num=st.integers(1, 1 << 20),
        local_worker_num=st.integers(1, 1 << 16),
        master_addr=st.sampled_from(["127.0.0.1", "node-1", "::1", "10.0.0.2"]),
        master_port=st.integers(0, 65535),
        node_rank=st.integers(-1, 64),
        log_dir=safe_text,
        join=st.booleans(),
        cluster_time_out=st.integers(0, 1 << 31),
        bind_core=bind_values("bind_core", folder),
        bind_numa=bind_values("bind_numa", folder),
        sim_level=st.sampled_from([-1, 0, 1, 2, 3]),
        sim_rank_id=st.integers(-1, 4096),
        sim_select=st.sampled_from(["", "first:8", "0,3,5", "first:8,last:8,sample:16"]),
        sim_concurrency=st.integers(0, 64),
        rank_table_file=safe_text,
        worker_log_name=st.sampled_from(["", "w_{rank}.log", "{node}-{rank}.log"]),
        tail_worker_log=st.sampled_from(["-1", "0", "0,3"]),
        scheduler=st.sampled_from(SCHEDULER_MODES),
        print_plan=st.booleans(),
        dist_port=st.integers(-1, 65535),
        trace=st.one_of(st.just(""), st.sampled_from(["/tmp/job.trace.json", "/a b/t.json"])),
    )


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_configurations_command_line_reads_back_as_it(data, bind_folder):
    from pytest_msrun.engine.argv import flags_of
    from pytest_msrun.engine.cli import config_from_args, parse_args

    cfg = data.draw(configs(bind_folder))
    read, _ = config_from_args(parse_args(flags_of(cfg)), {})
    assert {**vars(read), "given": None} == {**vars(cfg), "given": None}
