"""msrun inside a Slurm step takes the flags it was not given from the step's variables.

These run without Slurm: the step's variables are set by hand exactly as ``srun`` sets them
(a real cluster runs the same paths in ``test_slurm.py``).
"""

from __future__ import annotations

import json

import pytest
from conftest import read_status

from pytest_msrun.engine.slurm import (
    PORT_BASE,
    PORT_SPAN,
    HostlistError,
    allocation,
    expand_hostlist,
    slurm_step,
    tasks_per_node,
)


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[1-2]", ["node1", "node2"]),
        ("gpu[01-04,07],login2", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "login2"]),
        ("a,b[8-10]", ["a", "b8", "b9", "b10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("x[1-2].dom,y", ["x1.dom", "x2.dom", "y"]),
        ("", []),
    ],
)
def test_hostlists_expand_like_scontrol(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[1-2", "node1-2]", "node[a-b]", "node[3-1]", "n[[1]]", "n[1-]"])
def test_malformed_hostlists_are_refused(text):
    with pytest.raises(HostlistError):
        expand_hostlist(text)


def test_tasks_per_node_syntax():
    assert tasks_per_node("1(x2)") == [1, 1]
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]


def test_an_allocation_knows_its_nodes_and_their_cpus():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_JOB_CPUS_PER_NODE": "8(x2),4"}
    alloc = allocation(env)
    assert alloc is not None and alloc.nodes == ["gpu01", "gpu02", "gpu03"] and alloc.cpus == (8, 8, 4)
    assert allocation({**env, "SLURM_JOB_CPUS_PER_NODE": "8"}).cpus == ()  # not one count per node: unknown
    assert allocation({**env, "SLURM_STEP_ID": "0"}) is None  # inside a step's task: no steps of our own
    assert allocation({**env, "SLURM_STEP_ID": "interactive"}) is not None  # an salloc shell
    assert allocation({}) is None


def test_each_step_asks_for_its_ranks_cpus_on_nodes_slurm_picks():
    alloc = allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_CPUS_PER_NODE": "4(x4)"})
    argv = alloc.srun(2, 3, label="msrun-test")
    assert argv[:4] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1"]
    assert "--cpus-per-task=3" in argv and "--exact" in argv and "--kill-on-bad-exit=1" in argv
    assert not any(a.startswith(("--nodelist", "--overlap")) for a in argv)  # Slurm places it, CPUs its own
    assert "--cpus-per-task=4" in alloc.srun(1, 16)  # never more than a node of the allocation holds
    assert alloc.cpus_for(0) == 1
    assert not any(a.startswith("--gpus") for a in alloc.srun(2, 2, devices=4))  # Slurm manages no GPUs here


@pytest.mark.parametrize(
    "env",
    [{"SLURM_GPUS_ON_NODE": "4"}, {"SLURM_GPUS_PER_NODE": "a100:4"}, {"SLURM_JOB_GPUS": "0,1,2,3"}],
)
def test_where_slurm_manages_gpus_a_step_asks_for_its_own(env):
    alloc = allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", **env})
    assert alloc.gpus == 4
    assert "--gpus-per-node=2" in alloc.srun(2, 2, devices=4)  # a job's devices, spread over its nodes
    assert "--gpus-per-node=3" in alloc.srun(2, 3, devices=5)


def step_env(node: int, nodes: str = "localhost,remotehost", **extra: str) -> dict[str, str]:
    count = len(expand_hostlist(nodes))
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_NODEID": str(node),
        "SLURM_STEP_NODELIST": nodes,
        "SLURM_JOB_NODELIST": nodes,
        "SLURM_STEP_NUM_NODES": str(count),
        "SLURM_STEP_TASKS_PER_NODE": f"1(x{count})",
        "SLURM_NTASKS": str(count),
        "SLURM_PROCID": str(node),
        "SLURM_LOCALID": "0",
    }
    env.update(extra)
    return env


def test_only_an_srun_step_counts():
    assert slurm_step({}) is None
    batch = step_env(0)
    del batch["SLURM_STEP_ID"]
    assert slurm_step(batch) is None  # an sbatch script or an salloc shell: this node only
    assert slurm_step({**step_env(0), "SLURM_STEP_ID": "batch"}) is None
    assert slurm_step({**step_env(0), "MSRUN_SLURM": "0"}) is None
    step = slurm_step(step_env(1))
    assert step is not None and step.node_id == 1 and step.nodes == ["localhost", "remotehost"]


def test_every_node_derives_the_same_port_and_steps_differ():
    ports = {slurm_step(step_env(n)).master_port for n in (0, 1)}  # type: ignore[union-attr]
    assert len(ports) == 1
    port = ports.pop()
    assert PORT_BASE <= port < PORT_BASE + PORT_SPAN
    other_step = slurm_step({**step_env(0), "SLURM_STEP_ID": "1"})
    other_job = slurm_step({**step_env(0), "SLURM_JOB_ID": "4243"})
    assert other_step is not None and other_job is not None
    assert port != other_step.master_port and port != other_job.master_port


