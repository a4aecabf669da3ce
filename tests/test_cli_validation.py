"""Bad input: one clear error naming the flag, exit status 2, nothing started."""

from __future__ import annotations

import ipaddress
import json

import pytest
from conftest import REPO, free_port, job_args, wait_for

BAD = [
    (["--worker_num=0"], "--worker_num", "greater than 0"),
    (["--worker_num=x"], "--worker_num", "invalid int value"),
    (["--local_worker_num=0"], "--local_worker_num", "at least 1"),
    (["--worker_num=2", "--local_worker_num=4"], "--local_worker_num", "pass --local_worker_num=2 or raise"),
    (["--worker_num=4"], "--local_worker_num", "8 (the default) exceeds --worker_num=4; pass --local_worker_num=4"),
    (["--master_port=70000"], "--master_port", "not a TCP port"),
    (["--master_port=-1"], "--master_port", "not a TCP port"),
    (["--worker_num=4", "--local_worker_num=2", "--master_port=0"], "--master_port", "one node"),
    (["--node_rank=-2"], "--node_rank", "invalid"),
    (["--worker_num=4", "--local_worker_num=2", "--node_rank=3"], "--node_rank", "cannot fit"),
    (["--join=maybe"], "--join", "use True or False"),
    (["--sim_level=5"], "--sim_level", "invalid choice"),
    (["--sim_level=0", "--sim_rank_id=9", "--worker_num=4", "--local_worker_num=4"], "--sim_rank_id", "outside"),
    (["--sim_rank_id=1"], "--sim_rank_id", "needs --sim_level"),
    (["--rank_table_file=/nonexistent/rt.json"], "--rank_table_file", "does not exist"),
    (["--tail_worker_log=a"], "--tail_worker_log", "not a rank number"),
    (["--worker_num=2", "--local_worker_num=2", "--tail_worker_log=5"], "--tail_worker_log", "outside"),
    (["--worker_log_name=a/b"], "--worker_log_name", "not a path"),
    (["--master_addr=no-such-host.invalid"], "--master_addr", "cannot resolve"),
    (["--scheduler=bogus"], "--scheduler", "invalid choice"),
    (["--bind_core=[1]"], "--bind_core", "JSON object"),
    (['--bind_core={"gpu0": ["0"]}'], "--bind_core", "'scheduler' or 'deviceN'"),
    (['--bind_core={"device0": "0"}'], "--bind_core", "list of range strings"),
    (['--bind_core={"device0": [0]}'], "--bind_core", "must be a string"),
    (['--bind_core={"device0": ["3-1"]}'], "--bind_core", "start exceeds end"),
    (["--bind_numa=missing.json"], "--bind_numa", "does not exist"),
    (['--bind_numa={"bind_config": {"bind_cpu_mode": "x"}}'], "--bind_numa", "bind_cpu_mode"),
    (['--bind_core={"bind_config": {}}'], "--bind_core", "belongs to --bind_numa"),
    (["--dist_port=99999"], "--dist_port", "not a TCP port"),
    # what cannot exist is refused before it is expanded (this one once took 2.4 GB)
    (['--bind_core={"device0": ["0-99999999999"]}'], "--bind_core", "cannot exist: CPU ids go up to 65535"),
    (['--bind_numa={"device0": ["70000"]}'], "--bind_numa", "cannot exist"),
    (["--worker_num=99999999999", "--local_worker_num=1"], "--worker_num", "more than msrun can start"),
    (
        ["--worker_num=8", "--local_worker_num=8", "--sim_level=0", "--sim_select=0-99999999999"],
        "--sim_select",
        "outside",
    ),
    (["--worker_num=2", "--local_worker_num=2", "--tail_worker_log=" + "9" * 5000], "--tail_worker_log", ""),
]


