"""The fork server: a job's msrun and its Python ranks forked from a template interpreter stand
for spawned ones exactly; what a fork cannot stand for starts as a new process and says why."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import textwrap

import pytest
from conftest import wait_gone

from pytest_msrun.engine import template
from pytest_msrun.plugin.controller.forkserver import ForkServer

PROBE = """
import json, os, signal, sys, warnings

import pytest

try:
    import fwprobe  # an installed framework, where the test gives one
except ImportError:
    fwprobe = None


VOLATILE = ("MSRUN_JOB_ID", "MSRUN_LAUNCHER_ID", "MSRUN_JOB_TOKEN", "MSRUN_LOG_DIR", "MSRUN_ERROR_FILE",
            "MSRUN_PYTEST_OPTIONS",
            "MS_SCHED_PORT", "MASTER_PORT", "MSRUN_REPORT_DIR", "MSRUN_SHARED_TMP", "MSRUN_BASETEMP",
            "MSRUN_WORLD", "MSRUN_WORLD_TOKEN", "MSRUN_DEBUG", "MSRUN_DEBUG_TOKEN", "PYTEST_CURRENT_TEST")


def _read(path, mode="r"):
    with open(path, mode) as fh:
        return fh.read()


def _proc_environ():
    pairs = _read("/proc/self/environ", "rb").split(b"\\0")
    out = dict(p.decode().split("=", 1) for p in pairs if p)
    return {k: v for k, v in out.items() if k not in VOLATILE and not k.startswith("PYTEST_XDIST")}


def _describe():
    env = dict(os.environ)
    for name in VOLATILE:
        env.pop(name, None)
    handlers = {}
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        handlers[int(sig)] = handler if isinstance(handler, int) else getattr(handler, "__name__", "?")
    return {
        "env": {k: v for k, v in env.items() if not k.startswith("PYTEST_XDIST")},
        "argv": sys.argv[1:],
        "argv0": os.path.basename(sys.argv[0]),
        "orig_argv": sys.orig_argv[1:3],
        "path": sys.path,
        "cwd": os.getcwd(),
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "handlers": handlers,
        "cpus": sorted(os.sched_getaffinity(0)),
        "session_leader": os.getsid(0) == os.getpid(),
        "group_leader": os.getpgid(0) == os.getpid(),
        "parent_is_msrun": _read(f"/proc/{os.getppid()}/comm").strip(),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")) [:3],
        "stdout_is_log": os.path.realpath(f"/proc/self/fd/1").endswith(f"worker_{os.environ['RANK_ID']}.log"),
        "umask": os.umask(0o22),
        "flags": list(sys.flags),
        "excepthook": sys.excepthook.__name__,
        "main": sys.modules["__main__"].__spec__.name,
        "unbuffered": sys.stdout.write_through if hasattr(sys.stdout, "write_through") else None,
        "cpus_allowed": [l for l in _read("/proc/self/status").splitlines() if l.startswith("Cpus_allowed_list")],
        "memory_policy": _read("/proc/self/numa_maps").splitlines()[0].split()[1].split("=")[0],
        "cmdline": _read("/proc/self/cmdline").split("\\0"),
        "proc_environ": _proc_environ(),
        "parent_cmdline": _read(f"/proc/{os.getppid()}/cmdline").split("\\0")[1:3],
        "warnings_filters": [repr(f) for f in warnings.filters],
        "modules_of_the_project": sorted(m for m in sys.modules if m in ("threadplugin",)),
        "path_hooks": [type(h).__name__ for h in sys.path_hooks],
        "meta_path": [type(h).__name__ for h in sys.meta_path],
        "framework": fwprobe and {**fwprobe.STATE, "same_module": sys.modules["fwprobe"] is fwprobe},
    }


@pytest.mark.msrun(worker_num=2, MARKER_ARGS)
def test_probe(rank):
    forked = "pytest_msrun.engine.template" in sys.modules and sys.modules["pytest_msrun.engine.template"].is_template()
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{rank}.json"), "w") as fh:
        json.dump({"forked": forked, "me": _describe()}, fh)
"""


THREAD_PLUGIN = """
import threading

