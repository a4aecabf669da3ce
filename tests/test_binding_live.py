"""Binding on this machine for real: taskset, numactl, /proc read-back, tools missing, helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import REPO, job_args, wait_running

from pytest_msrun.binding.discover import discover
from pytest_msrun.cpulist import format_id_list

FIXTURES = REPO / "fixtures"
REPORT = """
import json, os, time
rank = os.environ["RANK_ID"]
with open(f"/proc/{os.getpid()}/numa_maps") as fh:
    policy = fh.readline().split()[1]
rec = {"cpus": sorted(os.sched_getaffinity(0)), "policy": policy, "cpu_list": os.environ.get("MSRUN_CPU_LIST"),
       "bind_file": os.environ.get("MSRUN_BIND_FILE")}
json.dump(rec, open(os.path.join(os.environ["DUMP_DIR"], f"bind_{rank}.json"), "w"))
print("started", flush=True)
release = os.environ.get("RELEASE_FILE")
if release:  # held until the test creates this file (it inspects the running job meanwhile)
    deadline = time.monotonic() + 120
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.02)
"""

# Every expectation below is derived from the machine the tests run on (its allowed CPUs, physical
# cores and NUMA nodes, read by live discovery), never from the machine they were written on.
HERE = discover(devices=False)
ALLOWED = sorted(os.sched_getaffinity(0))
CORES = HERE.allowed_cores()
NODE = HERE.usable_nodes()[0] if HERE.usable_nodes() else 0  # the node --bind_numa=True picks first

needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs 2 allowed physical cores")
needs_numactl = pytest.mark.numactl


def _recs(msrun, n):
    return [json.loads((msrun.dump / f"bind_{r}.json").read_text()) for r in range(n)]


def _assert_fair_whole_core_shares(cpu_sets: list[list[int]]) -> None:
    """Disjoint, allowed, whole physical cores, every allowed core used, shares within one core."""
    core_of = {cpu: tuple(core) for core in CORES for cpu in core}
    shares = []
    for cpus in cpu_sets:
        assert cpus and set(cpus) <= set(ALLOWED)
        cores = {core_of[c] for c in cpus}
        assert {c for core in cores for c in core} == set(cpus), "SMT siblings stay together"
        shares.append(len(cores))
    flat = [c for cpus in cpu_sets for c in cpus]
    assert len(flat) == len(set(flat)), "no CPU is shared"
    assert sum(shares) == len(CORES) and max(shares) - min(shares) <= 1


@needs_two_cores
def test_bind_core_auto_runs_where_the_plan_says(msrun):
    msrun.script("report.py", REPORT)
    job = msrun.run(job_args(2, "--bind_core=True", "report.py"))
    assert job.returncode == 0, job.stderr
    recs = _recs(msrun, 2)
    _assert_fair_whole_core_shares([r["cpus"] for r in recs])
    assert [r["cpu_list"] for r in recs] == [str(r["cpus"]) for r in recs]
    for rec in recs:
        assert f"Execute command: taskset -c {format_id_list(rec['cpus'])} " in job.stdout
    table = job.stdout[job.stdout.index("msrun: bindings") :]
    assert "rank 0" in table and "taskset" in table
    assert "Binding of" not in job.stderr, "the kernel must agree with the plan"


@needs_two_cores
def test_bind_core_dict_and_scheduler(msrun):
    a, b = ALLOWED[0], ALLOWED[1]
    msrun.script("report.py", REPORT)
    popen = msrun.start(
        job_args(
            2,
            "--bind_core=" + json.dumps({"device1": [str(a)], "scheduler": [str(b)], "device0": [str(b)]}),
            "report.py",
        ),
        env={"RELEASE_FILE": str(msrun.cwd / "release")},  # runs until the scheduler was inspected
    )
    status = wait_running(msrun.cwd / "logs", 2)
    sched = next(p for p in status["processes"] if p["role"] == "scheduler")
    assert psutil.Process(sched["pid"]).cpu_affinity() == [b]
    (msrun.cwd / "release").touch()
    job = msrun.finish(popen)
    assert job.returncode == 0, job.stderr
    assert [r["cpus"] for r in _recs(msrun, 2)] == [[b], [a]]
    assert [r["cpu_list"] for r in _recs(msrun, 2)] == [None, None], "MSRUN_CPU_LIST is for automatic binding only"


@needs_numactl
def test_numactl_binds_memory_to_the_first_usable_node(msrun):
    msrun.script("report.py", REPORT)
    job = msrun.run(job_args(1, "--bind_numa=True", "report.py"))
    assert job.returncode == 0, job.stderr
    (rec,) = _recs(msrun, 1)
    assert rec["policy"] == f"bind:{NODE}"
    assert rec["cpus"] == HERE.node_allowed_cpus(NODE)
    assert f"numactl --membind {NODE} --cpunodebind {NODE}" in job.stdout
    assert f"bind:{NODE}" in job.stdout[job.stdout.index("msrun: bindings") :]


@needs_numactl
@needs_two_cores
def test_numactl_with_cores_and_bind_file(msrun, tmp_path):
    a, b = ALLOWED[0], ALLOWED[1]
    msrun.script("report.py", REPORT)
    bind = tmp_path / "bind.json"
    bind.write_text(
        json.dumps(
            {
                "bind_config": {"bind_cpu_mode": "cpu", "bind_memory_mode": "numa", "actor_thread_fix_bind": True},
                "bind_cpu": {
                    "device0": {"main": str(b), "runtime": str(a)},
                    "device_1": {"main": str(a)},
                    "scheduler": {"main": str(a)},
                },
                "bind_memory": {"device0": NODE},
            }
        )
    )
    job = msrun.run(job_args(2, f"--bind_numa={bind}", "report.py"))
    assert job.returncode == 0, job.stderr
    recs = _recs(msrun, 2)
    assert recs[0]["cpus"] == [b] and recs[0]["policy"] == f"bind:{NODE}"
    assert recs[1]["cpus"] == [a] and recs[1]["policy"] == "default"
    assert all(r["bind_file"] == str(bind) for r in recs)
    assert f"numactl --membind {NODE} --physcpubind {b} " in job.stdout and f"taskset -c {a} " in job.stdout


def _path_without(tmp_path: Path, *tools: str) -> str:
    """A PATH (a directory in ``tmp_path``) holding every command of the current one except ``tools``."""
    keep = tmp_path / f"path-without-{'-'.join(tools)}"
    keep.mkdir(exist_ok=True)
    for entry in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(entry):
            continue
        for name in os.listdir(entry):
            target = keep / name
            if name in tools or target.exists():
                continue
            try:
                target.symlink_to(os.path.join(entry, name))
            except OSError:
                pass
    return str(keep)


@needs_two_cores
def test_without_taskset_children_bind_themselves(msrun, tmp_path):
    msrun.script("report.py", REPORT)
    path = _path_without(tmp_path, "taskset", "numactl")
    job = msrun.run(job_args(2, "--bind_core=True", "report.py"), env={"PATH": path})
    assert job.returncode == 0, job.stderr
    assert "taskset was not found on PATH" in job.stderr
    _assert_fair_whole_core_shares([r["cpus"] for r in _recs(msrun, 2)])
    assert "sched_setaffinity" in job.stdout


def test_without_numactl_memory_binding_is_refused_before_start(msrun, tmp_path):
    msrun.script("report.py", REPORT)
    path = _path_without(tmp_path, "numactl")
    job = msrun.run(job_args(1, f'--bind_numa={{"device0": ["{NODE}"]}}', "report.py"), env={"PATH": path})
    assert job.returncode == 2
    assert "argument --bind_numa: memory binding needs numactl" in job.stderr
    assert not list(msrun.dump.iterdir()) and not (msrun.cwd / "logs").exists()


def test_cpu_not_allowed_is_refused_before_start(msrun):
    msrun.script("report.py", REPORT)
    job = msrun.run(job_args(1, '--bind_core={"device0": ["4096"]}', "report.py"))
    assert job.returncode == 2
    assert "argument --bind_core: CPU 4096 in --bind_core['device0'] is not available" in job.stderr
    assert not (msrun.cwd / "logs").exists()


@pytest.mark.parametrize(
    "content,key",
    [
        ("{broken", "failed to load"),
        ('{"bind_config": {"bind_cpu_mode": "gpu"}}', "bind_cpu_mode"),
        ('{"bind_config": {"bind_cpu_mode": "cpu"}, "bind_cpu": {"npu0": {"main": "0"}}}', "'npu0'"),
        (
            '{"bind_config": {"bind_cpu_mode": "cpu"}, "bind_cpu": {"device0": {"main": "4095"}}}',
            "CPU 4095 in bind_cpu.device0.main",
        ),
        (
            '{"bind_config": {"bind_cpu_mode": "cpu"}, "bind_cpu": {"device0": {"main": 0}}}',
            "'bind_cpu.device0.main' must be a CPU range string",
        ),
        (
            '{"bind_config": {"bind_memory_mode": "numa"}, "bind_memory": {"scheduler": "0-x"}}',
            "'bind_memory.scheduler'",
        ),
    ],
    ids=["bad-json", "bad-mode", "unknown-device-key", "cpu-not-allowed", "int-for-range", "bad-range"],
)
def test_malformed_bind_files_exit_2_naming_the_key(msrun, tmp_path, content, key):
    msrun.script("report.py", REPORT)
    (tmp_path / "bind.json").write_text(content)
    job = msrun.run(job_args(1, "--bind_numa=bind.json", "report.py"))
    assert job.returncode == 2, job.stderr
    line = next(ln for ln in job.stderr.splitlines() if ln.startswith("msrun: error:"))
    assert "--bind_numa" in line and key in line, line
    assert not (msrun.cwd / "logs").exists()


def test_print_plan_for_a_snapshot(msrun):
    msrun.script("report.py", REPORT)
    job = msrun.run(
        ["--worker_num=8", "--local_worker_num=8", "--bind_core=True", "--print_plan", "report.py"],
        env={"MSRUN_TOPOLOGY": str(FIXTURES / "dgx_8gpu_2numa.json")},
    )
    assert job.returncode == 0, job.stderr
    plan = json.loads(job.stdout)
    w3 = plan["processes"][4]
    assert w3["command"][:3] == ["taskset", "-c", "39-51,143-155"]
    assert w3["device"] == "GPU3 0000:5d:00.0" and w3["cpus"][0] == 39


def test_gen_bind_json_for_the_seed_8gpu_server(tmp_path):
    out = tmp_path / "bind.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest_msrun.binding.gen_bind_json",
            "--topology",
            str(FIXTURES / "dgx_8gpu_2numa.json"),
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text().splitlines()
    expected_devices = [
        ("4-8", "9-12", "104-110"),
        ("17-21", "22-25", "117-123"),
        ("30-34", "35-38", "130-136"),
        ("43-47", "48-51", "143-149"),
        ("56-60", "61-64", "156-162"),
        ("69-73", "74-77", "169-175"),
        ("82-86", "87-90", "182-188"),
        ("95-99", "100-103", "195-201"),
    ]
    expected = [
        "{",
        '  "bind_config": {',
        '    "bind_cpu_mode": "cpu",',
        '    "bind_memory_mode": "numa",',
        '    "actor_thread_fix_bind": true',
        "  },",
        '  "bind_cpu": {',
    ]
    for i, (runtime, minddata, main) in enumerate(expected_devices):
        expected += [
            f'    "device{i}": {{',
            f'      "runtime": "{runtime}",',
            f'      "minddata": "{minddata}",',
            f'      "main": "{main}"',
            "    },",
        ]
    expected += ['    "scheduler": {', '      "main": "20-23"', "    }", "  },", '  "bind_memory": {']
    expected += [f'    "device{i}": {0 if i < 4 else 1}{"," if i < 7 else ""}' for i in range(8)]
    expected += ["  }", "}"]
    assert lines == expected
    # and msrun accepts what it wrote
    from pytest_msrun.binding.flags import parse_bind_value

    assert parse_bind_value(str(out), "bind_numa").kind == "unified"


def test_gen_bind_json_options(tmp_path):
    out = tmp_path / "b.json"
    args = [
        sys.executable,
        "-m",
        "pytest_msrun.binding.gen_bind_json",
        "--topology",
        str(FIXTURES / "epyc_2s_nps4_8numa.json"),
        "-o",
        str(out),
        "--device-ids",
        "0,1",
        "--runtime-range",
        "0-1",
        "--minddata-range",
        "2",
        "--main-range",
        "3-4",
        "--pynative-range",
        "5",
        "--scheduler-range",
        "0-1",
        "--scheduler-base",
        "device0",
    ]
    assert subprocess.run(args, capture_output=True).returncode == 0
    data = json.loads(out.read_text())
    # two devices on their own nodes get their whole node: device1 = cores 16-31 -> CPUs 16-31,144-159
    assert data["bind_cpu"]["device1"] == {"runtime": "16-17", "minddata": "18", "main": "19-20", "pynative": "21"}
    assert data["bind_cpu"]["scheduler"] == {"main": "0-1"}
    assert data["bind_memory"] == {"device0": 0, "device1": 1}
    too_big = [*args[:5], "-o", str(out), "--main-range", "13-500"]
    proc = subprocess.run(too_big, capture_output=True, text=True)
    assert proc.returncode == 2 and "--main-range 13-500 needs 501 CPUs" in proc.stderr


def test_discovery_reads_a_cgroup_v2_container(tmp_path):
    from pytest_msrun.binding.discover import discover

    root = tmp_path
    files = {
        "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
        "proc/self/mountinfo": "30 25 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw\n",
        "sys/fs/cgroup/kubepods/pod1/ctr/cgroup.procs": "",
        "sys/fs/cgroup/kubepods/pod1/cpuset.cpus.effective": "2-3,6-7\n",
        "sys/fs/cgroup/kubepods/pod1/cpuset.mems.effective": "0\n",
        "sys/devices/system/cpu/online": "0-7\n",
        "sys/devices/system/node/has_memory": "0-1\n",
        "sys/devices/system/node/node0/cpulist": "0-3\n",
        "sys/devices/system/node/node0/meminfo": "Node 0 MemTotal:       16000000 kB\n",
        "sys/devices/system/node/node0/distance": "10 21\n",
        "sys/devices/system/node/node1/cpulist": "4-7\n",
        "sys/devices/system/node/node1/meminfo": "Node 1 MemTotal:       16000000 kB\n",
        "sys/devices/system/node/node1/distance": "21 10\n",
    }
    for cpu in range(8):
        files[f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"] = f"{cpu % 4},{cpu % 4 + 4}\n"
        files[f"sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id"] = "0\n"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    topo = discover(root=str(root), affinity=set(range(8)), devices=False)
    assert topo.cgroup is not None and topo.cgroup.version == 2 and topo.cgroup.path == "/kubepods/pod1/ctr"
    assert topo.cpus_allowed == [2, 3, 6, 7] and topo.mems_allowed == [0]
    assert [n.cpus for n in topo.numa_nodes] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.cores == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.usable_nodes() == [0], "node 1 is outside the cpuset's memory nodes"
    assert topo.allowed_cores() == [[2, 6], [3, 7]]


def test_live_snapshot_round_trips(tmp_path):
    from pytest_msrun.binding.discover import discover
    from pytest_msrun.binding.topology import Topology

    out = tmp_path / "me.json"
    proc = subprocess.run([sys.executable, "-m", "pytest_msrun.binding.discover", "-o", str(out)], capture_output=True)
    assert proc.returncode == 0
    loaded = Topology.load(str(out))
    live = discover()
    assert loaded.cpus_allowed == sorted(os.sched_getaffinity(0)) == live.cpus_allowed
    assert [n.id for n in loaded.numa_nodes] == [n.id for n in live.numa_nodes]


def _vm_with_gpus(tmp_path) -> Path:
    """This machine's live snapshot plus two GPUs on its first usable NUMA node (GPU1 near that node's
    last allowed CPU only), for the helpers."""
    data = HERE.to_json()
    cpus = HERE.node_allowed_cpus(NODE)
    data["devices"] = [
        {
            "kind": "cuda",
            "index": 0,
            "pci_bus_id": "0000:00:10.0",
            "uuid": "GPU-aaaa",
            "name": "test",
            "numa_node": NODE,
            "cpu_affinity": ",".join(map(str, cpus)),
        },
        {
            "kind": "cuda",
            "index": 1,
            "pci_bus_id": "0000:00:11.0",
            "uuid": "GPU-bbbb",
            "name": "test",
            "numa_node": NODE,
            "cpu_affinity": str(cpus[-1]),
        },
    ]
    path = tmp_path / "vm_gpus.json"
    path.write_text(json.dumps(data))
    return path


def test_set_numa_affinity_follows_cuda_visible_devices(tmp_path):
    snap = _vm_with_gpus(tmp_path)
    code = (
        "import os, json; from pytest_msrun.binding.affinity import set_numa_affinity\n"
        "got = set_numa_affinity(0)\n"
        "print(json.dumps([got, sorted(os.sched_getaffinity(0))]))\n"
    )
    env = {**os.environ, "MSRUN_TOPOLOGY": str(snap), "CUDA_VISIBLE_DEVICES": "GPU-bbbb"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    last = HERE.node_allowed_cpus(NODE)[-1]
    assert json.loads(proc.stdout) == [[last], [last]], "logical GPU 0 is physical GPU1 (by UUID)"


@needs_numactl
def test_numa_wrap_binds_by_local_rank(tmp_path):
    snap = _vm_with_gpus(tmp_path)
    code = "print(open('/proc/self/numa_maps').readline().split()[1])"
    env = {**os.environ, "MSRUN_TOPOLOGY": str(snap), "LOCAL_RANK": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest_msrun.binding.numa_wrap", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"bind:{NODE}"
    assert f"Starting local rank 1 (GPU1 0000:00:11.0) on NUMA node {NODE}" in proc.stderr
    no_numactl = {**env, "PATH": _path_without(tmp_path, "numactl")}
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest_msrun.binding.numa_wrap", sys.executable, "-c", code],
        env=no_numactl,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "memory is NOT bound" in proc.stderr
    missing = {**env}
    missing.pop("LOCAL_RANK")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest_msrun.binding.numa_wrap", "true"], env=missing, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "LOCAL_RANK is not set" in proc.stderr


class FakeNvml:
    """What pynvml returns on a 2-GPU machine, for the NVML discovery path."""

    class _Pci:
        def __init__(self, bus: bytes) -> None:
            self.busId = bus

    def __init__(self) -> None:
        self.inited = False

    def nvmlInit(self) -> None:
        self.inited = True

    def nvmlShutdown(self) -> None:
        self.inited = False

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetPciInfo(self, h: int):
        return self._Pci([b"00000000:18:00.0", b"00000000:9A:00.0"][h])

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-fake-{h}"

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"Fake GPU"

    def nvmlDeviceGetCpuAffinity(self, h: int, words: int) -> list[int]:
        # GPU0: CPUs 0-3 and 64; GPU1: CPUs 4-7 (64-bit words, lowest first)
        return [[0b1111, 0b1], [0b11110000, 0]][h][:words] + [0] * max(0, words - 2)

    def nvmlDeviceGetNumaNodeId(self, h: int) -> int:
        raise RuntimeError("NVML too old for NUMA ids")


def test_nvml_discovery_parses_bus_ids_masks_and_sysfs_nodes(tmp_path):
    from pytest_msrun.binding.discover import nvidia_devices

    for bus, node in (("0000:18:00.0", "0"), ("0000:9a:00.0", "1")):
        d = tmp_path / "sys/bus/pci/devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(node + "\n")
    fake = FakeNvml()
    devs = nvidia_devices(root=str(tmp_path), nvml=lambda: fake)
    assert [(d.index, d.pci_bus_id, d.uuid, d.name, d.numa_node) for d in devs] == [
        (0, "0000:18:00.0", "GPU-fake-0", "Fake GPU", 0),
        (1, "0000:9a:00.0", "GPU-fake-1", "Fake GPU", 1),
    ]
    words = max(1, -(-(os.cpu_count() or 64) // 64))
    expected0 = [0, 1, 2, 3] + ([64] if words > 1 else [])
    assert devs[0].cpu_affinity == expected0 and devs[1].cpu_affinity == [4, 5, 6, 7]
    assert not fake.inited, "NVML is shut down again"


def test_nvidia_sysfs_fallback_without_nvml(tmp_path):
    from pytest_msrun.binding.discover import nvidia_devices

    entries = {
        "0000:3b:00.0": ("0x10de", "0x030200", "0", "0-15"),  # 3D controller, NVIDIA
        "0000:00:02.0": ("0x8086", "0x030000", "0", "0-31"),  # Intel graphics: not ours
        "0000:af:00.0": ("0x10de", "0x030200", "1", "16-31"),
    }
    for bdf, (vendor, cls, node, cpus) in entries.items():
        d = tmp_path / "sys/bus/pci/devices" / bdf
        d.mkdir(parents=True)
        for name, text in (("vendor", vendor), ("class", cls), ("numa_node", node), ("local_cpulist", cpus)):
            (d / name).write_text(text + "\n")

    def broken():
        raise ImportError("no pynvml / no driver")

    devs = nvidia_devices(root=str(tmp_path), nvml=broken)
    assert [(d.index, d.pci_bus_id, d.numa_node, d.cpu_affinity[-1]) for d in devs] == [
        (0, "0000:3b:00.0", 0, 15),
        (1, "0000:af:00.0", 1, 31),
    ]
