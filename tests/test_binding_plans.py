"""Placements for every fixture machine, against hand-derived expectations (no process is started)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pytest_msrun.binding.flags import parse_bind_value
from pytest_msrun.binding.strategies import BindingError
from pytest_msrun.binding.topology import Topology
from pytest_msrun.engine.config import LaunchConfig
from pytest_msrun.engine.plan import NodeFacts, build_plan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TOOLS = {"taskset": "/usr/bin/taskset", "numactl": "/usr/bin/numactl"}


def topo(name: str) -> Topology:
    return Topology.load(str(FIXTURES / f"{name}.json"))


def plan(
    name: str,
    local: int,
    core: str = "False",
    numa: str = "False",
    env: dict | None = None,
    tools: dict | None = None,
    sim: int = -1,
):
    cfg = LaunchConfig(
        task_script="t.py",
        worker_num=local,
        local_worker_num=local,
        sim_level=sim,
        bind_core=parse_bind_value(core, "bind_core"),
        bind_numa=parse_bind_value(numa, "bind_numa"),
    )
    facts = NodeFacts(
        master_ip="127.0.0.1",
        address_is_local=True,
        hostname="h",
        source_ip="127.0.0.1",
        task_argv=[sys.executable, "t.py"],
        task_python=sys.executable,
        python=sys.executable,
        scheduler_mode="task",
        job_id="j",
        job_token="",
        master_port=8118,
        dist_port=-1,
        base_env=env or {},
        topology=topo(name),
        tools=TOOLS if tools is None else tools,
    )
    return build_plan(cfg, facts)


def prefixes(p) -> list[str]:
    return [" ".join(w.bind_prefix) for w in p.workers]


def sched_prefix(p) -> str:
    return " ".join(p.scheduler.bind_prefix) if p.scheduler else ""


# ----------------------------------------------------------------------------- DGX (seed 002)
def test_dgx_auto_core_eight_workers():
    p = plan("dgx_8gpu_2numa", 8, core="True")
    assert prefixes(p) == [
        f"taskset -c {c}"
        for c in (
            "0-12,104-116",
            "13-25,117-129",
            "26-38,130-142",
            "39-51,143-155",
            "52-64,156-168",
            "65-77,169-181",
            "78-90,182-194",
            "91-103,195-207",
        )
    ]
    assert p.workers[0].env["MSRUN_CPU_LIST"] == str(list(range(0, 13)) + list(range(104, 117)))
    assert p.workers[3].device == "GPU3 0000:5d:00.0"
    assert sched_prefix(p) == "", "automatic binding never applies to the scheduler"


def test_dgx_auto_core_two_workers_share_their_node_then_spill():
    p = plan("dgx_8gpu_2numa", 2, core="True")
    assert prefixes(p) == ["taskset -c 0-25,52-77,104-129,156-181", "taskset -c 26-51,78-103,130-155,182-207"]


def test_dgx_auto_core_two_workers_on_two_nodes():
    p = plan("dgx_8gpu_2numa", 2, core="True", env={"CUDA_VISIBLE_DEVICES": "0,4"})
    assert prefixes(p) == ["taskset -c 0-51,104-155", "taskset -c 52-103,156-207"]


def test_dgx_auto_numa_too_few_nodes_is_a_loud_fallback():
    p = plan("dgx_8gpu_2numa", 8, numa="True")
    assert prefixes(p) == [""] * 8
    assert any("Available NUMA nodes count([0, 1]) is insufficient for device count(8)" in w for w in p.warnings)


def test_dgx_auto_numa_by_affinity():
    p = plan("dgx_8gpu_2numa", 2, numa="True", env={"CUDA_VISIBLE_DEVICES": "4,0"})
    assert prefixes(p) == ["numactl --membind 1 --cpunodebind 1", "numactl --membind 0 --cpunodebind 0"]
    assert p.workers[0].cpus == list(range(52, 104)) + list(range(156, 208)) and p.workers[0].mems == [1]
    assert p.workers[0].env["MSRUN_CPU_LIST"].startswith("[52, 53,")
    same = plan("dgx_8gpu_2numa", 2, numa="True")
    assert prefixes(same) == ["numactl --membind 0 --cpunodebind 0", "numactl --membind 1 --cpunodebind 1"]


def test_dgx_auto_numa_and_core_together():
    p = plan("dgx_8gpu_2numa", 2, core="True", numa="True", env={"CUDA_VISIBLE_DEVICES": "0,4"})
    assert prefixes(p) == [
        "numactl --membind 0 --physcpubind 0-51,104-155",
        "numactl --membind 1 --physcpubind 52-103,156-207",
    ]


def test_dgx_gpu_uuid_visibility():
    uuid6 = topo("dgx_8gpu_2numa").device("cuda", 6).uuid
    p = plan("dgx_8gpu_2numa", 1, numa="True", env={"CUDA_VISIBLE_DEVICES": uuid6[:12]})
    assert prefixes(p) == ["numactl --membind 1 --cpunodebind 1"]
    assert p.workers[0].device == "GPU6 0000:ba:00.0"


def test_dgx_custom_dicts_match_keys_by_name():
    core = '{"device1": ["10-19"], "device0": ["0-9"], "scheduler": ["200-207"]}'
    p = plan("dgx_8gpu_2numa", 2, core=core)
    assert prefixes(p) == ["taskset -c 0-9", "taskset -c 10-19"]
    assert sched_prefix(p) == "taskset -c 200-207"
    core = '{"scheduler": ["0-9"], "device7": ["20-29", "40-49"], "device6": ["10-19"]}'
    p = plan("dgx_8gpu_2numa", 2, core=core, env={"CUDA_VISIBLE_DEVICES": "6,7"})
    assert prefixes(p) == ["taskset -c 10-19", "taskset -c 20-29,40-49"]
    assert p.workers[1].cpus == list(range(20, 30)) + list(range(40, 50))


def test_dgx_both_dicts():
    p = plan(
        "dgx_8gpu_2numa",
        2,
        core='{"scheduler": ["1"], "device0": ["2-3"], "device1": []}',
        numa='{"scheduler": ["0"], "device0": ["1"], "device1": ["0"]}',
    )
    assert sched_prefix(p) == "numactl --membind 0 --physcpubind 1"
    assert prefixes(p) == ["numactl --membind 1 --physcpubind 2-3", "numactl --membind 0 --cpunodebind 0"]


def test_dict_missing_worker_key_is_named():
    p = plan("dgx_8gpu_2numa", 2, core='{"device1": ["20-29"]}')
    assert prefixes(p) == ["", "taskset -c 20-29"]
    assert any("no entry for local worker(s) [0]" in w for w in p.warnings)


def test_dry_run_splits_over_logical_devices():
    p = plan("dgx_8gpu_2numa", 2, core="True", sim=1)
    assert prefixes(p) == ["taskset -c 0-51,104-155", "taskset -c 52-103,156-207"]


# ----------------------------------------------------------------------------- lstopo machine (seed 002)
def test_lstopo_auto_core_eight_workers():
    p = plan("lstopo_2pkg_48core_8gpu", 8, core="True")
    assert prefixes(p) == [f"taskset -c {6 * k}-{6 * k + 5}" for k in range(8)]


def test_lstopo_auto_core_four_workers_on_node_0():
    p = plan("lstopo_2pkg_48core_8gpu", 4, core="True")
    assert prefixes(p) == [
        "taskset -c 0-5,24-29",
        "taskset -c 6-11,30-35",
        "taskset -c 12-17,36-41",
        "taskset -c 18-23,42-47",
    ]


def test_lstopo_auto_numa_visible_3_4():
    p = plan("lstopo_2pkg_48core_8gpu", 2, numa="True", env={"CUDA_VISIBLE_DEVICES": "3,4"})
    assert prefixes(p) == ["numactl --membind 0 --cpunodebind 0", "numactl --membind 1 --cpunodebind 1"]
    assert p.workers[1].cpus == list(range(24, 48))


# ----------------------------------------------------------------------------- Ascend 8 NPU
def test_ascend_auto_core_eight_workers_by_npu_affinity():
    p = plan("ascend_910b_8npu", 8, core="True")
    assert prefixes(p) == [
        f"taskset -c {c}" for c in ("144-167", "168-191", "96-119", "120-143", "48-71", "72-95", "0-23", "24-47")
    ]


def test_ascend_auto_numa_never_crashes_when_npus_share_nodes():
    p = plan("ascend_910b_8npu", 4, numa="True")
    assert prefixes(p) == [
        "numactl --membind 3 --cpunodebind 3",
        "numactl --membind 0 --cpunodebind 0",
        "numactl --membind 2 --cpunodebind 2",
        "numactl --membind 1 --cpunodebind 1",
    ]
    p = plan("ascend_910b_8npu", 4, numa="True", env={"ASCEND_RT_VISIBLE_DEVICES": "6,7,0,1"})
    assert prefixes(p) == [
        "numactl --membind 0 --cpunodebind 0",
        "numactl --membind 1 --cpunodebind 1",
        "numactl --membind 3 --cpunodebind 3",
        "numactl --membind 2 --cpunodebind 2",
    ]


def test_ascend_visible_devices_keep_the_users_order():
    core = '{"device7": ["24-47"], "device6": ["0-23"]}'
    p = plan("ascend_910b_8npu", 2, core=core, env={"ASCEND_RT_VISIBLE_DEVICES": "7,6"})
    assert prefixes(p) == ["taskset -c 24-47", "taskset -c 0-23"]
    assert [w.device for w in p.workers] == ["NPU7 0000:02:00.0", "NPU6 0000:01:00.0"]


def test_ascend_unknown_visible_device_is_an_error():
    with pytest.raises(BindingError, match="device 9 does not exist here"):
        plan("ascend_910b_8npu", 1, core="True", env={"ASCEND_RT_VISIBLE_DEVICES": "9"})


def test_ascend_devices_parse_from_the_recorded_npu_smi_output():
    from pytest_msrun.binding.discover import ascend_devices

    t = topo("ascend_910b_8npu")
    devices, raw = ascend_devices(root="/nonexistent", runner=lambda args: t.raw[" ".join(args)])
    assert [(d.index, d.pci_bus_id, d.name) for d in devices] == [(d.index, d.pci_bus_id, d.name) for d in t.devices]
    assert set(raw) == set(t.raw)


# ----------------------------------------------------------------------------- cgroup v2 container
def test_container_auto_core_stays_inside_the_cpuset():
    p = plan("container_cgroup_v2", 2, core="True")
    assert prefixes(p) == ["taskset -c 8-11,40-43", "taskset -c 12-15,44-47"]


def test_container_auto_numa_insufficient_and_unavailable_affinity():
    p = plan("container_cgroup_v2", 2, numa="True")
    assert prefixes(p) == ["", ""] and any("insufficient" in w for w in p.warnings)
    p = plan("container_cgroup_v2", 1, numa="True", env={"CUDA_VISIBLE_DEVICES": "1"})
    assert prefixes(p) == ["numactl --membind 0 --cpunodebind 0"]
    assert any("Device affinity NUMA nodes [1] are unavailable" in w for w in p.warnings)


def test_container_rejects_cpus_and_nodes_outside_the_cpuset():
    with pytest.raises(BindingError, match=r"CPU 0-1 in --bind_core\['device0'\] is not available.*8-15,40-47"):
        plan("container_cgroup_v2", 1, core='{"device0": ["0-1"]}')
    with pytest.raises(BindingError, match=r"NUMA node 1 in --bind_numa\['device0'\] is not usable here.*: 0\)"):
        plan("container_cgroup_v2", 1, numa='{"device0": ["1"]}')


# ----------------------------------------------------------------------------- SMT workstation
def test_smt_keeps_sibling_threads_together():
    p = plan("smt_1node_16cpu_2gpu", 2, core="True")
    assert prefixes(p) == ["taskset -c 0-3,8-11", "taskset -c 4-7,12-15"]


def test_smt_more_workers_than_devices_splits_evenly():
    p = plan("smt_1node_16cpu_2gpu", 3, core="True")
    assert prefixes(p) == ["taskset -c 0-2,8-10", "taskset -c 3-5,11-13", "taskset -c 6-7,14-15"]
    assert any("affinity is unknown" in w for w in p.warnings)


def test_smt_more_workers_than_cores_hands_out_threads():
    p = plan("smt_1node_16cpu_2gpu", 12, core="True")
    assert prefixes(p)[:5] == ["taskset -c 0-1", "taskset -c 2-3", "taskset -c 4-5", "taskset -c 6-7", "taskset -c 8"]
    assert prefixes(p)[-1] == "taskset -c 15"


def test_more_workers_than_cpus_is_an_error():
    with pytest.raises(BindingError, match="20 local workers but only 16 allowed CPUs"):
        plan("smt_1node_16cpu_2gpu", 20, core="True")


# ----------------------------------------------------------------------------- this VM (recorded live)
def test_vm_matches_the_real_msruns_verified_commands():
    p = plan("vm_1node_2cpu", 2, core="True")
    assert prefixes(p) == ["taskset -c 0", "taskset -c 1"]
    p = plan("vm_1node_2cpu", 1, numa="True")
    assert prefixes(p) == ["numactl --membind 0 --cpunodebind 0"]


def test_missing_tools_fall_back_or_fail():
    p = plan("vm_1node_2cpu", 2, core="True", tools={"taskset": None, "numactl": None})
    assert prefixes(p) == ["", ""] and [w.in_child_cpus for w in p.workers] == [[0], [1]]
    assert any("taskset was not found" in w for w in p.warnings)
    p = plan("vm_1node_2cpu", 1, numa="True", tools={"taskset": "/usr/bin/taskset", "numactl": None})
    assert p.workers[0].in_child_cpus == [0, 1] and any("memory is NOT bound" in w for w in p.warnings)
    with pytest.raises(BindingError, match="memory binding needs numactl"):
        plan("vm_1node_2cpu", 1, numa='{"device0": ["0"]}', tools={"taskset": None, "numactl": None})


# ----------------------------------------------------------------------------- unified JSON (seed examples 1-7)
SEED_EXAMPLES = {
    1: (
        {
            "bind_config": {"bind_cpu_mode": "cpu", "bind_memory_mode": "numa", "actor_thread_fix_bind": True},
            "bind_cpu": {
                "scheduler": {"main": "40-45"},
                "device0": {"main": "0-4", "runtime": "5-9", "pynative": "10-14", "minddata": "15-19"},
                "device1": {"main": "20-24", "runtime": "25-29", "pynative": "30-34", "minddata": "35-39"},
            },
            "bind_memory": {"device0": 0, "device1": 1, "scheduler": 2},
        },
        "numactl --membind 2 --physcpubind 40-45",
        ["numactl --membind 0 --physcpubind 0-4", "numactl --membind 1 --physcpubind 20-24"],
    ),
    2: (
        {
            "bind_config": {"bind_cpu_mode": "numa", "bind_memory_mode": "numa"},
            "bind_cpu": {"device0": 0, "device1": 1},
            "bind_memory": {"device0": 0, "device1": 1, "scheduler": "2-3,4"},
        },
        "numactl --membind 2-3,4",
        ["numactl --membind 0 --cpunodebind 0", "numactl --membind 1 --cpunodebind 1"],
    ),
    3: (
        {
            "bind_config": {"bind_cpu_mode": "cpu", "bind_memory_mode": "none", "actor_thread_fix_bind": False},
            "bind_cpu": {
                "scheduler": {"main": "40-45"},
                "device0": {"main": "0-4", "runtime": "5-9", "pynative": "10-14", "minddata": "15-19"},
                "device1": {"main": "20-24", "runtime": "25-29", "pynative": "30-34", "minddata": "35-39"},
            },
        },
        "taskset -c 40-45",
        ["taskset -c 0-4", "taskset -c 20-24"],
    ),
    4: (
        {
            "bind_config": {"bind_cpu_mode": "cpu", "bind_memory_mode": "numa"},
            "bind_cpu": {"device0": {"main": "0-4"}, "device1": {"main": "20-24"}},
        },
        "",
        ["taskset -c 0-4", "taskset -c 20-24"],
    ),
    5: (
        {
            "bind_config": {"bind_cpu_mode": "numa", "bind_memory_mode": "none"},
            "bind_cpu": {"device0": 0, "device1": 1},
        },
        "",
        ["numactl --cpunodebind 0", "numactl --cpunodebind 1"],
    ),
    6: (
        {
            "bind_config": {"bind_cpu_mode": "none", "bind_memory_mode": "numa"},
            "bind_memory": {"device0": 0, "device1": 1},
        },
        "",
        ["numactl --membind 0", "numactl --membind 1"],
    ),
    7: (
        {
            "bind_config": {"bind_cpu_mode": "cpu", "bind_memory_mode": "none"},
            "bind_cpu": {
                "device0": {"runtime": "5-9", "pynative": "10-14", "minddata": "15-19"},
                "device1": {"runtime": "25-29", "pynative": "30-34", "minddata": "35-39"},
            },
        },
        "",
        ["", ""],
    ),
}


@pytest.mark.parametrize("number", sorted(SEED_EXAMPLES), ids=[f"example{n}" for n in sorted(SEED_EXAMPLES)])
def test_seed_bind_file_examples(tmp_path, number):
    data, sched, workers = SEED_EXAMPLES[number]
    path = tmp_path / f"example{number}.json"
    path.write_text(json.dumps(data, indent=2))
    p = plan("epyc_2s_nps4_8numa", 2, numa=str(path))
    assert sched_prefix(p) == sched
    assert prefixes(p) == workers
    for proc in p.processes:
        assert proc.env["MSRUN_BIND_FILE"] == str(path)


def test_bind_file_checks_cpus_nodes_and_devices(tmp_path):
    cases = [
        (
            {"bind_config": {"bind_cpu_mode": "cpu"}, "bind_cpu": {"device0": {"main": "250-260"}}},
            r"CPU 256-260 in bind_cpu.device0.main is not available",
        ),
        (
            {"bind_config": {"bind_memory_mode": "numa"}, "bind_memory": {"device_1": 9}},
            r"NUMA node 9 in bind_memory.device1 is not usable",
        ),
        (
            {"bind_config": {"bind_cpu_mode": "numa"}, "bind_cpu": {"device12": 0}},
            r"Device ID 12 in key 'device12' exceeds the devices here",
        ),
    ]
    for i, (data, message) in enumerate(cases):
        path = tmp_path / f"bad{i}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(BindingError, match=message):
            plan("epyc_2s_nps4_8numa", 2, numa=str(path))


def test_epyc_one_node_per_gpu():
    p = plan("epyc_2s_nps4_8numa", 8, core="True", numa="True")
    assert prefixes(p)[0] == "numactl --membind 0 --physcpubind 0-15,128-143"
    assert prefixes(p)[7] == "numactl --membind 7 --physcpubind 112-127,240-255"


# ----------------------------------------------------------------------------- custom dict + JSON on every fixture
CUSTOM = {
    # fixture: (local workers, env, --bind_core dict, expected worker prefixes, expected scheduler prefix)
    "vm_1node_2cpu": (
        2,
        {},
        '{"device0": ["1"], "device1": ["0"], "scheduler": ["0-1"]}',
        ["taskset -c 1", "taskset -c 0"],
        "taskset -c 0-1",
    ),
    "dgx_8gpu_2numa": (
        2,
        {"CUDA_VISIBLE_DEVICES": "5,2"},
        '{"device2": ["52-63"], "device5": ["0-11"]}',
        ["taskset -c 0-11", "taskset -c 52-63"],
        "",
    ),
    "lstopo_2pkg_48core_8gpu": (
        2,
        {},
        '{"device1": ["24", "30-31"], "device0": ["0,2,4"]}',
        ["taskset -c 0,2,4", "taskset -c 24,30-31"],
        "",
    ),
    "ascend_910b_8npu": (
        2,
        {"ASCEND_RT_VISIBLE_DEVICES": "4,5"},
        '{"device5": ["72-95"], "device4": ["48-71"]}',
        ["taskset -c 48-71", "taskset -c 72-95"],
        "",
    ),
    "container_cgroup_v2": (
        2,
        {},
        '{"device0": ["8-11"], "device1": ["40-43"], "scheduler": ["15"]}',
        ["taskset -c 8-11", "taskset -c 40-43"],
        "taskset -c 15",
    ),
    "smt_1node_16cpu_2gpu": (
        2,
        {},
        '{"device0": ["0", "8"], "device1": ["1-2"]}',
        ["taskset -c 0,8", "taskset -c 1-2"],
        "",
    ),
    "epyc_2s_nps4_8numa": (
        2,
        {"CUDA_VISIBLE_DEVICES": "7,3"},
        '{"device3": ["48-63"], "device7": ["112-127"]}',
        ["taskset -c 112-127", "taskset -c 48-63"],
        "",
    ),
}

UNIFIED = {
    # fixture: (local workers, env, bind file, expected worker prefixes, expected scheduler prefix)
    "vm_1node_2cpu": (
        2,
        {},
        {
            "bind_config": {"bind_cpu_mode": "cpu", "bind_memory_mode": "numa"},
            "bind_cpu": {"device0": {"main": "0"}, "device1": {"main": "1"}},
            "bind_memory": {"device0": 0, "scheduler": 0},
        },
        ["numactl --membind 0 --physcpubind 0", "taskset -c 1"],
        "numactl --membind 0",
    ),
    "dgx_8gpu_2numa": (
        2,
        {"CUDA_VISIBLE_DEVICES": "3,4"},
        {
            "bind_config": {"bind_cpu_mode": "numa", "bind_memory_mode": "numa"},
            "bind_cpu": {"device3": 0, "device4": 1},
            "bind_memory": {"device3": 0, "device4": 1},
        },
        ["numactl --membind 0 --cpunodebind 0", "numactl --membind 1 --cpunodebind 1"],
        "",
    ),
    "lstopo_2pkg_48core_8gpu": (
        2,
        {},
        {
            "bind_config": {"bind_cpu_mode": "cpu"},
            "bind_cpu": {"device_0": {"main": "0-5"}, "device_1": {"main": "6-11"}, "scheduler": {"main": "47"}},
        },
        ["taskset -c 0-5", "taskset -c 6-11"],
        "taskset -c 47",
    ),
    "ascend_910b_8npu": (
        2,
        {"ASCEND_RT_VISIBLE_DEVICES": "0,1"},
        {
            "bind_config": {"bind_cpu_mode": "cpu", "bind_memory_mode": "numa", "actor_thread_fix_bind": True},
            "bind_cpu": {
                "device0": {"main": "144-151", "runtime": "152-156"},
                "device1": {"main": "168-175", "runtime": "176-180"},
            },
            "bind_memory": {"device0": 3, "device1": 3},
        },
        ["numactl --membind 3 --physcpubind 144-151", "numactl --membind 3 --physcpubind 168-175"],
        "",
    ),
    "container_cgroup_v2": (
        1,
        {},
        {"bind_config": {"bind_cpu_mode": "none", "bind_memory_mode": "numa"}, "bind_memory": {"device0": 0}},
        ["numactl --membind 0"],
        "",
    ),
    "smt_1node_16cpu_2gpu": (
        2,
        {},
        {"bind_config": {"bind_cpu_mode": "numa"}, "bind_cpu": {"device0": 0}},
        ["numactl --cpunodebind 0", ""],
        "",
    ),
    "epyc_2s_nps4_8numa": (
        2,
        {},
        {
            "bind_config": {"bind_cpu_mode": "numa", "bind_memory_mode": "numa"},
            "bind_cpu": {"device0": "0-1", "device1": "2"},
            "bind_memory": {"device0": "0-1", "device1": 2, "scheduler": 7},
        },
        ["numactl --membind 0-1 --cpunodebind 0-1", "numactl --membind 2 --cpunodebind 2"],
        "numactl --membind 7",
    ),
}


@pytest.mark.parametrize("fixture", sorted(CUSTOM))
def test_custom_dict_on_every_fixture(fixture):
    local, env, core, workers, sched = CUSTOM[fixture]
    p = plan(fixture, local, core=core, env=env)
    assert prefixes(p) == workers
    assert sched_prefix(p) == sched


@pytest.mark.parametrize("fixture", sorted(UNIFIED))
def test_bind_file_on_every_fixture(tmp_path, fixture):
    local, env, data, workers, sched = UNIFIED[fixture]
    path = tmp_path / "bind.json"
    path.write_text(json.dumps(data))
    p = plan(fixture, local, numa=str(path), env=env)
    assert prefixes(p) == workers
    assert sched_prefix(p) == sched
    if fixture == "epyc_2s_nps4_8numa":
        assert p.workers[0].cpus == list(range(0, 32)) + list(range(128, 160))
        assert p.workers[0].mems == [0, 1]


@pytest.mark.parametrize("number", sorted(SEED_EXAMPLES), ids=[f"example{n}" for n in sorted(SEED_EXAMPLES)])
def test_seed_examples_through_the_cli(tmp_path, number):
    """The same seven files through ``msrun --print_plan`` with MSRUN_TOPOLOGY (the CLI path)."""
    import os
    import subprocess

    data, sched, workers = SEED_EXAMPLES[number]
    path = tmp_path / f"example{number}.json"
    path.write_text(json.dumps(data))
    (tmp_path / "t.py").write_text("")
    # A plan for a recorded machine needs none of this host's binding tools.
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("python", "python3"):
        (bare / tool).symlink_to(sys.executable)
    env = {**os.environ, "MSRUN_TOPOLOGY": str(FIXTURES / "epyc_2s_nps4_8numa.json"), "PATH": str(bare)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest_msrun",
            "--worker_num=2",
            "--local_worker_num=2",
            "--scheduler=task",
            f"--bind_numa={path}",
            "--print_plan",
            "t.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    got = [" ".join(p["bind_prefix"]) for p in out["processes"]]
    assert got == [sched, *workers]