threading.Thread(target=threading.Event().wait, daemon=True).start()
"""
# how the session's template comes to be: forked from the session's own process at its start (no
# plugin runs a thread: pytest-randomly's numpy starts BLAS threads), or spawned (a plugin's thread)
TEMPLATES = {"forked": ("-p", "no:randomly"), "spawned": ("-p", "threadplugin")}


# an installed framework (outside the project): what its import saw - the CPUs, a variable, the
# environment's size; preloaded by the fork server where the probe imports it
FRAMEWORK = """
import os, sys

STATE = {
    "cpus": sorted(os.sched_getaffinity(0)),
    "setting": os.environ.get("PROBE_SETTING"),
    "path0": sys.path[0] == os.getcwd(),
}
"""


def _probe(
    pytester, monkeypatch, tracked, mode: str, marker_args: str, how: str = "forked", framework: bool = False
) -> dict[str, dict]:
    out = pytester.path / "probe"
    out.mkdir(exist_ok=True)
    monkeypatch.setenv("PROBE_DIR", str(out))
    monkeypatch.setenv("PROBE_SETTING", "from the session")
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # msrun sets it for every rank
    libs = pytester.path.parent / f"{pytester.path.name}-libs"
    if framework:
        libs.mkdir(exist_ok=True)
        (libs / "fwprobe.py").write_text(FRAMEWORK)
    if str(pytester.path) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # (-p threadplugin)
        paths = [str(pytester.path), str(libs), os.environ.get("PYTHONPATH")]
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
    pytester.makepyfile(test_probe=PROBE.replace(", MARKER_ARGS", marker_args), threadplugin=THREAD_PLUGIN)
    # -W error: a plugin the fork server imported must not warn in the rank (rewriting: "already imported")
    base = pytester.path / "bt"  # (one name: the ranks see paths below it)
    args = ("-p", "no:cacheprovider", "-W", "error", f"--msrun-fork-server={mode}", f"--basetemp={base}")
    result = pytester.runpytest_subprocess(*args, *TEMPLATES[how], timeout=240)
    result.assert_outcomes(passed=1)
    said = [line for line in result.stdout.lines if line.startswith("msrun:")]
    preloading = "msrun: ranks start with fwprobe imported (the marked tests import it; --msrun-preload)"
    assert said == ([preloading] if framework and mode == "on" else []), said  # nothing else to say
    if mode == "on":
        said = {"forked": "forked from the session's process", "spawned": "started"}[how]
        log = (base / "msrun-fork-server.log").read_text()
        assert f": {said};" in log
        assert ("frameworks: fwprobe" in log) == framework, log
    # each session's own directories (pytester's runpytest-N) named alike
    names = ("rank0.json", "rank1.json")
    texts = {name: re.sub(r"runpytest-\d+", "runpytest-N", (out / name).read_text()) for name in names}
    return {name: json.loads(text) for name, text in texts.items()}


def _shows_itself() -> bool:
    """Whether a fork here can set its /proc/PID/cmdline and environ (``template.show_as``)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if template.show_as(["probe"], {"A": "1"}) else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize(
    "marker_args",
    [
        "",
        ", bind_core=True",  # taskset -c in front of a spawned rank
        pytest.param(", bind_numa=True", marks=pytest.mark.numactl),  # numactl --membind ...
    ],
)
@pytest.mark.parametrize("how", TEMPLATES)
def test_a_forked_rank_is_indistinguishable_from_a_spawned_one(pytester, monkeypatch, tracked, marker_args, how):
    forked = _probe(pytester, monkeypatch, tracked, "on", marker_args, how)
    spawned = _probe(pytester, monkeypatch, tracked, "off", marker_args, how)
    for name in ("rank0.json", "rank1.json"):
        assert forked[name]["forked"], "the fork server did not fork this rank"
        assert not spawned[name]["forked"]
        mine, theirs = forked[name]["me"], spawned[name]["me"]
        if not _shows_itself():  # a kernel without PR_SET_MM_MAP: a fork shows the template's (documented)
            for key in ("cmdline", "proc_environ", "parent_cmdline"):
                mine.pop(key), theirs.pop(key)
        env, env_theirs = mine.pop("env"), theirs.pop("env")
        keys = set(env) | set(env_theirs)
        assert {k: (env.get(k), env_theirs.get(k)) for k in keys if env.get(k) != env_theirs.get(k)} == {}
        differ = {key: (mine[key], theirs.get(key)) for key in mine if mine[key] != theirs.get(key)}
        assert not differ, differ
        assert mine["session_leader"] and mine["stdout_is_log"]


