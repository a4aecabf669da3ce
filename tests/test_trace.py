"""``MSRUN_TRACE`` / ``--trace``: a job's timeline in the Chrome Trace Event Format."""

from __future__ import annotations

import json
import os
import time

from conftest import free_port, job_args, wait_for
from hypothesis import given
from hypothesis import strategies as st

from pytest_msrun.control import tracelog

# Rank 2 fails after three collectives; the others block in a fourth, which fails when it leaves.
FAILING = """
from pytest_msrun import cluster
cluster.init()
rank = cluster.get_rank()
cluster.barrier()
cluster.all_gather_object({"rank": rank})
cluster.broadcast_object("x" if rank == 0 else None, src=0)
if rank == 2:
    raise ValueError("rank 2 fails on purpose")
cluster.barrier()
"""


def load(path) -> list[dict]:
    doc = json.loads(path.read_text())
    assert isinstance(doc["traceEvents"], list) and doc["displayTimeUnit"] == "ms"
    for ev in doc["traceEvents"]:
        assert {"name", "ph", "pid", "tid"} <= set(ev), ev
        assert ev["ph"] == "M" or isinstance(ev["ts"], int), ev
    return doc["traceEvents"]


def lanes(events: list[dict]) -> dict[int, str]:
    return {ev["pid"]: ev["args"]["name"] for ev in events if ev["ph"] == "M" and ev["name"] == "process_name"}


def collectives(events: list[dict], rank: int) -> list[dict]:
    pid = tracelog.RANK_PID + rank
    return [ev for ev in events if ev["pid"] == pid and ev["ph"] == "X" and "#" in ev["name"]]


def test_failing_four_rank_job_gives_a_trace_of_every_rank_collective_and_the_failure(msrun):
    msrun.script("job.py", FAILING)
    trace = msrun.cwd / "job.trace.json"
    job = msrun.run(job_args(4, "--scheduler=builtin", "job.py"), env={"MSRUN_TRACE": str(trace)})
    assert job.returncode == 1, job.stderr
    assert "wrote the job's trace" in job.stderr and str(trace) in job.stderr
    events = load(trace)
    status = json.loads((job.log_dir / "msrun_status.json").read_text())
    pids = {p["rank"]: p["pid"] for p in status["processes"] if p["role"] == "worker"}
    named = lanes(events)
    rank_lanes = {pid - tracelog.RANK_PID: name for pid, name in named.items() if pid >= tracelog.RANK_PID}
    assert sorted(rank_lanes) == [0, 1, 2, 3]
    for rank, name in rank_lanes.items():
        assert name.startswith(f"rank {rank} (") and f"pid {pids[rank]})" in name, name
    assert named[tracelog.MSRUN_PID] == "msrun" and named[tracelog.CONTROL_PID].startswith("control plane")
    # every collective of every rank, entered -> released, with its sequence number
    for rank in range(4):
        names = [ev["name"] for ev in collectives(events, rank)]
        expected = ["barrier #1", "gather #2", "bcast #3"] + ([] if rank == 2 else ["barrier #4"])
        assert names == expected, (rank, names)
        for ev in collectives(events, rank):
            assert ev["dur"] >= 0 and ev["args"]["seq"] == int(ev["name"].split("#")[1])
            assert all(0 <= r < 4 for r in ev["args"]["waited for"])
    for rank in (0, 1, 3):
        (last,) = [ev for ev in collectives(events, rank) if ev["name"] == "barrier #4"]
        assert "rank 2" in last["args"]["error"] and last["args"]["not there"] == [2]
    # the failure: one instant across every lane, on rank 2's lane, carrying the error
    (first,) = [ev for ev in events if ev["name"].startswith("first failure")]
    assert first["ph"] == "i" and first["s"] == "g" and first["pid"] == tracelog.RANK_PID + 2
    assert first["args"]["rank"] == 2 and "ValueError: rank 2 fails on purpose" in first["args"]["error"]
    # each rank's process: spawn, python started, init() joined, exit with its status or signal
    for rank in range(4):
        mine = {ev["name"]: ev for ev in events if ev["pid"] == tracelog.RANK_PID + rank}
        assert {"spawn", "python started", "init() joined", "process", "exit"} <= set(mine), sorted(mine)
        assert mine["spawn"]["ts"] <= mine["python started"]["ts"] <= mine["init() joined"]["ts"] <= mine["exit"]["ts"]
        end = mine["exit"]["args"]
        if rank == 2:
            assert end == {"exit code": 1, "pid": pids[2], "stopped by msrun": False}
        else:  # stopped by msrun's signal, or - on a loaded machine - ended first by barrier #4's error
            assert end["pid"] == pids[rank] and ("signal" in end or end["exit code"] == 1), end
    stops = [ev for ev in events if ev["pid"] == tracelog.MSRUN_PID and ev["name"].startswith("stop:")]
    assert stops and "rank 2" in stops[0]["args"]["reason"]
    assert not [p for p in msrun.cwd.iterdir() if ".spool-" in p.name], "the spool is removed"