def plan(msrun, args, env):
    job = msrun.run(["--print_plan", *args, "task.py"], env=env)
    assert job.returncode == 0, job.stderr
    return json.loads(job.stdout)


def test_flags_not_given_come_from_the_step(msrun):
    msrun.script("task.py", "pass\n")
    p = plan(msrun, ["--local_worker_num=2"], step_env(1))
    expected_port = slurm_step(step_env(1)).master_port  # type: ignore[union-attr]
    assert (p["worker_num"], p["local_worker_num"], p["node_rank"]) == (4, 2, 1)
    assert p["master_ip"] == "127.0.0.1" and p["master_port"] == expected_port
    assert p["slurm"]["inferred"] == {
        "node_rank": 1,
        "worker_num": 4,
        "master_addr": "localhost",
        "master_port": expected_port,
    }
    assert p["slurm"]["job_id"] == "4242" and p["slurm"]["nodes"] == ["localhost", "remotehost"]


def test_given_flags_always_win(msrun):
    msrun.script("task.py", "pass\n")
    args = ["--worker_num=6", "--local_worker_num=3", "--node_rank=0", "--master_addr=127.0.0.1", "--master_port=7100"]
    p = plan(msrun, args, step_env(1))
    assert (p["worker_num"], p["local_worker_num"], p["node_rank"], p["master_port"]) == (6, 3, 0, 7100)
    assert p["slurm"]["inferred"] == {}


def test_workers_per_node_from_a_given_worker_num(msrun):
    msrun.script("task.py", "pass\n")
    p = plan(msrun, ["--worker_num=6"], step_env(0))
    assert (p["worker_num"], p["local_worker_num"]) == (6, 3)
    job = msrun.run(["--print_plan", "--worker_num=5", "task.py"], env=step_env(0))
    assert job.returncode == 2
    assert "--local_worker_num" in job.stderr and "2 nodes" in job.stderr


def test_several_tasks_per_node_is_one_clear_error(msrun, tmp_path):
    msrun.script("task.py", "pass\n")
    job = msrun.run(
        ["--local_worker_num=2", "--log_dir=logs", "task.py"], env=step_env(0, SLURM_STEP_TASKS_PER_NODE="2(x2)")
    )
    assert job.returncode == 2
    assert job.stderr.count("msrun: error:") == 1 and "--ntasks-per-node=1" in job.stderr
    assert not (tmp_path / "logs").exists()  # nothing started


def test_one_token_per_step_from_the_users_secret(msrun):
    msrun.script("task.py", "pass\n")
    auth = {plan(msrun, ["--local_worker_num=2"], step_env(n))["auth"] for n in (0, 1)}
    assert len(auth) == 1 and "secret" in auth.pop()


def test_a_two_node_step_runs_as_one_job(msrun, env_dump):
    """Two msruns with the step's variables and no flag but --local_worker_num form one 4-rank job
    (both "hosts" are this machine, so the first claims the derived port and hosts the scheduler)."""
    nodes = "localhost,localhost"
    args = ["--local_worker_num=2", "--join=True", "--log_dir=logs", "--cluster_time_out=30", "env_dump.py"]
    popens = [msrun.start(args, env=step_env(n, nodes)) for n in (0, 1)]
    jobs = [msrun.finish(p) for p in popens]
    for job in jobs:
        assert job.returncode == 0, job.stderr
        assert "Slurm job 4242 step 0" in job.stdout and "inferred --node_rank=" in job.stdout
    dumps = [d for d in msrun.dumps() if d.get("MS_ROLE") == "MS_WORKER"]
    by_rank = {int(d["RANK_ID"]): d for d in dumps}
    assert sorted(by_rank) == [0, 1, 2, 3]
    assert {by_rank[r]["GROUP_RANK"] for r in (0, 1)} == {"0"} and {by_rank[r]["GROUP_RANK"] for r in (2, 3)} == {"1"}
    assert {d["MS_WORKER_NUM"] for d in dumps} == {"4"}
    assert {read_status(msrun.cwd / "logs", f"msrun_status_node{n}.json")["state"] for n in (0, 1)} == {"succeeded"}


def test_where_slurm_tracks_memory_a_step_asks_its_cpus_share():
    """A step that names no memory would hold all of the allocation's memory on its nodes, and
    the next step on that node would wait however many CPUs are free."""
    base = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_CPUS_PER_NODE": "8(x2)"}
    assert "--mem-per-cpu=4000M" in allocation({**base, "SLURM_MEM_PER_CPU": "4000"}).srun(1, 2)
    assert "--mem-per-cpu=8000M" in allocation({**base, "SLURM_MEM_PER_NODE": "64000"}).srun(1, 2)
    assert not any(a.startswith("--mem") for a in allocation(base).srun(1, 2))