def test_a_rank_forked_with_a_preloaded_framework_is_indistinguishable_from_a_spawned_one(
    pytester, monkeypatch, tracked
):
    """The framework imported once by the fork server, before the fork, as the rank's own import
    would have: what its import saw (CPUs, variables) is what a spawned rank's import sees."""
    forked = _probe(pytester, monkeypatch, tracked, "on", "", framework=True)
    spawned = _probe(pytester, monkeypatch, tracked, "off", "", framework=True)
    for name in ("rank0.json", "rank1.json"):
        assert forked[name]["forked"] and not spawned[name]["forked"]
        assert forked[name]["me"]["framework"] == spawned[name]["me"]["framework"]
        assert forked[name]["me"]["framework"]["setting"] == "from the session"


def test_a_forked_rank_ignores_what_a_spawned_one_inherits_ignored(pytester, monkeypatch, tracked):
    """A session started with SIGINT and SIGQUIT ignored (``nohup``, ``&`` in a script, a CI runner):
    ``exec`` keeps an ignored signal ignored, so a spawned rank has them ignored - and a forked
    one, from either kind of template, the same."""
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGQUIT)}
    try:
        probes = {
            (mode, how): _probe(pytester, monkeypatch, tracked, mode, "", how)
            for mode in ("on", "off")
            for how in TEMPLATES
        }
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    for name in ("rank0.json", "rank1.json"):
        spawned = probes["off", "forked"][name]["me"]["handlers"]
        assert spawned[str(int(signal.SIGQUIT))] == int(signal.SIG_IGN), spawned
        for how in TEMPLATES:
            forked = probes["on", how][name]
            assert forked["forked"], "the fork server did not fork this rank"
            assert forked["me"]["handlers"] == spawned, how