def test_two_nodes_give_one_trace_written_by_node_0(msrun):
    msrun.script("job.py", FAILING.replace('raise ValueError("rank 2 fails on purpose")', "pass"))
    trace = msrun.cwd / "job.trace.json"
    port = free_port()
    args = job_args(4, "--scheduler=builtin", "job.py", local=2, port=port)
    node0 = msrun.start(["--node_rank=0", *args], env={"MSRUN_TRACE": str(trace)})
    wait_for(lambda: (msrun.cwd / "logs" / "scheduler.log").exists())
    other = msrun.cwd / "other.trace.json"  # node 1 ships its events to node 0; it writes no file
    node1 = msrun.start(["--node_rank=1", *args], env={"MSRUN_TRACE": str(other)})
    a, b = msrun.finish(node0), msrun.finish(node1)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert not other.exists()
    events = load(trace)
    for rank in range(4):
        mine = {ev["name"] for ev in events if ev["pid"] == tracelog.RANK_PID + rank}
        assert {"spawn", "python started", "init() joined", "process", "exit", "barrier #1", "barrier #4"} <= mine
    threads = [ev["args"]["name"] for ev in events if ev["name"] == "thread_name" and ev["pid"] == tracelog.MSRUN_PID]
    assert sorted(t.split(":")[0] for t in threads) == ["node 0", "node 1"]
    assert not [p for p in msrun.cwd.iterdir() if ".spool-" in p.name]


def test_untraced_job_records_nothing(msrun):
    msrun.script("job.py", "import os\nprint(sorted(k for k in os.environ if k.startswith('MSRUN_TRACE')))\n")
    job = msrun.run(job_args(2, "--tail_worker_log=0", "job.py"), env={"MSRUN_TRACE": ""})
    assert job.returncode == 0, job.stderr
    assert "[rank 0] []" in job.stdout and "trace" not in job.stderr
    assert sorted(p.name for p in msrun.cwd.iterdir()) == ["dump", "job.py", "logs"]


def test_a_traced_jobs_ranks_do_not_trace_nested_jobs(msrun):
    msrun.script("job.py", "import os\nprint(os.environ.get('MSRUN_TRACE'), 'MSRUN_TRACE_SPOOL' in os.environ)\n")
    job = msrun.run(job_args(1, "--tail_worker_log=0", "job.py"), env={"MSRUN_TRACE": str(msrun.cwd / "t.json")})
    assert job.returncode == 0 and "[rank 0] None True" in job.stdout, job.stdout + job.stderr


def test_bad_trace_path_is_one_error_and_nothing_starts(msrun):
    msrun.script("job.py", "print('ran')\n")
    for flag, env, named in [
        ("--trace=/nonexistent/dir/t.json", {}, "--trace"),
        ("--trace=.", {}, "is a directory"),
        ("", {"MSRUN_TRACE": "/nonexistent/t.json"}, "MSRUN_TRACE"),
    ]:
        job = msrun.run(job_args(1, *([flag] if flag else []), "job.py"), env=env)
        assert job.returncode == 2, job.stderr
        assert job.stderr.count("error:") == 1 and "argument --trace" in job.stderr and named in job.stderr
        assert "ran" not in job.stdout and not job.log_dir.exists()