@pytest.mark.parametrize("args,flag,text", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_flag_exits_2_naming_the_flag(msrun, env_dump, args, flag, text):
    join = [] if any(a.startswith("--join") for a in args) else ["--join=True"]
    job = msrun.run([*args, *join, "--log_dir=logs", "env_dump.py"])
    assert job.returncode == 2, job.stderr
    error_lines = [line for line in job.stderr.splitlines() if line.startswith("msrun: error:")]
    assert len(error_lines) == 1, job.stderr
    assert flag in error_lines[0] and text in error_lines[0], error_lines[0]
    assert job.stdout == ""
    assert not (msrun.cwd / "logs").exists(), "nothing may be created before validation passed"
    assert not list(msrun.dump.iterdir())


@pytest.mark.parametrize(
    ("name", "value"),
    [("MSRUN_CGROUP", "v3"), ("MSRUN_AUTH_TIMEOUT", "5s"), ("MSRUN_SLURM", "2"), ("MSRUN_ERROR_FILES", "maybe")],
)
def test_a_malformed_variable_exits_2_naming_it(msrun, name, value):
    msrun.script("x.py", "pass\n")
    args = ["--worker_num=1", "--local_worker_num=1", "--join=True", "--log_dir=logs", "x.py"]
    job = msrun.run(args, env={name: value})
    assert job.returncode == 2
    (line,) = [ln for ln in job.stderr.splitlines() if "error" in ln]
    assert f"{name}={value!r}" in line and "must be" in line, line
    assert not (msrun.cwd / "logs").exists()


# --master_addr with a zone (issue 45): each once waited for the cluster time out (600 s).
ZONES = [
    ("127.0.0.1%lo", "an IPv4 address has no zone ('%lo' belongs to IPv6 link-local ones); give 127.0.0.1"),
    ("fe80::1%nosuchif0", "this host has no network interface 'nosuchif0' (it has "),
    ("[fe80::1%]", "the zone after '%' is empty; name the interface ("),
    ("fe80::1%lo", "it can be neither bound nor reached through lo ("),  # lo has no link-local address
    ("fe80::1", "a link-local address is reached through one interface, which it does not name; give fe80::1%"),
]


@pytest.mark.parametrize(("addr", "why"), ZONES, ids=[a for a, _ in ZONES])
def test_a_master_addr_whose_zone_cannot_work_exits_2_before_anything_starts(msrun, env_dump, addr, why):
    job = msrun.run(job_args(1, f"--master_addr={addr}", "env_dump.py"), timeout=30)
    assert job.returncode == 2, job.stderr
    (line,) = [ln for ln in job.stderr.splitlines() if ln.startswith("msrun: error:")]
    assert line.startswith(f"msrun: error: --master_addr={addr}: {why}"), line
    assert not (msrun.cwd / "logs").exists() and not list(msrun.dump.iterdir())


def link_local_address() -> str:
    """A link-local IPv6 address of this host with its zone (``fe80::...%eth0``), or ""."""
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as fh:
            rows = [line.split() for line in fh]
    except OSError:
        return ""
    for row in rows:  # address, index, prefix, scope (20: link), flags (0x40 tentative, 0x08 DAD failed), name
        if len(row) == 6 and row[3] == "20" and not int(row[4], 16) & 0x48:
            text = ":".join(row[0][i : i + 4] for i in range(0, 32, 4))
            return f"{ipaddress.ip_address(text)}%{row[5]}"
    return ""


def test_a_link_local_master_addr_with_its_zone_runs_a_job(msrun):
    addr = link_local_address()
    if not addr:
        pytest.skip("this host has no link-local IPv6 address to run a job on")
    msrun.script(
        "job.py",
        """
        from pytest_msrun import cluster
        cluster.init()
        print("gathered", cluster.all_gather_object(cluster.get_rank()), flush=True)
        cluster.barrier()
        """,
    )
    job = msrun.run(job_args(2, f"--master_addr={addr}", "--scheduler=builtin", "job.py"), timeout=60)
    assert job.returncode == 0, job.stderr
    assert "gathered [0, 1]" in job.log("worker_0.log") and "gathered [0, 1]" in job.log("worker_1.log")


def test_missing_task_script(msrun):
    job = msrun.run(["--worker_num=1", "--local_worker_num=1"])
    assert job.returncode == 2
    assert "task_script" in job.stderr


def test_missing_py_script_is_reported_before_start(msrun):
    job = msrun.run(["--worker_num=1", "--local_worker_num=1", "--join=True", "nope.py"])
    assert job.returncode == 2
    assert "nope.py" in job.stderr and "not found" in job.stderr


def test_a_non_executable_shell_script_is_refused_before_start(msrun):
    """msrun runs a file that is not executable with Python: a #!/bin/sh script would die with a
    SyntaxError in every rank after the job started."""
    msrun.script("job.sh", "#!/bin/sh\necho hi\n")
    job = msrun.run(["--worker_num=1", "--local_worker_num=1", "--join=True", "--log_dir=logs", "job.sh"])
    assert job.returncode == 2
    (line,) = [ln for ln in job.stderr.splitlines() if ln.startswith("msrun: error:")]
    assert "not executable" in line and "chmod +x job.sh" in line and "msrun ... /bin/sh job.sh" in line
    assert not (msrun.cwd / "logs").exists()
    (msrun.cwd / "job.sh").chmod(0o755)
    ok = msrun.run(["--worker_num=1", "--local_worker_num=1", "--join=True", "--log_dir=logs", "job.sh"])
    assert ok.returncode == 0 and "hi" in ok.log("worker_0.log")


@pytest.mark.parametrize(
    ("line", "missing"),
    [
        ("#!/nonexistent/sh", "'/nonexistent/sh' is not an executable file"),
        ("#!/usr/bin/env nosuchsh", "'nosuchsh' is not on PATH"),
    ],
)
def test_a_script_whose_interpreter_is_missing_is_refused_before_start(msrun, line, missing):
    """The kernel would fail every worker's start (ENOENT for the script itself)."""
    path = msrun.script("job.sh", f"{line}\necho hi\n")
    path.chmod(0o755)
    job = msrun.run(["--worker_num=1", "--local_worker_num=1", "--join=True", "--log_dir=logs", "./job.sh"])
    assert job.returncode == 2, job.stderr
    (error,) = [ln for ln in job.stderr.splitlines() if ln.startswith("msrun: error:")]
    assert missing in error and "#! line" in error
    assert not (msrun.cwd / "logs").exists()


def test_a_worker_that_cannot_be_executed_is_a_launch_error_with_nothing_left(msrun):
    """A start that fails once msrun runs (here: an executable file the kernel cannot run) is one
    error line and status 1, with whatever had started stopped - not a traceback."""
    path = msrun.cwd / "garbage"
    path.write_bytes(b"\x00\x01 not a program\n")
    path.chmod(0o755)
    job = msrun.run(["--worker_num=2", "--local_worker_num=2", "--join=True", "--log_dir=logs", "./garbage"])
    assert job.returncode == 1, job.stderr
    assert "Traceback" not in job.stderr
    (error,) = [ln for ln in job.stderr.splitlines() if ln.startswith("msrun: error:")]
    assert "cannot start the job's processes" in error and "Exec format error" in error and "garbage" in error


def test_two_identical_launches_at_once_one_runs_one_is_refused(msrun):
    """The port is bound by msrun itself before anything starts (no check-then-bind gap): of two
    jobs on the same port, one runs and the other exits 2 with nothing created."""
    # The job that runs holds the port until the test lets it go - after the other has exited -
    # so "at once" does not depend on how quickly a loaded machine starts the second msrun.
    msrun.script(
        "x.py",
        """
        import os, time
        deadline = time.monotonic() + 120
        while not os.path.exists(os.environ["RELEASE"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        """,
    )
    for attempt in range(3):
        port = free_port()
        release = msrun.cwd / f"release{attempt}"
        args = ["--worker_num=2", "--local_worker_num=2", f"--master_port={port}", "--join=True"]
        args += ["--dist_port=70000", "--dist_port=-1"]
        env = {"RELEASE": str(release)}
        a = msrun.start([*args, f"--log_dir=a{attempt}", "x.py"], env=env)
        b = msrun.start([*args, f"--log_dir=b{attempt}", "x.py"], env=env)
        wait_for(lambda a=a, b=b: a.poll() is not None or b.poll() is not None, timeout=60)
        early = [p.returncode for p in (a, b) if p.poll() is not None]  # ended while the other held the port
        release.touch()
        codes = sorted([msrun.finish(a).returncode, msrun.finish(b).returncode])
        assert early == [2] and codes == [0, 2], (early, codes)
        assert len([d for d in (f"a{attempt}", f"b{attempt}") if (msrun.cwd / d).exists()]) == 1


def test_print_plan_needs_no_task_script_here(msrun):
    """--print_plan starts nothing, so the script may live on the machine the plan is for."""
    fixture = REPO / "fixtures" / "dgx_8gpu_2numa.json"
    job = msrun.run(
        ["--worker_num=8", "--local_worker_num=8", "--bind_core=True", "--print_plan", "x.py"],
        env={"MSRUN_TOPOLOGY": str(fixture)},
    )
    assert job.returncode == 0, job.stderr
    plan = json.loads(job.stdout)
    assert plan["processes"][1]["command"][-1] == "x.py"


def test_bad_bind_file_contents(msrun, env_dump, tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "mode.json").write_text(json.dumps({"bind_config": {"bind_memory_mode": "cpu"}}))
    (tmp_path / "key.json").write_text(json.dumps({"bind_config": {"bind_cpu_mode": "cpu"}, "bind_cpu": {"gpu1": {}}}))
    (tmp_path / "int.json").write_text(
        json.dumps({"bind_config": {"bind_cpu_mode": "cpu"}, "bind_cpu": {"device0": {"main": 3}}})
    )
    for name, text in [
        ("bad.json", "failed to load"),
        ("mode.json", "bind_memory_mode"),
        ("key.json", "'gpu1'"),
        ("int.json", "bind_cpu.device0.main"),
    ]:
        job = msrun.run(["--worker_num=1", "--local_worker_num=1", f"--bind_numa={name}", "env_dump.py"])
        assert job.returncode == 2, (name, job.stderr)
        assert "--bind_numa" in job.stderr and text in job.stderr, (name, job.stderr)


@pytest.mark.parametrize("join", ["True", "False"])
def test_port_in_use_is_a_clear_error(msrun, env_dump, join):
    """Nothing started, and nothing written: not even ``--join=False``'s supervisor log."""
    import socket

    before = sorted(p.name for p in msrun.cwd.iterdir())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        job = msrun.run(
            ["--worker_num=1", "--local_worker_num=1", f"--master_port={port}", f"--join={join}", "env_dump.py"]
        )
    assert job.returncode == 2
    assert f"--master_port: 127.0.0.1:{port} is already in use" in job.stderr
    assert not list(msrun.dump.iterdir())
    assert sorted(p.name for p in msrun.cwd.iterdir()) == before


@pytest.mark.parametrize("where", ["/proc/msrun-logs", "/sys/msrun/logs", "/proc/self/fd/logs"])
def test_a_log_dir_on_the_kernels_own_file_systems_exits_2(msrun, env_dump, where):
    job = msrun.run(["--worker_num=1", "--local_worker_num=1", "--join=True", f"--log_dir={where}", "env_dump.py"])
    assert job.returncode == 2, job.stderr
    errors = [line for line in job.stderr.splitlines() if line.startswith("msrun: error:")]
    assert len(errors) == 1 and "--log_dir" in errors[0] and "choose a directory on a real file system" in errors[0]
    assert "Traceback" not in job.stderr and not list(msrun.dump.iterdir())


def test_a_log_dir_that_cannot_be_made_exits_2(msrun, env_dump, tmp_path):
    """What validation cannot foresee (here: a name too long for the file system) is still a
    usage error naming the flag, raised before anything starts."""
    where = tmp_path / ("x" * 300)
    job = msrun.run(["--worker_num=1", "--local_worker_num=1", "--join=True", f"--log_dir={where}", "env_dump.py"])
    assert job.returncode == 2, job.stderr
    errors = [line for line in job.stderr.splitlines() if line.startswith("msrun: error:")]
    assert len(errors) == 1 and "--log_dir: cannot create" in errors[0], job.stderr
    assert "Start worker" not in job.stdout + job.stderr and not list(msrun.dump.iterdir())


@pytest.mark.parametrize(
    "value,expected", [("True", True), ("true", True), ("1", True), ("False", False), ("0", False)]
)
def test_join_spellings(value, expected):
    from pytest_msrun.engine.cliparser import build_parser

    ns = build_parser().parse_args([f"--join={value}", "x.py"])
    assert ns.join is expected


def test_task_args_pass_through_verbatim():
    from pytest_msrun.engine.cliparser import build_parser

    ns = build_parser().parse_args(["--worker_num=2", "s.py", "--join=True", "--worker_num", "9", "-x"])
    assert ns.task_script == "s.py"
    assert ns.task_script_args == ["--join=True", "--worker_num", "9", "-x"]
    assert ns.worker_num == 2


def test_help_lists_all_fifteen_flags():
    from pytest_msrun.engine.cliparser import build_parser

    text = build_parser().format_help()
    for flag in (
        "--worker_num",
        "--local_worker_num",
        "--master_addr",
        "--master_port",
        "--node_rank",
        "--log_dir",
        "--join",
        "--cluster_time_out",
        "--bind_core",
        "--bind_numa",
        "--sim_level",
        "--sim_rank_id",
        "--rank_table_file",
        "--worker_log_name",
        "--tail_worker_log",
        "task_script",
        "task_script_args",
    ):
        assert flag in text