def test_the_summary_says_why_ranks_start_as_new_processes(pytester, monkeypatch, tracked):
    pytester.makepyfile(
        test_why="""
        import pytest

        @pytest.mark.msrun(worker_num=2, env={"PYTHONHASHSEED": "7"})
        def test_seeded(rank):
            import sys
            assert "pytest_msrun.engine.template" not in sys.modules  # a new interpreter
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=240)
    result.assert_outcomes(passed=1)
    lines = [line for line in result.stdout.lines if line.startswith("msrun: ranks start as new processes")]
    assert len(lines) == 1 and "PYTHONHASHSEED" in lines[0], result.stdout.str()


def test_a_stale_fork_server_forks_nothing_more(pytester, monkeypatch, tracked):
    """A plugin the fork server imported, upgraded mid-session (its module rewritten): later jobs'
    msruns are spawned, and the summary says why; files a job writes beside it change nothing."""
    site = pytester.path / "site"
    info = site / "siteplugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: siteplugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pytest11]\nsiteplugin = siteplugin\n")
    (site / "siteplugin.py").write_text("VERSION = 1\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SITE_DIR", str(site))
    pytester.makepyfile(
        test_stale="""
        import os, sys
        import pytest

        def forked():
            return "pytest_msrun.engine.template" in sys.modules

        @pytest.mark.msrun(worker_num=1)
        def test_first(rank):
            assert forked()
            open(os.path.join(os.environ["SITE_DIR"], "notes.txt"), "w").close()  # beside: nothing

        @pytest.mark.msrun(worker_num=1, env={"SECOND": "1"})
        def test_second(rank):
            assert forked()
            path = os.path.join(os.environ["SITE_DIR"], "siteplugin.py")
            with open(path, "w") as fh:
                fh.write("VERSION = 2\\n")
            os.utime(path, ns=(0, 0))

        @pytest.mark.msrun(worker_num=1, env={"THIRD": "1"})
        def test_third(rank):
            assert not forked()
        """
    )
    # each world starts after the test before it (not ahead of it, beside it)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--msrun-prefetch=off", timeout=240)
    result.assert_outcomes(passed=3)
    lines = [line for line in result.stdout.lines if "changed since the fork server started" in line]
    assert len(lines) == 1 and "siteplugin.py" in lines[0], result.stdout.str()


def _job(tmp_path, worker: list[str]) -> list[str]:
    log_dir = tmp_path / "logs"
    return [
        sys.executable,
        "-m",
        "pytest_msrun",
        "--worker_num=1",
        "--local_worker_num=1",
        "--master_port=0",
        "--join=True",
        f"--log_dir={log_dir}",
        *worker,
    ]


def test_a_module_whose_import_starts_a_thread_is_left_to_the_ranks(tmp_path, monkeypatch, tracked):
    """numpy's BLAS pool, say: the template starts over without it, and forks as before."""
    (tmp_path / "threadmod.py").write_text(
        textwrap.dedent(
            """
            import threading
            STOP = threading.Event()
            threading.Thread(target=STOP.wait, daemon=True).start()
            """
        )
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    env = dict(os.environ)  # the template starts with this environment, as the job's
    server = ForkServer(lambda: (["threadmod"], []), lambda: str(tmp_path / "server.log"))
    try:
        cmd = _job(tmp_path, [sys.executable, "-m", "calendar", "2026", "12"])
        with open(tmp_path / "msrun.log", "wb") as log:
            proc = server.start_msrun(cmd, env, log.fileno(), log.fileno())
        assert proc is not None, server.refusals
        assert proc.wait(timeout=60) == 0, (tmp_path / "msrun.log").read_text()
        assert "December 2026" in (tmp_path / "logs" / "worker_0.log").read_text()
        assert not server.refusals
    finally:
        server.close()


def test_an_exception_in_a_forked_worker_is_its_error_file_and_exit_status(tmp_path, monkeypatch, tracked):
    (tmp_path / "boom.py").write_text("raise ValueError('forked and failed')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    env = dict(os.environ)
    server = ForkServer(lambda: ([], []), lambda: str(tmp_path / "server.log"))
    try:
        cmd = _job(tmp_path, [sys.executable, "-m", "boom"])
        with open(tmp_path / "msrun.log", "wb") as log:
            proc = server.start_msrun(cmd, env, log.fileno(), log.fileno())
        assert proc is not None, server.refusals
        assert proc.wait(timeout=60) == 1
        record = json.loads((tmp_path / "logs" / "worker_0.error.json").read_text())
        assert record["type"] == "ValueError" and record["message"] == "forked and failed"
        assert "ValueError: forked and failed" in (tmp_path / "logs" / "worker_0.log").read_text()
    finally:
        server.close()


@pytest.mark.parametrize(
    "env,origin,hook,expected",
    [
        ({"PYTHONPATH": "/h:/a", "X": "1"}, {"PYTHONPATH": "/a"}, "/h", []),
        ({"PYTHONPATH": "/h"}, {}, "/h", []),
        ({"PYTHONPATH": "/b"}, {"PYTHONPATH": "/a"}, "/h", ["PYTHONPATH"]),
        ({"LD_PRELOAD": "x.so", "LC_ALL": "C"}, {}, "", ["LC_ALL", "LD_PRELOAD"]),
        ({"RANK": "1", "MS_ROLE": "MS_WORKER", "OMP_NUM_THREADS": "2"}, {}, "", []),
    ],
)
def test_only_variables_start_up_reads_must_match(env, origin, hook, expected):
    assert template.differences(env, origin, hook) == expected


def test_the_template_leaves_nothing_when_its_session_closes_it(tmp_path, tracked):
    server = ForkServer(lambda: (["json"], []), lambda: str(tmp_path / "server.log"))
    server.begin()
    assert server._await_ready()
    server.close()
    assert not wait_gone(tracked)


def test_a_clean_session_forks_its_template_from_itself_and_ends_it(pytester, tracked):
    """A session that starts clean (``python -m pytest``, one thread, nothing traced, its first)
    forks its template from itself before any conftest is imported; the template ends with the
    session - one without a marked test, one stopped by a usage error after the fork - and one in
    a process that ran another session before it (in-process pytester) is started instead."""
    pytester.makepyfile(
        test_marked="import pytest\n\n@pytest.mark.msrun(worker_num=2)\ndef test_m(rank):\n    pass\n",
        test_plain="def test_p():\n    pass\n",
    )
    base = pytester.path / "bt"
    pytester.runpytest_subprocess(f"--basetemp={base}", "test_marked.py", timeout=240).assert_outcomes(passed=1)
    assert ": forked from the session's process;" in (base / "msrun-fork-server.log").read_text()
    pytester.runpytest_subprocess(f"--basetemp={base}", "test_plain.py", timeout=240).assert_outcomes(passed=1)
    assert pytester.runpytest_subprocess("--no-such-option", timeout=240).ret == pytest.ExitCode.USAGE_ERROR
    assert pytester.runpytest_subprocess("--msrun-worlds=bogus", timeout=240).ret == pytest.ExitCode.USAGE_ERROR
    assert not wait_gone(tracked)
    inner = pytester.path / "bt-inprocess"
    pytester.runpytest_inprocess(f"--basetemp={inner}", "test_marked.py").assert_outcomes(passed=1)
    assert ": started;" in (inner / "msrun-fork-server.log").read_text()


def test_a_project_plugin_is_imported_by_each_rank_under_its_own_environment(pytester, tracked):
    """A plugin of the project's own (``-p localplugin``, a module under the rootdir) imported by
    the session before its template was forked from it is imported again by each rank, as a
    started rank would: its import-time reads see the rank's environment, not the session's."""
    pytester.makepyfile(
        localplugin="import os\n\nRANK_AT_IMPORT = os.environ.get('RANK_ID')\n",
        test_rank="""
        import os
        import pytest
        import localplugin

        @pytest.mark.msrun(worker_num=2)
        def test_rank(rank):
            assert localplugin.RANK_AT_IMPORT == os.environ["RANK_ID"] == str(rank)
        """,
    )
    base = pytester.path / "bt"
    result = pytester.runpytest_subprocess(f"--basetemp={base}", "-p", "localplugin", timeout=240)
    result.assert_outcomes(passed=1)
    assert ": forked from the session's process;" in (base / "msrun-fork-server.log").read_text()


def test_a_project_that_ran_marked_tests_starts_its_fork_server_with_the_session(pytester, tracked):
    """pytest's cache remembers a session with marked tests: the next starts the fork server before
    it collects (its imports overlap the collection); a session without them forgets it."""
    pytester.makepyfile(
        test_marked="import pytest\n\n@pytest.mark.msrun(worker_num=1)\ndef test_m(rank):\n    pass\n",
        test_plain="def test_p():\n    pass\n",
    )

    def fork_server_started(*args: str) -> bool:
        base = pytester.path / f"bt{len(list(pytester.path.glob('bt*')))}"
        pytester.runpytest_subprocess(f"--basetemp={base}", *args, timeout=240).assert_outcomes(passed=1)
        return (base / "msrun-fork-server.log").exists()

    assert not fork_server_started("test_plain.py")
    assert fork_server_started("test_marked.py")
    assert fork_server_started("test_plain.py")  # remembered from the last session
    assert not fork_server_started("test_plain.py")  # which had none


ESCAPER = """
import os, subprocess, sys, time
pid = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(300)"]).pid
with open(os.environ["PIDS_FILE"], "w") as fh:
    fh.write(f"{os.getpid()} {pid} {'pytest_msrun.engine.template' in sys.modules}")
time.sleep(300)
"""


@pytest.mark.cgroup("v2")
def test_kill_9_of_a_forked_msrun_leaves_nothing(tmp_path, monkeypatch, tracked):
    """A forked msrun's forked worker and the process it started in a session of its own (out of
    every process group msrun knows) end with msrun's SIGKILL: the job's cgroup holds them."""
    from conftest import msrun_cgroups, wait_for

    (tmp_path / "escaper.py").write_text(ESCAPER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("PIDS_FILE", str(tmp_path / "pids"))
    before = msrun_cgroups()
    server = ForkServer(lambda: ([], []), lambda: str(tmp_path / "server.log"))
    try:
        with open(tmp_path / "msrun.log", "wb") as log:
            proc = server.start_msrun(
                _job(tmp_path, [sys.executable, "-m", "escaper"]), dict(os.environ), log.fileno(), log.fileno()
            )
        assert proc is not None, server.refusals
        pids = wait_for(lambda: (tmp_path / "pids").exists() and (tmp_path / "pids").read_text().split(), timeout=60)
        assert pids[2] == "True", "the worker was not forked"
        proc.kill()
        assert proc.wait(timeout=30) == -9
        server.close()  # (the template carries the mark too)
        left = wait_gone(tracked, timeout=10)
        assert not left, [p.cmdline() for p in left]
        wait_for(lambda: not (msrun_cgroups() - before), timeout=10)
    finally:
        server.close()