@given(
    offset=st.floats(-1e4, 1e4),
    exchanges=st.lists(st.tuples(st.floats(0, 1e6), st.floats(0, 2.0), st.floats(0, 2.0)), min_size=1, max_size=20),
)
def test_clock_offset_is_within_half_the_best_round_trip(offset, exchanges):
    """Oracle: an exchange sent at local ``t``, answered after ``up`` seconds, back after ``down``
    more, carries the other clock's ``t + up + offset``; the estimate is off by at most half the
    shortest round trip."""
    est = tracelog.ClockOffset()
    for t, up, down in exchanges:
        est.sample(t, t + up + offset, t + up + down)
    best = min(up + down for _, up, down in exchanges)
    assert est.rtt < float("inf") and abs(est.offset - offset) <= best / 2 + 1e-6


def test_shifted_events_keep_metadata_and_move_times():
    events = tracelog.lane(5, "x", 1) + [tracelog.instant("a", 5, 0, 10.0)]
    moved = tracelog.shifted(events, 2.5)
    assert moved[:2] == events[:2] and moved[2]["ts"] == events[2]["ts"] + 2_500_000


def test_merge_skips_torn_lines_and_puts_lane_names_first_once(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "a.jsonl").write_text(json.dumps(tracelog.instant("late", 1, 0, 3.0)) + "\n{torn")
    rec = tracelog.Recorder(str(spool / "b.jsonl"))
    rec.extend([*tracelog.lane(1, "msrun", 0), tracelog.span("early", 1, 0, 1.0, 2.0), *tracelog.lane(1, "msrun", 0)])
    rec.close()
    out = tmp_path / "t.json"
    assert tracelog.merge(str(spool), str(out), {"k": "v"}) == 2
    doc = json.loads(out.read_text())
    names = [e["name"] for e in doc["traceEvents"]]
    assert names[:2] == ["process_name", "process_sort_index"] and sorted(names[2:]) == ["early", "late"]
    assert doc["otherData"] == {"k": "v"}
    assert sorted(os.listdir(tmp_path)) == ["spool", "t.json"], "written atomically: no temporary file left"


def test_perfetto_opener_serves_the_trace_once_to_the_ui(tmp_path):
    """What the Perfetto UI does with the URL: fetch the file from 127.0.0.1 with CORS allowed."""
    import threading
    import urllib.request

    from pytest_msrun import perfetto

    trace = tmp_path / "job.trace.json"
    trace.write_text('{"traceEvents": []}')
    port = free_port()
    result: list[bool] = []
    server = threading.Thread(target=lambda: result.append(perfetto.serve(str(trace), port, 30, False)))
    server.start()
    url = perfetto.ui_url(trace.name, port)
    assert url.startswith("https://ui.perfetto.dev/#!/?url=http://127.0.0.1:")
    target = url.split("?url=", 1)[1]
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(target, timeout=5) as resp:
                assert resp.headers["Access-Control-Allow-Origin"] == "https://ui.perfetto.dev"
                assert json.loads(resp.read()) == {"traceEvents": []}
            break
        except OSError:
            assert time.monotonic() < deadline, "the server never answered"
            time.sleep(0.05)
    server.join(timeout=30)
    assert result == [True]


@given(
    st.text(max_size=20),
    st.dictionaries(st.integers(1000, 5000), st.floats(1e9, 2e9), max_size=6),
    st.floats(1e9, 2e9),
    st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5) | st.lists(st.integers(), max_size=3)),
)
def test_spans_of_a_collective_are_the_spans_one_by_one(name, starts, end, args):
    lines = tracelog.spans(name, starts, 0, end, args)
    got = [json.loads(line) for line in lines.splitlines()] if starts else []
    assert got == [tracelog.span(name, pid, 0, at, end, args) for pid, at in starts.items()]


def test_follower_reads_whole_lines_once_and_a_torn_last_line_only_at_the_end(tmp_path):
    path = tmp_path / "ranks.jsonl"
    follower = tracelog.Follower(str(path))
    assert follower.read() == []  # no file yet: no rank has started
    a = tracelog.instant("python started", tracelog.RANK_PID, 0, 1.0)
    b = tracelog.instant("python started", tracelog.RANK_PID + 1, 0, 2.0)
    path.write_text(json.dumps(a) + "\n" + json.dumps(b)[:10])  # rank 1's line half written
    assert follower.read() == [a]
    with path.open("a") as fh:
        fh.write(json.dumps(b)[10:] + "\n")
    assert follower.read() == [b] and follower.read() == []
    with path.open("a") as fh:
        fh.write('{"name":"torn')  # a line whose writer died mid-write
    assert follower.read(final=True) == []
