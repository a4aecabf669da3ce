"""The pure half: config + node facts -> the exact processes, environments, logs and commands."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from pytest_msrun.binding.flags import parse_bind_value
from pytest_msrun.engine.config import LaunchConfig
from pytest_msrun.engine.plan import NodeFacts, RankAssignment, assign, build_plan

PY = sys.executable
# What a dry-run worker gets from the launcher, as MindSpore's msrun exports it
DRY_RUN_VARS = ("MS_SIMULATION_LEVEL", "MS_WORKER_NUM", "RANK_SIZE", "RANK_ID", "DEVICE_ID", "MS_NODE_ID")


def facts(**kw) -> NodeFacts:
    base = dict(
        master_ip="127.0.0.1",
        address_is_local=True,
        hostname="vm",
        source_ip="127.0.0.1",
        task_argv=[PY, "net.py"],
        task_python=PY,
        python=PY,
        scheduler_mode="builtin",
        job_id="job1",
        job_token="tok",
        master_port=8118,
        dist_port=-1,
        base_env={"PATH": "/bin", "RANK_ID": "0", "MS_ROLE": "MS_SCHED", "MSRUN_CPU_LIST": "[9]", "HOME": "/root"},
    )
    base.update(kw)
    return NodeFacts(**base)


def cfg(**kw) -> LaunchConfig:
    base = dict(task_script="net.py", worker_num=4, local_worker_num=4)
    base.update(kw)
    return LaunchConfig(**base)


def test_single_node_scheduler_and_workers():
    plan = build_plan(cfg(log_dir="msrun_log"), facts())
    assert [p.name for p in plan.processes] == ["scheduler", "worker_0", "worker_1", "worker_2", "worker_3"]
    sched = plan.scheduler
    assert sched.argv == [PY, "-S", "-m", "pytest_msrun.control.scheduler"]
    assert sched.log_path == "msrun_log/scheduler.log"
    for key, value in {
        "MS_ROLE": "MS_SCHED",
        "MS_SCHED_HOST": "127.0.0.1",
        "MS_SCHED_PORT": "8118",
        "MS_WORKER_NUM": "4",
        "MS_TOPO_TIMEOUT": "600",
        "RANK_SIZE": "4",
        "RANK_ID": "0",
    }.items():
        assert sched.env[key] == value, key
    assert "DEVICE_ID" not in sched.env and "MS_NODE_ID" not in sched.env and "MSRUN_CPU_LIST" not in sched.env
    for i, w in enumerate(plan.workers):
        assert w.rank == i and w.log_path == f"msrun_log/worker_{i}.log"
        env = w.env
        assert env["MS_ROLE"] == "MS_WORKER" and env["RANK_ID"] == str(i) and env["MS_NODE_ID"] == str(i)
        assert env["DEVICE_ID"] == str(i) and env["RANK_SIZE"] == "4" and env["MS_WORKER_NUM"] == "4"
        assert env["RANK"] == str(i) and env["LOCAL_RANK"] == str(i) and env["WORLD_SIZE"] == "4"
        assert env["LOCAL_WORLD_SIZE"] == "4" and env["GROUP_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "8119"
        assert env["PYTHONUNBUFFERED"] == "1" and env["HOME"] == "/root"
        assert "MSRUN_CPU_LIST" not in env


def test_inherited_stale_vars_never_leak():
    plan = build_plan(cfg(local_worker_num=2, worker_num=2), facts(base_env={"MS_NODE_ID": "7", "DEVICE_ID": "5"}))
    assert "MS_NODE_ID" not in plan.scheduler.env and "DEVICE_ID" not in plan.scheduler.env
    assert plan.workers[1].env["MS_NODE_ID"] == "1"


def test_node_rank_ignored_on_single_node():
    plan = build_plan(cfg(node_rank=3), facts())
    assert [w.rank for w in plan.workers] == [0, 1, 2, 3]


def test_multi_node_builtin_waits_for_the_control_plane():
    plan = build_plan(cfg(worker_num=8, local_worker_num=4, node_rank=1), facts())
    assert plan.layout.pending and all(w.rank is None for w in plan.workers)
    plan = assign(plan, RankAssignment(3, 1, 2))
    assert [w.rank for w in plan.workers] == [3, 4, 5, 6]
    assert [w.log_path for w in plan.workers] == [f"worker_{r}.log" for r in (3, 4, 5, 6)]
    assert plan.workers[0].env["GROUP_RANK"] == "1" and plan.workers[0].env["GROUP_WORLD_SIZE"] == "2"
    assert plan.workers[0].env["DEVICE_ID"] == "0" and plan.workers[0].env["LOCAL_WORLD_SIZE"] == "4"


def test_non_master_node_has_no_scheduler():
    plan = build_plan(cfg(worker_num=8, local_worker_num=4), facts(address_is_local=False))
    assert plan.scheduler is None and len(plan.workers) == 4


@pytest.mark.parametrize("mode", ["task"])
def test_msrun_rank_formula_without_builtin(mode):
    plan = build_plan(cfg(worker_num=8, local_worker_num=4, node_rank=1), facts(scheduler_mode=mode))
    assert [w.rank for w in plan.workers] == [4, 5, 6, 7]
    auto = build_plan(cfg(worker_num=8, local_worker_num=4), facts(scheduler_mode=mode))
    assert all(w.rank is None for w in auto.workers)
    assert [w.log_path for w in auto.workers] == [f"worker_{i}.log" for i in range(4)]
    assert all("RANK_ID" not in w.env and "MS_NODE_ID" not in w.env for w in auto.workers)
    assert any("not setting '--node_rank'" in t for t in auto.warnings)


def test_task_and_mindspore_scheduler_commands():
    task = build_plan(cfg(), facts(scheduler_mode="task"))
    assert task.scheduler.argv == [PY, "net.py"]
    assert "MSRUN_JOB_TOKEN" not in task.workers[0].env
    for mode in ("auto", "builtin", "mindspore"):
        # The builtin control plane in every mode but task; auto and mindspore add a MindSpore
        # scheduler behind it, run with the task's interpreter.
        plan = build_plan(cfg(), facts(scheduler_mode=mode))
        assert plan.scheduler.argv[-2:] == ["-m", "pytest_msrun.control.scheduler"]
        assert plan.scheduler.env["MSRUN_SCHEDULER"] == mode
        assert plan.scheduler.env.get("MSRUN_TASK_PYTHON") == (None if mode == "builtin" else PY)
        assert "MSRUN_JOB_TOKEN" in plan.workers[0].env


@pytest.mark.parametrize("mode", ["auto", "mindspore"])
def test_control_plane_modes_assign_ranks_before_start(mode):
    pending = build_plan(cfg(worker_num=8, local_worker_num=4), facts(scheduler_mode=mode))
    assert pending.layout.pending


OURS = {"PYTHONUNBUFFERED", "MSRUN_JOB_ID", "MSRUN_LAUNCHER_ID", "MSRUN_SCHEDULER", "MSRUN_LOG_DIR"}
TORCHRUN = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def test_dry_run_env():
    """msrun's dry-run variables, torchrun's (a strategy's init_process_group reads them), and
    where the rank records what it holds; no scheduler's, no LOCAL_RANK_SIZE (msrun sets none)."""
    plan = build_plan(cfg(sim_level=1), facts())
    assert plan.scheduler is None and len(plan.workers) == 4
    for i, w in enumerate(plan.workers):
        env = w.env
        assert env["MS_SIMULATION_LEVEL"] == "1" and env["RANK_ID"] == str(i) and env["DEVICE_ID"] == str(i)
        assert env["MS_WORKER_NUM"] == "4" and env["RANK_SIZE"] == "4" and env["MS_NODE_ID"] == str(i)
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
            str(i),
            "4",
            str(i),
            "4",
        )
        assert env["MSRUN_SIM_RECORD"] == w.log_path.removesuffix(".log") + ".sim.json"
        assert set(plan.to_json()["processes"][i]["exported"]) == {*DRY_RUN_VARS, *TORCHRUN, *OURS}
        for gone in (
            "MS_ROLE",
            "MS_SCHED_HOST",
            "MS_SCHED_PORT",
            "MS_TOPO_TIMEOUT",
            "LOCAL_RANK_SIZE",
            "MSRUN_SIM_BUDGET",
        ):
            assert gone not in env, gone
    budgeted = build_plan(cfg(sim_level=1, sim_budget="1.5KiB"), facts())
    assert {w.env["MSRUN_SIM_BUDGET"] for w in budgeted.workers} == {"1536"}
    cpus = len(os.sched_getaffinity(0))
    assert {w.env["MSRUN_SIM_THREADS"] for w in plan.workers} == {"1"}  # one each: ranks run on every CPU at once
    halves = build_plan(cfg(sim_level=1, sim_concurrency=2), facts())
    assert {w.env["MSRUN_SIM_THREADS"] for w in halves.workers} == {str(max(1, cpus // 2))}


def test_dry_run_single_rank():
    plan = build_plan(cfg(worker_num=64, local_worker_num=8, sim_level=0, sim_rank_id=5), facts())
    assert len(plan.workers) == 1
    w = plan.workers[0]
    assert w.rank == 5 and w.env["RANK_ID"] == "5" and w.env["DEVICE_ID"] == "0" and w.log_path == "worker_0.log"
    assert "MS_NODE_ID" not in w.env  # as msrun
    assert (w.env["RANK"], w.env["LOCAL_RANK"], w.env["LOCAL_WORLD_SIZE"]) == ("5", "5", "8")  # as torchrun would
    assert "In dryrun case, RANK_ID is assigned to 5." in plan.warnings


def test_dry_run_runs_every_rank_not_one_when_over_128():
    plan = build_plan(cfg(worker_num=4096, local_worker_num=4096, sim_level=0), facts())
    assert list(plan.sim_ranks) == list(range(4096))
    assert len(plan.workers) == 256, "the plan previews 256; the agent builds the rest one at a time"
    specs = plan.dry_run_workers()
    first = next(specs)
    assert first.rank == 0 and first.env["RANK_ID"] == "0" and first.env["RANK_SIZE"] == "4096"
    last = list(specs)[-1]
    assert last.rank == 4095 and last.env["DEVICE_ID"] == "4095" and last.log_path == "worker_4095.log"
    data = json.loads(plan.dumps())
    assert data["sim_ranks"] == "0-4095" and len(data["processes"]) == 256


def test_dry_run_selection():
    plan = build_plan(
        cfg(worker_num=1024, local_worker_num=1024, sim_level=1, sim_select="first:2,last:1,500-501"), facts()
    )
    assert list(plan.sim_ranks) == [0, 1, 500, 501, 1023]
    assert [w.rank for w in plan.dry_run_workers()] == [0, 1, 500, 501, 1023]
    assert [w.env["DEVICE_ID"] for w in plan.workers] == ["0", "1", "500", "501", "1023"]
    two_nodes = build_plan(
        cfg(worker_num=8, local_worker_num=4, node_rank=1, sim_level=0, sim_select="sample:2:7"),
        facts(scheduler_mode="task"),
    )
    assert all(4 <= r < 8 for r in two_nodes.sim_ranks) and len(two_nodes.sim_ranks) == 2
    again = build_plan(
        cfg(worker_num=8, local_worker_num=4, node_rank=1, sim_level=0, sim_select="sample:2:7"),
        facts(scheduler_mode="task"),
    )
    assert again.sim_ranks == two_nodes.sim_ranks, "a sample is reproducible"
    for node, ranks in [(0, [0, 3, 5]), (1, [10, 12, 15])]:  # a mesh is over the job; a node runs its own ranks of it
        c = cfg(worker_num=16, local_worker_num=8, node_rank=node, sim_level=0, sim_select="mesh:4x4")
        assert list(build_plan(c, facts(scheduler_mode="task")).sim_ranks) == ranks


def test_dry_run_from_env_keeps_rank_size():
    c = cfg(sim_level=2, sim_from_env=True)
    plan = build_plan(c, facts(base_env={"MS_SIMULATION_LEVEL": "2", "RANK_SIZE": "32"}))
    assert plan.workers[0].env["RANK_SIZE"] == "32" and plan.workers[0].env["MS_SIMULATION_LEVEL"] == "2"


def test_worker_log_name_placeholders():
    c = cfg(worker_num=4, local_worker_num=2, node_rank=1, worker_log_name="w_{ip}_{hostname}")
    plan = build_plan(c, facts(scheduler_mode="task", source_ip="10.0.0.2"))
    assert [w.log_path for w in plan.workers] == ["w_10.0.0.2_vm_2.log", "w_10.0.0.2_vm_3.log"]


def test_tail_selection_by_global_rank():
    c = cfg(join=True, tail_worker_log="1,3")
    plan = build_plan(c, facts())
    assert [w.tail for w in plan.workers] == [False, True, False, True]
    assert all(not w.tail for w in build_plan(cfg(tail_worker_log="1"), facts()).workers), "only with --join"


def test_rank_table_and_bind_file_env(tmp_path):
    bind = tmp_path / "bind.json"
    bind.write_text(json.dumps({"bind_config": {"bind_cpu_mode": "none", "bind_memory_mode": "none"}}))
    spec = parse_bind_value(str(bind), "bind_numa")
    from pytest_msrun.binding.topology import Topology

    vm = Topology.load(str(Path(__file__).resolve().parents[1] / "fixtures" / "vm_1node_2cpu.json"))
    plan = build_plan(cfg(rank_table_file="/rt.json", bind_numa=spec), facts(topology=vm))
    for p in plan.processes:
        assert p.env["RANK_TABLE_FILE"] == "/rt.json"
        assert p.env["MSRUN_BIND_FILE"] == str(bind) and len(p.env["MSRUN_BIND_FILE_HASH"]) == 64


def test_plan_json_hides_the_token_and_full_env():
    plan = build_plan(cfg(), facts())
    data = json.loads(plan.dumps())
    assert data["processes"][1]["exported"]["RANK_ID"] == "0"
    assert "MSRUN_JOB_TOKEN" not in json.dumps(data) and "HOME" not in json.dumps(data)
    assert data["processes"][1]["command"] == [PY, "net.py"]


def test_dist_port_override():
    plan = build_plan(cfg(), facts(dist_port=29500))
    assert plan.workers[0].env["MASTER_PORT"] == "29500"
